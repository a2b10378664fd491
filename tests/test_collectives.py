"""Every collective x dtype x reduce op x size x world size, against gloo and exact references.

The ranks run with small internal buffers (harness.SMALL_BUFFERS), so the sizes here cross
the one-shot/chunked switch, chunk boundaries and ring wrap-around.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from collective_cases import (DTYPES, OPS, SIZES, assert_equal, gloo_agrees, make_input, op_applies,
                              reduce_op, reference, strided)
from harness import SMALL_BUFFERS, TRANSPORTS, get_pool, transport_env


# In make test-slow (make test's time budget): variants whose shared-memory twins run in make test.
SLOW_VARIANTS = {"test_all_reduce_matches_reference_for_every_op_and_size[float32-4-tcp]",
                 "test_all_reduce_matches_reference_for_every_op_and_size[float32-3-tcp]",
                 "test_all_reduce_matches_reference_for_every_op_and_size[float64-4-tcp]"}

pytestmark = [pytest.mark.timeout(300), pytest.mark.parametrize("transport", TRANSPORTS)]

WORLD_SIZES = [1, 2, 3, 4]


def pool(world_size, transport):
    return get_pool(world_size, env=transport_env(transport, SMALL_BUFFERS))


def ids(dtypes):
    return [str(d).replace("torch.", "") for d in dtypes]


# ----------------------------------------------------------------------------------------
# Rank-side checks (module-level so the pool can run them)

def _all_reduce(ctx, dtype):
    for n in SIZES:
        inputs = [make_input(r, n, dtype) for r in range(ctx.world_size)]
        for op in OPS:
            if not op_applies(op, dtype):
                continue
            what = f"all_reduce {op} n={n}"
            expected = reference(inputs, op)
            t = inputs[ctx.rank].clone()
            dist.all_reduce(t, op=reduce_op(op), group=ctx.pg)
            assert_equal(t, expected, what)
            nc = strided(inputs[ctx.rank])
            dist.all_reduce(nc, op=reduce_op(op), group=ctx.pg)
            assert_equal(nc, expected, what + " (non-contiguous)")
    return True


def _all_reduce_vs_gloo(ctx, dtype):
    """gloo as the oracle, on the dtypes and ops it supports."""
    checked = 0
    for n in SIZES:
        for op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
            if not op_applies(op, dtype):
                continue
            ours = make_input(ctx.rank, n, dtype, salt=1)
            theirs = ours.clone()
            try:
                dist.all_reduce(theirs, op=reduce_op(op), group=ctx.gloo)
            except (RuntimeError, ValueError):
                continue  # gloo does not support this dtype/op
            dist.all_reduce(ours, op=reduce_op(op), group=ctx.pg)
            assert torch.equal(ours, theirs), f"all_reduce {op} n={n} differs from gloo"
            checked += 1
    return checked


def _broadcast(ctx, dtype):
    for n in SIZES:
        for root in range(ctx.world_size):
            src = make_input(root, n, dtype)
            t = src.clone() if ctx.rank == root else torch.zeros(n, dtype=dtype)
            dist.broadcast(t, src=root, group=ctx.pg)
            assert_equal(t, src, f"broadcast root={root} n={n}")
            nc = strided(src if ctx.rank == root else torch.zeros(n, dtype=dtype))
            dist.broadcast(nc, src=root, group=ctx.pg)
            assert_equal(nc, src, f"broadcast root={root} n={n} (non-contiguous)")
    return True


def _reduce(ctx, dtype):
    root = ctx.world_size - 1
    for n in SIZES:
        inputs = [make_input(r, n, dtype) for r in range(ctx.world_size)]
        for op in OPS:
            if not op_applies(op, dtype):
                continue
            t = inputs[ctx.rank].clone()
            dist.reduce(t, dst=root, op=reduce_op(op), group=ctx.pg)
            if ctx.rank == root:
                assert_equal(t, reference(inputs, op), f"reduce {op} n={n}")
            else:
                assert torch.equal(t, inputs[ctx.rank]), "reduce changed a non-root tensor"
    return True


def _all_gather(ctx, dtype):
    for n in SIZES:
        inputs = [make_input(r, n, dtype) for r in range(ctx.world_size)]
        outs = [torch.zeros(n, dtype=dtype) for _ in range(ctx.world_size)]
        dist.all_gather(outs, inputs[ctx.rank], group=ctx.pg)
        for r in range(ctx.world_size):
            assert_equal(outs[r], inputs[r], f"all_gather n={n} from rank {r}")
        flat = torch.zeros(n * ctx.world_size, dtype=dtype)
        dist.all_gather_into_tensor(flat, strided(inputs[ctx.rank]), group=ctx.pg)
        assert_equal(flat, torch.cat(inputs), f"all_gather_into_tensor n={n}")
        gl = torch.zeros(n * ctx.world_size, dtype=dtype)
        if gloo_agrees(lambda: dist.all_gather_into_tensor(gl, inputs[ctx.rank], group=ctx.gloo)) is not None:
            assert torch.equal(gl, flat), "all_gather_into_tensor differs from gloo"
    return True


def _reduce_scatter(ctx, dtype):
    w = ctx.world_size
    for n in SIZES:
        full = [make_input(r, n * w, dtype) for r in range(w)]
        for op in OPS:
            if not op_applies(op, dtype):
                continue
            expected = reference([f[ctx.rank * n:(ctx.rank + 1) * n] for f in full], op)
            out = torch.zeros(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, full[ctx.rank].clone(), op=reduce_op(op), group=ctx.pg)
            assert_equal(out, expected, f"reduce_scatter_tensor {op} n={n}")
            out_list = strided(torch.zeros(n, dtype=dtype))
            pieces = list(full[ctx.rank].clone().chunk(w)) if n else [torch.zeros(0, dtype=dtype)] * w
            dist.reduce_scatter(out_list, pieces, op=reduce_op(op), group=ctx.pg)
            assert_equal(out_list, expected, f"reduce_scatter {op} n={n}")
    return True


def _gather_scatter(ctx, dtype):
    w = ctx.world_size
    for n in SIZES:
        for root in {0, w - 1}:
            inputs = [make_input(r, n, dtype) for r in range(w)]
            outs = [torch.zeros(n, dtype=dtype) for _ in range(w)] if ctx.rank == root else None
            dist.gather(inputs[ctx.rank], gather_list=outs, dst=root, group=ctx.pg)
            if ctx.rank == root:
                for r in range(w):
                    assert_equal(outs[r], inputs[r], f"gather root={root} n={n} from {r}")
            out = torch.zeros(n, dtype=dtype)
            dist.scatter(out, scatter_list=inputs if ctx.rank == root else None, src=root, group=ctx.pg)
            assert_equal(out, inputs[ctx.rank], f"scatter root={root} n={n}")
    return True


def _all_to_all(ctx, dtype, scale):
    w = ctx.world_size
    # Uneven splits: rank q sends (q + r) * scale + 1 rows to rank r.
    send = [(ctx.rank + r) * scale + 1 for r in range(w)]
    recv = [(q + ctx.rank) * scale + 1 for q in range(w)]
    mine = [make_input(ctx.rank * 100 + r, send[r] * 3, dtype).view(-1, 3) for r in range(w)]
    inp = torch.cat(mine)
    out = torch.zeros(sum(recv), 3, dtype=dtype)
    dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send, group=ctx.pg)
    expected = torch.cat([make_input(q * 100 + ctx.rank, recv[q] * 3, dtype).view(-1, 3) for q in range(w)])
    assert_equal(out, expected, f"all_to_all_single scale={scale}")
    outs = [torch.zeros(recv[q], 3, dtype=dtype) for q in range(w)]
    dist.all_to_all(outs, mine, group=ctx.pg)
    assert_equal(torch.cat(outs), expected, f"all_to_all scale={scale}")
    even_in = make_input(ctx.rank, 4 * w, dtype)
    even_out = torch.zeros(4 * w, dtype=dtype)
    dist.all_to_all_single(even_out, even_in, group=ctx.pg)
    exp = torch.cat([make_input(q, 4 * w, dtype)[4 * ctx.rank:4 * ctx.rank + 4] for q in range(w)])
    assert_equal(even_out, exp, "all_to_all_single even")
    # In place: the output is the input, so a peer's data lands where ours is still to go out.
    n = (4 + 100 * scale) * w  # up to megabytes: past what a socket buffers
    both = make_input(ctx.rank, n, dtype)
    dist.all_to_all_single(both, both, group=ctx.pg)
    k = n // w
    exp = torch.cat([make_input(q, n, dtype)[k * ctx.rank:k * ctx.rank + k] for q in range(w)])
    assert_equal(both, exp, "all_to_all_single in place")
    return True


def _coalesced(ctx):
    w = ctx.world_size
    ts = [make_input(ctx.rank, n, torch.float32, salt=3) for n in (5, 0, 1000, 7)]
    expected = [reference([make_input(r, t.numel(), torch.float32, salt=3) for r in range(w)], "SUM") for t in ts]
    with dist._coalescing_manager(group=ctx.pg):
        for t in ts:
            dist.all_reduce(t, group=ctx.pg)
    for t, e in zip(ts, expected):
        assert_equal(t, e, "coalesced all_reduce")
    ins = [make_input(ctx.rank, n, torch.float64, salt=4) for n in (3, 100)]
    outs = [torch.zeros(i.numel() * w, dtype=torch.float64) for i in ins]
    with dist._coalescing_manager(group=ctx.pg):
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i, group=ctx.pg)
    for o, i in zip(outs, ins):
        assert_equal(o, torch.cat([make_input(r, i.numel(), torch.float64, salt=4) for r in range(w)]), "coalesced all_gather")
    # Async coalescing: the manager's single work covers the whole batch.
    ts = [make_input(ctx.rank, n, torch.float32, salt=6) for n in (3000, 5)]
    with dist._coalescing_manager(group=ctx.pg, device=torch.device("cpu"), async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, group=ctx.pg)
    cm.wait()
    for t in ts:
        assert_equal(t, reference([make_input(r, t.numel(), torch.float32, salt=6) for r in range(w)], "SUM"),
                     "async coalesced all_reduce")
    rs_in = [make_input(ctx.rank, 6 * w, torch.float32, salt=5)]
    rs_out = [torch.zeros(6)]
    with dist._coalescing_manager(group=ctx.pg):
        dist.reduce_scatter_tensor(rs_out[0], rs_in[0], group=ctx.pg)
    exp = reference([make_input(r, 6 * w, torch.float32, salt=5)[6 * ctx.rank:6 * ctx.rank + 6] for r in range(w)], "SUM")
    assert_equal(rs_out[0], exp, "coalesced reduce_scatter")
    return True


def _complex(ctx):
    w = ctx.world_size
    vals = [torch.complex(make_input(r, 9, torch.float32), make_input(r + 10, 9, torch.float32)) for r in range(w)]
    t = vals[ctx.rank].clone()
    dist.all_reduce(t, group=ctx.pg)
    torch.testing.assert_close(t, sum(vals))
    b = vals[0].clone() if ctx.rank == 0 else torch.zeros(9, dtype=torch.complex64)
    dist.broadcast(b, 0, group=ctx.pg)
    torch.testing.assert_close(b, vals[0])
    # A lazily conjugated view is read as its values, not its raw memory (torch's Python layer
    # refuses such views, so call the backend as C++ callers would).
    out = torch.zeros(9 * w, dtype=torch.complex64)
    backend = ctx.pg._get_backend(torch.device("cpu"))
    backend._allgather_base(out, vals[ctx.rank].conj()).wait()
    torch.testing.assert_close(out, torch.cat(vals).conj())
    # all_to_all_single where this rank sends nothing but receives: counts in complex elements.
    send = [0] * w if ctx.rank == 0 else [1] * w
    recv = [0 if q == 0 else 1 for q in range(w)]
    a_out = torch.zeros(sum(recv), dtype=torch.complex64)
    a_in = torch.full((sum(send),), complex(ctx.rank, 1), dtype=torch.complex64)
    dist.all_to_all_single(a_out, a_in, recv, send, group=ctx.pg)
    assert torch.equal(a_out, torch.tensor([complex(q, 1) for q in range(1, w)], dtype=torch.complex64))
    return True


def _barrier_and_order(ctx):
    # Many back-to-back small collectives of different kinds: generations never drift.
    t = torch.zeros(1)
    for i in range(200):
        dist.barrier(group=ctx.pg)
        t.fill_(1)
        dist.all_reduce(t, group=ctx.pg)
        assert t.item() == ctx.world_size
    return True


def _inputs_released_by_wait(ctx):
    # Once wait() returns, the backend holds none of the caller's tensors: dropping the input frees
    # it then, on the caller's thread (the worker used to let go of it only after waking the
    # waiter, which kept FSDP's packed gradients allocated into the optimizer step; issue 19).
    import weakref
    w, n = ctx.world_size, 1 << 12
    for _ in range(20):
        inp, out = torch.ones(n * w), torch.empty(n)
        ref = weakref.ref(inp)
        work = dist.reduce_scatter_tensor(out, inp, group=ctx.pg, async_op=True)
        work.wait()
        del inp
        assert ref() is None, "reduce_scatter_tensor's input still referenced after wait()"
        assert torch.equal(out, torch.full((n,), float(w)))
        inp = torch.ones(n)
        ref = weakref.ref(inp)
        work = dist.all_gather_into_tensor(torch.empty(n * w), inp, group=ctx.pg, async_op=True)
        work.wait()
        del inp
        assert ref() is None, "all_gather_into_tensor's input still referenced after wait()"
    # Nor the work's outputs: the worker that ran the work lets go of it before wait() returns,
    # so that the caller's references are the last (they once were dropped on the worker after
    # wait(), freeing an FSDP order all-gather's outputs there; the window is short, hence the
    # many rounds, and both ways of waiting: the worker, and a point-to-point exchange).
    for _ in range(300):
        out = [torch.empty(4) for _ in range(w)]
        refs = [weakref.ref(o) for o in out]
        work = dist.all_gather(out, torch.ones(4), group=ctx.pg, async_op=True)
        work.wait()
        del work, out
        assert all(r() is None for r in refs), "all_gather's outputs still referenced after wait()"
        buf = torch.empty(4)
        ref = weakref.ref(buf)
        peer = ctx.rank ^ 1
        ops = [dist.P2POp(dist.isend, torch.ones(4), peer, group=ctx.pg), dist.P2POp(dist.irecv, buf, peer, group=ctx.pg)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        del work, ops, buf
        assert ref() is None, "a received tensor still referenced after wait()"
    return True


def _timed_wait_times_out(ctx):
    # wait(timeout) on an operation its peer has not issued raises at the timeout, and the
    # operation still completes once the peer comes (review: a timed wait blocked until then).
    import time
    from datetime import timedelta
    store = dist.distributed_c10d._get_default_store()
    peer = 1 - ctx.rank
    t, buf = torch.ones(4), torch.zeros(4)
    if ctx.rank == 0:
        works = [dist.all_reduce(t, group=ctx.pg, async_op=True), dist.irecv(buf, peer, group=ctx.pg)]
        for work in works:
            start = time.monotonic()
            with pytest.raises(RuntimeError, match="timed out"):
                work.wait(timedelta(milliseconds=300))
            assert time.monotonic() - start < 10, "a timed wait waited for the operation"
        store.set("timed_wait/go", "1")
        for work in works:
            work.wait()
        assert torch.equal(t, torch.full((4,), 2.0)) and torch.equal(buf, torch.full((4,), 7.0))
        store.delete_key("timed_wait/go")  # the peer is past its wait: both operations completed
    else:
        store.wait(["timed_wait/go"])
        dist.all_reduce(t, group=ctx.pg)
        dist.send(torch.full((4,), 7.0), peer, group=ctx.pg)
    return True


# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2])
def test_timed_wait_raises_at_its_timeout(world_size, transport):
    pool(world_size, transport).run(_timed_wait_times_out)


@pytest.mark.parametrize("world_size", [2])
def test_async_inputs_released_by_wait(world_size, transport):
    pool(world_size, transport).run(_inputs_released_by_wait)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids(DTYPES))
def test_all_reduce_matches_reference_for_every_op_and_size(world_size, dtype, transport):
    pool(world_size, transport).run(_all_reduce, dtype)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids(DTYPES))
def test_all_reduce_matches_gloo(world_size, dtype, transport):
    pool(world_size, transport).run(_all_reduce_vs_gloo, dtype)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids(DTYPES))
def test_broadcast_from_every_root(world_size, dtype, transport):
    pool(world_size, transport).run(_broadcast, dtype)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids(DTYPES))
def test_reduce_writes_only_the_root(world_size, dtype, transport):
    pool(world_size, transport).run(_reduce, dtype)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids(DTYPES))
def test_all_gather_list_and_into_tensor(world_size, dtype, transport):
    pool(world_size, transport).run(_all_gather, dtype)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids(DTYPES))
def test_reduce_scatter_list_and_tensor(world_size, dtype, transport):
    pool(world_size, transport).run(_reduce_scatter, dtype)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=ids(DTYPES))
def test_gather_and_scatter(world_size, dtype, transport):
    pool(world_size, transport).run(_gather_scatter, dtype)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=ids([torch.float32, torch.bfloat16, torch.int64, torch.bool]))
@pytest.mark.parametrize("scale", [0, 1, 2000], ids=["tiny", "small", "past-slot"])
def test_all_to_all_with_uneven_splits(world_size, dtype, scale, transport):
    pool(world_size, transport).run(_all_to_all, dtype, scale)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_coalesced_variants(world_size, transport):
    pool(world_size, transport).run(_coalesced)


def _coalesced_in_place(ctx, dtype, op):
    """all_reduce_coalesced reduces contiguous tensors where they lie: sizes that end inside
    pieces, chunks and slots, and empty ones, must land exactly. A non-contiguous tensor among
    them takes the packed path."""
    w = ctx.world_size
    backend = ctx.pg._get_backend(torch.device("cpu"))
    sizes = (1, 0, 4099, 17, 12000, 3, 0, 2500)
    ts = [make_input(ctx.rank, n, dtype, salt=9 + k) for k, n in enumerate(sizes)]
    ptrs = [t.data_ptr() for t in ts]
    expected = [reference([make_input(r, n, dtype, salt=9 + k) for r in range(w)], op).to(dtype)
                for k, n in enumerate(sizes)]
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = reduce_op(op)
    backend.allreduce_coalesced(ts, opts).wait()
    for t, e, p in zip(ts, expected, ptrs):
        assert t.data_ptr() == p
        assert_equal(t, e, f"all_reduce_coalesced {op}")
    # The same memory twice (and overlapping views) cannot be reduced in place: packed path.
    t = make_input(ctx.rank, 3000, dtype, salt=42)
    backend.allreduce_coalesced([t, t, t[10:20]], opts).wait()
    assert_equal(t, reference([make_input(r, 3000, dtype, salt=42) for r in range(w)], op).to(dtype),
                 "all_reduce_coalesced of aliased tensors")
    strided = [make_input(ctx.rank, 2 * 900, dtype, salt=40)[::2], make_input(ctx.rank, 50, dtype, salt=41)]
    backend.allreduce_coalesced(strided, opts).wait()
    assert_equal(strided[0], reference([make_input(r, 2 * 900, dtype, salt=40)[::2] for r in range(w)], op).to(dtype),
                 "all_reduce_coalesced of a strided tensor")
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype,op", [(torch.float32, "SUM"), (torch.bfloat16, "SUM"), (torch.int64, "MAX"),
                                      (torch.float64, "AVG")], ids=["f32-sum", "bf16-sum", "i64-max", "f64-avg"])
def test_coalesced_all_reduce_in_place(world_size, dtype, op, transport):
    pool(world_size, transport).run(_coalesced_in_place, dtype, op)


@pytest.mark.parametrize("world_size", [2, 3])
def test_complex_through_real_view(world_size, transport):
    pool(world_size, transport).run(_complex)


@pytest.mark.parametrize("world_size", [2, 4])
def test_many_collectives_stay_in_step(world_size, transport):
    pool(world_size, transport).run(_barrier_and_order)


def _read_only_and_non_contiguous_tensors(ctx):
    """What the backend reads it must not write, and what it writes it writes below autograd,
    whichever thread runs the op (review findings: each failed the whole group)."""
    rank, w = ctx.rank, ctx.world_size
    # The root only reads: an expanded tensor, and a transposed view of a parameter.
    src = torch.arange(4.0).expand(3, 4) if rank == 0 else torch.zeros(3, 4)
    dist.broadcast(src, 0)
    assert src.tolist() == [[0.0, 1.0, 2.0, 3.0]] * 3
    weight = nn.Parameter(torch.full((3, 2), float(rank)))
    got = weight.t() if rank == 0 else torch.empty(2, 3)
    dist.broadcast(got, 0)
    assert got.tolist() == [[0.0] * 3] * 2
    # Written, non-contiguous: a channels_last weight that requires grad (the start-of-training sync).
    conv = nn.Conv2d(2, 3, 2).to(memory_format=torch.channels_last)
    with torch.no_grad():
        conv.weight.fill_(rank + 1.0)
    for async_op in (False, True):
        work = dist.broadcast(conv.weight, 0, async_op=async_op)
        if async_op:
            work.wait()
        assert conv.weight.eq(1.0).all() and conv.weight.requires_grad
        with torch.no_grad():
            conv.weight.fill_(rank + 1.0)
    # Async ops on the worker thread, from inside no_grad and inference_mode.
    with torch.no_grad():
        dist.all_reduce(weight.t(), async_op=True).wait()
    assert weight.detach().eq(sum(range(w))).all()
    with torch.inference_mode():
        t = torch.ones(3, 2).t()
        dist.all_reduce(t, async_op=True).wait()
    assert t.eq(w).all()
    # A tensor that would be written through several aliases is refused at the call.
    with pytest.raises(RuntimeError, match="several of its elements share memory"):
        dist.all_reduce(torch.zeros(4).expand(2, 4))
    t = torch.ones(2)
    dist.all_reduce(t)  # the group goes on
    return t.tolist()


@pytest.mark.parametrize("world_size", [2])
def test_read_only_and_non_contiguous_tensors(world_size, transport):
    assert pool(world_size, transport).run(_read_only_and_non_contiguous_tensors) == [[2.0, 2.0]] * 2
