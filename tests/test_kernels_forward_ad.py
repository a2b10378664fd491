"""Forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) through the three fused ops.

A tangent on any input sends an op down ATen's composite of the same math (a C++ autograd
function has no jvp), so these tests check the tangents against finite differences
(gradcheck's forward-AD mode) and against the jvp of torch's own ops, and that the composite
keeps the fused op's contract: its errors, and for dropout the very mask the fused path draws.
"""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as TF

import torchpar.nn as tnn

pytestmark = pytest.mark.timeout(120)
F = tnn.functional


def _randn(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _seeded(seed, fn):
    """fn with the default generator reset before every call: one mask for gradcheck's probes."""
    def call(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return call


@pytest.mark.parametrize("op", ["layer_norm", "bias_gelu", "bias_gelu_tanh", "bias_dropout_add"])
def test_forward_ad_gradcheck_float64(op):
    x, v, w = _randn(5, 12), _randn(12, seed=1), _randn(12, seed=2)
    fns = {
        "layer_norm": (lambda x, w, b: F.layer_norm(x, [12], w, b), (x, w, v)),
        "bias_gelu": (lambda x, b: F.bias_gelu(x, b), (x, v)),
        "bias_gelu_tanh": (lambda x, b: F.bias_gelu(x, b, "tanh"), (x, v)),
        "bias_dropout_add": (_seeded(7, lambda x, b, r: F.bias_dropout_add(x, b, r, 0.3)),
                             (x, v, _randn(5, 12, seed=3))),
    }
    fn, args = fns[op]
    args = tuple(a.requires_grad_() for a in args)
    assert torch.autograd.gradcheck(fn, args, check_forward_ad=True, check_backward_ad=False,
                                    check_batched_forward_grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jvp_matches_torch_ops(dtype):
    x, t = _randn(6, 64, dtype=dtype), _randn(6, 64, dtype=dtype, seed=1)
    w, b = _randn(64, dtype=dtype, seed=2), _randn(64, dtype=dtype, seed=3)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    pairs = [
        (lambda x: F.layer_norm(x, [64], w, b), lambda x: TF.layer_norm(x, [64], w, b)),
        (lambda x: F.bias_gelu(x, b), lambda x: TF.gelu(x.float() + b.float()).to(dtype)),
        (lambda x: F.bias_gelu(x, b, "tanh"),
         lambda x: TF.gelu(x.float() + b.float(), approximate="tanh").to(dtype)),
    ]
    for ours, theirs in pairs:
        out, tangent = torch.func.jvp(ours, (x,), (t,))
        ref_out, ref_tangent = torch.func.jvp(theirs, (x,), (t,))
        assert out.dtype == dtype and tangent.dtype == dtype
        torch.testing.assert_close(out, ref_out, **tol)
        torch.testing.assert_close(tangent, ref_tangent, **tol)


def test_dropout_jvp_uses_the_fused_mask():
    x, b, r = _randn(9, 40), _randn(40, seed=1), _randn(9, 40, seed=2)
    tx, tb, tr = _randn(9, 40, seed=3), _randn(40, seed=4), _randn(9, 40, seed=5)
    torch.manual_seed(11)
    fused = F.bias_dropout_add(x, b, r, 0.4)
    torch.manual_seed(11)
    with fwAD.dual_level():
        dual = F.bias_dropout_add(fwAD.make_dual(x, tx), fwAD.make_dual(b, tb),
                                  fwAD.make_dual(r, tr), 0.4)
        out, tangent = fwAD.unpack_dual(dual)
    torch.testing.assert_close(out, fused)
    keep = (fused - r) != 0
    torch.testing.assert_close(tangent, tr + keep * (tx + tb) / 0.6)
    # Eval mode: no mask, no draw.
    _, t_eval = torch.func.jvp(lambda x: F.bias_dropout_add(x, b, r, 0.4, False), (x,), (tx,))
    torch.testing.assert_close(t_eval, tx)


def test_reverse_mode_through_a_dual_input():
    # The composite keeps backward formulas: a tangent and a gradient in the same computation.
    x, w, b = (_randn(4, 16, seed=s) for s in range(3))
    x.requires_grad_()
    with fwAD.dual_level():
        y = F.layer_norm(fwAD.make_dual(x, torch.ones_like(x)), [16], w[0], b[0])
        fwAD.unpack_dual(y).primal.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    TF.layer_norm(x_ref, [16], w[0], b[0]).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("call,match", [
    (lambda x, t: F.layer_norm(x, [5], None, None), "normalized_shape"),
    (lambda x, t: F.bias_gelu(x, torch.ones(3, dtype=x.dtype)), "bias must have shape"),
    (lambda x, t: F.bias_dropout_add(x, torch.zeros(8, dtype=x.dtype), x, 1.5), "p must be in"),
])
def test_bad_input_still_names_the_argument(call, match):
    x, t = _randn(4, 8), _randn(4, 8, seed=1)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=match):
        call(fwAD.make_dual(x, t), t)
