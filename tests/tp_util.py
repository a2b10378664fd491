"""Shared pieces of the tensor-parallel tests: the group to use per backend, sharding of
dense gradients for comparison, and a small seq-first GPT written with plain nn modules."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from torchpar.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

BACKENDS = ["torchpar", "gloo"]


def group_for(ctx, backend):
    """The world group of the pool on `backend` (the pools are torchpar pools; gloo is ctx.gloo)."""
    return ctx.pg if backend == "torchpar" else ctx.gloo


def tolerances(dtype):
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=4e-2, atol=4e-2)


def seq_shard(t, rank, tp):
    return t.chunk(tp, 0)[rank]


def expected_param_grads(tp_model, dense_model, rank, tp):
    """(name, tp parameter, the matching shard of the dense model's parameter) for every
    tensor-parallel model, where shard(t) is this rank's part of a tensor shaped like the dense
    parameter (its value or its gradient); parallelize and from_dense keep module names."""
    out = []
    for name, module in tp_model.named_modules():
        dense = dense_model.get_submodule(name)
        for pname, p in module.named_parameters(recurse=False):
            shard = lambda t: t  # noqa: E731
            if isinstance(module, ColumnParallelLinear):  # each of its `stride` fused blocks split
                shard = lambda t, n=module.stride: torch.cat(  # noqa: E731
                    [b.chunk(tp, 0)[rank] for b in t.chunk(n, 0)])
            elif isinstance(module, VocabParallelEmbedding):
                shard = lambda t: t.chunk(tp, 0)[rank]  # noqa: E731
            elif isinstance(module, RowParallelLinear) and pname == "weight":
                shard = lambda t: t.chunk(tp, 1)[rank]  # noqa: E731
            out.append((f"{name}.{pname}", p, getattr(dense, pname), shard))
    return out


class Attention(nn.Module):
    """Plain causal self-attention on [s, b, h]; reads its local head count from the
    projection's output, so it runs unchanged on tensor-parallel shards. With ``fused_qkv``
    one ``qkv = nn.Linear(h, 3h)`` projects q, k and v side by side (GPT-2's c_attn)."""

    def __init__(self, hidden, heads, fused_qkv=False):
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        if fused_qkv:
            self.qkv = nn.Linear(hidden, 3 * hidden)
        else:
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).chunk(3, -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        s, b = q.shape[:2]
        q, k, v = (t.reshape(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(o.permute(2, 0, 1, 3).reshape(s, b, -1))


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden, heads, fused_qkv=False):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads, fused_qkv)
        self.ln2, self.mlp = nn.LayerNorm(hidden), MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids [s, b] -> logits [s, b, vocab] (no position embedding: causal attention
    alone orders the tokens, enough for equivalence tests)."""

    def __init__(self, vocab=32, hidden=16, heads=4, layers=2, fused_qkv=False):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, fused_qkv) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_plan(sequence_parallel, fused_qkv=False):
    plan = {
        "tok_emb": "vocab",
        **({"blocks.*.attn.qkv": "colwise:3"} if fused_qkv else {"blocks.*.attn.[qkv]_proj": "colwise"}),
        "blocks.*.attn.out_proj": "rowwise",
        "blocks.*.mlp.fc1": "colwise",
        "blocks.*.mlp.fc2": "rowwise",
        "lm_head": "colwise",
    }
    if sequence_parallel:
        plan.update({"blocks.*.ln[12]": "sequence", "ln_f": "sequence"})
    return plan


def dense_loss(logits, target):
    return F.cross_entropy(logits.float().flatten(0, -2), target.flatten())


def new_groups(ranks_list, backend):
    """One new group per rank list (every rank creates all of them, in the same order);
    returns the group holding this rank."""
    mine = None
    for ranks in ranks_list:
        g = dist.new_group(ranks, backend=None if backend == "torchpar" else "gloo")
        if dist.get_rank() in ranks:
            mine = g
    return mine
