"""TorchScript: the modules and functions script, as torch's LayerNorm, GeLU and dropout do
(a model that scripts with nn.LayerNorm must still script with ours), and the scripted forms
compute what the eager ones do (the same dropout mask from the same seed), gradients included.
torch 2.13 deprecates torch.jit.script in favour of torch.compile and torch.export (tested in
test_kernels_compile.py) but still runs it."""
import pytest
import torch

import torchpar.nn as tnn

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")]
F = tnn.functional


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kwargs", [dict(normalized_shape=8), dict(normalized_shape=[3, 8]),
                                    dict(normalized_shape=8, bias=False),
                                    dict(normalized_shape=8, elementwise_affine=False)],
                         ids=["int", "list", "no-bias", "no-affine"])
def test_scripted_layer_norm_module_matches_eager_with_gradients(kwargs):
    eager = tnn.LayerNorm(**kwargs)
    with torch.no_grad():
        for prm in eager.parameters():
            prm.copy_(_x(*prm.shape, seed=1))
    scripted = torch.jit.script(eager)
    outs = []
    for m in (eager, scripted):
        for prm in eager.parameters():
            prm.grad = None
        x = _x(2, 3, 8).requires_grad_()
        y = m(x)
        y.backward(_x(2, 3, 8, seed=2))
        outs.append([y, x.grad] + [prm.grad for prm in eager.parameters()])
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _normalize_by_tuples(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(F.layer_norm(x, (3, 8)), (8,))


class _Model(torch.nn.Module):
    """A model holding the module (built from a torch.Size) beside a functional call with a
    tuple attribute: what scripting a model that used torch's LayerNorm looks like."""

    def __init__(self):
        super().__init__()
        self.norm = tnn.LayerNorm(torch.Size([3, 8]))
        self.shape = (8,)

    def forward(self, x):
        return F.layer_norm(self.norm(x), self.shape)


def test_scripted_callers_pass_lists_tuples_and_sizes_as_with_torchs_layer_norm():
    x = _x(2, 3, 8)
    layer_norm = torch.jit.script(F.layer_norm)
    torch.testing.assert_close(layer_norm(x, [8]), F.layer_norm(x, 8), rtol=0, atol=0)
    by_tuples = torch.jit.script(_normalize_by_tuples)
    torch.testing.assert_close(by_tuples(x), _normalize_by_tuples(x), rtol=0, atol=0)
    model = _Model()
    torch.testing.assert_close(torch.jit.script(model)(x), model(x), rtol=0, atol=0)


def test_scripted_bias_gelu_function_matches_eager():
    x = _x(4, 8)
    bias_gelu = torch.jit.script(F.bias_gelu)
    torch.testing.assert_close(bias_gelu(x, _x(8, seed=1), "tanh"), F.bias_gelu(x, _x(8, seed=1), "tanh"),
                               rtol=0, atol=0)


def test_scripted_bias_gelu_module_matches_eager():
    eager = tnn.BiasGeLU(8, approximate="tanh")
    with torch.no_grad():
        eager.bias.copy_(_x(8, seed=1))
    x = _x(5, 8)
    torch.testing.assert_close(torch.jit.script(eager)(x), eager(x), rtol=0, atol=0)


def test_scripted_bias_dropout_add_draws_the_eager_mask_and_is_identity_in_eval():
    eager = tnn.BiasDropoutAdd(8, p=0.3)
    scripted = torch.jit.script(eager)
    x, r = _x(6, 8), _x(6, 8, seed=1)
    torch.manual_seed(7)
    want = eager(x, r)
    torch.manual_seed(7)
    torch.testing.assert_close(scripted(x, r), want, rtol=0, atol=0)
    scripted.eval()  # switching the scripted module, as users do
    torch.testing.assert_close(scripted(x, r), x + r, rtol=0, atol=0)
