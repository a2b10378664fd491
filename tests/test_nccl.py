"""CUDA tensors through the torchpar backend (NCCL), on every GPU of the machine.

The same cases as the CPU suite (collective_cases.py's inputs and exact references) at world
size = the number of GPUs, one rank per GPU; one GPU still exercises communicator set-up,
streams, events, futures, grouped calls and the watchdog. Skipped where there is no GPU (CI);
`make test-gpu` runs them where there is one.
"""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from collective_cases import make_input, op_applies, reduce_op, reference
from harness import get_pool

HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0
pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not HAS_GPU, reason="no CUDA device on this machine")]
WORLD = min(torch.cuda.device_count(), 4) if HAS_GPU else 1

# NCCL's types: no int16 (it is refused, test_unsupported_dtype_is_named).
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.bool]
NCCL_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
SIZES = [0, 1, 7, 20011]


def _dev(ctx):
    torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _all_reduce_cases(ctx):
    dev = _dev(ctx)
    checked = 0
    for dtype in DTYPES:
        for op in NCCL_OPS:
            if not op_applies(op, dtype):
                continue
            for n in SIZES:
                inputs = [make_input(r, n, dtype) for r in range(ctx.world_size)]
                t = inputs[ctx.rank].to(dev)
                dist.all_reduce(t, op=reduce_op(op))
                want = reference(inputs, op)
                got = t.cpu()
                if dtype.is_floating_point:
                    torch.testing.assert_close(got.double(), want.double(), rtol=1e-2, atol=1e-2,
                                               msg=f"{op} {dtype} n={n}")
                else:
                    assert torch.equal(got, want.to(got.dtype)), f"{op} {dtype} n={n}"
                checked += 1
    return checked


def test_all_reduce_every_dtype_op_size():
    assert get_pool(WORLD).run(_all_reduce_cases)[0] > 100


def _collectives(ctx):
    dev = _dev(ctx)
    w, r = ctx.world_size, ctx.rank
    x = make_input(r, 33, torch.float32).to(dev)
    everyone = [make_input(q, 33, torch.float32) for q in range(w)]

    b = x.clone()
    dist.broadcast(b, src=0)
    assert torch.equal(b.cpu(), everyone[0])

    red = x.clone()
    dist.reduce(red, dst=0)
    if r == 0:
        assert torch.equal(red.cpu(), sum(everyone))

    outs = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(outs, x)
    assert all(torch.equal(o.cpu(), e) for o, e in zip(outs, everyone))

    flat = torch.empty(w * 33, device=dev)
    dist.all_gather_into_tensor(flat, x)
    assert torch.equal(flat.cpu(), torch.cat(everyone))

    # reduce-scatter: rank r gets the sum over ranks of block r
    blocks = [make_input(r, 5, torch.float32, salt=q + 1).to(dev) for q in range(w)]
    out = torch.empty(5, device=dev)
    dist.reduce_scatter(out, blocks)
    want = sum(make_input(q, 5, torch.float32, salt=r + 1) for q in range(w))
    assert torch.equal(out.cpu(), want)
    out2 = torch.empty(5, device=dev)
    dist.reduce_scatter_tensor(out2, torch.cat(blocks))
    assert torch.equal(out2.cpu(), want)

    g = [torch.empty_like(x) for _ in range(w)] if r == 0 else None
    dist.gather(x, g, dst=0)
    if r == 0:
        assert all(torch.equal(o.cpu(), e) for o, e in zip(g, everyone))

    s_out = torch.empty(4, device=dev)
    pieces = [torch.full((4,), float(q), device=dev) for q in range(w)] if r == 0 else None
    dist.scatter(s_out, pieces, src=0)
    assert torch.equal(s_out.cpu(), torch.full((4,), float(r)))

    # all_to_all_single, even and uneven splits (rank q sends q + 1 rows to every rank)
    send = torch.arange(w * 3, dtype=torch.float32, device=dev) + 100 * r
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    want = torch.cat([torch.arange(r * 3, r * 3 + 3, dtype=torch.float32) + 100 * q for q in range(w)])
    assert torch.equal(recv.cpu(), want)
    send = torch.full(((r + 1) * w,), float(r), device=dev)
    recv = torch.empty(sum(q + 1 for q in range(w)), device=dev)
    # receives q + 1 rows from rank q, sends r + 1 rows to every rank
    dist.all_to_all_single(recv, send, [q + 1 for q in range(w)], [r + 1] * w)
    assert torch.equal(recv.cpu(), torch.cat([torch.full((q + 1,), float(q)) for q in range(w)]))

    # PREMUL_SUM with the factor as a GPU tensor (NCCL reads it on the device)
    pm = torch.ones(6, device=dev) * (r + 1)
    dist.all_reduce(pm, op=dist._make_nccl_premul_sum(torch.tensor([3.0], device=dev)))
    assert torch.equal(pm.cpu(), torch.full((6,), 3.0 * sum(q + 1 for q in range(w))))

    ins = [torch.full((2,), float(10 * r + q), device=dev) for q in range(w)]
    outs = [torch.empty(2, device=dev) for _ in range(w)]
    dist.all_to_all(outs, ins)
    assert all(torch.equal(o.cpu(), torch.full((2,), float(10 * q + r))) for q, o in enumerate(outs))
    return True


def test_every_collective_against_exact_values():
    assert all(get_pool(WORLD).run(_collectives))


def _layouts(ctx):
    """Non-contiguous and complex tensors, staged as on the CPU."""
    dev = _dev(ctx)
    w, r = ctx.world_size, ctx.rank
    base = torch.arange(24, dtype=torch.float32, device=dev).view(4, 6) + r
    t = base.t()  # non-contiguous, reduced in place through a staging copy
    dist.all_reduce(t)
    want = (torch.arange(24, dtype=torch.float32).view(4, 6) * w + sum(range(w))).t()
    assert torch.equal(t.cpu(), want)
    c = torch.tensor([1 + 2j, 3 - 1j], device=dev) * (r + 1)
    dist.all_reduce(c)
    assert torch.equal(c.cpu(), torch.tensor([1 + 2j, 3 - 1j]) * sum(q + 1 for q in range(w)))
    src = torch.arange(24, dtype=torch.float32, device=dev).view(4, 6) + r
    outs = [torch.empty(6, 4, device=dev).t() for _ in range(w)]  # non-contiguous outputs
    dist.all_gather(outs, src)
    assert all(torch.equal(o.cpu(), torch.arange(24.0).view(4, 6) + q) for q, o in enumerate(outs))
    return True


def test_noncontiguous_and_complex_tensors():
    assert all(get_pool(WORLD).run(_layouts))


def _coalesced(ctx):
    dev = _dev(ctx)
    w = ctx.world_size
    ts = [torch.full((n,), 1.0, device=dev) for n in (3, 0, 1000)]
    dist.all_reduce_coalesced(ts)
    assert all(torch.equal(t.cpu(), torch.full_like(t.cpu(), w)) for t in ts)
    with dist._coalescing_manager(device=dev, async_ops=True) as cm:
        a = torch.ones(7, device=dev)
        b = torch.ones(9, device=dev) * 2
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    assert torch.equal(a.cpu(), torch.full((7,), float(w))) and torch.equal(b.cpu(), torch.full((9,), 2.0 * w))
    ins = [torch.ones(2, device=dev) * ctx.rank, torch.ones(3, device=dev) * 5]
    outs = [[torch.empty(2, device=dev), torch.empty(3, device=dev)] for _ in range(w)]
    dist.all_gather_coalesced(outs, ins)
    assert all(torch.equal(o[0].cpu(), torch.full((2,), float(q))) and torch.equal(o[1].cpu(), torch.full((3,), 5.0))
               for q, o in enumerate(outs))
    return True


def test_coalesced_operations():
    assert all(get_pool(WORLD).run(_coalesced))


def _async_semantics(ctx):
    dev = _dev(ctx)
    w = ctx.world_size
    x = torch.ones(1 << 20, device=dev)
    torch.cuda._sleep(int(1e9))  # the current stream is busy for a while ...
    y = x * 3  # ... before it produces y: the collective must start after that
    work = dist.all_reduce(y, async_op=True)
    fut = work.get_future()
    work.wait()  # the current stream waits; the host goes on
    z = y + 1  # ordered after the all-reduce on the device
    assert torch.equal(z.cpu(), torch.full((1 << 20,), 3.0 * w + 1))
    torch.cuda.synchronize()
    assert work.is_completed() and work.is_success()
    val = fut.wait()
    assert torch.equal(val[0].cpu(), torch.full((1 << 20,), 3.0 * w))
    chained = fut.then(lambda f: f.value()[0] * 2)
    assert torch.equal(chained.wait().cpu(), torch.full((1 << 20,), 6.0 * w))
    # synchronize() blocks the host until the work is done
    v = torch.ones(10, device=dev)
    work = dist.all_reduce(v, async_op=True)
    work.synchronize()
    assert torch.equal(v.cpu(), torch.full((10,), float(w)))
    # the caller's stream: a side stream's collective is ordered after that stream's kernels
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(1e9))
        s = torch.ones(100, device=dev) * 4
        dist.all_reduce(s)
        s2 = s + 0
    side.synchronize()
    assert torch.equal(s2.cpu(), torch.full((100,), 4.0 * w))
    return True


def test_async_work_streams_and_futures():
    assert all(get_pool(WORLD).run(_async_semantics))


def _errors(ctx):
    dev = _dev(ctx)
    msgs = []
    for call in (
        lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32, device=dev), op=dist.ReduceOp.BAND),
        lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16, device=dev)),
        lambda: dist.all_gather([torch.empty(3) for _ in range(ctx.world_size)], torch.ones(3, device=dev)),
        lambda: dist.recv(torch.empty(3, device=dev)),
    ):
        try:
            call()
        except (RuntimeError, ValueError) as e:
            msgs.append(str(e))
        else:
            msgs.append("no error")
    # the group is still usable after bad input
    t = torch.ones(2, device=dev)
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((2,), float(ctx.world_size)))
    return msgs


def test_bad_input_is_named_and_leaves_the_group_usable():
    msgs = get_pool(WORLD).run(_errors)[0]
    assert "BAND" in msgs[0], msgs[0]
    assert "Short" in msgs[1] or "int16" in msgs[1], msgs[1]
    assert "mixes CPU and CUDA" in msgs[2], msgs[2]
    assert "any source" in msgs[3], msgs[3]


def _timeout(ctx):
    dev = _dev(ctx)
    group = dist.new_group(backend="torchpar", timeout=timedelta(seconds=1))
    t = torch.ones(8, device=dev)
    dist.all_reduce(t, group=group)  # sets the communicator up first
    torch.cuda.synchronize()
    # The current stream sleeps (8e9 cycles: about 4 s at 2 GHz) before the collective can
    # start: well past the 1 s timeout.
    torch.cuda._sleep(int(8e9))
    work = dist.all_reduce(t, group=group, async_op=True)
    msgs = []
    try:
        work.synchronize()
        msgs.append("no error")
    except Exception as e:  # noqa: BLE001
        msgs.append(str(e))
    try:
        dist.all_reduce(t, group=group)
        msgs.append("no error")
    except Exception as e:  # noqa: BLE001
        msgs.append(str(e))
    torch.cuda.synchronize()
    # the default group is unaffected
    u = torch.ones(2, device=dev)
    dist.all_reduce(u)
    assert torch.equal(u.cpu(), torch.full((2,), float(ctx.world_size)))
    return msgs


def test_watchdog_times_out_a_stuck_operation():
    msgs = get_pool(WORLD).run(_timeout)[0]
    assert "Timed out" in msgs[0], msgs[0]
    assert "no longer usable" in msgs[1], msgs[1]


def _p2p(ctx):
    dev = _dev(ctx)
    w, r = ctx.world_size, ctx.rank
    nxt, prv = (r + 1) % w, (r - 1) % w
    buf = torch.empty(5, device=dev)
    ops = [dist.P2POp(dist.isend, torch.full((5,), float(r), device=dev), nxt),
           dist.P2POp(dist.irecv, buf, prv)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert torch.equal(buf.cpu(), torch.full((5,), float(prv)))
    if r == 0:
        dist.send(torch.arange(4.0, device=dev), 1)
    elif r == 1:
        got = torch.empty(4, device=dev)
        dist.recv(got, 0)
        assert torch.equal(got.cpu(), torch.arange(4.0))
    # Lone isend and irecv both ways between one pair, larger than NCCL buffers (as 1F1B
    # sends activations one way and gradients the other): one channel per direction.
    if r < 2:
        peer = 1 - r
        out = torch.full((16 << 20,), float(r), device=dev)
        into = torch.empty(16 << 20, device=dev)
        works = [dist.isend(out, peer), dist.irecv(into, peer)]
        for wk in works:
            wk.wait()
        assert torch.equal(into[:4].cpu(), torch.full((4,), float(peer)))
    return True


@pytest.mark.skipif(WORLD < 2, reason="point-to-point needs two GPUs")
def test_point_to_point():
    assert all(get_pool(WORLD).run(_p2p))


def _ddp(ctx, ours):
    import torchpar.parallel
    dev = _dev(ctx)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(dev)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(dev)
    ref.load_state_dict(model.state_dict())
    wrap = torchpar.parallel.DistributedDataParallel if ours else torch.nn.parallel.DistributedDataParallel
    ddp = wrap(model, device_ids=[dev.index])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ctx.world_size * 8, 16, generator=g).to(dev)
    for _ in range(2):  # the second step reuses the buckets
        for p in list(model.parameters()) + list(ref.parameters()):
            p.grad = None
        ddp(x[ctx.rank * 8:(ctx.rank + 1) * 8]).square().mean().backward()
        ref(x).square().mean().backward()  # the mean over the whole batch: DDP's average
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    return True


@pytest.mark.parametrize("ours", [True, False], ids=["torchpar-ddp", "torch-ddp"])
def test_ddp_on_cuda(ours):
    assert all(get_pool(WORLD).run(_ddp, ours))


def _mixed(ctx):
    dev = _dev(ctx)
    a, b = torch.ones(3), torch.ones(3, device=dev)
    dist.all_reduce(a)  # the shared-memory transport
    dist.all_reduce(b)  # NCCL
    return a.sum().item() + b.sum().item()


def test_cpu_and_cuda_tensors_in_one_group():
    assert get_pool(WORLD).run(_mixed)[0] == 6.0 * WORLD

