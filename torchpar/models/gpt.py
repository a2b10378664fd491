"""A GPT (decoder-only transformer, Radford et al. 2019) written with plain ``nn`` modules, the
model of issue 20's 3D-parallel training.

Activations are ``[seq, batch, hidden]``, the layout of torchpar's tensor-parallel layers, and
the module names are the ones ``tensor_parallel_plan`` and the pipeline cut of
``torchpar.models.parallel_gpt`` address, so the same object runs on one process and, after
``parallelize``, sharded::

    tok_emb, pos_emb, drop, blocks[i].{ln1, attn.{q,k,v,out}_proj, ln2, mlp.{fc1, fc2}}, ln_f, lm_head

Where the model has the pattern of one of torchpar's fused kernels it calls it, in the dense
model and in the parallel one alike (so both run the same arithmetic): LayerNorm, fc1's bias
with the GeLU (``bias_gelu``), and the bias of out_proj / fc2 with dropout and the residual add
(``bias_dropout_add``). Those linears' matmuls run without their bias; the bias goes to the
kernel (a tensor-parallel layer hands it back with Megatron's ``skip_bias_add``).
"""
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from torchpar.nn import LayerNorm
from torchpar.nn import functional as TF

RECOMPUTE = ("none", "selective", "full")


@dataclass
class GPTConfig:
    """Defaults: byte-level, 6 layers of width 384, 10.8M parameters."""
    vocab_size: int = 256
    seq_len: int = 256
    hidden: int = 384
    heads: int = 6
    layers: int = 6
    dropout: float = 0.0
    tie_embeddings: bool = False

    @classmethod
    def tiny(cls, **overrides):
        """The tests' model: 4 layers of width 32 (every layout of 4 ranks can split it)."""
        return cls(**{**dict(seq_len=16, hidden=32, heads=4, layers=4), **overrides})

    def to_dict(self):
        return asdict(self)


def _matmul_and_bias(linear, x):
    """(x @ W^T, bias) for a fused kernel to add the bias: a dense ``nn.Linear`` skips its bias
    here; a tensor-parallel layer made with ``skip_bias_add`` returns the pair itself. Any other
    layer has added its bias already: (output, None)."""
    if type(linear) is nn.Linear:
        return F.linear(x, linear.weight), linear.bias
    out = linear(x)
    return out if isinstance(out, tuple) else (out, None)


def _bias_dropout_add(out, bias, residual, p, training):
    if bias is None:
        return residual + F.dropout(out, p, training)
    return TF.bias_dropout_add(out, bias, residual, p, training)


class Attention(nn.Module):
    """Causal multi-head self-attention. The local head count is read from q_proj's output, so
    the same code runs on a tensor-parallel shard of the heads."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(cfg.hidden, cfg.hidden) for _ in range(4))
        self.dropout = cfg.dropout
        self.recompute_core = False  # selective recomputation (set by GPT.set_recompute)

    def core(self, q, k, v):
        """softmax(q k^T / sqrt(d)) v on [s, b, local heads * d]: the part whose activations are
        large (s^2 per head) and cheap to recompute (Korthikanti et al. 2022, section 5)."""
        s, b = q.shape[:2]
        q, k, v = (t.reshape(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)

    def forward(self, x):
        """Returns (out_proj's matmul, its bias): the bias is added with the residual."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.recompute_core and torch.is_grad_enabled():
            o = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            o = self.core(q, k, v)
        return _matmul_and_bias(self.out_proj, o)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x):
        """Returns (fc2's matmul, its bias), as Attention does."""
        h, bias = _matmul_and_bias(self.fc1, x)
        h = F.gelu(h) if bias is None else TF.bias_gelu(h, bias)
        return _matmul_and_bias(self.fc2, h)


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = LayerNorm(cfg.hidden), Attention(cfg)
        self.ln2, self.mlp = LayerNorm(cfg.hidden), MLP(cfg)
        self.dropout = cfg.dropout
        self.recompute = False  # full recomputation of the block (set by GPT.set_recompute)

    def _forward(self, x):
        x = _bias_dropout_add(*self.attn(self.ln1(x)), x, self.dropout, self.training)
        return _bias_dropout_add(*self.mlp(self.ln2(x)), x, self.dropout, self.training)

    def forward(self, x):
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPTParts:
    """The embedding and the head, shared by GPT and a pipeline stage holding the same modules
    under the same names (``torchpar.models.parallel_gpt``)."""

    def embed(self, idx):
        """Token ids [s, b] -> [s, b, hidden] (under sequence parallelism, tok_emb returns this
        rank's slice [s/tp, b, hidden] and this rank adds the matching positions)."""
        x = self.tok_emb(idx)
        s_local = x.shape[0]
        start = 0
        # Decided by the module, not by comparing shapes, so that torch.fx can trace this
        # (pipeline split of a GPT).
        if getattr(self.tok_emb, "sequence_parallel", False):  # slice `rank` of tp along the sequence
            start = self.tok_emb.rank * s_local
        pos = torch.arange(start, start + s_local, device=idx.device)
        return self.drop(x + self.pos_emb(pos).unsqueeze(1))

    def head(self, x):
        """[s, b, hidden] -> logits [s, b, vocab] (the local vocabulary slice when lm_head is
        column-parallel)."""
        return self.lm_head(self.ln_f(x))


class GPT(GPTParts, nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"GPTConfig: hidden {cfg.hidden} is not a multiple of heads {cfg.heads}")
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def _init(self, m):
        # GPT-2's: N(0, 0.02) weights, zero biases.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def set_recompute(self, mode: str):
        """Activation recomputation: "selective" recomputes each attention core in backward,
        "full" each whole block, "none" nothing."""
        set_recompute(self.blocks, mode)
        return self

    def forward(self, idx):
        """Token ids [s, b] -> logits [s, b, vocab]."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def set_recompute(blocks, mode):
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {mode!r}")
    for block in blocks:
        block.recompute = mode == "full"
        block.attn.recompute_core = mode == "selective"


def num_parameters(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
