"""torchpar.nn.functional.layer_norm and torchpar.nn.LayerNorm against torch's own."""
import pytest
import torch
import torch.nn.functional as TF

import torchpar.nn as tnn
from kernels_util import assert_close, noncontiguous, requires_cuda

pytestmark = pytest.mark.timeout(120)
F = tnn.functional

SHAPES = [((4, 7), (7,)), ((3, 5, 33), (33,)), ((2, 3, 4, 16), (4, 16)), ((6, 1024), (1024,)),
          ((3, 2100), (2100,)), ((5, 1), (1,))]


def _inputs(shape, norm, dtype, affine=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)
    w = (torch.randn(norm, generator=g, dtype=torch.float64)).to(dtype) if affine else None
    b = (torch.randn(norm, generator=g, dtype=torch.float64)).to(dtype) if affine and bias else None
    return x, w, b


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("shape,norm", SHAPES[:3])
def test_gradcheck_float64(shape, norm, affine, bias):
    x, w, b = _inputs(shape, norm, torch.float64, affine, bias)
    args = [t.requires_grad_() for t in (x, w, b) if t is not None]

    def fn(*ts):
        ts = list(ts) + [None] * (3 - len(ts))
        return F.layer_norm(ts[0], norm, ts[1], ts[2], 1e-5)

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(13, 2500), (9, 1025), (17, 4096)])
def test_wide_rows_backward(rows, cols, dtype):
    """Rows wider than one backward chunk go in tiles of rows x chunks: ragged on both sides."""
    x, w, b = _inputs((rows, cols), (cols,), dtype)
    dy = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = []
    for fn, run_dtype in ((F.layer_norm, dtype), (TF.layer_norm, torch.float64)):
        args = [t.to(run_dtype).requires_grad_() for t in (x, w, b)]
        grads.append(torch.autograd.grad(fn(args[0], [cols], args[1], args[2], 1e-5), args,
                                         dy.to(run_dtype)))
    for got, want in zip(*grads):
        if dtype == torch.float64:
            torch.testing.assert_close(got, want)
        else:  # dweight and dbias sum rows of a float32 product rounded once
            assert_close(got, want.to(dtype), dtype, scale=5)


def test_gradgradcheck_float64_bias_without_weight():
    # torch's own layer_norm fails this: its bias gradient has no second derivative when there
    # is no weight.
    x, _, b = _inputs((3, 5, 6), (5, 6), torch.float64)
    args = [x.requires_grad_(), b.requires_grad_()]
    assert torch.autograd.gradgradcheck(lambda x, b: F.layer_norm(x, (5, 6), None, b, 1e-5), args)
    x1 = torch.randn(6, dtype=torch.float64, requires_grad=True)  # no leading dims
    assert torch.autograd.gradgradcheck(lambda x, b: F.layer_norm(x, (6,), None, b, 1e-5),
                                        [x1, torch.randn(6, dtype=torch.float64, requires_grad=True)])


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_gradgradcheck_float64(affine, bias):
    shape, norm = SHAPES[2]
    x, w, b = _inputs(shape, norm, torch.float64, affine, bias)
    args = [t.requires_grad_() for t in (x, w, b) if t is not None]

    def fn(*ts):
        ts = list(ts) + [None] * (3 - len(ts))
        return F.layer_norm(ts[0], norm, ts[1], ts[2], 1e-5)

    assert torch.autograd.gradgradcheck(fn, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_double_backward_matches_torch(dtype):
    """A gradient penalty: d/d(x, w, b) of |d loss / dx|^2, as with torch's layer_norm."""
    shape, norm = SHAPES[1]
    outs = []
    # torch's reference runs in float64 on the same (rounded) inputs.
    for fn, run_dtype in ((F.layer_norm, dtype), (TF.layer_norm, torch.float64)):
        x, w, b = (t.to(run_dtype).requires_grad_() for t in _inputs(shape, norm, dtype))
        (gx,) = torch.autograd.grad(fn(x, norm, w, b, 1e-5).square().sum(), x, create_graph=True)
        gx.square().sum().backward()
        outs.append((gx.detach(), x.grad, w.grad, b.grad))
    # The second gradients sum rows of a first gradient that was itself rounded to dtype.
    for got, want in zip(*outs):
        assert_close(got, want.to(dtype), dtype, scale=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("shape,norm", SHAPES)
def test_matches_torch_forward_and_every_gradient(shape, norm, dtype, contiguous):
    x, w, b = _inputs(shape, norm, dtype)
    if not contiguous:
        x = noncontiguous(x)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = [t.double().requires_grad_() for t in (x, w, b)]
    y = F.layer_norm(ours[0], norm, ours[1], ours[2], eps=1e-5)
    y_ref = TF.layer_norm(ref[0], norm, ref[1], ref[2], 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, y_ref, dtype, scale=10)
    y.backward(dy)
    y_ref.backward(dy.double())
    rows = x.numel() // w.numel()
    for name, a, r, scale in [("x", ours[0], ref[0], 10), ("weight", ours[1], ref[1], 10 * rows),
                              ("bias", ours[2], ref[2], 10 * rows)]:
        assert a.grad.dtype == dtype, name
        assert_close(a.grad, r.grad, dtype, scale=scale)


def test_statistics_are_float32_for_bfloat16_and_saved_shape_is_leading_dims():
    x, w, b = _inputs((2, 3, 8), (8,), torch.bfloat16)
    y, mean, rstd = torch.ops.torchpar.layer_norm_fwd(x, [8], w, b, 1e-5)
    assert mean.dtype == torch.float32 and rstd.dtype == torch.float32
    assert mean.shape == (2, 3) and rstd.shape == (2, 3)
    torch.testing.assert_close(mean, x.float().mean(-1))
    torch.testing.assert_close(rstd, (x.float().var(-1, unbiased=False) + 1e-5).rsqrt())


def test_welford_is_stable_for_a_large_offset():
    # sum(x^2) - sum(x)^2 would cancel catastrophically here; Welford does not.
    x = torch.randn(4, 4096, dtype=torch.float64) + 1e4
    y = F.layer_norm(x.float(), [4096])
    torch.testing.assert_close(y.double(), TF.layer_norm(x, [4096]), atol=1e-2, rtol=0)


@pytest.mark.parametrize("cols", [37, 256, 1000, 4099])
@pytest.mark.parametrize("offset,scale", [(1e4, 1.0), (1e3, 1e-2)])
def test_statistics_are_as_precise_as_torchs_for_offset_rows(cols, offset, scale):
    # float32 rows far from zero with a small spread: the statistics are only as good as the
    # chunk and lane means they merge. Pinned against torch's own layer_norm, in float64.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, cols, generator=g) * scale + offset
    exact = (x.double().var(-1, unbiased=False) + 1e-5).rsqrt()
    _, _, ours = torch.ops.torchpar.layer_norm_fwd(x, [cols], None, None, 1e-5)
    _, _, theirs = torch.native_layer_norm(x, [cols], None, None, 1e-5)
    err = lambda r: ((r.double().flatten() - exact).abs() / exact).max().item()
    assert err(ours) <= max(1.5 * err(theirs), 1e-5)


@pytest.mark.parametrize("elementwise_affine,bias", [(True, True), (True, False), (False, True)])
def test_state_dict_round_trip_with_nn_layernorm(elementwise_affine, bias):
    theirs = torch.nn.LayerNorm([3, 8], eps=1e-6, elementwise_affine=elementwise_affine, bias=bias)
    ours = tnn.LayerNorm([3, 8], eps=1e-6, elementwise_affine=elementwise_affine, bias=bias)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    with torch.no_grad():
        for prm in theirs.parameters():
            prm.copy_(torch.randn_like(prm))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 3, 8)
    torch.testing.assert_close(ours(x), theirs(x))
    back = torch.nn.LayerNorm([3, 8], eps=1e-6, elementwise_affine=elementwise_affine, bias=bias)
    back.load_state_dict(ours.state_dict())
    torch.testing.assert_close(back(x), theirs(x))


@pytest.mark.parametrize("elementwise_affine,bias", [(True, True), (True, False), (False, True)])
def test_module_repr_is_nn_layernorms(elementwise_affine, bias):
    args = dict(eps=1e-6, elementwise_affine=elementwise_affine, bias=bias)
    assert repr(tnn.LayerNorm([3, 8], **args)) == repr(torch.nn.LayerNorm([3, 8], **args))


def test_functional_takes_every_form_of_normalized_shape():
    x, w, b = _inputs((4, 2, 8), (8,), torch.float32)
    want = TF.layer_norm(x, [8], w, b)
    for shape in (8, [8], (8,), torch.Size([8])):
        torch.testing.assert_close(F.layer_norm(x, shape, w, b), want)


def test_module_takes_nn_layernorm_arguments():
    m = tnn.LayerNorm(16, eps=1e-3, elementwise_affine=True, bias=False, dtype=torch.float64)
    assert m.weight.dtype == torch.float64 and m.bias is None and m.normalized_shape == (16,)
    x = torch.randn(2, 16, dtype=torch.float64)
    torch.testing.assert_close(m(x), TF.layer_norm(x, [16], m.weight, None, 1e-3))


def test_inference_mode_and_no_grad_use_the_forward_kernel():
    x, w, b = _inputs((4, 32), (32,), torch.float32)
    with torch.inference_mode():
        y = F.layer_norm(x, [32], w, b)
    torch.testing.assert_close(y, TF.layer_norm(x, [32], w, b))


@pytest.mark.parametrize("call,match", [
    (lambda x, w, b: F.layer_norm(x, [9], w, b), "normalized_shape"),
    (lambda x, w, b: F.layer_norm(x, [3, 8], w, b), "normalized_shape"),
    (lambda x, w, b: F.layer_norm(x, [8], torch.ones(7), b), "weight has shape"),
    (lambda x, w, b: F.layer_norm(x, [8], w, torch.ones(2, 4)), "bias has shape"),
    (lambda x, w, b: F.layer_norm(x, [8], w.double(), b), "weight has dtype"),
    (lambda x, w, b: F.layer_norm(x.int(), [8], None, None), "input must be float"),
])
def test_bad_input_names_the_argument(call, match):
    x, w, b = _inputs((4, 8), (8,), torch.float32)
    with pytest.raises(RuntimeError, match=match):
        call(x, w, b)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    x, w, b = _inputs((64, 1000), (1000,), dtype)
    dy = torch.randn_like(x)
    outs = []
    for dev in ("cpu", "cuda"):
        ts = [t.to(dev).requires_grad_() for t in (x, w, b)]
        y = F.layer_norm(ts[0], [1000], ts[1], ts[2])
        y.backward(dy.to(dev))
        outs.append([y.cpu()] + [t.grad.cpu() for t in ts])
    for a, c in zip(*outs):
        assert_close(a, c.float(), dtype, scale=100)
