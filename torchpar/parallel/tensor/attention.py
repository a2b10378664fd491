"""Tensor-parallel self-attention: heads split across ranks (Megatron-LM, arXiv:1909.08053,
figure 3b).

The fused q/k/v projection is column-parallel with stride 3, so that rank r holds the q, k
and v rows of its heads ``[r nh/tp, (r+1) nh/tp)``; each rank runs
``F.scaled_dot_product_attention`` on its heads alone, and the output projection is
row-parallel. One all-reduce forward and one backward (under sequence parallelism an all-gather
before and a reduce-scatter after).

Dropout on the attention probabilities acts on this rank's heads, so it draws from the
model-parallel stream of ``torchpar.parallel.tensor.random`` (a mask per rank); dropout on the
output does too under sequence parallelism (a sequence shard), and otherwise draws from the
default generator, the same mask on every rank of the replicated output.
"""
import torch
from torch import nn
from torch.nn import functional as F

from torchpar.parallel.tensor import comm
from torchpar.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from torchpar.parallel.tensor.random import bias_dropout_add, fork_if


def _dense_projections(module):
    """(Wq, Wk, Wv, bq, bk, bv, out_proj, num_heads) of a dense attention block, or TypeError."""
    if isinstance(module, nn.MultiheadAttention):
        if (module.batch_first or not module._qkv_same_embed_dim or module.bias_k is not None
                or module.add_zero_attn):
            raise TypeError("ParallelSelfAttention.from_dense: nn.MultiheadAttention must have "
                            "batch_first=False ([s, b, h]), no kdim/vdim, no add_bias_kv and no add_zero_attn")
        w = module.in_proj_weight.chunk(3, 0)
        b = module.in_proj_bias.chunk(3, 0) if module.in_proj_bias is not None else (None,) * 3
        return (*w, *b, module.out_proj, module.num_heads)
    names = ("q_proj", "k_proj", "v_proj", "out_proj")
    heads = getattr(module, "num_heads", getattr(module, "n_head", None))
    if all(isinstance(getattr(module, n, None), nn.Linear) for n in names) and heads:
        q, k, v, o = (getattr(module, n) for n in names)
        return q.weight, k.weight, v.weight, q.bias, k.bias, v.bias, o, heads
    raise TypeError(f"ParallelSelfAttention.from_dense: {type(module).__name__} is neither an "
                    "nn.MultiheadAttention nor a module with q_proj/k_proj/v_proj/out_proj nn.Linear and num_heads")


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention on ``x [s, b, hidden_size]`` (``[s/tp, b, hidden_size]`` with
    ``sequence_parallel``, and so is the output), ``num_attention_heads`` split across ``group``.
    Causal by default; computes what ``nn.MultiheadAttention(hidden_size, num_attention_heads)``
    computes with a causal mask."""

    def __init__(self, hidden_size, num_attention_heads, bias=True, causal=True, attention_dropout=0.0,
                 dropout=0.0, sequence_parallel=False, group=None, dtype=None, *, _dense=None):
        super().__init__()
        self.group = comm.resolve_group(group)
        self.rank, self.tp = comm.group_rank_and_size(self.group)
        comm.check_divisible(hidden_size, num_attention_heads,
                             "ParallelSelfAttention hidden_size by num_attention_heads: hidden_size")
        comm.check_divisible(num_attention_heads, self.tp, "ParallelSelfAttention num_attention_heads")
        self.hidden_size, self.num_heads = hidden_size, num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.local_heads = num_attention_heads // self.tp
        self.causal, self.attention_dropout, self.dropout = causal, attention_dropout, dropout
        if _dense is None:
            qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=bias, dtype=dtype)
            proj = nn.Linear(hidden_size, hidden_size, bias=bias, dtype=dtype)
            wq, wk, wv = qkv.weight.chunk(3, 0)
            bq, bk, bv = qkv.bias.chunk(3, 0) if bias else (None,) * 3
            _dense = (wq, wk, wv, bq, bk, bv, proj)
        wq, wk, wv, bq, bk, bv, proj = _dense
        qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=bq is not None, dtype=wq.dtype)
        with torch.no_grad():
            qkv.weight.copy_(torch.cat([wq, wk, wv]))
            if bq is not None:
                qkv.bias.copy_(torch.cat([bq, bk, bv]))
        self.qkv = ColumnParallelLinear.from_dense(qkv, self.group, sequence_parallel=sequence_parallel, stride=3)
        self.proj = RowParallelLinear.from_dense(proj, self.group, sequence_parallel=sequence_parallel,
                                                 skip_bias_add=True)
        self.proj.check_input_sizes = False  # qkv has checked them: proj's input derives from qkv's output

    @classmethod
    def from_dense(cls, module: nn.Module, group=None, *, causal=True, sequence_parallel=False, dropout=0.0):
        """Shards ``module``: an ``nn.MultiheadAttention`` (batch_first=False) or any module
        with ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (``nn.Linear``) and ``num_heads``."""
        wq, wk, wv, bq, bk, bv, out_proj, heads = _dense_projections(module)
        attention_dropout = module.dropout if isinstance(module, nn.MultiheadAttention) else 0.0
        return cls(out_proj.in_features, heads, out_proj.bias is not None, causal, attention_dropout, dropout,
                   sequence_parallel, group, wq.dtype, _dense=(wq, wk, wv, bq, bk, bv, out_proj))

    @torch.no_grad()
    def to_dense(self) -> nn.MultiheadAttention:
        """The whole block as an ``nn.MultiheadAttention`` (a collective; causality is the
        caller's attn_mask there)."""
        qkv, proj = self.qkv.to_dense(), self.proj.to_dense()
        out = nn.MultiheadAttention(self.hidden_size, self.num_heads, dropout=self.attention_dropout,
                                    bias=qkv.bias is not None, dtype=qkv.weight.dtype)
        out.in_proj_weight.copy_(qkv.weight)
        out.out_proj.weight.copy_(proj.weight)
        if qkv.bias is not None:
            out.in_proj_bias.copy_(qkv.bias)
            out.out_proj.bias.copy_(proj.bias)
        return out

    def forward(self, x, residual=None):
        qkv = self.qkv(x)  # [s, b, 3 * local_heads * head_dim], the whole sequence
        if qkv.dim() != 3:
            raise ValueError(f"ParallelSelfAttention: input must be [s, b, hidden]; got {tuple(x.shape)}")
        s, b = qkv.shape[:2]
        q, k, v = (t.reshape(s, b, self.local_heads, self.head_dim).permute(1, 2, 0, 3)
                   for t in qkv.chunk(3, -1))
        p = self.attention_dropout if self.training else 0.0
        with fork_if(p > 0 and self.tp > 1):  # this rank's heads: masks of their own
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=p)
        o = o.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        out, bias = self.proj(o)
        return bias_dropout_add(out, bias, residual, self.dropout, self.training, split=self.proj.sequence_parallel)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads} ({self.local_heads} on this "
                f"rank of {self.tp}), causal={self.causal}")
