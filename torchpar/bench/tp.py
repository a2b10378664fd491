"""``python -m torchpar.bench tp``: forward+backward of a GPT block, tensor-parallel, torchpar's
layers beside PyTorch's own DTensor tensor parallelism, in the same run.

One dense pre-LayerNorm GPT block (``ln1, attn(q, k, v, out), ln2, mlp(fc1, gelu, fc2)``,
``[s, b, h]``) is built from one seed and made tensor-parallel two ways, each in the same ranks:

- ``ours``     ParallelSelfAttention / ParallelMLP ``from_dense`` (C++ region operators, the
               backward's input-gradient reduction overlapped with the weight gradient, fused
               bias+GeLU, bias+dropout+add, LayerNorm), sequence-parallel LayerNorms with ``--sp``;
- ``dtensor``  ``torch.distributed.tensor.parallel.parallelize_module`` with ColwiseParallel /
               RowwiseParallel, plus SequenceParallel and PrepareModuleInput under sequence
               parallelism (Shard(0): the same [s, b, h] layout).

at each ``--tp`` on each backend (torchpar, gloo), with and without sequence parallelism; modes
run in interleaved rounds so drift in machine load hits them alike. It also reports the bytes
each rank sends per step in our layers (ring-algorithm accounting) beside the analytic count,
and strong scaling: ours at tp=1 and tp=2 at ``--scaling-width`` (one thread per rank).
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
from torch.nn import functional as F

from torchpar.bench._report import print_table, pyplot, write_json
from torchpar.bench._spawn import run_ranks


class Attention(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.num_heads, self.head_dim = heads, h // heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        s, b = q.shape[:2]
        q, k, v = (t.reshape(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(o.permute(2, 0, 1, 3).reshape(s, b, -1))


class MLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """The dense block, written as a user would, for DTensor's parallelize_module."""

    def __init__(self, h, heads):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(h), Attention(h, heads), nn.LayerNorm(h), MLP(h)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class OurBlock(nn.Module):
    """The same block from torchpar's layers."""

    def __init__(self, dense, group, sp):
        super().__init__()
        from torchpar.nn import LayerNorm
        from torchpar.parallel.tensor import ParallelMLP, ParallelSelfAttention, mark_sequence_parallel
        self.ln1, self.ln2 = LayerNorm(dense.ln1.normalized_shape), LayerNorm(dense.ln2.normalized_shape)
        self.ln1.load_state_dict(dense.ln1.state_dict())
        self.ln2.load_state_dict(dense.ln2.state_dict())
        if sp:
            mark_sequence_parallel(self.ln1, group)
            mark_sequence_parallel(self.ln2, group)
        self.attn = ParallelSelfAttention.from_dense(dense.attn, group, sequence_parallel=sp)
        self.mlp = ParallelMLP.from_dense(dense.mlp, group, sequence_parallel=sp)

    def forward(self, x):
        x = self.attn(self.ln1(x), residual=x)
        return self.mlp(self.ln2(x), residual=x)


def _dtensor_block(dense, tp, sp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    mesh = init_device_mesh("cpu", (tp,))
    plan = {f"attn.{n}_proj": ColwiseParallel() for n in "qkv"}
    plan["mlp.fc1"] = ColwiseParallel()
    if sp:
        plan.update({
            "ln1": SequenceParallel(sequence_dim=0, use_local_output=True),
            "ln2": SequenceParallel(sequence_dim=0, use_local_output=True),
            "attn": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
            "attn.out_proj": RowwiseParallel(output_layouts=Shard(0)),
            "mlp.fc2": RowwiseParallel(output_layouts=Shard(0)),
        })
    else:
        plan.update({"attn.out_proj": RowwiseParallel(), "mlp.fc2": RowwiseParallel()})
    return parallelize_module(copy.deepcopy(dense), mesh, plan)


def analytic_bytes(s, b, h, tp, sp, elem=4):
    """Bytes each rank sends per forward+backward of our block, ring accounting (see
    csrc/parallel/tensor_parallel.h): without SP four all-reduces of [s, b, h] (attention
    and MLP output forward, their inputs' gradients backward); with SP four reduce-scatters
    of [s, b, h] (the same four), six all-gathers of a [s/tp, b, h] shard (two forward, the
    two inputs again in backward, the two row layers' output gradients) and the all-reduce
    of the 6 replicated vectors of length h whose gradients are partial sums (two LayerNorms'
    weight and bias, the two row layers' biases)."""
    if tp == 1:
        return 0
    act = s * b * h * elem
    if not sp:
        return 4 * act * 2 * (tp - 1) / tp
    return 4 * act * (tp - 1) / tp + 6 * (act / tp) * (tp - 1) + 6 * h * elem * 2 * (tp - 1) / tp


def _measure(rank, world, args, modes):
    torch.set_num_threads(args.threads)
    from torchpar import _C
    group = dist.group.WORLD
    torch.manual_seed(0)
    dense = Block(args.width, args.heads)
    x = torch.randn(args.seq, args.batch, args.width)
    shard = x.chunk(world, 0)[rank].contiguous()
    runs = {}
    for mode in modes:
        impl, sp = mode.split("/")[0], mode.endswith("/sp")
        model = OurBlock(dense, group, sp) if impl == "ours" else _dtensor_block(dense, world, sp)
        inp = (shard if sp else x).clone().requires_grad_(True)

        def step(model=model, inp=inp):
            model.zero_grad(set_to_none=True)
            inp.grad = None
            model(inp).sum().backward()
        runs[mode] = step
    samples = {m: [] for m in modes}
    cpu = {m: [] for m in modes}  # this process's CPU seconds (all its threads): load-independent work
    bytes_per_step = {}
    for round_ in range(args.rounds):
        order = modes[round_ % len(modes):] + modes[:round_ % len(modes)]
        for mode in order:
            for _ in range(args.warmup if round_ == 0 else 0):
                runs[mode]()
            dist.barrier(group)
            for _ in range(args.steps):
                _C.tp_reset_bytes_communicated()
                t0, c0 = time.perf_counter(), time.process_time()
                runs[mode]()
                samples[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
                bytes_per_step[mode] = _C.tp_bytes_communicated()
    return {m: {"median_ms": statistics.median(s) * 1e3, "min_ms": min(s) * 1e3,
                "cpu_ms": statistics.median(cpu[m]) * 1e3,
                "bytes": bytes_per_step[m] if m.startswith("ours") else None}
            for m, s in samples.items()}


def _run(backend, world, args, modes):
    return run_ranks(_measure, world, backend, (world, args, modes), timeout=args.timeout,
                     label=f"{backend} tp={world}")


def _modes(tp):
    modes = ["ours/tp", "ours/sp"] if tp > 1 else ["ours/tp"]
    return modes + (["dtensor/tp", "dtensor/sp"] if tp > 1 else ["dtensor/tp"])


def _plot(results, path):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (backend, per_tp) in zip(axes[0], results.items()):
        tps = sorted(int(t) for t in per_tp)
        for mode in ["ours/tp", "ours/sp", "dtensor/tp", "dtensor/sp"]:
            pts = [(t, per_tp[str(t)][mode]["median_ms"]) for t in tps if mode in per_tp[str(t)]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xticks(tps)
        ax.set_xlabel("tensor-parallel size")
        ax.set_ylabel("fwd+bwd of one block (ms, median)")
        ax.set_title(f"{backend} backend")
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m torchpar.bench tp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="torchpar,gloo")
    ap.add_argument("--tp", default="1,2,4", help="tensor-parallel sizes")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per mode per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--scaling-width", type=int, default=2048,
                    help="width of the strong-scaling run (ours, torchpar, tp=1 and 2); 0 skips it")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--plot", help="write a PNG here")
    args = ap.parse_args(argv)

    import torchpar
    load = os.getloadavg()
    meta = {k: getattr(args, k) for k in ("width", "heads", "seq", "batch", "threads", "steps", "rounds")}
    meta.update(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), torch=torch.__version__,
                load_before=load[0], cpus=os.cpu_count())
    tps = [int(t) for t in args.tp.split(",")]
    backends = [b for b in args.backends.split(",") if b]
    if "torchpar" in backends and not hasattr(torchpar._C, "ProcessGroupTorchpar"):
        backends.remove("torchpar")
    results = {}
    for backend in backends:
        results[backend] = {}
        for tp in tps:
            print(f"running {backend} tp={tp} ...", file=sys.stderr, flush=True)
            results[backend][str(tp)] = _run(backend, tp, args, _modes(tp))

    rows = []
    for backend, per_tp in results.items():
        for tp in tps:
            r = per_tp[str(tp)]
            for sp in ("tp", "sp") if tp > 1 else ("tp",):
                ours, theirs = r[f"ours/{sp}"], r[f"dtensor/{sp}"]
                want = analytic_bytes(args.seq, args.batch, args.width, tp, sp == "sp")
                rows.append([backend, tp, "yes" if sp == "sp" else "no", f"{ours['median_ms']:.1f}",
                             f"{theirs['median_ms']:.1f}", f"{theirs['median_ms'] / ours['median_ms']:.2f}x",
                             f"{ours['bytes'] / 2**20:.3f}", f"{want / 2**20:.3f}",
                             "yes" if abs(ours["bytes"] - want) < 1 else "NO"])
    print_table(f"GPT block fwd+bwd, width {args.width}, seq {args.seq}, batch {args.batch}, "
                f"{args.heads} heads, fp32, {args.threads} thread(s)/rank, median of "
                f"{args.steps * args.rounds} steps (ms); MiB sent per rank per step",
                ["backend", "tp", "SP", "ours", "DTensor", "DTensor/ours", "MiB ours", "MiB analytic", "equal"],
                rows)

    scaling = None
    if args.scaling_width and "torchpar" in backends:
        sargs = copy.copy(args)
        sargs.width, sargs.threads = args.scaling_width, 1
        scaling = {}
        for tp in (1, 2):
            print(f"running scaling width {sargs.width} tp={tp} ...", file=sys.stderr, flush=True)
            scaling[str(tp)] = _run("torchpar", tp, sargs, ["ours/tp"])["ours/tp"]
        speedup = scaling["1"]["median_ms"] / scaling["2"]["median_ms"]
        print_table(f"strong scaling, ours, torchpar backend, width {sargs.width}, seq {args.seq}, 1 thread/rank",
                    ["tp", "median ms", "min ms", "speed-up vs tp=1", "CPU ms rank 0", "CPU ratio vs tp=1"],
                    [[tp, f"{scaling[tp]['median_ms']:.1f}", f"{scaling[tp]['min_ms']:.1f}",
                      f"{scaling['1']['median_ms'] / scaling[tp]['median_ms']:.2f}x",
                      f"{scaling[tp]['cpu_ms']:.1f}", f"{scaling['1']['cpu_ms'] / scaling[tp]['cpu_ms']:.2f}x"]
                     for tp in ("1", "2")])
        print("CPU ms: rank 0's CPU time per step (all its threads, spinning waits included); on a machine "
              "with a free core per rank, wall time follows it.")
        scaling["speedup"] = speedup
    meta["load_after"] = os.getloadavg()[0]
    print(f"{meta['date']}, torch {meta['torch']}, {meta['cpus']} CPUs, load average "
          f"{meta['load_before']:.2f} before / {meta['load_after']:.2f} after the run")
    if args.json:
        write_json(args.json, {"meta": meta, "results": results, "scaling": scaling})
    if args.plot:
        _plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
