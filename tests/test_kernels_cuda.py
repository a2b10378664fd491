"""The CUDA kernels on a GPU: every op, dtype and shape class against a float64 reference.

The reference is the CPU kernel in float64 on the same (rounded) inputs, which the other
kernel test files check against torch's composites and gradcheck; bias_dropout_add draws the
same mask on both devices from the same seed, so it is compared element for element too.
Skipped on machines without a GPU (CI); `make test-gpu` runs them where there is one.
"""
import math

import pytest
import torch

import torchpar.nn as tnn
from kernels_util import assert_close, gelu_exact, noncontiguous, requires_cuda

pytestmark = [pytest.mark.timeout(300), requires_cuda]
F = tnn.functional

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One element; rows narrower than a warp; not a multiple of any vector width; a 3-D input;
# exactly a block's worth; wider than a block takes in one pass; no rows at all.
SHAPES = [(1, 1), (37,), (4, 7), (3, 5, 33), (64, 1000), (2, 1024), (3, 2100), (5, 12289), (0, 64)]


def _call(op, x, p, r, approximate="none"):
    if op == "layer_norm":
        return F.layer_norm(x, [x.shape[-1]], p, p * 0.5 + 0.25, 1e-5)
    if op == "bias_gelu":
        return F.bias_gelu(x, p, approximate)
    return F.bias_dropout_add(x, p, r, 0.3, True)


def _run(op, device, x, p, r, dy, approximate="none", contiguous=True):
    """Output and the gradients of x, p (and r) of `op` on `device`, as float64 on the CPU."""
    leaves = [t.detach().to(device).requires_grad_() for t in (x, p, r)]
    xs = leaves[0] if contiguous else noncontiguous(leaves[0])
    torch.manual_seed(123)  # bias_dropout_add's mask: the same on every device and dtype
    y = _call(op, xs, leaves[1], leaves[2], approximate)
    y.backward(dy.to(device, y.dtype))
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return [t.detach().cpu().double() for t in [y] + grads]


def _inputs(shape, dtype, param_dtype=None, residual_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2).to(dtype)
    p = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(param_dtype or dtype)
    r = torch.randn(shape, generator=g, dtype=torch.float64).to(residual_dtype or dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    return x, p, r, dy


def _check(op, shape, dtype, param_dtype=None, residual_dtype=None, approximate="none",
           contiguous=True):
    """Compares `op` on the GPU with the float64 reference; returns both, as _run gives them."""
    x, p, r, dy = _inputs(shape, dtype, param_dtype, residual_dtype)
    dy = dy.to(dtype).double()  # the gradient each device receives, exactly
    got = _run(op, "cuda", x, p, r, dy, approximate, contiguous)
    want = _run(op, "cpu", x.double(), p.double(), r.double(), dy, approximate)
    rows = max(1, x.numel() // max(1, shape[-1]))
    # Parameter gradients sum over rows: their error grows with the row count.
    for name, a, b, scale in zip(("y", "dx", "dparam", "dresidual"), got, want,
                                 (1, 1, 4 * math.sqrt(rows), 1)):
        try:
            assert_close(a, b, dtype, scale=scale)
        except AssertionError as e:
            raise AssertionError(f"{op} {shape} {dtype}: {name}: {e}") from None
    return got, want


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "bias_gelu", "bias_dropout_add"])
def test_matches_float64_reference(op, dtype, shape, contiguous):
    _check(op, shape, dtype, contiguous=contiguous)


# Rows enough for many row chunks per column tile in the backwards' partial sums: chunks that
# end mid-way, and (2140 rows of <= 128 columns on a 132-SM GPU: 66 chunks of 33) empty
# trailing ones, which must still write their zeros.
MANY_ROWS = [(2140, 33), (4097, 8), (1000, 3000)]


@pytest.mark.parametrize("shape", MANY_ROWS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "bias_gelu", "bias_dropout_add"])
def test_parameter_gradients_over_many_row_chunks_from_a_dirty_allocator(op, dtype, shape):
    # The partials are not zeroed before their kernel writes them: hand the caching allocator
    # back NaN-filled blocks first, of its small pool (up to 1 MiB, where the partials of
    # these shapes come from) and its large one, so an entry left unwritten would show.
    junk = [torch.full((1 << 18,), math.nan, device="cuda") for _ in range(32)]
    junk.append(torch.full((16 << 20,), math.nan, device="cuda"))
    torch.cuda.synchronize()
    del junk
    _check(op, shape, dtype)


@pytest.mark.parametrize("shape", [(64, 1000), (3, 2100), (5, 12289)], ids=str)
def test_bias_gelu_tanh(shape):
    for dtype in DTYPES:
        _check("bias_gelu", shape, dtype, approximate="tanh")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "bias_gelu", "bias_dropout_add"])
def test_float32_parameters_beside_16bit_input(op, dtype):
    for shape in ((64, 1000), (3, 2100), (5, 12289)):
        got, want = _check(op, shape, dtype, param_dtype=torch.float32)
        # The float32 parameter's gradient is summed in float32 and never rounded to 16 bits:
        # float32 accuracy, which _check's 16-bit tolerance would not tell from a rounded one.
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{op} {shape} {dtype}: dparam: {m}")
    x, p, r, dy = _inputs((8, 300), dtype, torch.float32)
    leaves = [t.cuda().requires_grad_() for t in (x, p, r)]
    y = _call(op, *leaves)
    y.backward(torch.ones_like(y))
    assert y.dtype == dtype and leaves[1].grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_bias_dropout_add_float32_residual_stream(dtype):
    # A 16-bit input and bias beside a float32 residual: the output is float32.
    for shape in ((64, 1000), (3, 2100), (5, 12289)):
        _check("bias_dropout_add", shape, dtype, residual_dtype=torch.float32)
        _check("bias_dropout_add", shape, dtype, param_dtype=torch.float32,
               residual_dtype=torch.float32)


@pytest.mark.parametrize("op", ["layer_norm", "bias_gelu", "bias_dropout_add"])
def test_gradcheck_float64(op):
    x, p, r, _ = _inputs((3, 5, 37), torch.float64)
    leaves = [t.cuda().requires_grad_() for t in (x, p, r)]

    def fn(x, p, r):
        torch.manual_seed(5)
        return _call(op, x, p, r)

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_gelu_extreme_inputs(dtype, approximate):
    big = 3e38 if dtype != torch.bfloat16 else 3e38 * (1 - 2**-9)
    far = [-big, -1e30, -1e4, -100.0, -40.0, 40.0, 100.0, 1e4, 1e30, big, math.inf, -math.inf]
    mid = [-12.0, -9.0, -5.0, -1.0, 0.0, 1.0, 5.0, 9.0, 12.0]
    z = torch.tensor(far + mid, dtype=dtype)
    x = z[:, None].expand(-1, 309).contiguous().cuda().requires_grad_()
    y = F.bias_gelu(x, torch.zeros(309, dtype=dtype, device="cuda"), approximate)
    y.sum().backward()
    rtol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}[dtype]
    for i, zi in enumerate(z.tolist()):
        want_y, want_g = gelu_exact(zi, approximate)
        atol_y = 1e-6 if zi in mid else 1e-13
        torch.testing.assert_close(y[i].double().cpu(), torch.full((309,), want_y, dtype=torch.float64),
                                   rtol=rtol, atol=atol_y, equal_nan=True, msg=f"gelu({zi})")
        atol_g = 1e-30 if dtype != torch.bfloat16 else 1e-30 + abs(want_g) * 1e-2
        torch.testing.assert_close(x.grad[i].double().cpu(), torch.full((309,), want_g, dtype=torch.float64),
                                   rtol=max(rtol, 1e-3), atol=atol_g, msg=f"gelu'({zi})")


def test_dropout_keep_rate_p0_p1_and_eval():
    x = torch.ones(256, 1024, device="cuda")
    b, r = torch.zeros(1024, device="cuda"), torch.zeros(256, 1024, device="cuda")
    for p in (0.1, 0.5, 0.9):
        kept = (F.bias_dropout_add(x, b, r, p, True) != 0).double().mean().item()
        assert abs(kept - (1 - p)) < 0.01, (p, kept)
    xr = torch.randn(256, 1024, device="cuda")
    torch.testing.assert_close(F.bias_dropout_add(xr, b, r + 1, 0.0, True), xr + 1, rtol=0, atol=0)
    assert torch.equal(F.bias_dropout_add(xr, b, r + 1, 1.0, True), r + 1)
    torch.testing.assert_close(F.bias_dropout_add(xr, b, r + 1, 0.5, False), xr + 1, rtol=0, atol=0)


def test_torch_compile_inductor_fullgraph():
    ln = tnn.LayerNorm(300).cuda()

    def block(x, b1, b2):
        h = F.bias_gelu(ln(x), b1, "tanh")
        return F.bias_dropout_add(h, b2, x, 0.2, True)

    x, b1, _, _ = _inputs((16, 300), torch.float32)
    args = [t.cuda().requires_grad_() for t in (x, b1, b1.flip(0))]
    compiled = torch.compile(block, fullgraph=True)
    outs = []
    for fn in (block, compiled):
        for t in args:
            t.grad = None
        torch.manual_seed(9)
        y = fn(*args)
        y.square().sum().backward()
        outs.append([y] + [t.grad for t in args])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_parameters_on_another_device_are_refused():
    x = torch.randn(4, 8, device="cuda")
    for call, match in ((lambda: F.bias_gelu(x, torch.zeros(8)), "bias is on cpu"),
                        (lambda: F.layer_norm(x, [8], torch.ones(8), None, 1e-5), "weight is on cpu"),
                        (lambda: F.bias_dropout_add(x, torch.zeros(8, device="cuda"), x.cpu(), 0.1, True),
                         "residual is on cpu")):
        with pytest.raises(RuntimeError, match=match):
            call()
    torch.cuda.synchronize()


def test_modules_match_torch_modules_under_cuda_autocast():
    torch.manual_seed(0)
    ln, ref = tnn.LayerNorm(512).cuda(), torch.nn.LayerNorm(512).cuda()
    ref.load_state_dict(ln.state_dict())
    x = torch.randn(32, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fc = torch.nn.Linear(512, 512).cuda()
        h = fc(x)
        ours, theirs = ln(h), ref(h)
    # torch's autocast runs its layer_norm in float32; ours keeps the input's bfloat16.
    assert ours.dtype == torch.bfloat16 and theirs.dtype == torch.float32
    assert_close(ours.float(), theirs, torch.bfloat16)
    ours.float().sum().backward()
    assert ln.weight.grad.dtype == torch.float32
