"""Porting a model to torchpar's fused kernels: a GPT-style transformer built from torch's
modules, and the same model with torchpar.nn.LayerNorm, BiasGeLU and BiasDropoutAdd.

    python examples/fused_gpt_block.py                    # train both side by side and time them
    python examples/fused_gpt_block.py --dtype bfloat16
    python examples/fused_gpt_block.py --dropout 0        # also check the losses agree

Each fused op takes over the bias of the Linear before it: `Linear(d, 4d)` then GeLU becomes
`Linear(d, 4d, bias=False)` then `BiasGeLU(4d)`, and a projection, its dropout and the residual
add become `Linear(..., bias=False)` then `BiasDropoutAdd(d)`. LayerNorm is a drop-in. So a
checkpoint of the torch model loads into the fused one by renaming those biases
(`fused_state_dict` below). Both models then train from the same weights. Without dropout
their losses agree step for step (float32: to rounding; bfloat16: to its precision), which
the script checks, as it checks first that the two compute the same logits; with dropout the
two draw different masks. The step times show what fusing saves in a whole model: on a CPU
the matrix products take most of a step (about 85 % here), and the fused ops save most of
the rest where dropout is on, since torch's dropout draws a float per element.
"""
import argparse
import time

import torch
import torch.nn.functional as TF
from torch import nn

import torchpar.nn as tnn


class Attention(nn.Module):
    def __init__(self, d, heads, proj_bias):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=proj_bias)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TorchBlock(nn.Module):
    """Pre-LayerNorm transformer block from torch's modules."""

    def __init__(self, d, heads, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, proj_bias=True)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.fc2(TF.gelu(self.fc1(self.ln2(x)))))


class FusedBlock(nn.Module):
    """The same block on torchpar's fused ops; each fused op holds the bias of the Linear
    before it."""

    def __init__(self, d, heads, dropout):
        super().__init__()
        self.ln1, self.ln2 = tnn.LayerNorm(d), tnn.LayerNorm(d)
        self.attn = Attention(d, heads, proj_bias=False)
        self.attn_out = tnn.BiasDropoutAdd(d, p=dropout)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
        self.act = tnn.BiasGeLU(4 * d)
        self.mlp_out = tnn.BiasDropoutAdd(d, p=dropout)

    def forward(self, x):
        x = self.attn_out(self.attn(self.ln1(x)), x)
        return self.mlp_out(self.fc2(self.act(self.fc1(self.ln2(x)))), x)


class GPT(nn.Module):
    def __init__(self, block, vocab, d, heads, layers, seq, dropout):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(block(d, heads, dropout) for _ in range(layers))
        self.ln_f = (tnn.LayerNorm if block is FusedBlock else nn.LayerNorm)(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# Where each torch bias lives in a fused block.
BIAS_MOVES = {"attn.proj.bias": "attn_out.bias", "fc1.bias": "act.bias", "fc2.bias": "mlp_out.bias"}


def fused_state_dict(torch_state):
    """A TorchBlock-based GPT's state_dict, keyed for the FusedBlock-based one: in each block
    (`blocks.<i>.`), the biases of BIAS_MOVES move; every other key stays."""
    out = {}
    for key, value in torch_state.items():
        parts = key.split(".", 2)
        if len(parts) == 3 and parts[0] == "blocks" and parts[2] in BIAS_MOVES:
            key = f"blocks.{parts[1]}.{BIAS_MOVES[parts[2]]}"
        out[key] = value
    return out


def check_port(reference, fused, idx):
    """The ported model computes what the original does: the same logits in float32 and eval
    mode (no dropout), to float32 rounding. Every bias has the same shape, so a misplaced one
    would load without complaint: this is what catches it."""
    with torch.no_grad():
        want, got = reference.eval()(idx), fused.eval()(idx)
    reference.train()
    fused.train()
    worst = ((got - want).abs().max() / want.abs().max()).item()
    if worst > 1e-5:
        raise SystemExit(f"the ported model's logits differ: {worst:.1e} relative")
    print(f"ported model checked: float32 logits agree to {worst:.1e}")


def train(model, batches, lr, label):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    for step, (idx, target) in enumerate(batches):
        t0 = time.perf_counter()
        logits = model(idx)
        loss = TF.cross_entropy(logits.flatten(0, 1), target.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step % max(1, len(batches) // 5) == 0 or step == len(batches) - 1:
            print(f"  {label:8s} step {step:3d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:7.1f} ms", flush=True)
    return losses, times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--lr", type=float, default=3e-4)
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    dims = (args.vocab, args.width, args.heads, args.layers, args.seq, args.dropout)
    reference = GPT(TorchBlock, *dims)
    fused = GPT(FusedBlock, *dims)
    fused.load_state_dict(fused_state_dict(reference.state_dict()))  # strict: every key maps
    n_params = sum(prm.numel() for prm in reference.parameters())
    print(f"GPT: {args.layers} blocks, width {args.width}, {n_params / 1e6:.1f}M parameters, "
          f"{args.dtype}, dropout {args.dropout}, {torch.get_num_threads()} threads")

    g = torch.Generator().manual_seed(1)
    data = torch.randint(args.vocab, (args.steps, args.batch, args.seq + 1), generator=g)
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    check_port(reference, fused, batches[0][0])
    reference, fused = reference.to(dtype), fused.to(dtype)
    results = {}
    for label, model in (("torch", reference), ("torchpar", fused)):
        torch.manual_seed(2)
        results[label] = train(model, batches, args.lr, label)

    (l_ref, t_ref), (l_fused, t_fused) = results["torch"], results["torchpar"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(l_ref, l_fused))
    if args.dropout == 0:
        # float32: rounding alone (1e-7 seen); bfloat16 rounds each op's output to 8 bits, so
        # two correct models drift apart by ~1e-3 over steps (0 seen on this machine).
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        verdict = "losses match" if worst <= tol else "LOSSES DIFFER"
        print(f"{verdict}: worst relative difference {worst:.1e} over {args.steps} steps (tolerance {tol:.0e})")
        if worst > tol:
            raise SystemExit(1)
    else:
        print(f"with dropout the masks differ; worst relative loss difference {worst:.1e}")
    # The first steps warm up allocators and caches: time the rest.
    skip = min(3, max(0, args.steps - 3))
    med = lambda ts: sorted(ts[skip:])[len(ts[skip:]) // 2]  # noqa: E731
    print(f"median step: torch {med(t_ref) * 1e3:.1f} ms, torchpar {med(t_fused) * 1e3:.1f} ms "
          f"({med(t_ref) / med(t_fused):.2f}x)")


if __name__ == "__main__":
    main()
