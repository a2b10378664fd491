"""torchpar.nn.functional.bias_gelu and torchpar.nn.BiasGeLU against gelu(x + b)."""
import math

import pytest
import torch
import torch.nn.functional as TF

import torchpar.nn as tnn
from kernels_util import assert_close, gelu_exact, noncontiguous, requires_cuda

pytestmark = pytest.mark.timeout(120)
F = tnn.functional

SHAPES = [(5,), (4, 7), (3, 5, 33), (2, 1024), (3, 300), (2, 2100), (9, 1)]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    b = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(dtype)
    return x, b


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(3, 5, 6), (37,)])
def test_gradcheck_float64(shape, approximate):
    x, b = (t.requires_grad_() for t in _inputs(shape, torch.float64))
    assert torch.autograd.gradcheck(lambda x, b: F.bias_gelu(x, b, approximate), (x, b))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_extreme_inputs(dtype, approximate):
    # Far tails: z and 1 on the right; on the left 0 up to an approximate function's floor
    # (the erf forward's is 6.3e-15, the gradients' below 3e-34) that does not grow with |z|;
    # +-inf give their limits (the forward at -inf is NaN, as torch's).
    big = 3e38 if dtype != torch.bfloat16 else 3e38 * (1 - 2**-9)
    far = [-big, -1e30, -1e4, -100.0, -40.0, 40.0, 100.0, 1e4, 1e30, big, math.inf, -math.inf]
    mid = [-12.0, -9.0, -5.0, -1.0, 0.0, 1.0, 5.0, 9.0, 12.0]
    z = torch.tensor(far + mid, dtype=dtype)
    # A row per value, 309 wide: the lockstep loop, a two-vector step and a scalar tail each
    # see it, on AVX-512 (128 floats a lockstep step) and AVX2 (32) alike.
    x = z[:, None].expand(-1, 309).contiguous().requires_grad_()
    y = F.bias_gelu(x, torch.zeros(309, dtype=dtype), approximate)
    y.sum().backward()
    for i, zi in enumerate(z.tolist()):
        want_y, want_g = gelu_exact(zi, approximate)
        # Forward: within 1e-6 of the value (the float erfc's floor is an absolute 3e-7), and
        # under 1e-13 in the far tails; the gradient to its relative accuracy.
        rtol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}[dtype]
        atol_y = 1e-6 if zi in mid else 1e-13
        torch.testing.assert_close(y[i].double(), torch.full((309,), want_y, dtype=torch.float64),
                                   rtol=rtol, atol=atol_y, equal_nan=True, msg=f"gelu({zi})")
        atol_g = 1e-30 if dtype != torch.bfloat16 else 1e-30 + abs(want_g) * 1e-2
        torch.testing.assert_close(x.grad[i].double(), torch.full((309,), want_g, dtype=torch.float64),
                                   rtol=max(rtol, 1e-3), atol=atol_g, msg=f"gelu'({zi})")


def _gelu_grad_float64(z):
    return 0.5 * torch.erfc(-z / 2**0.5) + z * torch.exp(-0.5 * z * z) / (2 * torch.pi) ** 0.5


def test_gradient_keeps_relative_accuracy_in_the_left_tail():
    # gelu'(z) = Phi(z) + z phi(z): as 1/2 (1 + erf(z / sqrt2)), Phi loses its relative accuracy
    # for z < -4 in float32 (torch's own gradient is off by up to 100 % there).
    z = torch.linspace(-9, 4, 13 * 128, dtype=torch.float64)
    z = z[(z + 0.7518).abs() > 0.05]  # gelu' has a root at -0.7518: no relative accuracy there
    x = z.float()[None, :]
    x = x.requires_grad_()
    F.bias_gelu(x, torch.zeros(x.shape[1]), "none").sum().backward()
    want = _gelu_grad_float64(x.detach().double())
    torch.testing.assert_close(x.grad.double(), want, rtol=1e-3, atol=0)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gradgradcheck_float64(approximate):
    x, b = (t.requires_grad_() for t in _inputs((3, 6), torch.float64))
    assert torch.autograd.gradgradcheck(lambda x, b: F.bias_gelu(x, b, approximate), (x, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_double_backward_matches_torch(dtype):
    """A gradient penalty: d/dx of |d loss / dx|^2, as with torch's gelu."""
    outs = []
    # torch's reference runs in float64 on the same (rounded) inputs.
    for fn, run_dtype in ((lambda x, b: F.bias_gelu(x, b, "none"), dtype),
                          (lambda x, b: TF.gelu(x + b), torch.float64)):
        x, b = (t.to(run_dtype).requires_grad_() for t in _inputs((4, 33), dtype))
        (gx,) = torch.autograd.grad(fn(x, b).square().sum(), x, create_graph=True)
        gx.square().sum().backward()
        outs.append((gx.detach(), x.grad, b.grad))
    # The second gradients sum rows of a first gradient that was itself rounded to dtype.
    for got, want in zip(*outs):
        assert_close(got, want.to(dtype), dtype, scale=5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_composite_forward_and_every_gradient(shape, dtype, contiguous, approximate):
    x, b = _inputs(shape, dtype)
    if not contiguous:
        x = noncontiguous(x)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    xo, bo = x.clone().requires_grad_(), b.clone().requires_grad_()
    xr, br = x.double().requires_grad_(), b.double().requires_grad_()
    y = F.bias_gelu(xo, bo, approximate)
    y_ref = TF.gelu(xr + br, approximate=approximate)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, y_ref, dtype, scale=10)
    y.backward(dy)
    y_ref.backward(dy.double())
    assert_close(xo.grad, xr.grad, dtype, scale=10)
    assert_close(bo.grad, br.grad, dtype, scale=10 * (x.numel() // shape[-1]))


def test_backward_saves_input_not_output():
    # gelu' is recomputed from x + bias: the graph holds x and bias, never y.
    x, b = (t.requires_grad_() for t in _inputs((4, 8), torch.float32))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = F.bias_gelu(x, b)
    assert len(packed) == 2
    assert {t.data_ptr() for t in packed} == {x.data_ptr(), b.data_ptr()}
    y.sum().backward()
    assert x.grad is not None and b.grad is not None


def test_module():
    m = tnn.BiasGeLU(8, approximate="tanh")
    with torch.no_grad():
        m.bias.copy_(torch.randn(8))
    x = torch.randn(3, 8)
    torch.testing.assert_close(m(x), TF.gelu(x + m.bias, approximate="tanh"))
    with pytest.raises(ValueError, match="approximate"):
        tnn.BiasGeLU(8, approximate="exact")


@pytest.mark.parametrize("call,match", [
    (lambda x, b: F.bias_gelu(x, torch.ones(7)), "bias must have shape"),
    (lambda x, b: F.bias_gelu(x, torch.ones(1, 8)), "bias must have shape"),
    (lambda x, b: F.bias_gelu(x, b.double()), "bias has dtype"),
    (lambda x, b: F.bias_gelu(x, b, "fast"), "approximate must be"),
    (lambda x, b: F.bias_gelu(x.long(), b.long()), "input must be float"),
])
def test_bad_input_names_the_argument(call, match):
    x, b = _inputs((4, 8), torch.float32)
    with pytest.raises(RuntimeError, match=match):
        call(x, b)


@requires_cuda
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype, approximate):
    x, b = _inputs((64, 1000), dtype)
    dy = torch.randn_like(x)
    outs = []
    for dev in ("cpu", "cuda"):
        xd, bd = x.to(dev).requires_grad_(), b.to(dev).requires_grad_()
        y = F.bias_gelu(xd, bd, approximate)
        y.backward(dy.to(dev))
        outs.append([y.cpu(), xd.grad.cpu(), bd.grad.cpu()])
    for a, c, scale in zip(*outs, (10, 10, 1000)):
        assert_close(a, c.float(), dtype, scale=scale)
