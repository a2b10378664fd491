"""Point-to-point: tag matching, any-source receives, async work handles, and every
pattern in which each rank posts all its sends and receives before waiting."""
import time

import pytest
import torch
import torch.distributed as dist

from harness import SMALL_BUFFERS, TRANSPORTS, get_pool, transport_env

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("transport", TRANSPORTS)]

# Far larger than the test pools' 16 KiB rings.
BIG = 100_003


def pool(world_size, transport):
    return get_pool(world_size, env=transport_env(transport, SMALL_BUFFERS))


def payload(src, dst, n, tag=0):
    return torch.arange(n, dtype=torch.float32) + 1000 * src + 10 * dst + tag


def _ring(ctx, n):
    w, r = ctx.world_size, ctx.rank
    right, left = (r + 1) % w, (r - 1) % w
    out = torch.empty(n)
    reqs = [dist.irecv(out, src=left, group=ctx.pg), dist.isend(payload(r, right, n), dst=right, group=ctx.pg)]
    for q in reqs:
        q.wait()
    assert torch.equal(out, payload(left, r, n))
    return True


def _all_pairs_posted_first(ctx, n):
    """Every rank posts sends to and receives from every peer, then waits on all."""
    w, r = ctx.world_size, ctx.rank
    outs = {q: torch.empty(n) for q in range(w) if q != r}
    reqs = [dist.isend(payload(r, q, n), dst=q, group=ctx.pg) for q in range(w) if q != r]
    reqs += [dist.irecv(outs[q], src=q, group=ctx.pg) for q in outs]
    for q in reqs:
        q.wait()
    for q, t in outs.items():
        assert torch.equal(t, payload(q, r, n))
    return True


def _batch_isend_irecv(ctx, n):
    w, r = ctx.world_size, ctx.rank
    right, left = (r + 1) % w, (r - 1) % w
    a, b = torch.empty(n), torch.empty(n)
    ops = [dist.P2POp(dist.isend, payload(r, right, n), right, group=ctx.pg),
           dist.P2POp(dist.irecv, a, left, group=ctx.pg),
           dist.P2POp(dist.isend, payload(r, left, n, tag=1), left, group=ctx.pg),
           dist.P2POp(dist.irecv, b, right, group=ctx.pg)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    assert torch.equal(a, payload(left, r, n))
    assert torch.equal(b, payload(right, r, n, tag=1))
    return True


def _one_f_one_b_exchange(ctx, n, micro):
    """Pipeline-style: each stage sends activations forward and gradients backward,
    posting both before waiting, for several micro-batches."""
    w, r = ctx.world_size, ctx.rank
    for m in range(micro):
        reqs, fwd, bwd = [], None, None
        if r + 1 < w:
            reqs.append(dist.isend(payload(r, r + 1, n, m), dst=r + 1, group=ctx.pg))
            bwd = torch.empty(n)
            reqs.append(dist.irecv(bwd, src=r + 1, group=ctx.pg))
        if r > 0:
            reqs.append(dist.isend(payload(r, r - 1, n, m), dst=r - 1, group=ctx.pg))
            fwd = torch.empty(n)
            reqs.append(dist.irecv(fwd, src=r - 1, group=ctx.pg))
        for q in reqs:
            q.wait()
        if fwd is not None:
            assert torch.equal(fwd, payload(r - 1, r, n, m))
        if bwd is not None:
            assert torch.equal(bwd, payload(r + 1, r, n, m))
    return True


def _tags_match_out_of_order(ctx):
    if ctx.rank == 0:
        for tag in (1, 2, 3):
            dist.send(payload(0, 1, 50, tag), dst=1, tag=tag, group=ctx.pg)
    elif ctx.rank == 1:
        # Blocking receives in the opposite order: earlier messages are buffered, not stalled.
        for tag in (3, 1, 2):
            t = torch.empty(50)
            dist.recv(t, src=0, tag=tag, group=ctx.pg)
            assert torch.equal(t, payload(0, 1, 50, tag)), f"tag {tag}"
    return True


def _same_tag_keeps_order(ctx):
    if ctx.rank == 0:
        works = [dist.isend(torch.full((BIG,), float(i)), dst=1, group=ctx.pg) for i in range(4)]
        for q in works:
            q.wait()
    elif ctx.rank == 1:
        outs = [torch.empty(BIG) for _ in range(4)]
        works = [dist.irecv(o, src=0, group=ctx.pg) for o in outs]
        for q in works:
            q.wait()
        for i, o in enumerate(outs):
            assert (o == i).all()
    return True


def _any_source(ctx):
    w, r = ctx.world_size, ctx.rank
    if r == 0:
        seen = set()
        for _ in range(w - 1):
            t = torch.empty(20)
            src = dist.recv(t, group=ctx.pg)  # any source
            assert torch.equal(t, payload(src, 0, 20)), f"payload from {src}"
            seen.add(src)
        assert seen == set(range(1, w))
        work = dist.irecv(torch.empty(20), tag=5, group=ctx.pg)
        work.wait()
        assert work._source_rank() == 1
    else:
        dist.send(payload(r, 0, 20), dst=0, group=ctx.pg)
        if r == 1:
            sent = dist.isend(payload(r, 0, 20), dst=0, tag=5, group=ctx.pg)
            sent.wait()
            with pytest.raises(RuntimeError, match="only defined for a completed receive"):
                sent._source_rank()  # a send has no source (as gloo's; it gave the destination)
    return True


def _async_returns_before_peer_arrives(ctx):
    if ctx.rank == 0:
        t = torch.empty(10)
        work = dist.irecv(t, src=1, group=ctx.pg)
        assert not work.is_completed()  # rank 1 is still asleep
        fut = work.get_future()
        work.wait()
        assert work.is_success() and torch.equal(t, payload(1, 0, 10))
        assert torch.equal(fut.value()[0], t)
        a = torch.ones(8)
        w2 = dist.all_reduce(a, async_op=True, group=ctx.pg)
        assert not w2.is_completed()
        assert w2.get_future().wait()[0].sum().item() == 8 * ctx.world_size
    else:
        time.sleep(0.5)
        if ctx.rank == 1:
            dist.send(payload(1, 0, 10), dst=0, group=ctx.pg)
        time.sleep(0.5)
        a = torch.ones(8)
        dist.all_reduce(a, group=ctx.pg)
    return True


def _collective_does_not_wait_for_p2p(ctx):
    """An irecv posted before a collective must not hold the collective back."""
    if ctx.rank == 0:
        late = torch.empty(5)
        work = dist.irecv(late, src=1, tag=9, group=ctx.pg)
        t = torch.ones(3)
        dist.all_reduce(t, group=ctx.pg)
        assert t[0].item() == ctx.world_size
        work.wait()
        assert torch.equal(late, payload(1, 0, 5))
    else:
        t = torch.ones(3)
        dist.all_reduce(t, group=ctx.pg)
        if ctx.rank == 1:
            dist.send(payload(1, 0, 5), dst=0, tag=9, group=ctx.pg)
    return True


def _non_contiguous_and_dtypes(ctx):
    if ctx.world_size < 2 or ctx.rank > 1:
        return True
    for dtype in (torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.complex64, torch.float64):
        src = (torch.arange(24).view(4, 6) % 3).to(dtype)
        if ctx.rank == 0:
            dist.send(src.t(), dst=1, group=ctx.pg)  # non-contiguous send
        else:
            out = torch.zeros(12, 4, dtype=dtype)[::2]  # non-contiguous receive
            dist.recv(out, src=0, group=ctx.pg)
            assert torch.equal(out, src.t()), dtype
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, BIG], ids=["empty", "one", "larger-than-ring"])
def test_ring_exchange(world_size, n, transport):
    pool(world_size, transport).run(_ring, n)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("n", [7, BIG], ids=["small", "larger-than-ring"])
def test_every_pair_posted_before_waiting(world_size, n, transport):
    pool(world_size, transport).run(_all_pairs_posted_first, n)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_batch_isend_irecv(world_size, transport):
    pool(world_size, transport).run(_batch_isend_irecv, BIG)


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_f_one_b_exchanges(world_size, transport):
    pool(world_size, transport).run(_one_f_one_b_exchange, BIG, 4)


def test_tags_match_whatever_the_receive_order(transport):
    pool(2, transport).run(_tags_match_out_of_order)


def test_messages_with_one_tag_arrive_in_order(transport):
    pool(2, transport).run(_same_tag_keeps_order)


@pytest.mark.parametrize("world_size", [2, 4])
def test_receive_from_any_source_reports_the_sender(world_size, transport):
    pool(world_size, transport).run(_any_source)


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_operations_return_before_the_peer_arrives(world_size, transport):
    pool(world_size, transport).run(_async_returns_before_peer_arrives)


def test_collectives_do_not_queue_behind_receives(transport):
    pool(3, transport).run(_collective_does_not_wait_for_p2p)


def test_send_recv_non_contiguous_and_every_dtype(transport):
    pool(2, transport).run(_non_contiguous_and_dtypes)


def _object_collectives(ctx):
    w, r = ctx.world_size, ctx.rank
    objs = [None] * w
    dist.all_gather_object(objs, {"rank": r, "pad": "x" * (r * 100)}, group=ctx.pg)
    assert [o["rank"] for o in objs] == list(range(w))
    lst = [("hello", r)] if r == 1 else [None]
    dist.broadcast_object_list(lst, src=1, group=ctx.pg)
    assert lst == [("hello", 1)]
    out = [None]
    dist.scatter_object_list(out, [f"to {q}" for q in range(w)] if r == 0 else None, src=0, group=ctx.pg)
    assert out == [f"to {r}"]
    gathered = [None] * w if r == 0 else None
    dist.gather_object(r * 10, gathered, dst=0, group=ctx.pg)
    if r == 0:
        assert gathered == [q * 10 for q in range(w)]
    return True


def _failed_async_work_reports_its_exception(ctx):
    t = torch.ones(3 + ctx.rank)  # counts differ: the collective fails on every rank
    work = dist.all_reduce(t, async_op=True, group=ctx.pg)
    try:
        work.wait()
    except Exception:  # noqa: BLE001
        pass
    assert work.is_completed() and not work.is_success()
    assert "mismatch" in str(work.exception())
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_object_collectives(world_size, transport):
    pool(world_size, transport).run(_object_collectives)


def test_failed_async_work_reports_its_exception(transport):
    pool(2, transport).run(_failed_async_work_reports_its_exception)


# ------------------------------------------------------- the send fast path (issue 18)
# A send with nothing queued before it is written into the ring or the socket by the caller of
# isend (as far as there is room), not by the progress thread. Each case runs with the fast path
# (default) and without it (TORCHPAR_P2P_FAST_SEND=0: every send queued), on both transports.

SEND_PATHS = {"fast": {}, "queued": {"TORCHPAR_P2P_FAST_SEND": "0"}}
RING = 16 * 1024  # SMALL_BUFFERS' TORCHPAR_SHM_RING_BYTES
HEADER = 16  # the engine's frame header: tag and length
# Element counts (float32) around the ring's capacity and the collectives' 8 KiB chunk: empty,
# tiny, a frame that fills the ring exactly, one byte more than fits, and many rings long.
MIXED_SIZES = [0, 1, 2047, 2048, (RING - HEADER) // 4, (RING - HEADER) // 4 + 1, RING // 4 + 1, 7, BIG, 3,
               3 * RING // 4 + 5, 0, 1]


def path_pool(world_size, transport, send_path):
    return get_pool(world_size, env=transport_env(transport, {**SMALL_BUFFERS, **SEND_PATHS[send_path]}))


def _small_send_after_queued_large_ones(ctx):
    """Large sends queue behind the first (larger than the ring); a small send posted after them,
    which would fit the ring by itself, must not overtake them, with the same tag or another."""
    if ctx.rank == 0:
        works = [dist.isend(torch.full((BIG,), float(i)), dst=1, group=ctx.pg) for i in range(3)]
        works.append(dist.isend(torch.full((5,), 3.0), dst=1, group=ctx.pg))          # same tag, after
        works.append(dist.isend(torch.full((5,), 4.0), dst=1, tag=7, group=ctx.pg))   # other tag
        works.append(dist.isend(torch.full((BIG,), 5.0), dst=1, group=ctx.pg))
        for q in works:
            q.wait()
    elif ctx.rank == 1:
        time.sleep(0.2)  # the sends queue up before anything is received
        other = torch.empty(5)
        early = dist.irecv(other, src=0, tag=7, group=ctx.pg)  # posted first, matched by tag
        outs = [torch.empty(BIG) for _ in range(3)] + [torch.empty(5), torch.empty(BIG)]
        works = [dist.irecv(o, src=0, group=ctx.pg) for o in outs]
        for q in works + [early]:
            q.wait()
        for i, o in zip([0, 1, 2, 3, 5], outs):
            assert (o == i).all(), f"message {i} out of order"
        assert (other == 4).all()
    return True


def _mixed_sizes_and_tags_both_ways(ctx, rounds):
    """Every rank sends every other rank messages of sizes around the ring's and chunk's, on many
    tags, from one loop that also posts its receives (tags in another order): what the caller
    writes and what the progress thread writes interleave on one ring, both directions busy."""
    w, r = ctx.world_size, ctx.rank
    tags = list(range(6))
    plan = [(MIXED_SIZES[(k * 5 + i) % len(MIXED_SIZES)], tags[(k + i) % len(tags)])
            for i in range(rounds) for k in range(len(MIXED_SIZES))]
    sends, recvs = [], []
    for peer in range(w):
        if peer == r:
            continue
        for k, (n, tag) in enumerate(plan):
            sends.append(dist.isend(payload(r, peer, n, tag) + 100000 * k, dst=peer, tag=tag, group=ctx.pg))
        # Receives per tag in plan order (so each one's size and content are known), tags reversed.
        for tag in reversed(tags):
            for k, (n, t) in enumerate(plan):
                if t == tag:
                    out = torch.empty(n)
                    recvs.append((dist.irecv(out, src=peer, tag=tag, group=ctx.pg), out,
                                  payload(peer, r, n, tag) + 100000 * k))
    for q in sends:
        q.wait()
    for q, out, want in recvs:
        q.wait()
        assert torch.equal(out, want)
    return len(recvs)


def _small_send_leaves_before_isend_returns(ctx):
    """With nothing queued and room in the ring, the send is done when isend returns: its
    caller wrote it (the progress thread had no part in it)."""
    dist.barrier(group=ctx.pg)
    done = None
    if ctx.rank == 0:
        work = dist.isend(payload(0, 1, 20), dst=1, tag=11, group=ctx.pg)
        done = work.is_completed()
        work.wait()
    elif ctx.rank == 1:
        out = torch.empty(20)
        dist.recv(out, src=0, tag=11, group=ctx.pg)
        assert torch.equal(out, payload(0, 1, 20))
    return done


@pytest.mark.parametrize("send_path", SEND_PATHS)
def test_a_send_that_could_go_at_once_waits_for_those_queued_before_it(transport, send_path):
    path_pool(2, transport, send_path).run(_small_send_after_queued_large_ones)


@pytest.mark.parametrize("send_path", SEND_PATHS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_mixed_sizes_and_tags_in_both_directions_arrive_in_order(world_size, transport, send_path):
    counts = path_pool(world_size, transport, send_path).run(_mixed_sizes_and_tags_both_ways, 3)
    assert counts == [(world_size - 1) * 3 * len(MIXED_SIZES)] * world_size


def test_a_small_send_is_written_by_its_caller(transport):
    # A ring with room, or a socket whose send buffer takes it: the same on both transports.
    done = path_pool(2, transport, "fast").run(_small_send_leaves_before_isend_returns)
    assert done[0] is True
