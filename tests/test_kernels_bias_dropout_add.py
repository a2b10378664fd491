"""torchpar.nn.functional.bias_dropout_add: residual + dropout(x + bias)."""
import math

import pytest
import torch

import torchpar.nn as tnn
from kernels_util import assert_close, noncontiguous, reference_keep_mask, requires_cuda

pytestmark = pytest.mark.timeout(120)
F = tnn.functional
ops = torch.ops.torchpar


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(dtype)
    r = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, b, r


def _mask(shape, p, seed, dtype=torch.float32):
    """The keep mask the op draws after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    out = F.bias_dropout_add(torch.ones(shape, dtype=dtype), torch.zeros(shape[-1], dtype=dtype),
                             torch.zeros(shape, dtype=dtype), p, True)
    return out != 0


@pytest.mark.parametrize("p,training", [(0.3, True), (0.0, True), (1.0, True), (0.5, False)])
def test_gradcheck_float64(p, training):
    x, b, r = (t.requires_grad_() for t in _inputs((3, 5, 6), torch.float64))

    def fn(x, b, r):
        torch.manual_seed(7)  # gradcheck calls fn many times; each call must draw one mask
        return F.bias_dropout_add(x, b, r, p, training)

    assert torch.autograd.gradcheck(fn, (x, b, r))


@pytest.mark.parametrize("p,training", [(0.3, True), (0.5, False)])
def test_gradgradcheck_float64(p, training):
    x, b, r = (t.requires_grad_() for t in _inputs((3, 6), torch.float64))

    def fn(x, b, r):
        torch.manual_seed(7)
        return F.bias_dropout_add(x, b, r, p, training)

    # Linear in (x, b, r), so a nonzero second derivative comes only from the loss: check the
    # gradient-of-gradient through a nonlinear use of the first gradient as well.
    assert torch.autograd.gradgradcheck(fn, (x, b, r))

    def penalty(x, b, r):
        (gx, gb) = torch.autograd.grad(fn(x, b, r).square().sum(), (x, b), create_graph=True)
        return gx.square().sum() + gb.pow(3).sum()

    assert torch.autograd.gradcheck(penalty, (x, b, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("shape", [(4, 7), (3, 5, 33), (2, 1024), (3, 2100), (37,)])
def test_matches_composite_with_the_same_mask(shape, dtype, contiguous):
    p = 0.25
    x, b, r = _inputs(shape, dtype)
    if not contiguous:
        x, r = noncontiguous(x), noncontiguous(r)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    keep = _mask(shape, p, seed=11, dtype=dtype)
    ts = [t.clone().requires_grad_() for t in (x, b, r)]
    ref = [t.double().requires_grad_() for t in (x, b, r)]
    torch.manual_seed(11)
    y = F.bias_dropout_add(*ts, p, True)
    y_ref = ref[2] + (ref[0] + ref[1]) * keep.double() / (1 - p)
    assert y.dtype == dtype
    assert_close(y, y_ref, dtype, scale=10)
    y.backward(dy)
    y_ref.backward(dy.double())
    for t, tr, scale in zip(ts, ref, (10, 10 * (x.numel() // shape[-1]), 1)):
        assert t.grad.dtype == dtype
        assert_close(t.grad, tr.grad, dtype, scale=scale)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    n = 1 << 20
    keep = _mask((1024, 1024), p, seed=3)
    rate = keep.float().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 6 * sigma, (rate, 1 - p)


def test_kept_values_are_scaled_by_one_over_keep_probability():
    p = 0.4
    x, b, r = _inputs((64, 96), torch.float64)
    torch.manual_seed(5)
    y = F.bias_dropout_add(x, b, r, p, True)
    keep = _mask((64, 96), p, seed=5)
    torch.testing.assert_close(y[keep], (r + (x + b) / (1 - p))[keep])
    torch.testing.assert_close(y[~keep], r[~keep])


def test_same_seed_same_mask_and_new_draws_differ():
    a = _mask((33, 65), 0.5, seed=123)
    assert torch.equal(a, _mask((33, 65), 0.5, seed=123))
    assert not torch.equal(a, _mask((33, 65), 0.5, seed=124))
    torch.manual_seed(123)
    ones, zb, zr = torch.ones(33, 65), torch.zeros(65), torch.zeros(33, 65)
    first = F.bias_dropout_add(ones, zb, zr, 0.5, True) != 0
    second = F.bias_dropout_add(ones, zb, zr, 0.5, True) != 0
    assert torch.equal(first, a) and not torch.equal(first, second)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 45), (3, 1000), (2, 2100), (5,), (2, 3, 129)])
def test_mask_follows_the_philox_rule_cpu_and_cuda_share(shape, dtype):
    # The rule in csrc/kernels/dropout.h, checked against an independent numpy Philox: the
    # vector lanes, the scalar edges and the CUDA kernel all implement this one function.
    p = 0.3
    torch.manual_seed(2024)
    out, seed = ops.bias_dropout_add_fwd(torch.ones(shape, dtype=dtype), torch.zeros(shape[-1], dtype=dtype),
                                         torch.zeros(shape, dtype=dtype), p, True)
    numel = math.prod(shape)
    expected = reference_keep_mask(int(seed.item()) & ((1 << 64) - 1), numel, p)
    assert torch.equal(out.reshape(-1) != 0, expected)


def test_mask_depends_on_logical_index_not_layout():
    x, b, r = _inputs((16, 24), torch.float32)
    torch.manual_seed(9)
    a = F.bias_dropout_add(x, b, r, 0.5, True)
    torch.manual_seed(9)
    c = F.bias_dropout_add(noncontiguous(x), b, noncontiguous(r), 0.5, True)
    assert torch.equal(a, c)


def test_p_zero_is_exact_add_and_p_one_drops_everything():
    x, b, r = (t.requires_grad_() for t in _inputs((8, 16), torch.float32))
    torch.testing.assert_close(F.bias_dropout_add(x, b, r, 0.0, True), r + x + b)
    y = F.bias_dropout_add(x, b, r, 1.0, True)
    assert torch.equal(y, r.detach())
    y.sum().backward()
    assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(b.grad) == 0
    assert torch.equal(r.grad, torch.ones_like(r))


def test_eval_mode_is_identity_dropout():
    m = tnn.BiasDropoutAdd(16, p=0.5)
    with torch.no_grad():
        m.bias.copy_(torch.randn(16))
    x, _, r = _inputs((8, 16), torch.float32)
    m.eval()
    torch.testing.assert_close(m(x, r), r + x + m.bias)
    m.train()
    assert not torch.allclose(m(x, r), r + x + m.bias)


@pytest.mark.parametrize("call,match", [
    (lambda x, b, r: F.bias_dropout_add(x, b, r, -0.1), "p must be in"),
    (lambda x, b, r: F.bias_dropout_add(x, b, r, 1.5), "p must be in"),
    (lambda x, b, r: F.bias_dropout_add(x, torch.ones(3), r), "bias must have shape"),
    (lambda x, b, r: F.bias_dropout_add(x, b, r[:2]), "residual has shape"),
    (lambda x, b, r: F.bias_dropout_add(x, b, r.double()), "residual has dtype"),
    (lambda x, b, r: F.bias_dropout_add(x, b.half(), r), "bias has dtype"),
])
def test_bad_input_names_the_argument(call, match):
    x, b, r = _inputs((4, 8), torch.float32)
    with pytest.raises(RuntimeError, match=match):
        call(x, b, r)


def test_module_rejects_bad_p():
    with pytest.raises(ValueError, match="p must be"):
        tnn.BiasDropoutAdd(8, p=2.0)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_draws_the_same_mask_as_cpu(dtype):
    shape = (67, 1001)
    x, b, r = _inputs(shape, dtype)
    dy = torch.randn(shape).to(dtype)
    outs = []
    for dev in ("cpu", "cuda"):
        ts = [t.to(dev).requires_grad_() for t in (x, b, r)]
        torch.manual_seed(77)
        y = F.bias_dropout_add(*ts, 0.3, True)
        y.backward(dy.to(dev))
        outs.append([y.cpu()] + [t.grad.cpu() for t in ts])
    assert torch.equal(outs[0][0] == outs[0][2].detach(), outs[1][0] == outs[1][2].detach())
    for a, c, scale in zip(*outs, (10, 10, 1000, 1)):
        assert_close(a, c.float(), dtype, scale=scale)


@requires_cuda
def test_cuda_graph_replays_draw_new_masks_and_the_backward_follows_them():
    # Captured forward + backward, as a whole training step is captured: every replay must draw
    # a fresh mask (the key comes from the CUDA generator's state at replay time), and the
    # backward in the same replay must regenerate that mask, not the one seen at capture.
    shape, p = (64, 256), 0.5
    x = torch.randn(shape, device="cuda").abs().add_(0.5).requires_grad_()
    b = torch.zeros(shape[-1], device="cuda", requires_grad=True)
    r = torch.zeros(shape, device="cuda")
    dy = torch.ones(shape, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as torch.cuda.graph asks
        for _ in range(2):
            F.bias_dropout_add(x, b, r, p, True).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    x.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = F.bias_dropout_add(x, b, r, p, True)
        y.backward(dy)
    masks = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        keep = y != 0
        masks.append(keep.clone())
        torch.testing.assert_close(x.grad, keep.float() / (1 - p))
        torch.testing.assert_close(b.grad, x.grad.sum(0))
        assert abs(keep.float().mean().item() - (1 - p)) < 0.05
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@requires_cuda
def test_cuda_graph_two_dropouts_differ_and_inactive_dropout_captures():
    shape = (32, 128)
    ones = torch.ones(shape, device="cuda")
    zb, zr = torch.zeros(shape[-1], device="cuda"), torch.zeros(shape, device="cuda")
    cpu_state = torch.get_rng_state()
    graph = torch.cuda.CUDAGraph()
    F.bias_dropout_add(ones, zb, zr, 0.5, True)  # warm-up
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        first = F.bias_dropout_add(ones, zb, zr, 0.5, True)
        second = F.bias_dropout_add(ones, zb, zr, 0.5, True)
        none = F.bias_dropout_add(ones, zb, zr, 0.0, True)
        evaluated = F.bias_dropout_add(ones, zb, zr, 0.5, False)
        everything = F.bias_dropout_add(ones, zb, zr, 1.0, True)
    # Capture drew from the CUDA generator only.
    assert torch.equal(torch.get_rng_state(), cpu_state)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(first, second)
    assert torch.equal(none, ones) and torch.equal(evaluated, ones)
    assert torch.count_nonzero(everything) == 0


def test_mask_and_gradients_do_not_depend_on_thread_count():
    x, b, r = _inputs((96, 130), torch.float32)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            ts = [t.clone().requires_grad_() for t in (x, b, r)]
            torch.manual_seed(31)
            y = F.bias_dropout_add(*ts, 0.4, True)
            y.backward(torch.ones_like(y))
            results.append([y.detach()] + [t.grad for t in ts])
    finally:
        torch.set_num_threads(threads)
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
