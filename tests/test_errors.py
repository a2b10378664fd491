"""Bad input and failures: a clear Python exception on every live rank, never a hang, and
no shared-memory segment left behind."""
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import SMALL_BUFFERS, TRANSPORTS, get_pool, transport_env, spawn

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("transport", TRANSPORTS)]
# Timeout and abort cases (each spawns fresh ranks and waits out a timeout): one transport of each
# in make test, the other in make test-slow (conftest.py), alternating so both keep some.
SLOW_VARIANTS = {"test_ddp_backward_times_out_when_a_peer_stops_training[tcp]",
                 "test_peer_that_never_arrives_times_out_on_every_rank[shm]",
                 "test_a_timeout_names_the_collectives_this_rank_ran_before[tcp]",
                 "test_a_pending_recv_names_the_senders_abort[shm]",
                 "test_recv_without_a_sender_times_out[tcp]",
                 "test_dead_peer_fails_the_collective_quickly[shm]",
                 "test_a_failed_group_leaves_other_groups_usable[tcp]"}


def pool(world_size, transport):
    return get_pool(world_size, env=transport_env(transport, SMALL_BUFFERS))


def torchpar_segments():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("torchpar-"))


def expect_error(fn, *words):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        for w in words:
            assert w in msg, f"error message lacks {w!r}: {msg}"
        return msg
    raise AssertionError(f"expected an error mentioning {words}")


def still_usable(ctx):
    t = torch.ones(4)
    dist.all_reduce(t, group=ctx.pg)
    assert t[0].item() == ctx.world_size


# ---------------------------------------------------------------- mismatches across ranks

def _count_mismatch(ctx):
    t = torch.ones(10 + 5 * ctx.rank)
    expect_error(lambda: dist.all_reduce(t, group=ctx.pg), "mismatch", "rank 0 called all_reduce of 10",
                 "rank 1 called all_reduce of 15")
    big = torch.ones(30000 + ctx.rank)  # chunked path on one rank count, checked before data moves
    expect_error(lambda: dist.all_reduce(big, group=ctx.pg), "mismatch")
    still_usable(ctx)
    return True


def _dtype_mismatch(ctx):
    t = torch.ones(8, dtype=torch.float32 if ctx.rank == 0 else torch.float64)
    expect_error(lambda: dist.all_reduce(t, group=ctx.pg), "mismatch", "Float", "Double")
    g = torch.ones(8, dtype=torch.int32 if ctx.rank == 0 else torch.int64)
    out = torch.zeros(8 * ctx.world_size, dtype=g.dtype)
    expect_error(lambda: dist.all_gather_into_tensor(out, g, group=ctx.pg), "mismatch")
    still_usable(ctx)
    return True


def _op_mismatch(ctx):
    t = torch.ones(8)
    if ctx.rank == 0:
        expect_error(lambda: dist.all_reduce(t, group=ctx.pg), "mismatch", "broadcast")
    else:
        expect_error(lambda: dist.broadcast(t, src=0, group=ctx.pg), "mismatch", "all_reduce")
    r = torch.ones(8)
    expect_error(lambda: dist.all_reduce(r, op=dist.ReduceOp.MAX if ctx.rank else dist.ReduceOp.SUM,
                                         group=ctx.pg), "mismatch", "MAX", "SUM")
    still_usable(ctx)
    return True


def _split_mismatch(ctx):
    w = ctx.world_size
    send = [2] * w
    recv = [3 if ctx.rank == 1 else 2] * w  # rank 1 expects 3 rows from everyone
    inp = torch.ones(sum(send))
    out = torch.zeros(sum(recv))
    expect_error(lambda: dist.all_to_all_single(out, inp, recv, send, group=ctx.pg), "split sizes disagree")
    still_usable(ctx)
    return True


def _sparse_index_out_of_range(ctx):
    # Rank 1's gradient rows lie outside the tensor (torch checks no sparse indices by default): a
    # sum holding them would be written out of bounds where it is used. Every rank refuses it.
    rows = torch.tensor([[1, 9 if ctx.rank == 1 else 2]])
    t = torch.sparse_coo_tensor(rows, torch.ones(2, 3), (5, 3), check_invariants=False)
    expect_error(lambda: dist.all_reduce(t, group=ctx.pg), "rank 1's tensor has indices outside its sizes [5, 3]")
    # Two sparse dimensions: coalescing would fold (0, 7) of a 4 x 5 tensor into (1, 2).
    two = torch.tensor([[1, 0], [0, 7 if ctx.rank == 1 else 2]])
    t = torch.sparse_coo_tensor(two, torch.ones(2), (4, 5), check_invariants=False)
    expect_error(lambda: dist.all_reduce(t, group=ctx.pg), "rank 1's tensor has indices outside its sizes [4, 5]")
    still_usable(ctx)
    return True


def _recv_size_mismatch(ctx):
    if ctx.rank == 0:
        dist.send(torch.ones(10), dst=1, group=ctx.pg)
    elif ctx.rank == 1:
        expect_error(lambda: dist.recv(torch.empty(12), src=0, group=ctx.pg), "48 bytes", "40 bytes")
    still_usable(ctx)
    return True


# ---------------------------------------------------------------- bad arguments (caller side)

def _bad_arguments(ctx):
    t = torch.ones(4)
    expect_error(lambda: dist.broadcast(t, src=ctx.world_size + 3, group=ctx.pg))
    expect_error(lambda: dist.send(t, dst=ctx.world_size + 3, group=ctx.pg))
    expect_error(lambda: dist.all_reduce(torch.ones(4, dtype=torch.float32), op=dist.ReduceOp.BAND, group=ctx.pg),
                 "bitwise")
    expect_error(lambda: dist.all_to_all_single(torch.zeros(4), torch.ones(5), group=ctx.pg), "divide")
    expect_error(lambda: dist.all_to_all_single(torch.zeros(8), torch.ones(8), [1] * ctx.world_size,
                                                [3] * ctx.world_size, group=ctx.pg), "sum")
    expect_error(lambda: dist.all_gather_into_tensor(torch.zeros(3), torch.ones(2), group=ctx.pg), "elements")
    # torch routes meta tensors to its own no-op kernels; call the backend directly.
    backend = ctx.pg._get_backend(torch.device("cpu"))
    expect_error(lambda: backend.allreduce([torch.ones(4, device="meta")]), "is on meta", "moves CPU and CUDA tensors")
    # Sparse tensors: all_reduce SUM only (as gloo; tests/test_conformance_fixes.py).
    expect_error(lambda: backend.broadcast([torch.ones(4).to_sparse()]), "dense")
    sparse_max = dist.AllreduceOptions()
    sparse_max.reduceOp = dist.ReduceOp.MAX
    expect_error(lambda: backend.allreduce([torch.ones(4).to_sparse()], sparse_max), "sparse", "only SUM")
    expect_error(lambda: backend.send([t], ctx.rank, 0), "itself")
    expect_error(lambda: backend.send([t], ctx.world_size, 0), "invalid destination rank")
    still_usable(ctx)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_element_count_mismatch_raises_on_every_rank(world_size, transport):
    pool(world_size, transport).run(_count_mismatch)


@pytest.mark.parametrize("world_size", [2, 4])
def test_dtype_mismatch_raises_on_every_rank(world_size, transport):
    pool(world_size, transport).run(_dtype_mismatch)


def test_different_collectives_raise_on_every_rank(transport):
    pool(2, transport).run(_op_mismatch)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_split_disagreement_raises_on_every_rank(world_size, transport):
    pool(world_size, transport).run(_split_mismatch)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_sparse_index_outside_the_tensor_raises_on_every_rank(world_size, transport):
    pool(world_size, transport).run(_sparse_index_out_of_range)


def test_recv_of_the_wrong_size_raises(transport):
    pool(2, transport).run(_recv_size_mismatch)


@pytest.mark.parametrize("world_size", [2])
def test_bad_arguments_raise_at_the_call(world_size, transport):
    pool(world_size, transport).run(_bad_arguments)


# ---------------------------------------------------------------- failures (fresh processes)

def _init(rank, world_size, init_file, timeout_s):
    import torchpar  # noqa: F401
    dist.init_process_group("torchpar", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _peer_never_arrives(rank, world_size, init_file):
    _init(rank, world_size, init_file, 3)
    t = torch.ones(4)
    if rank != world_size - 1:
        start = time.monotonic()
        msg = expect_error(lambda: dist.all_reduce(t), "all_reduce", f"rank {world_size - 1}")
        assert time.monotonic() - start < 20
        assert "timed out" in msg or "aborted" in msg, msg
        # The group has failed: later operations fail at once.
        expect_error(lambda: dist.all_reduce(t), "no longer usable")
    else:
        time.sleep(6)  # past the timeout, then arrive late: the group was aborted meanwhile
        expect_error(lambda: dist.all_reduce(t), "aborted by rank")
    dist.destroy_process_group()
    return True


def _one_rank_runs_one_more(rank, world_size, init_file):
    """Rank 0 runs a collective rank 1 never issues: its timeout names the collectives it ran
    before, so two ranks' messages show where their programs parted."""
    _init(rank, world_size, init_file, 3)
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    if rank == 0:
        msg = expect_error(lambda: dist.all_gather_into_tensor(torch.empty(8), t), "all_gather_into_tensor")
        assert "(collective #2)" in msg, msg
        assert msg.endswith(" [rank 0's collectives before it: #0 all_reduce, #1 broadcast]"
                            " [the group is no longer usable]"), msg
    else:
        time.sleep(5)
        msg = expect_error(lambda: dist.barrier(), "aborted by rank 0")
        # Its own list after the one rank 0's quoted reason carries.
        assert "[rank 0's collectives before it: #0 all_reduce, #1 broadcast]" in msg, msg
        assert msg.endswith(" [rank 1's collectives before it: #0 all_reduce, #1 broadcast]"
                            " [the group is no longer usable]"), msg
    dist.destroy_process_group()
    return True


def _peer_dies(rank, world_size, init_file):
    _init(rank, world_size, init_file, 60)
    t = torch.ones(100_000)
    if rank == 1:
        dist.all_reduce(t)
        os._exit(3)
    # Rank 1 exits once its share of the first all-reduce is done; the monitor may see that
    # before this rank has finished its own, so that one may fail too (the group is unusable
    # from the exit on). Within a few collectives, each rank must fail with rank 1 named.
    start = time.monotonic()
    expect_error(lambda: [dist.all_reduce(t) for _ in range(4)], "rank 1", "exited")
    assert time.monotonic() - start < 15, "a dead peer must be noticed long before the 60 s timeout"
    # A failed group's threads sleep until it is destroyed (none polls the dead connection).
    cpu = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.5, "a failed group keeps a CPU busy"
    dist.destroy_process_group()
    return True


def _peer_dies_during_recv(rank, world_size, init_file):
    _init(rank, world_size, init_file, 60)
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)
    start = time.monotonic()
    expect_error(lambda: dist.recv(torch.empty(5), src=1), "rank 1", "exited")
    assert time.monotonic() - start < 15
    return True


def _send_to_an_exited_peer(rank, world_size, init_file):
    """A send that fits the pipe completes (its bytes are in the pipe, whoever reads them); one
    that cannot leave fails naming the peer, written by the caller (fast path) or queued."""
    _init(rank, world_size, init_file, 60)
    dist.barrier()
    if rank == 1:
        os._exit(3)
    time.sleep(0.5)  # rank 1 is gone before anything is sent
    start = time.monotonic()
    big = torch.ones(1 << 20)  # 4 MiB: more than the ring (16 KiB) or a socket's buffers hold
    msg = expect_error(lambda: [dist.send(big, dst=1, tag=t) for t in range(4)], "rank 1")
    assert "exited" in msg or "lost" in msg or "closed" in msg, msg
    assert time.monotonic() - start < 15, "a dead peer must be noticed long before the 60 s timeout"
    # The group has failed: a later send fails at once, however small.
    expect_error(lambda: dist.send(torch.ones(1), dst=1), "rank 1")
    return True


def _messages_of_an_exited_peer(rank, world_size, init_file):
    """Rank 1 sends two messages and exits; rank 0's progress thread is held up (a callback on
    the first receive's future sleeps in it), so the second message waits unread in the pipe
    while rank 0 sends to rank 1 (over TCP that send fails on the closed connection). The second
    message must still arrive: over TCP a failed write used to stop reading the socket (review
    finding)."""
    _init(rank, world_size, init_file, 60)
    dist.barrier()
    if rank == 1:
        dist.send(torch.ones(4), dst=0, tag=1)
        dist.send(torch.arange(256.0), dst=0, tag=2)
        time.sleep(0.05)
        os._exit(0)
    first, second = torch.empty(4), torch.empty(256)
    work = dist.irecv(first, src=1, tag=1)
    held = work.get_future().then(lambda f: time.sleep(1.0))
    last = dist.irecv(second, src=1, tag=2)
    time.sleep(0.4)  # rank 1 has sent both and exited; the progress thread sleeps in the callback
    for _ in range(3):
        try:
            dist.isend(torch.ones(1024), dst=1, tag=9)
        except Exception:  # noqa: BLE001 - the failure itself is test_send_to_an_exited_peer's
            pass
    last.wait()
    held.wait()
    assert torch.equal(second, torch.arange(256.0))
    return True


def _stalled_peer_then_drained(rank, world_size, init_file, side):
    """Rank 1 is stopped (SIGSTOP) while rank 0 fills the pipe with empty sends until the one
    in front expires before a byte of it was written; rank 1 is resumed and drains the pipe.
    Rank 0's progress thread must then sleep, not spin (review finding: over TCP it kept asking
    poll() for room it had nothing to write into)."""
    import signal
    _init(rank, world_size, init_file, 3)
    if rank == 1:
        with open(side + ".pid", "w") as f:
            f.write(str(os.getpid()))
        while not os.path.exists(side + ".done"):
            time.sleep(0.05)
        return True
    while not os.path.exists(side + ".pid"):
        time.sleep(0.01)
    time.sleep(0.1)
    peer = int(open(side + ".pid").read())
    os.kill(peer, signal.SIGSTOP)
    works = []
    try:
        for _ in range(100):
            works += [dist.isend(torch.empty(0), dst=1) for _ in range(10000)]
            time.sleep(0.2)
            if not works[-1].is_completed():
                break  # the socket is full
        expect_error(lambda: works[-1].wait(), "timed out")
    finally:
        os.kill(peer, signal.SIGCONT)
    time.sleep(1.5)  # rank 1 drains the socket
    spent = _p2p_thread_cpu()
    time.sleep(1.0)
    spent = _p2p_thread_cpu() - spent
    with open(side + ".done", "w") as f:
        f.write("1")
    assert spent < 0.3, f"the point-to-point progress thread used {spent:.2f} s of CPU in 1 s while idle"
    return True


def _p2p_thread_cpu():
    """CPU seconds of this process's point-to-point progress threads."""
    ticks = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "torchpar-p2p":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        except FileNotFoundError:
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def _p2p_timeout(rank, world_size, init_file):
    _init(rank, world_size, init_file, 2)
    if rank == 0:
        expect_error(lambda: dist.recv(torch.empty(5), src=1, tag=3), "timed out", "rank 1")
    else:
        time.sleep(3)
    return True


def _recv_pending_when_the_sender_aborts(rank, world_size, init_file):
    """Rank 1 waits in a receive; rank 0 aborts the group instead of sending (a pipeline stage
    that failed does) and stays alive. The receive names the abort and its rank, over either
    transport (over TCP it used to name the connection rank 0 closed in aborting)."""
    _init(rank, world_size, init_file, 60)
    group = dist.distributed_c10d._get_default_group()
    if rank == 0:
        time.sleep(0.5)  # rank 1 is waiting by now
        group.abort()
        time.sleep(3)    # alive while rank 1 reads why
    else:
        start = time.monotonic()
        expect_error(lambda: dist.recv(torch.empty(5), src=0, tag=3), "aborted by rank 0")
        assert time.monotonic() - start < 20
    return True


def _ddp_model():
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))


def _ddp_peer_dies(rank, world_size, init_file, as_view):
    """A rank dies between steps; the others are in backward, with bucket all-reduces in flight."""
    from torchpar.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    _init(rank, world_size, init_file, 60)
    ddp = DDP(_ddp_model(), bucket_cap_mb=0.05, gradient_as_bucket_view=as_view)
    x = torch.randn(8, 64)
    ddp(x).sum().backward()
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    expect_error(lambda: ddp(x).sum().backward(), "rank 1", "exited")
    assert time.monotonic() - start < 15, "a dead peer must be noticed long before the 60 s timeout"
    dist.destroy_process_group()
    return True


def _ddp_peer_stops_training(rank, world_size, init_file):
    """A rank leaves the training loop early (uneven inputs without join()): the others' backward
    times out with an error naming the rank, instead of hanging."""
    from torchpar.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    _init(rank, world_size, init_file, 3)
    ddp = DDP(_ddp_model(), bucket_cap_mb=0.05)
    x = torch.randn(8, 64)
    ddp(x).sum().backward()
    if rank == world_size - 1:
        time.sleep(8)  # past the others' timeout
        return True
    start = time.monotonic()
    msg = expect_error(lambda: ddp(x).sum().backward(), f"rank {world_size - 1}")
    assert "timed out" in msg or "aborted" in msg, msg
    assert time.monotonic() - start < 20
    return True


@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
def test_ddp_backward_fails_clearly_when_a_peer_dies(as_view, transport):
    results = spawn(_ddp_peer_dies, 3, as_view, timeout=60, env=transport_env(transport))
    assert results[0] is True and results[2] is True and results[1] == "died"
    assert torchpar_segments() == []


def test_ddp_backward_times_out_when_a_peer_stops_training(transport):
    before = torchpar_segments()
    assert spawn(_ddp_peer_stops_training, 2, timeout=60, env=transport_env(transport)) == [True, True]
    assert torchpar_segments() == before


def test_peer_that_never_arrives_times_out_on_every_rank(transport):
    before = torchpar_segments()
    assert spawn(_peer_never_arrives, 3, timeout=60, env=transport_env(transport)) == [True] * 3
    assert torchpar_segments() == before


def test_a_timeout_names_the_collectives_this_rank_ran_before(transport):
    assert spawn(_one_rank_runs_one_more, 2, timeout=60, env=transport_env(transport)) == [True] * 2


def test_dead_peer_fails_the_collective_quickly(transport):
    results = spawn(_peer_dies, 3, timeout=60, env=transport_env(transport))
    assert results[0] is True and results[2] is True and results[1] == "died"
    assert torchpar_segments() == []


def test_dead_peer_fails_a_pending_recv(transport):
    results = spawn(_peer_dies_during_recv, 2, timeout=60, env=transport_env(transport))
    assert results[0] is True


@pytest.mark.parametrize("send_path", ["fast", "queued"])
def test_send_to_an_exited_peer_fails_naming_it(transport, send_path):
    env = transport_env(transport, {**SMALL_BUFFERS, "TORCHPAR_P2P_FAST_SEND": "1" if send_path == "fast" else "0"})
    results = spawn(_send_to_an_exited_peer, 2, timeout=60, env=env)
    assert results[0] is True and results[1] == "died"


@pytest.mark.parametrize("send_path", ["fast", "queued"])
def test_messages_of_an_exited_peer_arrive_after_a_failed_send(transport, send_path):
    env = transport_env(transport, {"TORCHPAR_P2P_FAST_SEND": "1" if send_path == "fast" else "0"})
    results = spawn(_messages_of_an_exited_peer, 2, timeout=60, env=env)
    assert results[0] is True


@pytest.mark.slow
def test_progress_thread_sleeps_after_a_send_expired_on_a_full_pipe(transport, tmp_path):
    assert spawn(_stalled_peer_then_drained, 2, str(tmp_path / "side"), timeout=110,
                 env=transport_env(transport)) == [True, True]


def test_a_pending_recv_names_the_senders_abort(transport):
    assert spawn(_recv_pending_when_the_sender_aborts, 2, timeout=60, env=transport_env(transport)) == [True, True]


def test_recv_without_a_sender_times_out(transport):
    assert spawn(_p2p_timeout, 2, timeout=60, env=transport_env(transport)) == [True, True]


def _failure_stays_in_its_group(rank, world_size, init_file):
    _init(rank, world_size, init_file, 30)
    pair = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    t = torch.ones(4)
    if rank == 0:
        expect_error(lambda: dist.all_reduce(t, group=pair), "timed out", "rank 1")
    if rank == 1:
        time.sleep(3)  # misses the pair's collective: the pair fails ...
        expect_error(lambda: dist.all_reduce(t, group=pair), "aborted by rank 0")
    # ... and the world group, which shares ranks 0 and 1, does not.
    w = torch.ones(4)
    dist.all_reduce(w)
    assert w[0].item() == world_size
    dist.destroy_process_group()
    return True


def _destroy_with_async_work_pending(rank, world_size, init_file):
    _init(rank, world_size, init_file, 30)
    works = [dist.all_reduce(torch.ones(1000), async_op=True) for _ in range(5)]
    if rank == 0:
        works.append(dist.irecv(torch.empty(3), src=1, tag=77))  # never sent
    works[4].wait()
    dist.destroy_process_group()  # returns; the unmatched receive fails instead of hanging
    if rank == 0:
        assert works[-1].is_completed() and not works[-1].is_success()
    return True


def _destroy_a_subgroup_a_peer_still_waits_in(rank, world_size, init_file):
    """Rank 0 issues a collective on a subgroup that rank 1 never joins; both then destroy the
    subgroup. Rank 1's side is gone, so rank 0's collective fails at once (it waited for the
    group's timeout before, 2026-11-30; gloo's fails when rank 1 closes its connection)."""
    _init(rank, world_size, init_file, 30)
    pair = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(4), group=pair)
    work = dist.all_reduce(torch.ones(4), group=pair, async_op=True) if rank == 0 else None
    start = time.monotonic()
    dist.destroy_process_group(pair)  # rank 1 still holds `pair`: destroying it is what says so
    if work is not None:
        msg = expect_error(work.wait, "rank 1")
        assert "has left the group" in msg or "lost the TCP connection" in msg, msg
    elapsed = time.monotonic() - start
    dist.barrier()  # rank 1 waits here, its `pair` alive, until rank 0's work has failed
    del pair
    dist.destroy_process_group()
    return elapsed


def test_destroying_a_group_fails_a_peers_collective_at_once(transport):
    elapsed = spawn(_destroy_a_subgroup_a_peer_still_waits_in, 2, timeout=60, env=transport_env(transport))
    assert max(elapsed) < 10, elapsed  # not the group's 30 s timeout


def test_a_failed_group_leaves_other_groups_usable(transport):
    assert spawn(_failure_stays_in_its_group, 3, timeout=60, env=transport_env(transport)) == [True] * 3


def test_destroy_with_pending_work_does_not_hang(transport):
    assert spawn(_destroy_with_async_work_pending, 2, timeout=60, env=transport_env(transport)) == [True, True]
