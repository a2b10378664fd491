"""torch.compile traces the fused ops (Meta kernels, C++ autograd) without graph breaks."""
import pytest
import torch

import torchpar.nn as tnn

pytestmark = pytest.mark.timeout(170)
F = tnn.functional


def block(x, w, b, bias1, r):
    h = F.layer_norm(x, [x.shape[-1]], w, b)
    h = F.bias_gelu(h, bias1, "tanh")
    return F.bias_dropout_add(h, bias1, r, 0.2, True)


def test_compile_fullgraph_matches_eager_forward_and_gradients():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(16, 64, generator=g), torch.randn(64, generator=g),
            torch.randn(64, generator=g), torch.randn(64, generator=g),
            torch.randn(16, 64, generator=g)]
    results = []
    for fn in (block, torch.compile(block, fullgraph=True, dynamic=False)):
        ts = [a.clone().requires_grad_() for a in args]
        torch.manual_seed(42)
        y = fn(*ts)
        y.backward(torch.ones_like(y))
        results.append([y.detach()] + [t.grad for t in ts])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)


def test_compiled_dropout_draws_a_fresh_mask_each_call():
    torch._dynamo.reset()
    fn = torch.compile(lambda x, b, r: F.bias_dropout_add(x, b, r, 0.5, True), fullgraph=True)
    x, b, r = torch.ones(32, 32), torch.zeros(32), torch.zeros(32, 32)
    torch.manual_seed(1)
    first, second = fn(x, b, r), fn(x, b, r)
    assert not torch.equal(first, second)
    torch.manual_seed(1)
    assert torch.equal(fn(x, b, r), first)


def test_meta_kernels_give_shapes_and_dtypes():
    x = torch.empty(4, 6, 8, device="meta", dtype=torch.bfloat16)
    w = torch.empty(8, device="meta", dtype=torch.bfloat16)
    y, mean, rstd = torch.ops.torchpar.layer_norm_fwd(x, [8], w, w, 1e-5)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert mean.shape == (4, 6) and mean.dtype == torch.float32 and rstd.shape == (4, 6)
    assert torch.ops.torchpar.bias_gelu(x, w, "none").shape == x.shape
    out, seed = torch.ops.torchpar.bias_dropout_add_fwd(x, w, x, 0.1, True)
    assert out.shape == x.shape and seed.dtype == torch.int64
    with pytest.raises(RuntimeError, match="bias must have shape"):
        torch.ops.torchpar.bias_gelu(x, w[:3], "none")


def test_compiled_graphs_call_the_fused_kernels():
    # The ops fall back to ATen composites under forward-mode AD and functorch transforms;
    # compiling (AOTAutograd's tracing) must not be mistaken for either.
    import re
    import warnings

    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    g = torch.Generator().manual_seed(0)
    x, w, b, bias1 = (torch.randn(shape, generator=g).requires_grad_()
                      for shape in [(16, 64), (64,), (64,), (64,)])
    args = [x, w, b, bias1, torch.randn(16, 64, generator=g)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # aot_eager's note about boxed arguments
        torch.compile(block, backend=backend, fullgraph=True)(*args).sum().backward()
    code = "".join(gm.code for gm in backend.fw_graphs + backend.bw_graphs)
    called = set(re.findall(r"torchpar\.([a-z_]+)", code))
    assert {"layer_norm_fwd", "layer_norm_bwd", "bias_gelu", "bias_gelu_bwd",
            "bias_dropout_add_fwd", "bias_dropout_add_bwd"} <= called
    assert "aten.gelu" not in code and "aten.native_layer_norm" not in code


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = tnn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16, bias=False)
        self.act = tnn.BiasGeLU(16)
        self.drop = tnn.BiasDropoutAdd(16, p=0.2)

    def forward(self, x):
        return self.drop(self.act(self.fc(self.ln(x))), x)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_export_keeps_the_fused_ops_with_a_dynamic_batch_and_round_trips(training, tmp_path):
    # torch.export sees the ops whole (their Meta kernels give symbolic shapes), and the saved
    # program, loaded back, draws the eager dropout mask from the same seed.
    model = _Block().train(training)
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (torch.randn(4, 16),), dynamic_shapes={"x": {0: batch}})
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"torchpar.layer_norm.default", "torchpar.bias_gelu.default",
            "torchpar.bias_dropout_add.default"} <= targets
    torch.export.save(program, tmp_path / "block.pt2")
    loaded = torch.export.load(tmp_path / "block.pt2")
    x = torch.randn(7, 16)
    torch.manual_seed(3)
    want = model(x)
    for prog in (program, loaded):
        torch.manual_seed(3)
        torch.testing.assert_close(prog.module()(x), want, rtol=0, atol=0)
