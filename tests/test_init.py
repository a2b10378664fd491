"""Initialisation the standard ways, the choice of transport, sub-groups, teardown, and
shared-memory hygiene."""
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import TRANSPORTS, spawn, transport_env

# For make test's time budget (conftest.py): its shm twin stays in make test.
SLOW_VARIANTS = {"test_destroy_then_init_again_leaves_nothing_in_dev_shm[tcp]"}

pytestmark = pytest.mark.timeout(120)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_group(group=None):
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t, group=group)
    n = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(n)
    assert t[0].item() == sum(r + 1 for r in ranks)


def _init_with(rank, world_size, init_file, method, port):
    import torchpar  # noqa: F401
    kwargs = dict(rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    if method == "env":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
        dist.init_process_group("torchpar", init_method="env://", timeout=timedelta(seconds=30))
    elif method == "tcp":
        dist.init_process_group("torchpar", init_method=f"tcp://127.0.0.1:{port}", **kwargs)
    elif method == "file":
        dist.init_process_group("torchpar", init_method=f"file://{init_file}", **kwargs)
    else:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=30))
        dist.init_process_group("torchpar", store=store, **kwargs)
    assert dist.get_backend() == "torchpar"
    check_group()
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("method", ["env", "tcp", "file", "store"])
def test_init_process_group_every_way(method):
    assert spawn(_init_with, 2, method, free_port()) == [True, True]


def _sub_groups(rank, world_size, init_file):
    import torchpar  # noqa: F401
    dist.init_process_group("torchpar", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    low = dist.new_group([0, 1])
    high = dist.new_group([2, 3])
    odd = dist.new_group([1, 3])
    mine = low if rank < 2 else high
    # The pairs run different numbers of collectives, interleaved with the world group:
    # each group keeps its own order.
    for _ in range(3 if rank < 2 else 5):
        check_group(mine)
    check_group()
    if rank in (1, 3):
        check_group(odd)
        t = torch.full((4,), float(rank))
        dist.broadcast(t, src=3, group=odd)
        assert (t == 3).all()
    check_group()
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("transport", ["shm", pytest.param("tcp", marks=pytest.mark.slow)])
def test_sub_groups_are_independent(transport):
    assert spawn(_sub_groups, 4, env=transport_env(transport)) == [True] * 4


def _reinit(rank, world_size, init_file):
    import torchpar  # noqa: F401
    for round_ in range(2):
        dist.init_process_group("torchpar", init_method=f"file://{init_file}.{round_}", rank=rank,
                                world_size=world_size)
        check_group()
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        # The segment is unlinked as soon as every rank has mapped it (none over TCP).
        assert not backend.segment_name or not os.path.exists("/dev/shm" + backend.segment_name)
        dist.destroy_process_group()
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_destroy_then_init_again_leaves_nothing_in_dev_shm(transport):
    before = sorted(os.listdir("/dev/shm"))
    assert spawn(_reinit, 3, env=transport_env(transport)) == [True] * 3
    assert [n for n in os.listdir("/dev/shm") if n.startswith("torchpar-")] == \
        [n for n in before if n.startswith("torchpar-")]


def _transport_in_use(rank, world_size, init_file):
    import torchpar  # noqa: F401
    dist.init_process_group("torchpar", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    check_group()
    pair = dist.new_group([0, 1])  # sub-groups pick theirs the same way
    check_group(pair)
    used = backend.transport, pair._get_backend(torch.device("cpu")).transport
    dist.destroy_process_group()
    return used


@pytest.mark.parametrize("setting,expected", [("auto", "shm"), ("shm", "shm"), ("tcp", "tcp")])
def test_ranks_on_one_host_share_memory_unless_tcp_is_asked_for(setting, expected):
    assert spawn(_transport_in_use, 2, env={"TORCHPAR_TRANSPORT": setting}) == [(expected, expected)] * 2


def _init_expecting_error(rank, world_size, init_file, *words):
    import torchpar  # noqa: F401
    try:
        dist.init_process_group("torchpar", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=20))
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        for w in words:
            assert w in str(e), f"error message lacks {w!r}: {e}"
        return True
    raise AssertionError("init_process_group succeeded")


def test_unknown_transport_setting_is_a_clear_error():
    assert spawn(_init_expecting_error, 1, "TORCHPAR_TRANSPORT", "auto, shm or tcp",
                 env={"TORCHPAR_TRANSPORT": "udp"}) == [True]


def _init_with_own_transport(rank, world_size, init_file):
    os.environ["TORCHPAR_TRANSPORT"] = ["shm", "tcp"][rank]
    return _init_expecting_error(rank, world_size, init_file, "TORCHPAR_TRANSPORT differs")


def test_ranks_asking_for_different_transports_is_a_clear_error():
    assert spawn(_init_with_own_transport, 2) == [True, True]


def _init_with_own_chunk(rank, world_size, init_file):
    os.environ["TORCHPAR_P2P_CHUNK_BYTES"] = ["64K", "1M"][rank]
    return _init_expecting_error(rank, world_size, init_file, "TORCHPAR_P2P_CHUNK_BYTES differs", "rank 1 (1048576)")


def test_ranks_with_different_wire_settings_is_a_clear_error():
    """Settings that decide what each rank sends must agree (they would go out of step)."""
    assert spawn(_init_with_own_chunk, 2, env={"TORCHPAR_TRANSPORT": "tcp"}) == [True, True]


def test_socket_interface_without_an_address_is_a_clear_error():
    env = {"TORCHPAR_TRANSPORT": "tcp", "TORCHPAR_SOCKET_IFNAME": "no-such-if0"}
    assert spawn(_init_expecting_error, 2, "TORCHPAR_SOCKET_IFNAME=no-such-if0", env=env) == [True, True]


def test_socket_interface_names_the_addresses_ranks_publish():
    env = {"TORCHPAR_TRANSPORT": "tcp", "TORCHPAR_SOCKET_IFNAME": "lo"}
    assert spawn(_transport_in_use, 2, env=env) == [("tcp", "tcp")] * 2


def _drop_a_ddp_after_destroy(rank, world_size, init_file, backend, kind):
    import time

    import torch.nn as nn

    import torchpar  # noqa: F401
    from torchpar.parallel import DistributedDataParallel, fully_shard
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    model = nn.Linear(4, 4)
    holder = DistributedDataParallel(model) if kind == "ddp" else fully_shard(model)
    # Rank 0's work is still running on the group's thread when the group's last owner goes:
    # that thread then needs the GIL to release the tensor's Python object, while the group's
    # destructor, run by the garbage collection of `holder`, joins it.
    if rank == 1:
        time.sleep(1)
    t = torch.ones(1 << 16)
    work = dist.all_reduce(t, async_op=True)
    del t, work
    dist.destroy_process_group()
    del holder, model
    return True


@pytest.mark.parametrize("backend,kind", [("gloo", "ddp"), ("gloo", "fsdp"), ("torchpar", "ddp")])
def test_a_module_that_outlives_destroy_process_group_is_dropped_without_a_hang(backend, kind):
    # CI hung a rank this way: our Reducer held the last reference to a gloo group and destroyed
    # it with the GIL held, while gloo's thread waited for the GIL (gloo, ddp hung before).
    assert spawn(_drop_a_ddp_after_destroy, 2, backend, kind, timeout=45) == [True, True]


def _world_of_one(rank, world_size, init_file):
    import torchpar  # noqa: F401
    dist.init_process_group("torchpar", init_method=f"file://{init_file}", rank=0, world_size=1)
    t = torch.arange(5.0)
    dist.all_reduce(t)
    out = torch.empty(5)
    dist.all_gather_into_tensor(out, t)
    assert torch.equal(out, torch.arange(5.0))
    dist.barrier()
    dist.destroy_process_group()
    return True


def test_world_of_one():
    assert spawn(_world_of_one, 1) == [True]


def test_backend_is_registered_for_cpu_and_cuda():
    import torchpar  # noqa: F401
    assert "torchpar" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["torchpar"] == ["cpu", "cuda"]
