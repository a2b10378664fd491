"""Forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) and functorch transforms
(torch.func.grad, vmap) through the three fused ops.

A tangent on any input, or an active transform, sends an op down ATen's composite of the same
math (a C++ autograd function has no jvp, and torch refuses one under functorch), and under
vmap the ops decompose into batched ATen ops. These tests check the results against finite
differences (gradcheck's forward-AD mode) and against torch's own ops under the same
transform, and that the composite keeps the fused op's contract: its errors, for dropout under
forward-mode AD the very mask the fused path draws, and under vmap the meaning of `randomness`.
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
    # Batched forward gradients run under vmap, where dropout needs a `randomness` mode.
    batched = op != "bias_dropout_add"
    assert torch.autograd.gradcheck(fn, args, check_forward_ad=True, check_backward_ad=False,
                                    check_batched_forward_grad=batched)


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


def test_func_grad_matches_torch_ops():
    x, w, b = _randn(4, 16), _randn(16, seed=1), _randn(16, seed=2)
    pairs = [
        (lambda w: F.layer_norm(x, [16], w, b).pow(2).sum(),
         lambda w: TF.layer_norm(x, [16], w, b).pow(2).sum()),
        (lambda w: F.bias_gelu(x * w, b).pow(2).sum(), lambda w: TF.gelu(x * w + b).pow(2).sum()),
    ]
    for ours, theirs in pairs:
        torch.testing.assert_close(torch.func.grad(ours)(w), torch.func.grad(theirs)(w))
    # Under a transform the mask comes from torch's bernoulli: check the gradient against it.
    g = torch.func.grad(lambda x: F.bias_dropout_add(x, b, torch.zeros_like(x), 0.5).sum())(x)
    assert set(g.unique().tolist()) <= {0.0, 2.0} and 0 < g.count_nonzero() < g.numel()


def test_per_sample_gradients_with_vmap_of_grad():
    # The classic per-sample-gradient recipe, through a block built from the fused modules.
    ln, act = tnn.LayerNorm(16).double(), tnn.BiasGeLU(16).double()
    with torch.no_grad():
        ln.weight.copy_(_randn(16, seed=1))
        act.bias.copy_(_randn(16, seed=2))
    params = {k: v.detach() for k, v in [("weight", ln.weight), ("bias", ln.bias), ("act", act.bias)]}

    def loss(p, x):
        h = F.bias_gelu(F.layer_norm(x, [16], p["weight"], p["bias"]), p["act"])
        return h.pow(2).sum()

    xs = _randn(5, 3, 16, seed=3)
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, xs)
    for i in range(xs.shape[0]):
        ref = {k: v.clone().requires_grad_() for k, v in params.items()}
        h = TF.gelu(TF.layer_norm(xs[i], [16], ref["weight"], ref["bias"]) + ref["act"])
        h.pow(2).sum().backward()
        for k in params:
            torch.testing.assert_close(per_sample[k][i], ref[k].grad)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_vmap_matches_torch_ops(approximate):
    x, w, b = _randn(3, 5, 16), _randn(16, seed=1), _randn(16, seed=2)
    torch.testing.assert_close(torch.func.vmap(lambda x: F.layer_norm(x, [16], w, b))(x),
                               TF.layer_norm(x, [16], w, b))
    torch.testing.assert_close(torch.func.vmap(lambda x: F.bias_gelu(x, b, approximate))(x),
                               TF.gelu(x + b, approximate=approximate))
    # Batched weights too: one LayerNorm per example.
    ws = _randn(3, 16, seed=4)
    out = torch.func.vmap(lambda x, w: F.layer_norm(x, [16], w, b))(x, ws)
    for i in range(3):
        torch.testing.assert_close(out[i], TF.layer_norm(x[i], [16], ws[i], b))


def test_vmap_dropout_follows_randomness():
    x, b = _randn(4, 6, 32), torch.zeros(32, dtype=torch.float64)

    def drop(x):
        return F.bias_dropout_add(torch.ones_like(x), b, torch.zeros_like(x), 0.5)

    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(drop)(x)  # randomness="error" is vmap's default
    same = torch.func.vmap(drop, randomness="same")(x)
    different = torch.func.vmap(drop, randomness="different")(x)
    assert all(torch.equal(same[0], same[i]) for i in range(1, 4))
    assert not torch.equal(different[0], different[1])
    for y in (same, different):
        assert set(y.unique().tolist()) <= {0.0, 2.0}
    # Inference: no draw, so no randomness mode needed.
    r = _randn(4, 6, 32, seed=1)
    torch.testing.assert_close(
        torch.func.vmap(lambda x, r: F.bias_dropout_add(x, b, r, 0.5, False))(x, r), x + r)


@pytest.mark.parametrize("outer", ["none", "jacrev"])
def test_vmap_dropout_of_an_unbatched_tensor_follows_randomness(outer):
    # Dropout of a tensor vmap does not batch (closed over), added to a batched one: the op
    # sees no batched argument, yet the mask must still follow `randomness`. Under jacrev the
    # derivative with respect to the dropped tensor's scale is each example's mask itself.
    xs = _randn(4, 6, 32)
    w, b, r = (torch.ones(6, 32, dtype=torch.float64), torch.zeros(32, dtype=torch.float64),
               torch.zeros(6, 32, dtype=torch.float64))

    def run(randomness):
        def step(scale):
            return torch.func.vmap(lambda x: x * 0 + F.bias_dropout_add(w * scale, b, r, 0.5),
                                   randomness=randomness)(xs)
        scale = torch.tensor(1.0, dtype=torch.float64)
        return step(scale) if outer == "none" else torch.func.jacrev(step)(scale)

    with pytest.raises(RuntimeError, match="randomness"):
        run("error")
    same, different = run("same"), run("different")
    assert all(torch.equal(same[0], same[i]) for i in range(1, 4))
    assert not torch.equal(different[0], different[1])
    assert set(different.unique().tolist()) <= {0.0, 2.0}
