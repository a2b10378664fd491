"""Each op's backward produces only the gradients autograd asks for: a frozen LayerNorm weight or
bias, or a frozen bias of bias_gelu / bias_dropout_add (adapter or LoRA fine-tuning freezes them
all), costs no column sums, and a LayerNorm on a frozen input no dx. The gradients that are asked
for stay what they were, and torch.compile traces the masked ops."""
import itertools

import pytest
import torch
import torch.nn.functional as TF
from torch.utils._python_dispatch import TorchDispatchMode

import torchpar.nn as tnn
from kernels_util import assert_close

pytestmark = pytest.mark.timeout(120)
F = tnn.functional
ops = torch.ops.torchpar

# A row in one backward chunk, and one wider than a chunk (the tiled backward).
SHAPES = [(5, 33), (3, 2100)]
# Which of (input, weight, bias) require grad: every mix with at least one.
REQUIRES = [m for m in itertools.product([True, False], repeat=3) if any(m)]


def _data(shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dtype)
    b = (0.3 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, b, dy


def _grads(fn, tensors, requires, dy, create_graph=False):
    leaves = [t.clone().requires_grad_(r) for t, r in zip(tensors, requires)]
    out = fn(*leaves)
    wanted = [t for t in leaves if t.requires_grad]
    got = iter(torch.autograd.grad(out, wanted, dy, create_graph=create_graph))
    return [next(got) if t.requires_grad else None for t in leaves]


class _BackwardCalls(TorchDispatchMode):
    """Records the arguments of every torchpar backward op called under it."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "torchpar" and func.__name__.split(".")[0].endswith("_bwd"):
            self.calls[func.__name__.split(".")[0]] = func._schema.arguments, args, kwargs
        return func(*args, **kwargs)

    def arg(self, op, name):
        schema, args, kwargs = self.calls[op]
        i = [a.name for a in schema].index(name)
        return kwargs.get(name, args[i] if i < len(args) else schema[i].default_value)


@pytest.mark.parametrize("requires", REQUIRES, ids=lambda m: "".join("xwb"[i] for i in range(3) if m[i]))
def test_backward_asks_the_kernels_only_for_what_autograd_needs(requires):
    x, w, b, dy = _data((4, 24), torch.float32)
    xs, ws, bs = (t.clone().requires_grad_(r) for t, r in zip((x, w, b), requires))
    with _BackwardCalls() as calls:
        torch.manual_seed(0)
        y = F.layer_norm(xs, [24], ws, bs, 1e-5)
        y = F.bias_dropout_add(F.bias_gelu(y, bs, "none"), bs, y, 0.1, True)
        y.backward(dy)
    assert calls.arg("layer_norm_bwd", "output_mask") == list(requires)
    assert calls.arg("bias_gelu_bwd", "bias_grad") == requires[2]
    assert calls.arg("bias_dropout_add_bwd", "bias_grad") == requires[2]


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("requires", REQUIRES, ids=lambda m: "".join("xwb"[i] for i in range(3) if m[i]))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layer_norm_gives_the_gradients_asked_for(shape, requires, create_graph):
    x, w, b, dy = _data(shape)
    cols = [shape[-1]]
    got = _grads(lambda *t: F.layer_norm(*t[:1], cols, *t[1:], 1e-5), (x, w, b), requires, dy,
                 create_graph)
    want = _grads(lambda *t: TF.layer_norm(*t[:1], cols, *t[1:], 1e-5), (x, w, b), requires, dy)
    for g, e in zip(got, want):
        assert (g is None) == (e is None)
        if e is not None:
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("absent", ["weight", "bias"])
@pytest.mark.parametrize("requires", [(True, False), (False, True), (True, True)], ids=["x", "p", "xp"])
def test_layer_norm_with_one_parameter_gives_the_gradients_asked_for(requires, absent):
    # One parameter absent: the other is autograd's second edge, and nothing is summed for the
    # absent one.
    x, w, b, dy = _data((4, 300))

    def call(fn):
        if absent == "weight":
            return lambda x, b: fn(x, [300], None, b, 1e-5)
        return lambda x, w: fn(x, [300], w, None, 1e-5)

    param = b if absent == "weight" else w
    got = _grads(call(F.layer_norm), (x, param), requires, dy)
    want = _grads(call(TF.layer_norm), (x, param), requires, dy)
    for g, e in zip(got, want):
        assert (g is None) == (e is None)
        if e is not None:
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layer_norm_bwd_output_mask(shape, dtype):
    x, w, b, dy = _data(shape, dtype)
    cols = [shape[-1]]
    _, mean, rstd = ops.layer_norm_fwd(x, cols, w, b, 1e-5)
    full = ops.layer_norm_bwd(dy, x, cols, mean, rstd, w, b)
    for mask in itertools.product([True, False], repeat=3):
        got = ops.layer_norm_bwd(dy, x, cols, mean, rstd, w, b, list(mask))
        for asked, g, f in zip(mask, got, full):
            if asked:
                assert torch.equal(g, f), mask
            else:
                assert g.numel() == 0, mask
    # A parameter that is not there gets no gradient, whatever the mask says.
    assert ops.layer_norm_bwd(dy, x, cols, mean, rstd, None, None)[1].numel() == 0


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype,bias_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bias_gelu_gives_the_gradients_asked_for(shape, dtype, bias_dtype, approximate):
    x, _, b, dy = _data(shape, dtype)
    b = b.to(bias_dtype)
    both = _grads(lambda x, b: F.bias_gelu(x, b, approximate), (x, b), (True, True), dy)
    frozen_bias = _grads(lambda x, b: F.bias_gelu(x, b, approximate), (x, b), (True, False), dy)
    frozen_input = _grads(lambda x, b: F.bias_gelu(x, b, approximate), (x, b), (False, True), dy)
    assert frozen_bias[1] is None and frozen_input[0] is None
    # dx alone may round its last bit differently in mixed precision (its terms then need only
    # 16-bit accuracy); the rest is the same computation.
    assert_close(frozen_bias[0], both[0], dtype) if bias_dtype != dtype else \
        torch.testing.assert_close(frozen_bias[0], both[0], rtol=0, atol=0)
    torch.testing.assert_close(frozen_input[1], both[1], rtol=0, atol=0)
    dx, db = ops.bias_gelu_bwd(dy, x, b, approximate, False)
    assert db.numel() == 0 and dx.shape == x.shape


@pytest.mark.parametrize("p,training", [(0.3, True), (0.0, True), (0.3, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bias_dropout_add_gives_the_gradients_asked_for(shape, dtype, p, training):
    x, r, b, dy = _data(shape, dtype)
    r = r.expand(shape).contiguous()

    def run(x, b, r):
        torch.manual_seed(7)
        return F.bias_dropout_add(x, b, r, p, training)

    both = _grads(run, (x, b, r), (True, True, True), dy)
    frozen_bias = _grads(run, (x, b, r), (True, False, True), dy)
    assert frozen_bias[1] is None
    torch.testing.assert_close(frozen_bias[0], both[0], rtol=0, atol=0)
    torch.testing.assert_close(frozen_bias[2], both[2], rtol=0, atol=0)
    seed = ops.bias_dropout_add_fwd(x, b, r, p, training)[1]
    dx, db = ops.bias_dropout_add_bwd(dy, seed, p, training, False)
    assert db.numel() == 0
    torch.testing.assert_close(dx, ops.bias_dropout_add_bwd(dy, seed, p, training)[0], rtol=0, atol=0)


def test_compile_traces_frozen_parameters():
    """A block whose parameters are all frozen (LoRA-style) compiles in one graph and matches eager."""
    torch._dynamo.reset()
    x, w, b, dy = _data((8, 64), torch.float32)
    b2 = b.flip(0)

    def block(x, w, b, b2):
        h = F.bias_gelu(F.layer_norm(x, [64], w, b, 1e-5), b2)
        return F.bias_dropout_add(h, b, x, 0.2, True)

    results = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        xs = x.clone().requires_grad_()
        torch.manual_seed(3)
        out = fn(xs, w, b, b2)
        with _BackwardCalls() as calls:
            (gx,) = torch.autograd.grad(out, xs, dy)
        results.append((out, gx))
        # The compiled backward, too, asks the kernels for dx alone.
        assert calls.arg("layer_norm_bwd", "output_mask") == [True, False, False]
        assert calls.arg("bias_gelu_bwd", "bias_grad") is False
        assert calls.arg("bias_dropout_add_bwd", "bias_grad") is False
    for a, c in zip(*results):
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("bias_requires_grad", [True, False])
def test_bias_dropout_add_double_backward_for_the_input_alone(bias_requires_grad):
    # A gradient penalty on the input alone: the bias's column sums are not asked for, in
    # either backward, whether the bias is frozen or not.
    x, r, b, _ = _data((4, 40))
    x, b = x.clone().requires_grad_(), b.clone().requires_grad_(bias_requires_grad)

    def run(fn):
        torch.manual_seed(3)
        y = fn(x, b, r.expand(4, 40), 0.3, True)
        (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), x)[0]

    def composite(x, b, r, p, training):  # the same mask, drawn by the fused op with ones in
        mult = F.bias_dropout_add(torch.ones_like(x), torch.zeros_like(b), torch.zeros_like(x), p, training)
        return r + (x + b) * mult

    torch.testing.assert_close(run(F.bias_dropout_add), run(composite))
