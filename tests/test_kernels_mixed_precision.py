"""Mixed precision: float32 parameters (and bias_dropout_add's residual) beside bfloat16 or
float16 input, as mixed-precision training and torch.autocast produce them.

The output keeps the input's dtype (bias_dropout_add's follows a float32 residual); each
parameter's gradient is float32, summed in float32 and never rounded to 16 bits.
"""
import pytest
import torch
import torch.nn.functional as TF

import torchpar.nn as tnn
from kernels_util import assert_close, requires_cuda

pytestmark = pytest.mark.timeout(120)
F = tnn.functional

DTYPES = [torch.bfloat16, torch.float16]
# 2100 columns: rows past kWideRow, where 16-bit parameters would be read as 16 bits.
SHAPES = [(3, 5, 37), (4, 2100)]


def _data(shape, dtype, seed=0):
    """16-bit input and upstream gradient, float32 parameters of no 16-bit value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    w = 1 + 0.3 * torch.randn(shape[-1], generator=g)
    b = 0.3 * torch.randn(shape[-1], generator=g)
    return x, dy, w, b


def _check_forward(got, want64, dtype):
    """`got` is the float64 reference rounded once (up to the rare value on a rounding edge):
    rounding the float32 parameters to 16 bits first would miss it in a large share."""
    assert got.dtype == dtype
    want = want64.to(dtype)
    assert_close(got, want64, dtype)
    assert (got == want).double().mean() > 0.98


def _check_param_grad(got, terms64):
    """A float32 column sum of the float64 `terms64` ([rows, cols]): float32 accuracy, which a
    gradient rounded to 16 bits (relative 4e-3 for bfloat16) would miss."""
    assert got.dtype == torch.float32
    want = terms64.sum(0)
    err = (got.double() - want).abs()
    assert (err <= 1e-5 * terms64.abs().sum(0) + 1e-6).all(), err.max()


def _leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm(shape, dtype):
    x, dy, w, b = _data(shape, dtype)
    x, w, b = _leaves(x, w, b)
    y = F.layer_norm(x, shape[-1:], w, b, 1e-5)
    y.backward(dy)

    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = TF.layer_norm(x64, shape[-1:], w64, b64, 1e-5)
    _check_forward(y, y64.detach(), dtype)
    y64.backward(dy.double())
    assert x.grad.dtype == dtype
    assert_close(x.grad, x64.grad, dtype, scale=5)
    xhat = TF.layer_norm(x64.detach(), shape[-1:], eps=1e-5).reshape(-1, shape[-1])
    _check_param_grad(w.grad, dy.double().reshape(-1, shape[-1]) * xhat)
    _check_param_grad(b.grad, dy.double().reshape(-1, shape[-1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(shape, dtype, approximate):
    x, dy, _, b = _data(shape, dtype)
    x, b = _leaves(x, b)
    y = F.bias_gelu(x, b, approximate)
    y.backward(dy)

    z64 = (x.detach().double() + b.detach().double()).requires_grad_()
    y64 = TF.gelu(z64, approximate=approximate)
    _check_forward(y, y64.detach(), dtype)
    y64.backward(dy.double())
    assert x.grad.dtype == dtype
    assert_close(x.grad, z64.grad, dtype)
    _check_param_grad(b.grad, z64.grad.reshape(-1, shape[-1]))


def _keep(shape, p, seed):
    """The keep mask bias_dropout_add draws after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return F.bias_dropout_add(torch.ones(shape), torch.zeros(shape[-1]), torch.zeros(shape),
                              p, True) != 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual_dtype", ["input", "float32"])
def test_bias_dropout_add(shape, dtype, residual_dtype):
    p = 0.25
    x, dy, _, b = _data(shape, dtype)
    out_dtype = dtype if residual_dtype == "input" else torch.float32
    r = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(out_dtype)
    dy = dy.to(out_dtype)
    x, b, r = _leaves(x, b, r)
    keep = _keep(shape, p, seed=3)
    torch.manual_seed(3)
    y = F.bias_dropout_add(x, b, r, p, True)
    y.backward(dy)

    mult = keep.double() / (1 - p)
    y64 = (x.detach().double() + b.detach().double()) * mult + r.detach().double()
    if out_dtype == torch.float32:
        assert y.dtype == torch.float32
        torch.testing.assert_close(y.double(), y64, atol=1e-5, rtol=1e-5)
    else:
        _check_forward(y, y64, dtype)
    dz64 = dy.double() * mult
    assert x.grad.dtype == dtype
    assert torch.equal(x.grad, dz64.to(dtype))
    _check_param_grad(b.grad, dz64.reshape(-1, shape[-1]))
    assert r.grad.dtype == out_dtype and torch.equal(r.grad, dy)


def test_double_backward_gives_the_same_gradients():
    """create_graph takes the ATen-composite backward; its gradients keep the same dtypes."""
    x, dy, w, b = _data((6, 40), torch.bfloat16)
    for fn in (lambda x, w, b: F.layer_norm(x, (40,), w, b, 1e-5),
               lambda x, w, b: F.bias_gelu(x, b) * w,
               lambda x, w, b: F.bias_dropout_add(x, b, w.expand(6, 40), 0.2, True)):
        grads = []
        for create_graph in (False, True):
            xs = _leaves(x, w, b)
            torch.manual_seed(0)
            out = fn(*xs)
            grads.append(torch.autograd.grad(out, xs, dy.to(out.dtype), create_graph=create_graph))
        for g0, g1 in zip(*grads):
            assert g0.dtype == g1.dtype
            torch.testing.assert_close(g0.float(), g1.float(), atol=2e-2, rtol=2e-2)


class _Block(torch.nn.Module):
    """A transformer-style MLP block: LayerNorm, Linear, GeLU, Linear, dropout, residual add,
    and a LayerNorm on the first Linear's output, so one sees float32 input under autocast and
    one 16-bit input beside its float32 parameters."""

    def __init__(self, d, fused):
        super().__init__()
        self.fused = fused
        self.norm = (tnn.LayerNorm if fused else torch.nn.LayerNorm)(d)
        self.norm_h = (tnn.LayerNorm if fused else torch.nn.LayerNorm)(4 * d)
        self.fc1 = torch.nn.Linear(d, 4 * d, bias=False)
        self.b1 = torch.nn.Parameter(0.1 * torch.randn(4 * d))
        self.fc2 = torch.nn.Linear(4 * d, d, bias=False)
        self.b2 = torch.nn.Parameter(0.1 * torch.randn(d))

    def forward(self, x):
        h = self.norm_h(self.fc1(self.norm(x)))
        if self.fused:
            return F.bias_dropout_add(self.fc2(F.bias_gelu(h, self.b1)), self.b2, x, 0.0, True)
        h = TF.gelu(h + self.b1.to(h.dtype))
        return x + TF.dropout(self.fc2(h) + self.b2, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("float32_param", ["weight", "bias", "both"])
def test_layer_norm_under_vmap_and_forward_ad(float32_param, dtype):
    """vmap and forward-mode AD run layer_norm as torch's composite (kernels/ops.h): it must
    take every mix the fused kernel takes, one float32 parameter beside a 16-bit one too."""
    x, dx, w, b = _data((4, 24), dtype)
    w = w if float32_param in ("weight", "both") else w.to(dtype)
    b = b if float32_param in ("bias", "both") else b.to(dtype)
    want = F.layer_norm(x, (24,), w, b, 1e-5)
    got = torch.func.vmap(lambda row: F.layer_norm(row, (24,), w, b, 1e-5))(x)
    assert got.dtype == dtype
    assert_close(got, want, dtype)

    x64, w64, b64 = (t.double() for t in (x, w, b))
    _, tangent64 = torch.func.jvp(lambda t: TF.layer_norm(t, (24,), w64, b64, 1e-5), (x64,), (dx.double(),))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, dx)
        y, tangent = torch.autograd.forward_ad.unpack_dual(F.layer_norm(dual, (24,), w, b, 1e-5))
    assert y.dtype == tangent.dtype == dtype
    assert_close(y, want, dtype)
    assert_close(tangent, tangent64, dtype, scale=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_modules_train_under_autocast(dtype):
    """The fused block under torch.autocast matches the same block built from torch's modules:
    float32 parameters, 16-bit activations, a float32 residual stream."""
    torch.manual_seed(0)
    fused = _Block(16, fused=True)
    ref = _Block(16, fused=False)
    ref.load_state_dict(fused.state_dict())
    norm_h_inputs = []
    fused.norm_h.register_forward_pre_hook(lambda m, args: norm_h_inputs.append(args[0].dtype))
    x = torch.randn(8, 16)
    outs = []
    for m in (fused, ref):
        with torch.autocast("cpu", dtype=dtype):
            y = m(x)
        assert y.dtype == torch.float32
        y.square().mean().backward()
        outs.append(y)
    assert norm_h_inputs == [dtype]  # 16-bit input beside float32 weight and bias
    torch.testing.assert_close(outs[0], outs[1], atol=3e-2, rtol=3e-2)
    for (name, p), q in zip(fused.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, atol=3e-2, rtol=5e-2, msg=name)


def test_compile_traces_mixed_dtypes():
    """The Meta kernels give the same dtypes as the CPU kernels: no graph break, no recompile."""
    x, dy, w, b = _data((4, 24), torch.bfloat16)
    r = torch.randn(4, 24)

    def fn(x, w, b, r):
        h = F.layer_norm(x, (24,), w, b, 1e-5)
        return F.bias_dropout_add(F.bias_gelu(h, b), b, r, 0.0, True)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    grads = []
    for f in (fn, compiled):
        xs = _leaves(x, w, b, r)
        out = f(*xs)
        assert out.dtype == torch.float32
        grads.append(torch.autograd.grad(out, xs, dy.float()))
    for g0, g1 in zip(*grads):
        assert g0.dtype == g1.dtype
        torch.testing.assert_close(g0, g1)


@pytest.mark.parametrize("call,match", [
    (lambda x, w, b: F.layer_norm(x, (8,), w.double(), b, 1e-5), "weight has dtype Double"),
    (lambda x, w, b: F.layer_norm(x, (8,), w, b.half(), 1e-5), "bias has dtype Half"),
    (lambda x, w, b: F.layer_norm(x.float(), (8,), w.bfloat16(), b.float(), 1e-5),
     "weight has dtype BFloat16 but input has dtype Float"),
    (lambda x, w, b: F.bias_gelu(x, b.double()), "bias has dtype Double"),
    (lambda x, w, b: F.bias_dropout_add(x, b, x.double()), "residual has dtype Double"),
    (lambda x, w, b: F.bias_dropout_add(x.float(), b, x), "residual has dtype BFloat16"),
])
def test_other_mixes_are_refused(call, match):
    x, _, w, b = _data((2, 8), torch.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        call(x, w, b)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    x, dy, w, b = _data((6, 130), dtype)
    r = torch.randn(6, 130)
    results = []
    for dev in ("cpu", "cuda"):
        xs = [t.to(dev).requires_grad_() for t in (x, w, b, r)]
        torch.manual_seed(5)
        h = F.layer_norm(xs[0], (130,), xs[1], xs[2], 1e-5)
        out = F.bias_dropout_add(F.bias_gelu(h, xs[2]), xs[2], xs[3], 0.1, True)
        out.backward(dy.float().to(dev))
        results.append([out] + [t.grad for t in xs])
    for a, c in zip(*results):
        assert a.dtype == c.dtype
        torch.testing.assert_close(a, c.cpu(), atol=2e-2, rtol=2e-2)
