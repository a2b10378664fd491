"""``python -m torchpar.bench ddp``: DDP step time, torchpar's reducer beside torch's.

Spawns ``--world-size`` ranks per backend and, in the same ranks, times one training step
(forward, backward, gradient averaging, SGD step) of the same MLP five ways:

- ``torchpar_ddp``  torchpar.parallel.DistributedDataParallel (C++ reducer, overlapped)
- ``torch_ddp``     torch.nn.parallel.DistributedDataParallel
- ``no_overlap``    plain backward, then one all-reduce per gradient (the naive baseline)
- ``compute_only``  forward + backward + step with no communication (a lower bound)
- ``comm_only``     the all-reduces alone (what overlap can hide)
- ``comm_flat``     one all-reduce of all the gradients at once (the least time their bytes take)

and the bound no overlap can beat, ``overlap_bound``: the first gradient is ready only after the
forward and the last layer's backward (timed in ``compute_only``), and all the gradients' bytes
take at least ``comm_flat`` to all-reduce after it, so a step takes at least
max(compute_only, first gradient + comm_flat). ``no_overlap / overlap_bound`` is the most any
overlapping DDP can gain on that model and link.

``--backends`` takes torchpar, gloo, nccl, and ``torchpar-tcp``: the torchpar backend over
its TCP transport (sockets between the ranks, as between hosts; gloo's situation).

``--hosts N`` runs the torchpar backend over N test hosts instead (network namespaces joined by
a bridge, as root: torchpar/bench/_hosts.py), ``--ranks-per-host`` each, once per link in
``--links``: the plain veth, and one shaped with ``tc tbf`` at ``--rate``, where the network and
not the cores is the bottleneck and overlap shows (issue 21). Overlap has the most to hide when
the backward is about as long as the transfer; on the 2-core machine of docs/hosts.md that is::

    python -m torchpar.bench ddp --hosts 2 --links shaped --width 1024 --depth 4 --batch 768 \
        --bucket-cap-mb 4 --rounds 5 --timeline

Modes run in interleaved rounds so that drift in machine load hits all of them alike;
the table shows the median step time and the ratios against torchpar's DDP.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
from torch import nn

from torchpar.bench._hosts import add_arguments as add_host_arguments
from torchpar.bench._hosts import run_links, run_worker
from torchpar.bench._spawn import run_ranks

MODES = ["torchpar_ddp", "torch_ddp", "no_overlap", "compute_only", "comm_only", "comm_flat"]


def _mlp(width, depth):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _steps(model, pg, args, first_grad_ms=None):
    """One closure per mode, each on its own replica and optimizer. ``compute_only`` appends to
    ``first_grad_ms`` (a list) when its step's first gradient was ready, from the step's start."""
    from torchpar.parallel import DistributedDataParallel

    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)

    def trainer(net, after_backward=None, first_grad_ms=None):
        params = [p for p in net.parameters()]
        opt = torch.optim.SGD(params, lr=1e-4)
        start = [0.0]
        if first_grad_ms is not None:
            def ready(_):
                if start[0]:
                    first_grad_ms.append((time.perf_counter() - start[0]) * 1e3)
                    start[0] = 0.0
            for p in params:
                p.register_post_accumulate_grad_hook(ready)

        def step():
            start[0] = time.perf_counter()
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            if after_backward:
                after_backward([p.grad for p in params])
            opt.step()
        return step

    def allreduce_each(grads):
        for g in grads:
            dist.all_reduce(g, group=pg)
            g.div_(dist.get_world_size(pg))

    grads = [torch.zeros_like(p) for p in model.parameters()]
    flat = torch.zeros(sum(g.numel() for g in grads))

    return {
        "torchpar_ddp": trainer(DistributedDataParallel(
            copy.deepcopy(model), process_group=pg, bucket_cap_mb=args.bucket_cap_mb,
            gradient_as_bucket_view=args.gradient_as_bucket_view)),
        "torch_ddp": trainer(nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), process_group=pg, bucket_cap_mb=args.bucket_cap_mb,
            gradient_as_bucket_view=args.gradient_as_bucket_view)),
        "no_overlap": trainer(copy.deepcopy(model), allreduce_each),
        "compute_only": trainer(copy.deepcopy(model), first_grad_ms=first_grad_ms),
        "comm_only": lambda: allreduce_each(grads),
        "comm_flat": lambda: allreduce_each([flat]),
    }


# Benchmark names that are a backend plus a setting.
VARIANTS = {"torchpar-tcp": ("torchpar", {"TORCHPAR_TRANSPORT": "tcp"})}


def _measure(rank, args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = _mlp(args.width, args.depth)
    first_grad = []
    steps = _steps(model, dist.group.WORLD, args, first_grad)
    samples = {m: [] for m in MODES}
    for round_ in range(args.rounds):
        # Rotate the order so that no mode always follows the same one.
        for mode in MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]:
            timed_from = len(first_grad)
            for _ in range(args.warmup):
                steps[mode]()
            del first_grad[timed_from:]  # from the timed steps only, as compute_only's time
            dist.barrier()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                steps[mode]()
                samples[mode].append(time.perf_counter() - t0)
    if rank == 0 and args.dump_samples:
        print(json.dumps({m: [round(t * 1e3, 1) for t in s] for m, s in samples.items()}), flush=True)
    out = {stat: {m: fn(s) * 1e3 for m, s in samples.items()}
           for stat, fn in (("median", statistics.median), ("min", min))}
    for stat, fn in (("median", statistics.median), ("min", min)):
        out[stat]["overlap_bound"] = overlap_bound(out[stat], fn(first_grad))
    if args.timeline:
        out["timeline"] = bucket_timeline(model, dist.group.WORLD, args)
    return out


def bucket_timeline(model, pg, args, steps=3):
    """Where the time of a step of torchpar's DDP goes, for ``steps`` steps after a warm-up:
    when the forward and the backward ended and, per bucket, when the reducer handed it over
    and when its all-reduce ended (ms from the step's start), so the link's idle gaps between
    buckets show. The times come from a communication hook that all-reduces each bucket and
    averages it, so this DDP takes the hooked path: the reducer copies the gradients into its
    buckets and back (on the torchpar backend the unhooked one reduces them where they lie),
    and a Python callback ends each bucket. Its steps can be a little longer than
    ``torchpar_ddp``'s; the order of events is the same."""
    from torchpar.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(copy.deepcopy(model), process_group=pg, bucket_cap_mb=args.bucket_cap_mb,
                                  gradient_as_bucket_view=args.gradient_as_bucket_view)
    world = dist.get_world_size(pg)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    start, buckets = [0.0], []

    def since_start():
        return round((time.perf_counter() - start[0]) * 1e3, 1)

    def hook(_, bucket):
        ready, buffer = since_start(), bucket.buffer()

        def done(fut):
            buckets.append({"bytes": buffer.numel() * buffer.element_size(), "ready": ready, "done": since_start()})
            return fut.value()[0].div_(world)
        return dist.all_reduce(buffer, group=pg, async_op=True).get_future().then(done)

    ddp.register_comm_hook(None, hook)
    rows = []
    for i in range(steps + 1):
        dist.barrier(group=pg)
        buckets = []
        start[0] = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        forward = since_start()
        loss.backward()
        row = {"forward": forward, "backward": since_start(), "buckets": buckets}
        opt.step()
        row["step"] = since_start()
        if i:
            rows.append(row)
    return rows


def format_timeline(rows):
    """Lines for ``bucket_timeline``'s rows: per bucket in the order handed over, the time from
    when its all-reduce could start (handed over, and the ones before it done) to its end, and
    the link's idle time before it (waiting for backward to hand it over)."""
    lines = []
    for row in rows:
        free, parts = None, []
        for b in sorted(row["buckets"], key=lambda b: b["ready"]):
            began = b["ready"] if free is None else max(b["ready"], free)
            idle = "" if free is None else f", link idle {max(0.0, b['ready'] - free):.1f}"
            parts.append(f"{b['bytes'] / 2**20:.1f} MiB ready {b['ready']:.1f}, done {b['done']:.1f}"
                         f" ({max(0.0, b['done'] - began):.1f}{idle})")
            free = b["done"] if free is None else max(free, b["done"])
        lines.append(f"forward {row['forward']:.1f}, backward {row['backward']:.1f}, step {row['step']:.1f} ms; "
                     + "; ".join(parts))
    return lines


def overlap_bound(ms, first_grad_ms):
    """The least step time an overlapping DDP can reach (module docstring), from a mode's
    step times ``ms`` (median or min) and the first gradient's time in compute_only."""
    return max(ms["compute_only"], first_grad_ms + ms["comm_flat"])


def _run_backend(backend, args):
    name, env = VARIANTS.get(backend, (backend, {}))
    return run_ranks(_measure, args.world_size, name, (args,), timeout=args.timeout, label=backend, env=env)


def _available(backend):
    import torchpar
    backend = VARIANTS.get(backend, (backend, {}))[0]
    if backend == "torchpar":
        return hasattr(torchpar._C, "ProcessGroupTorchpar")
    return dist.is_backend_available(backend)


def _print_table(results, meta, stat):
    where = f" over {meta['hosts']} test hosts x {meta['ranks_per_host']} ranks (torchpar)" if "hosts" in meta else ""
    print(f"\nDDP step time, world size {meta['world_size']}{where}, MLP {meta['depth']}x{meta['width']} "
          f"({meta['params'] / 1e6:.1f}M params, {meta['params'] * 4 / 2**20:.0f} MiB of fp32 gradients), "
          f"batch {meta['batch']} per rank, {meta['threads']} thread(s) per rank, "
          f"{stat} of {meta['samples']} steps (ms)")
    head = (f"{'link' if 'hosts' in meta else 'backend':<14}" + "".join(f"{m:>14}" for m in MODES + ["overlap_bound"])
            + f"{'torch/ours':>12}{'naive/ours':>12}{'naive/bound':>12}")
    print(head)
    print("-" * len(head))
    for backend, r in results.items():
        r = r and r[stat]
        if r is None:
            print(f"{backend:<14}  (backend not available in this build: skipped)")
            continue
        row = f"{backend:<14}" + "".join(f"{r[m]:>14.1f}" for m in MODES + ["overlap_bound"])
        row += (f"{r['torch_ddp'] / r['torchpar_ddp']:>11.2f}x{r['no_overlap'] / r['torchpar_ddp']:>11.2f}x"
                f"{r['no_overlap'] / r['overlap_bound']:>11.2f}x")
        print(row)
    print("torch/ours > 1: torchpar DDP faster than torch DDP; naive/ours: speed-up over "
          "backward-then-all-reduce; naive/bound: the most any overlap could give (overlap_bound: the\n"
          "first gradient's time in compute_only plus comm_flat, or compute_only if longer).")
    print(f"{meta['date']}, torch {meta['torch']}, load average before the run {meta['load']:.2f}")


def _plot(results, path, by="backend"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = [b for b, r in results.items() if r is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        ax.bar([b + i * width for b in range(len(backends))], [results[k]["median"][mode] for k in backends],
               width, label=mode)
    for b, k in enumerate(backends):  # the least any overlap could reach, across the group's bars
        ax.hlines(results[k]["median"]["overlap_bound"], b - width / 2, b + 0.8 - width / 2, colors="black",
                  linestyles="dashed", label="overlap_bound" if b == 0 else None)
    ax.set_xticks([b + 0.4 - width / 2 for b in range(len(backends))], backends)
    ax.set_ylabel("step time (ms, median)")
    ax.set_title(f"DDP step time by {by}")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def _worker_argv(args):
    """The command of every rank of a ``--hosts`` job: this benchmark with the same sizes."""
    argv = [sys.executable, "-m", "torchpar.bench", "ddp"]
    for name in ("width", "depth", "batch", "threads", "bucket_cap_mb", "steps", "rounds", "warmup"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv + [flag for flag, on in (("--gradient-as-bucket-view", args.gradient_as_bucket_view),
                                         ("--timeline", args.timeline), ("--dump-samples", args.dump_samples)) if on]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m torchpar.bench ddp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="torchpar,gloo")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--depth", type=int, default=10, help="Linear layers (width x width each)")
    ap.add_argument("--batch", type=int, default=64, help="samples per rank")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--bucket-cap-mb", type=float, default=25)
    ap.add_argument("--gradient-as-bucket-view", action="store_true",
                    help="both DDPs keep .grad as views into their buckets (no copy in or out)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per mode per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before each mode in each round")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--dump-samples", action="store_true", help="print every step time (rank 0)")
    ap.add_argument("--timeline", action="store_true",
                    help="then print rank 0's bucket timeline of 3 torchpar DDP steps (bucket_timeline)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--plot", help="write a PNG bar chart here")
    add_host_arguments(ap, ranks_per_host=1, note="; torchpar only")
    args = ap.parse_args(argv)
    if args.worker_results:
        return run_worker(_measure, args)

    meta = {k: getattr(args, k) for k in ("world_size", "width", "depth", "batch", "threads", "bucket_cap_mb",
                                          "gradient_as_bucket_view")}
    meta["params"] = args.depth * (args.width * args.width + args.width)
    meta["samples"] = args.steps * args.rounds
    meta["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta["torch"] = torch.__version__
    meta["load"] = os.getloadavg()[0]  # other work on the machine skews every mode
    if args.hosts:
        meta.update(world_size=args.hosts * args.ranks_per_host, hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                    links=args.links, rate=args.rate)
        # rank 0's printed samples (--dump-samples) are passed on; its other output is the results
        results = run_links(args, _worker_argv(args), relay=args.dump_samples)
    else:
        results = {}
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            if not _available(backend):
                print(f"note: backend '{backend}' is not available in this build; skipped", file=sys.stderr)
                results[backend] = None
                continue
            print(f"running {backend} ...", file=sys.stderr, flush=True)
            results[backend] = _run_backend(backend, args)
    _print_table(results, meta, "median")  # the JSON also has "min", least disturbed by other load
    for backend, r in results.items():
        if r and "timeline" in r:
            print(f"\n{backend}: torchpar DDP steps on rank 0 (ms from the step's start; per bucket, its all-reduce's time)")
            print("\n".join(format_timeline(r["timeline"])))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results_ms": results}, f, indent=2)
    if args.plot and any(r is not None for r in results.values()):
        _plot(results, args.plot, "link across test hosts" if args.hosts else "backend")
    return 0


if __name__ == "__main__":
    sys.exit(main())
