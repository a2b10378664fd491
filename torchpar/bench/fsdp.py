"""``python -m torchpar.bench fsdp``: fully sharded data parallel, torchpar's beside torch's FSDP2.

Spawns ``--world-size`` ranks per backend; in the same ranks, each system trains its own copy of
the same GPT (AdamW, next-token loss on random tokens):

- ``fsdp``         torchpar.parallel.fully_shard per block, then on the whole model
- ``torch_fsdp2``  torch.distributed.fsdp.fully_shard, the same way (DeviceMesh over the group)
- ``hsdp``, ``torch_hsdp``  the two with hybrid sharding on a (2 replicas, W/2 shards) mesh (only
  at an even world size of 4 or more)
- ``fsdp_prefetch2``, ``torch_fsdp2_prefetch2``  the first two with FSDP2's explicit prefetching,
  two blocks ahead in forward and backward (only when named in ``--systems``)
- ``fsdp_reshard_half``, ``torch_fsdp2_reshard_half``  the first two with ``reshard_after_forward
  = W/2``: backward all-gathers within halves of the ranks (with ``--hosts 2``, within each host;
  only when named in ``--systems``, at an even world size of 4 or more)
- whatever ``torchpar.bench._zero_systems.SYSTEMS`` adds when it exists (a dict
  name -> make(model, group, lr) -> (wrapped_model, optimizer): DDP, ZeRO-1/2, torch's ZeRO)

Step time: median over interleaved rounds (each round runs every system, in rotated order, so that
drift in machine load hits all alike). Peak memory per rank: one step run under torch's profiler
with memory profiling, whose allocation events (every CPU tensor allocation and free, the
systems' own buffers and activations included) give the highest bytes live during the step above
its start, plus the bytes live at its start (parameters, optimizer state) counted from the
system's tensors; and the same for forward and backward alone (without the optimizer step, whose
peak is the same for systems with the same shard sizes). All are rank 0's; ratios are against ``torch_fsdp2``.

``--hosts N`` runs the torchpar backend over N test hosts instead (network namespaces joined by a
bridge, as root: torchpar/bench/_hosts.py), ``--ranks-per-host`` each (default 2), once per link
(the plain veth, and ``tc tbf`` at ``--rate``): where hybrid sharding pays. Its mesh is (2,
W/2) over ranks numbered host by host, so with 2 hosts each shard group is one host and only the
replicas' all-reduce crosses the link (with more hosts, shard groups span several), e.g.::

    python -m torchpar.bench fsdp --hosts 2 --systems fsdp,torch_fsdp2,hsdp,torch_hsdp \
        --dim 256 --layers 4 --vocab 4096 --rounds 5
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

from torchpar.bench._hosts import add_arguments as add_host_arguments
from torchpar.bench._hosts import run_links, run_worker
from torchpar.bench._report import print_table, pyplot, write_json
from torchpar.bench._spawn import run_ranks


# ---- the model: a GPT-2-style decoder ----

class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


# ---- the systems: make(model, group, lr) -> (wrapped model, optimizer) ----

def _shard_blocks_then_root(fully_shard, model, lr, reshard_after_forward=True, **kwargs):
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)  # the root keeps its parameters for backward on both stacks
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _make_fsdp(model, group, lr, **kwargs):
    from torchpar.parallel import fully_shard
    return _shard_blocks_then_root(fully_shard, model, lr, group=group, **kwargs)


def _make_torch_fsdp2(model, group, lr, **kwargs):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    return _shard_blocks_then_root(fully_shard, model, lr, mesh=DeviceMesh.from_group(group, "cpu"), **kwargs)


def _hybrid_mesh(group):
    """2 replicas of W/2 shards (HSDP), over the world."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, dist.get_world_size(group) // 2), mesh_dim_names=("replicate", "shard"))


def _make_hsdp(model, group, lr):
    from torchpar.parallel import fully_shard
    return _shard_blocks_then_root(fully_shard, model, lr, mesh=_hybrid_mesh(group))


def _make_torch_hsdp(model, group, lr):
    from torch.distributed.fsdp import fully_shard
    return _shard_blocks_then_root(fully_shard, model, lr, mesh=_hybrid_mesh(group))


def _reshard_to_half(make):
    """The system `make` with FSDP2's int reshard_after_forward = W/2: forward leaves each unit
    sharded within a half of the ranks (one host's with --hosts 2), where backward gathers it."""
    def made(model, group, lr):
        return make(model, group, lr, reshard_after_forward=dist.get_world_size(group) // 2)
    return made


def _prefetch_two_ahead(made):
    """FSDP2's explicit prefetching as its tutorial sets it (the same calls on both stacks): each
    block launches the next two blocks' all-gathers in forward and the two before it in backward."""
    model, opt = made
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
        block.set_modules_to_backward_prefetch(blocks[max(i - 2, 0):i][::-1])
    return model, opt


# Hybrid sharding needs an even world of at least 4 ranks (2 replicas of 2 or more shards); so
# does resharding to half of it (to 2 or more ranks).
HYBRID = ("hsdp", "torch_hsdp", "fsdp_reshard_half", "torch_fsdp2_reshard_half")
# Run when asked for by name (--systems) only.
EXPLICIT_PREFETCH = ("fsdp_prefetch2", "torch_fsdp2_prefetch2", "fsdp_reshard_half", "torch_fsdp2_reshard_half")


def systems():
    out = {"fsdp": _make_fsdp, "torch_fsdp2": _make_torch_fsdp2, "hsdp": _make_hsdp, "torch_hsdp": _make_torch_hsdp,
           "fsdp_prefetch2": lambda *a: _prefetch_two_ahead(_make_fsdp(*a)),
           "torch_fsdp2_prefetch2": lambda *a: _prefetch_two_ahead(_make_torch_fsdp2(*a)),
           "fsdp_reshard_half": _reshard_to_half(_make_fsdp),
           "torch_fsdp2_reshard_half": _reshard_to_half(_make_torch_fsdp2)}
    try:
        from torchpar.bench._zero_systems import SYSTEMS
        out.update(SYSTEMS)
    except ImportError:
        pass
    return out


# ---- per rank ----

def _live_bytes(model, opt):
    """Bytes of the parameters, gradients and optimizer state live now (local shards for DTensors;
    storages shared by several tensors counted once)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes() > 0:
            seen.add(s.data_ptr())
            total += s.nbytes()

    for p in model.parameters():
        add(p)
        if p.grad is not None:
            add(p.grad)
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                add(v)
    return total


def _peak_step_bytes(step, model, opt):
    """Highest bytes live during one step: live at its start plus the running sum of the CPU
    allocator's allocation and free events recorded by the profiler."""
    from torch.profiler import ProfilerActivity, profile
    # Gradients freed inside the step would be blocks the profiler saw no allocation of (their
    # frees are not reported): free them before it starts, so the step's zero_grad is a no-op.
    opt.zero_grad(set_to_none=True)
    start = _live_bytes(model, opt)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # Every allocation and free, from the raw profiler events (prof.events() folds those made
    # inside an op into that op's totals).
    deltas = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running, peak = 0, 0
    for _, d in deltas:
        running += d
        peak = max(peak, running)
    return start + peak


def _measure(rank, args):
    torch.set_num_threads(args.threads)
    group = dist.group.WORLD
    torch.manual_seed(0)
    base = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    made = {name: make(copy.deepcopy(base), group, 1e-4)
            for name, make in systems().items() if name in args.systems}
    del base

    def stepper(model, opt, with_step=True):
        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            if with_step:
                opt.step()
        return step

    steps = {name: stepper(*mo) for name, mo in made.items()}
    names = list(steps)
    for name in names:  # warm up (optimizer state created) and measure memory
        for _ in range(args.warmup):
            steps[name]()
    peaks, fwd_bwd = {}, {}
    for name in names:
        dist.barrier()
        peaks[name] = _peak_step_bytes(steps[name], *made[name])
        # Forward and backward alone: the working set the sharding strategy shapes (the
        # optimizer step's peak is the same for systems with the same shard sizes).
        fwd_bwd[name] = _peak_step_bytes(stepper(*made[name], with_step=False), *made[name])
        made[name][1].zero_grad(set_to_none=True)
    samples = {n: [] for n in names}
    for round_ in range(args.rounds):
        k = round_ % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            steps[name]()
            samples[name].append(time.perf_counter() - t0)
    return {n: {"median_ms": statistics.median(s) * 1e3, "min_ms": min(s) * 1e3,
                "peak_bytes": peaks[n], "fwd_bwd_peak_bytes": fwd_bwd[n]}
            for n, s in samples.items()}


def _run_backend(backend, args):
    return run_ranks(_measure, args.world_size, backend, (args,), timeout=args.timeout, label=backend)


def _worker_argv(args):
    """The command of every rank of a ``--hosts`` job: this benchmark with the same sizes."""
    argv = [sys.executable, "-m", "torchpar.bench", "fsdp", "--systems", ",".join(args.systems)]
    for name in ("dim", "layers", "heads", "vocab", "seq", "batch", "threads", "warmup", "rounds"):
        argv += [f"--{name}", str(getattr(args, name))]
    return argv


def _params(args):
    d, v = args.dim, args.vocab
    block = 12 * d * d + 13 * d
    return args.layers * block + 2 * v * d + args.seq * d + 2 * d


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m torchpar.bench fsdp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="torchpar,gloo")
    ap.add_argument("--systems", default=None, help="comma-separated (default: all available)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--plot", help="write a PNG bar chart here")
    add_host_arguments(ap, ranks_per_host=2, note="; torchpar only, in place of --backends")
    args = ap.parse_args(argv)
    if args.systems:  # a list before anything reads it (a worker rank too: "fsdp" in a string matches "torch_fsdp2")
        args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.worker_results:
        return run_worker(_measure, args)
    if args.hosts:
        args.world_size = args.hosts * args.ranks_per_host
    hybrid_ok = args.world_size >= 4 and args.world_size % 2 == 0
    args.systems = args.systems or [name for name in systems()
                                    if (hybrid_ok or name not in HYBRID) and name not in EXPLICIT_PREFETCH]
    if not hybrid_ok and set(args.systems) & set(HYBRID):
        raise SystemExit(f"--systems {','.join(sorted(set(args.systems) & set(HYBRID)))}: needs an even world size "
                         f"of 4 or more, not {args.world_size}")

    meta = {k: getattr(args, k) for k in ("world_size", "dim", "layers", "heads", "vocab", "seq", "batch",
                                          "threads", "warmup", "rounds", "systems")}
    meta["params"] = _params(args)
    meta["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta["torch"] = torch.__version__
    meta["load_before"] = os.getloadavg()[0]  # other work on the machine skews every system
    if args.hosts:  # one row block per link instead of per backend
        meta.update(hosts=args.hosts, ranks_per_host=args.ranks_per_host, links=args.links, rate=args.rate)
        results = run_links(args, _worker_argv(args))
    else:
        results = {}
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            print(f"running {backend} ...", file=sys.stderr, flush=True)
            results[backend] = _run_backend(backend, args)
    meta["load_after"] = os.getloadavg()[0]

    for backend, r in results.items():
        ref = r.get("torch_fsdp2")
        rows = []
        for name, v in r.items():
            rows.append([name, f"{v['median_ms']:.0f}", f"{v['min_ms']:.0f}",
                         f"{v['peak_bytes'] / 2**20:.0f}", f"{v['fwd_bwd_peak_bytes'] / 2**20:.0f}",
                         f"{v['median_ms'] / ref['median_ms']:.2f}x" if ref else "-",
                         f"{v['peak_bytes'] / ref['peak_bytes']:.2f}x" if ref else "-",
                         f"{v['fwd_bwd_peak_bytes'] / ref['fwd_bwd_peak_bytes']:.2f}x" if ref else "-"])
        print_table(f"{backend}: GPT {meta['params'] / 1e6:.1f}M params ({args.layers}x{args.dim}, vocab "
                    f"{args.vocab}), batch {args.batch}x{args.seq} per rank, world size {args.world_size}, "
                    f"{args.rounds} rounds", ["system", "step ms (median)", "min", "peak MiB/rank",
                                              "fwd+bwd peak", "time / torch_fsdp2", "peak / torch_fsdp2",
                                              "fwd+bwd peak / torch_fsdp2"], rows)
        if "hsdp" in r and "torch_hsdp" in r:
            print(f"{backend}: hsdp / torch_hsdp: step time {r['hsdp']['median_ms'] / r['torch_hsdp']['median_ms']:.2f}x, "
                  f"peak {r['hsdp']['peak_bytes'] / r['torch_hsdp']['peak_bytes']:.2f}x")
    print(f"\n{meta['date']}, torch {meta['torch']}, load average {meta['load_before']:.1f} before, "
          f"{meta['load_after']:.1f} after (2 cores)")
    if args.json:
        write_json(args.json, {"meta": meta, "results": results})
    if args.plot and (plt := pyplot()):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        backends = list(results)
        names = list(next(iter(results.values())))
        width = 0.8 / max(1, len(names))
        for ax, key, label in ((axes[0], "median_ms", "step time (ms, median)"),
                               (axes[1], "peak_bytes", "peak memory per rank (MiB)")):
            for i, n in enumerate(names):
                vals = [results[b][n][key] / (2**20 if key == "peak_bytes" else 1) for b in backends]
                ax.bar([j + i * width for j in range(len(backends))], vals, width, label=n)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(backends))], backends)
            ax.set_ylabel(label)
        axes[0].legend()
        fig.suptitle(f"FSDP, GPT {meta['params'] / 1e6:.0f}M, world size {args.world_size}")
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
