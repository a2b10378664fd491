"""Callbacks on a work's future that issue or wait on other operations (issue 21): they run
where the work finishes, on the group's worker, in the caller, or on the point-to-point
progress thread. A collective issued there runs at once, after those issued before the
finished operation's future was taken (where NCCL's complete-at-issue futures put it), and so
does a queued one its work's wait() waits for; a wait that only that thread could end is an
error saying so. (Waiting on a queued collective's future, rather than its work, from a callback
on the group's worker still blocks that thread: docs/backend.md.)"""
import time

import pytest
import torch
import torch.distributed as dist

from harness import SMALL_BUFFERS, TRANSPORTS, get_pool, transport_env

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("transport", TRANSPORTS)]


def pool(transport):
    return get_pool(2, env=transport_env(transport, SMALL_BUFFERS))


def _collective_waited_on_in_a_callback(ctx):
    """An async all_reduce's callback (on the group's worker) runs a blocking all_reduce. It
    used to be queued behind the callback that waits for it, forever."""
    t = torch.full((5,), float(ctx.rank + 1))

    def then_sum_again(fut):
        again = fut.value()[0] * 10
        dist.all_reduce(again, group=ctx.pg)  # blocking, on the worker thread
        return again

    chained = dist.all_reduce(t, async_op=True, group=ctx.pg).get_future().then(then_sum_again)
    assert torch.equal(chained.wait(), torch.full((5,), 60.0))
    # An operation issued from the main thread meanwhile keeps its place in the order.
    u = torch.full((2,), float(ctx.rank))
    dist.all_reduce(u, group=ctx.pg)
    assert torch.equal(u, torch.ones(2))
    return True


def _callback_waits_on_a_collective_queued_after_its_own(ctx):
    """Two async all_reduces; the first one's callback waits on the second's work. The callback
    runs on the thread that would run the second: it runs it there (it waited forever before:
    audit finding; gloo's thread pool runs it), and the group goes on in order."""
    a, b = torch.ones(2), torch.full((2,), float(ctx.rank + 1))
    first = dist.all_reduce(a, async_op=True, group=ctx.pg)
    second = dist.all_reduce(b, async_op=True, group=ctx.pg)

    def wait_for_the_second(fut):
        second.wait()
        return fut.value()[0] + b

    assert torch.equal(first.get_future().then(wait_for_the_second).wait(), torch.full((2,), 5.0))
    second.wait()
    # A chain: the first's callback waits on the second, whose callback waits on the third (a
    # nested wait found the queue moved aside: review finding).
    if ctx.rank == 1:
        time.sleep(0.2)  # rank 0's callbacks are attached before its first all_reduce can finish
    works = [dist.all_reduce(torch.ones(1), async_op=True, group=ctx.pg) for _ in range(3)]
    chained = [works[i].get_future().then(lambda fut, i=i: works[i + 1].wait()) for i in range(2)]
    assert all(c.wait() for c in chained) and torch.equal(works[2].result()[0], torch.full((1,), 2.0))
    u = torch.full((2,), float(ctx.rank))
    dist.all_reduce(u, group=ctx.pg)
    assert torch.equal(u, torch.ones(2))
    return True


def _callback_collective_is_ordered_after_its_work_on_every_rank(ctx):
    """A's callback issues C; the main thread issues B right after attaching it (a DDP comm
    hook's pattern: PowerSGD's callbacks all-reduce P and Q before the next bucket's all-reduce).
    Rank 0's B is queued before A finishes (A waits for rank 1), rank 1's only after A's
    callback ran: C runs right after A on both (before: A, B, C on rank 0 and A, C, B on rank 1,
    a mismatch)."""
    if ctx.rank == 1:
        time.sleep(0.2)
    a = torch.ones(1)

    def issue_c(fut):
        c = torch.full((3,), float(ctx.rank + 1))
        dist.all_reduce(c, group=ctx.pg)  # blocking, on the thread that ran A
        return c

    chained = dist.all_reduce(a, async_op=True, group=ctx.pg).get_future().then(issue_c)
    if ctx.rank == 1:
        time.sleep(0.2)
    b = torch.full((5,), float(ctx.rank))
    work_b = dist.all_reduce(b, async_op=True, group=ctx.pg)
    assert torch.equal(chained.wait(), torch.full((3,), 3.0))
    work_b.wait()
    assert torch.equal(b, torch.ones(5)) and a.item() == 2.0
    return True


def _callback_attached_after_a_later_collective_runs_after_it(ctx, coalesced):
    """A and B issued, then A's future taken and a callback attached that issues C (review
    finding). Rank 0's A finished before (its callback runs at once, C queued behind B), rank
    1's not (its callback runs on the worker after A): C must come after B on both, where NCCL
    puts it. B and C have the same shape, so a swap would go unnoticed but for the values. A
    coalesced A (one work over several collectives) too (second review)."""
    if ctx.rank == 0:
        time.sleep(0.3)  # rank 1's A waits for rank 0
    if coalesced:
        work_a = ctx.pg.allgather_into_tensor_coalesced([torch.zeros(4 * ctx.world_size)], [torch.ones(4)])
    else:
        work_a = dist.all_reduce(torch.ones(4), async_op=True, group=ctx.pg)
    b = torch.full((4,), 10.0 * (ctx.rank + 1))
    work_b = dist.all_reduce(b, async_op=True, group=ctx.pg)
    if ctx.rank == 0:
        work_b.wait()
    c = torch.full((4,), 100.0 * (ctx.rank + 1))
    issued = []
    work_a.get_future().then(lambda fut: issued.append(dist.all_reduce(c, async_op=True, group=ctx.pg))).wait()
    work_b.wait()
    issued[0].wait()
    assert torch.equal(b, torch.full((4,), 30.0)) and torch.equal(c, torch.full((4,), 300.0)), (b, c)
    return True


def _async_collective_in_a_recv_callback(ctx):
    """A recv's callback runs on the progress thread; an async collective issued there goes
    to the worker and completes."""
    peer = 1 - ctx.rank
    got = torch.zeros(3)
    out = {}

    def reduce_it(fut):
        out["work"] = dist.all_reduce(fut.value()[0].clone(), async_op=True, group=ctx.pg)
        return True

    recv_done = dist.irecv(got, src=peer, group=ctx.pg).get_future().then(reduce_it)
    # Both receives are posted before either send, so both finish on the progress thread.
    dist.barrier(group=ctx.pg)
    dist.send(torch.full((3,), float(ctx.rank + 1)), dst=peer, group=ctx.pg)
    recv_done.wait()
    out["work"].wait()
    assert torch.equal(out["work"].result()[0], torch.full((3,), 3.0))
    return True


def _blocking_collective_in_a_recv_callback_is_an_error(ctx):
    """A blocking all_reduce on the progress thread would wait for that thread itself: it is
    refused with a message that says why, and the group keeps working."""
    peer = 1 - ctx.rank
    got = torch.zeros(3)

    def block(fut):
        dist.all_reduce(fut.value()[0], group=ctx.pg)
        return True

    chained = dist.irecv(got, src=peer, group=ctx.pg).get_future().then(block)
    # Both receives are posted before either send, so both finish on the progress thread.
    dist.barrier(group=ctx.pg)
    dist.send(torch.ones(3), dst=peer, group=ctx.pg)
    with pytest.raises(Exception, match="progress thread"):
        chained.wait()
    t = torch.ones(4)
    dist.all_reduce(t, group=ctx.pg)
    assert torch.equal(t, torch.full((4,), 2.0))
    return True


def _wait_in_a_recv_callback_is_an_error(ctx):
    """Waiting in a recv's callback for a recv not yet arrived would block the thread that
    must receive it."""
    peer = 1 - ctx.rank
    first, second = torch.zeros(1), torch.zeros(1)
    later = {}

    def wait_for_the_next(fut):
        later["work"] = dist.irecv(second, src=peer, tag=2, group=ctx.pg)
        later["work"].wait()
        return True

    chained = dist.irecv(first, src=peer, tag=1, group=ctx.pg).get_future().then(wait_for_the_next)
    # Both receives are posted before either send, so both finish on the progress thread.
    dist.barrier(group=ctx.pg)
    dist.send(torch.ones(1), dst=peer, tag=1, group=ctx.pg)
    with pytest.raises(Exception, match="progress thread"):
        chained.wait()
    dist.barrier(group=ctx.pg)  # both ranks have seen the error before tag 2 goes out
    dist.send(torch.full((1,), 7.0), dst=peer, tag=2, group=ctx.pg)
    later["work"].wait()  # from the main thread it completes
    assert second.item() == 7.0
    return True


def test_a_callback_can_wait_on_a_collective_it_issues(transport):
    pool(transport).run(_collective_waited_on_in_a_callback)


def test_a_callback_can_wait_on_a_collective_queued_after_its_own(transport):
    pool(transport).run(_callback_waits_on_a_collective_queued_after_its_own)


def test_a_collective_issued_by_a_callback_runs_right_after_its_work_on_every_rank(transport):
    pool(transport).run(_callback_collective_is_ordered_after_its_work_on_every_rank)


@pytest.mark.parametrize("coalesced", [False, True], ids=["plain", "coalesced"])
def test_a_callback_attached_after_a_later_collective_runs_its_collective_after_that_one(transport, coalesced):
    pool(transport).run(_callback_attached_after_a_later_collective_runs_after_it, coalesced)


def test_a_recv_callback_can_issue_an_async_collective(transport):
    pool(transport).run(_async_collective_in_a_recv_callback)


def test_a_blocking_collective_in_a_recv_callback_is_an_error(transport):
    pool(transport).run(_blocking_collective_in_a_recv_callback_is_an_error)


def test_waiting_in_a_recv_callback_is_an_error(transport):
    pool(transport).run(_wait_in_a_recv_callback_is_an_error)
