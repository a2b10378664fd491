"""Registration of the ``"torchpar"`` backend with torch.distributed."""
import torch.distributed as dist

from torchpar import _C

BACKEND_NAME = "torchpar"


def _create_backend(dist_backend_opts, backend_options):
    """Called by torch.distributed (extended API) for each new group."""
    return _C.ProcessGroupTorchpar(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,
        str(dist_backend_opts.group_id),
    )


def register_backend():
    """Register ``"torchpar"`` for CPU and CUDA tensors (idempotent)."""
    if not hasattr(_C, "ProcessGroupTorchpar"):
        return
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )
