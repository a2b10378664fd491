"""torchpar.models.GPT (issue 20) on one process: the fused kernels compute what the plain
modules would, and recomputation ("selective", "full") changes no gradient."""
import copy

import pytest
import torch
from torch.nn import functional as F

from torchpar.models import GPT, GPTConfig


def _unfused_forward(m, idx):
    s = idx.shape[0]
    x = m.tok_emb(idx) + m.pos_emb(torch.arange(s)).unsqueeze(1)
    for blk in m.blocks:
        a = blk.attn
        h = F.layer_norm(x, (x.shape[-1],), blk.ln1.weight, blk.ln1.bias)
        x = x + a.out_proj(a.core(a.q_proj(h), a.k_proj(h), a.v_proj(h)))
        h = F.layer_norm(x, (x.shape[-1],), blk.ln2.weight, blk.ln2.bias)
        x = x + blk.mlp.fc2(F.gelu(blk.mlp.fc1(h)))
    return m.lm_head(F.layer_norm(x, (x.shape[-1],), m.ln_f.weight, m.ln_f.bias))


def test_gpt_equals_unfused_modules():
    torch.manual_seed(0)
    m = GPT(GPTConfig.tiny())
    idx = torch.randint(0, 256, (16, 3))
    torch.testing.assert_close(m(idx), _unfused_forward(m, idx), rtol=1e-5, atol=1e-5)
    assert m(idx).shape == (16, 3, 256)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_same_gradients(mode):
    torch.manual_seed(0)
    ref = GPT(GPTConfig.tiny())
    m = copy.deepcopy(ref).set_recompute(mode)
    idx, tgt = torch.randint(0, 256, (16, 2)), torch.randint(0, 256, (16, 2))
    for model in (ref, m):
        F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()).backward()
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=lambda s: f"{name}: {s}")


def test_bad_config():
    with pytest.raises(ValueError, match="hidden 30 is not a multiple of heads 4"):
        GPT(GPTConfig.tiny(hidden=30))
    with pytest.raises(ValueError, match="recompute must be one of"):
        GPT(GPTConfig.tiny()).set_recompute("some")


def test_a_model_built_on_meta_draws_no_random_numbers():
    """examples/train_gpt.py counts parameters this way on rank 0 after the dropout streams are
    seeded: a CPU model there drew from rank 0's generator alone, and under tp > 1 its dropout
    masks then differed from its peer's (replicated weights drifted apart; audit finding)."""
    state = torch.random.get_rng_state()
    with torch.device("meta"):
        GPT(GPTConfig.tiny())
    assert torch.equal(state, torch.random.get_rng_state())
