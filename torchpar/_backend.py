"""Registration of the ``"torchpar"`` backend with torch.distributed, and the calls torch
reaches only for its own backends."""
from datetime import timedelta

import torch
import torch.distributed as dist

from torchpar import _C

BACKEND_NAME = "torchpar"


def _incarnation_store(store, size):
    """The group's store, scoped to this incarnation of the group.

    A store can outlive the processes that used it: torchrun's agents share one TCPStore
    with their workers and keep it across ``--max-restarts`` attempts, so a restarted group
    of the same name finds the last attempt's keys (its ports, its abort notice) and would
    take them for its own (pytorch/pytorch#135712; issue 21). Every member counts itself in
    with one atomic add; the ``size`` members of one incarnation draw ``k*size+1 ...
    (k+1)*size`` and all scope their keys by ``k``. This holds when every member of each
    earlier incarnation got as far as creating the group; when one did not, the next
    incarnation's members may disagree on ``k`` and its set-up times out (an error, not a
    mix-up). The first incarnation keeps the store's own key names."""
    incarnation = (store.add("torchpar/arrivals", 1) - 1) // size
    return store if incarnation == 0 else dist.PrefixStore(f"torchpar/incarnation{incarnation}", store)


def _create_backend(dist_backend_opts, backend_options):
    """Called by torch.distributed (extended API) for each new group.

    Returns the group itself (``_C.TorchparGroup``, a c10d ProcessGroup carrying the backend
    for CPU and CUDA), not only the backend: torch's own group calls every plugin "custom",
    and DDP's logging data took that name from it (issue 23). torch skips its
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wrapper for a group a creator returns, so it is
    applied here, as torch would.
    """
    opts = dist_backend_opts
    store = _incarnation_store(opts.store, opts.group_size)
    backend = _C.ProcessGroupTorchpar(store, opts.group_rank, opts.group_size, opts.timeout, str(opts.group_id))
    if dist.get_debug_level() == dist.DebugLevel.DETAIL and dist.is_gloo_available():
        backend = dist.distributed_c10d._create_process_group_wrapper(
            wrapped_pg=backend,
            store_prefix=str(opts.group_id),
            store=store,
            rank=opts.group_rank,
            world_size=opts.group_size,
            timeout=opts.timeout,
        )
    return _C.TorchparGroup(store, opts.group_rank, opts.group_size, backend)


def register_backend():
    """Register ``"torchpar"`` for CPU and CUDA tensors (idempotent)."""
    if not hasattr(_C, "ProcessGroupTorchpar"):
        return
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """``torch.distributed.monitored_barrier`` for torchpar groups (issue 23).

    torch's function refuses every backend but gloo by name
    (``get_backend(group) != "gloo"`` raises ValueError) before it reaches the backend,
    although c10d lets any backend implement ``monitoredBarrier``. torchpar does (in C++,
    csrc/backend/monitored_barrier.cpp); this reaches it through the group's backend object.

    Rank 0 waits up to ``timeout`` (default: the group's) for every other rank; a rank that
    does not arrive is named in rank 0's error ("Rank 1 failed to pass monitoredBarrier in
    1000 ms"; with ``wait_all_ranks=True`` every late rank: "Ranks 1, 3 failed ..."). The
    other ranks raise if rank 0 does not release them in time. Groups of other backends go
    to torch's function unchanged.
    """
    c10d = dist.distributed_c10d
    if group is not None and c10d._rank_not_in_group(group):
        return None  # not a member: nothing to wait for, as torch's function
    pg = group if group is not None else c10d._get_default_group()
    if dist.get_backend(pg) != BACKEND_NAME:
        return c10d.monitored_barrier(group, timeout=timeout, wait_all_ranks=wait_all_ranks)
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    backend = pg._get_backend(torch.device("cpu"))
    if not hasattr(backend, "monitored_barrier"):  # wrapped (TORCH_DISTRIBUTED_DEBUG=DETAIL)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
    if timeout is None:
        return backend.monitored_barrier(wait_all_ranks=wait_all_ranks)
    return backend.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
