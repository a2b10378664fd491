"""``python -m torchpar.bench zero``: ZeRO-1 and ZeRO-2 beside DDP and torch's ZeRO.

Spawns ``--world-size`` ranks per backend and, in the same ranks, trains a GPT-like MLP stack
(pre-LayerNorm residual blocks of Linear(d, 4d), GELU, Linear(4d, d)) with AdamW under each
system of ``torchpar/bench/_zero_systems.py``. Reports per rank: the median step time
(forward, backward, gradient reduction, optimizer step, parameter all-gather), the bytes of
optimizer-state tensors, and the bytes of gradients left after backward. The issue's target:
ZeRO-1 optimizer-state memory 1/W of DDP's.

Systems run in interleaved rounds so that drift in machine load hits all of them alike.
"""
import argparse
import copy
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
from torch import nn

from torchpar.bench._report import human_bytes, print_table, pyplot, write_json
from torchpar.bench._spawn import run_ranks


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def gpt_mlp(d, depth):
    return nn.Sequential(*[Block(d) for _ in range(depth)], nn.LayerNorm(d))


def _measure(rank, args):
    torch.set_num_threads(args.threads)
    from torchpar.bench._zero_systems import SYSTEMS, optimizer_state_bytes

    torch.manual_seed(0)
    model = gpt_mlp(args.width, args.depth)
    x = torch.randn(args.batch, args.seq, args.width)
    systems = {name: SYSTEMS[name](copy.deepcopy(model), dist.group.WORLD, 1e-4) for name in args.systems}
    grads = {}

    def step(name):
        net, opt = systems[name]
        opt.zero_grad()
        net(x).float().pow(2).mean().backward()
        grads[name] = sum(p.grad.nbytes for p in net.parameters() if p.grad is not None)
        opt.step()

    samples = {name: [] for name in systems}
    names = list(systems)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            step(name)  # warm-up: the first step also allocates the optimizer state
            dist.barrier()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(name)
                samples[name].append(time.perf_counter() - t0)
    state = {name: optimizer_state_bytes(opt) for name, (_, opt) in systems.items()}
    # Per rank: the largest over ranks (ZeRO shards differ by at most a parameter).
    t = torch.tensor([[state[n], grads[n]] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {name: {"step_ms": statistics.median(samples[name]) * 1e3, "min_ms": min(samples[name]) * 1e3,
                   "state_bytes": int(t[i, 0]), "grad_bytes": int(t[i, 1])}
            for i, name in enumerate(names)}


def _run_backend(backend, args):
    return run_ranks(_measure, args.world_size, backend, (args,), timeout=args.timeout, label=backend)


def _plot(results, path):
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    backends = list(results)
    names = list(next(iter(results.values())))
    width = 0.8 / len(backends)
    for j, backend in enumerate(backends):
        xs = [i + j * width for i in range(len(names))]
        left.bar(xs, [results[backend][n]["step_ms"] for n in names], width, label=backend)
        right.bar(xs, [results[backend][n]["state_bytes"] / 2 ** 20 for n in names], width, label=backend)
    for ax, label in ((left, "step time (ms, median)"), (right, "optimizer state per rank (MiB)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("ZeRO beside DDP and torch's ZeroRedundancyOptimizer")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m torchpar.bench zero", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="torchpar,gloo")
    ap.add_argument("--systems", default="ddp,zero1,zero2,torch-zero")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--depth", type=int, default=6, help="residual MLP blocks")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per system per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--plot", help="write a PNG bar chart here")
    args = ap.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]

    params = sum(p.numel() for p in gpt_mlp(args.width, args.depth).parameters())
    meta = {k: getattr(args, k) for k in ("world_size", "width", "depth", "batch", "seq", "threads",
                                          "steps", "rounds")}
    meta.update(params=params, date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, load=os.getloadavg()[0],
                command="python -m torchpar.bench zero " + " ".join(argv if argv is not None else sys.argv[1:]))
    results = {}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        print(f"running {backend} ...", file=sys.stderr, flush=True)
        results[backend] = _run_backend(backend, args)
    for backend, r in results.items():
        ddp_state = r.get("ddp", {}).get("state_bytes")
        peer = r.get("torch-zero", {}).get("step_ms")
        rows = [[name, f"{v['step_ms']:.1f}", f"{peer / v['step_ms']:.2f}x" if peer else "-",
                 human_bytes(v["state_bytes"]), f"{v['state_bytes'] / ddp_state:.3f}" if ddp_state else "-",
                 human_bytes(v["grad_bytes"])] for name, v in r.items()]
        print_table(f"{backend}, world size {args.world_size}: GPT-like MLP {args.depth}x{args.width} "
                    f"({params / 1e6:.1f}M params), AdamW, median of {args.steps * args.rounds} steps",
                    ["system", "step ms", "torch-zero/this", "opt state/rank", "state vs ddp",
                     "grads/rank"], rows)
    print(f"target: ZeRO state vs ddp = 1/W = {1 / args.world_size:.3f}. {meta['date']}, torch "
          f"{meta['torch']}, load average before the run {meta['load']:.2f}")
    if args.json:
        write_json(args.json, {"meta": meta, "results": results})
    if args.plot:
        _plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
