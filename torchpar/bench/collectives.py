"""Collective benchmark: torchpar beside gloo, same ranks, same run.

    python -m torchpar.bench collectives [--world-sizes 2,4] [--max-bytes 64M] [--json F] [--plot F]
    python -m torchpar.bench collectives --transport tcp      (torchpar over sockets, as between hosts)
    torchrun --nproc_per_node=2 -m torchpar.bench collectives     (uses torchrun's ranks)

For each collective and message size it reports the median time per call (batches of
back-to-back calls after a barrier, each batch at its slowest rank), algbw = bytes / time and busbw
(nccl-tests' definitions: all_reduce x 2(n-1)/n; all_gather, reduce_scatter and
all_to_all x (n-1)/n; broadcast x 1), for torchpar and gloo, and the speed-up of torchpar.
A single-core copy bandwidth measured in the same run is printed beside busbw: the
shared-memory transport is bounded by memory bandwidth. With ``--transport tcp`` torchpar
runs over its TCP transport (loopback between ranks of this host), as gloo always does.

    python -m torchpar.bench collectives --hosts 2 [--ranks-per-host 2] [--rate 1gbit]

runs over test hosts made of network namespaces (as root; torchpar/bench/_hosts.py), on the
plain link and on one shaped with ``tc tbf`` at ``--rate``: torchpar across hosts
(hierarchical), its flat algorithms over the same transport, torchpar with TCP between every
pair, and gloo, round by round in one job (torchpar/bench/_hosts_report.py).
"""
import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torchpar.bench._hosts import add_arguments as add_host_arguments
from torchpar.bench._report import human_bytes, parse_bytes, print_table, pyplot, write_json
from torchpar.bench._spawn import run_ranks

OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single"]
# Newer torch renamed the tensor forms (the old names warn); same operations.
_all_gather_tensor = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def bus_factor(op, n):
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def make_op(op, nbytes, world, group):
    """Returns a zero-argument callable running `op` on `nbytes` (nccl-tests sizing: the
    all-reduce/broadcast buffer, the gathered output, the scattered input)."""
    numel = max(1, nbytes // 4)
    numel = (numel + world - 1) // world * world
    if op == "all_reduce":
        t = torch.ones(numel)
        return lambda: dist.all_reduce(t, group=group)
    if op == "broadcast":
        t = torch.ones(numel)
        return lambda: dist.broadcast(t, group_src=0, group=group)
    if op == "all_gather_into_tensor":
        out, inp = torch.empty(numel), torch.ones(numel // world)
        return lambda: _all_gather_tensor(out, inp, group=group)
    if op == "reduce_scatter_tensor":
        out, inp = torch.empty(numel // world), torch.ones(numel)
        return lambda: _reduce_scatter_tensor(out, inp, group=group)
    if op == "all_to_all_single":
        out, inp = torch.empty(numel), torch.ones(numel)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    raise ValueError(op)


def time_op(fn, group, budget_s, max_batches):
    """Median over batches of back-to-back calls (nccl-tests style) of the per-call time, each
    batch counted at its slowest rank; in seconds."""
    fn()  # warm-up: first touch of buffers, connection set-up
    t0 = time.perf_counter()
    fn()
    once = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(once, op=dist.ReduceOp.MAX, group=group)
    # Batches of ~5 ms: long enough to hide timer and barrier skew, short enough for many.
    per_batch = max(1, min(1000, int(5e-3 / max(float(once), 1e-7))))
    batches = max(3, min(max_batches, int(budget_s / max(float(once) * per_batch, 1e-7))))
    times = []
    for _ in range(batches):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        times.append((time.perf_counter() - t0) / per_batch)
    per_iter = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(per_iter, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(per_iter.tolist())


def copy_bandwidth(nbytes, iters=20):
    src, dst = torch.ones(max(1, nbytes // 4)), torch.empty(max(1, nbytes // 4))
    dst.copy_(src)
    best = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        best.append(time.perf_counter() - t0)
    return nbytes / statistics.median(best)


def sizes_up_to(max_bytes):
    sizes, n = [], 4
    while n <= max_bytes:
        sizes.append(n)
        n *= 4
    return sizes


# The systems compared: the default group (torchpar as the environment makes it), torchpar
# groups made with one setting changed, gloo.
SYSTEMS = {"torchpar": None, "torchpar_flat": ("TORCHPAR_HIERARCHICAL", "0"),
           "torchpar_tcp": ("TORCHPAR_TRANSPORT", "tcp"), "gloo": None,
           # 64 MiB arena slots: the hierarchical all_reduce, all_gather and reduce_scatter of
           # up to 128 MiB run their stages one after the other, not pipelined (docs/hosts.md).
           # For an A/B of the pipeline in one job; not run unless named.
           "torchpar_staged": ("TORCHPAR_SHM_SLOT_BYTES", "64M")}
DEFAULT_SYSTEMS = ["torchpar", "torchpar_flat", "torchpar_tcp", "gloo"]


def make_groups(systems):
    """One group of every rank per system (every rank calls this alike)."""
    timeout = timedelta(seconds=600)
    groups = {}
    for name in systems:
        if name == "torchpar":
            groups[name] = dist.group.WORLD
        elif name == "gloo":
            groups[name] = dist.new_group(backend="gloo", timeout=timeout)
        else:
            setting, value = SYSTEMS[name]  # read by the backend when the group is made
            old = os.environ.get(setting)
            os.environ[setting] = value
            try:
                groups[name] = dist.new_group(timeout=timeout)
            finally:
                if old is None:
                    del os.environ[setting]
                else:
                    os.environ[setting] = old
    return groups


def run_rank(args):
    """Runs in every rank with the default group already initialised (torchpar). With
    ``args.rounds`` > 1 the systems take turns round by round (each round in a rotated order)
    and each point is the median of the rounds."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = make_groups(args.systems)
    results = []
    copy_bw = {}
    for size in args.sizes or sizes_up_to(args.max_bytes):
        dist.barrier()
        if rank == 0 and size >= 64 << 10:
            copy_bw[size] = copy_bandwidth(size)
        dist.barrier()
        for op in args.ops:
            row = {"op": op, "world_size": world, "bytes": size}
            fns = {name: make_op(op, size, world, group) for name, group in groups.items()}
            samples = {name: [] for name in groups}
            names = list(groups)
            for round_ in range(args.rounds):
                for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                    # Slow peers (gloo at MiB sizes) get fewer iterations.
                    samples[name].append(time_op(fns[name], groups[name], args.budget / args.rounds,
                                                 args.batches))
            for name in names:
                row[name] = statistics.median(samples[name])
            results.append(row)
            if rank == 0 and args.progress:
                times = "".join(f"  {name} {row[name] * 1e6:10.1f} us" for name in names)
                print(f"  ws={world} {op:24s} {human_bytes(size):>8s}{times}", flush=True)
    transport = dist.group.WORLD._get_backend(torch.device("cpu")).transport
    for r in results:
        r["copy_GBps"] = copy_bw.get(r["bytes"], 0) / 1e9
        r["transport"] = transport
    return results if rank == 0 else None


def _measure(rank, args):
    return run_rank(args)


def spawn_world(world, args):
    # A bound on the whole run, so that a rank that hung or died fails it instead of hanging it.
    return run_ranks(_measure, world, "torchpar", (args,), timeout=3600, label=f"collectives ws={world}",
                     pg_timeout=600)


def report(results, args):
    headers = ["op", "ws", "size", "torchpar us", "gloo us", "speed-up", "tp busbw GB/s", "gloo busbw GB/s",
               "copy GB/s"]
    rows = []
    for r in results:
        f = bus_factor(r["op"], r["world_size"])
        tp_bw = r["bytes"] / r["torchpar"] * f / 1e9
        gl_bw = r["bytes"] / r["gloo"] * f / 1e9
        r.update(torchpar_busbw_GBps=tp_bw, gloo_busbw_GBps=gl_bw, speedup=r["gloo"] / r["torchpar"])
        rows.append([r["op"], r["world_size"], human_bytes(r["bytes"]), f"{r['torchpar'] * 1e6:.1f}",
                     f"{r['gloo'] * 1e6:.1f}", f"{r['speedup']:.1f}x", f"{tp_bw:.2f}", f"{gl_bw:.2f}",
                     f"{r['copy_GBps']:.1f}" if r["copy_GBps"] else ""])
    transport = results[0]["transport"] if results else "?"
    print_table(f"torchpar ({transport} transport) vs gloo (fp32, CPU; median per-call time, slowest rank)",
                headers, rows)
    slower = [r for r in results if r["speedup"] < 1.0]
    print(f"\nslower than gloo: {len(slower)} of {len(results)} points"
          + "".join(f"\n  {r['op']} ws={r['world_size']} {human_bytes(r['bytes'])}: {r['speedup']:.2f}x" for r in slower))
    if args.json:
        write_json(args.json, {"suite": "collectives", "results": results})
    if args.markdown:
        write_markdown(results, args.markdown)
    if args.plot:
        plot(results, args.plot)


def write_markdown(results, path, sizes=(4, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20), bw_at=16 << 20):
    """A compact table for the README: per op and world size, time and speed-up over gloo at
    a few sizes, and busbw at `bw_at` beside the copy bandwidth measured in the same run."""
    copy = next((r["copy_GBps"] for r in results if r["bytes"] == bw_at and r["copy_GBps"]), 0)
    lines = ["| op | ranks | " + " | ".join(human_bytes(b) for b in sizes) +
             f" | busbw at {human_bytes(bw_at)}, torchpar / gloo (copy: {copy:.1f}) |",
             "|---|---|" + "---|" * (len(sizes) + 1)]
    for w in sorted({r["world_size"] for r in results}):
        for op in OPS:
            pts = {r["bytes"]: r for r in results if r["world_size"] == w and r["op"] == op}
            if not pts:
                continue
            cells = [f"{pts[b]['torchpar'] * 1e6:.0f} us / {pts[b]['speedup']:.1f}x" if b in pts else ""
                     for b in sizes]
            big = pts.get(bw_at)
            bw = f"{big['torchpar_busbw_GBps']:.1f} / {big['gloo_busbw_GBps']:.1f} GB/s" if big else ""
            lines.append(f"| {op} | {w} | " + " | ".join(cells) + f" | {bw} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


def plot(results, path):
    """Per world size, two rows: busbw against size, and torchpar's speed-up over gloo."""
    plt = pyplot()
    if plt is None:
        return
    worlds = sorted({r["world_size"] for r in results})
    ops = [op for op in OPS if any(r["op"] == op for r in results)]
    fig, axes = plt.subplots(2 * len(worlds), len(ops), figsize=(3.6 * len(ops), 5.6 * len(worlds)),
                             squeeze=False)
    for i, w in enumerate(worlds):
        for j, op in enumerate(ops):
            pts = [r for r in results if r["world_size"] == w and r["op"] == op]
            xs = [r["bytes"] for r in pts]
            bw, up = axes[2 * i][j], axes[2 * i + 1][j]
            bw.plot(xs, [r["torchpar_busbw_GBps"] for r in pts], "o-", label="torchpar")
            bw.plot(xs, [r["gloo_busbw_GBps"] for r in pts], "s--", label="gloo")
            bw.set_yscale("log")
            bw.set_title(f"{op}, {w} ranks", fontsize=9)
            bw.set_ylabel("busbw GB/s")
            up.plot(xs, [r["speedup"] for r in pts], "o-", color="tab:green")
            up.axhline(1.0, color="gray", lw=1)
            up.set_yscale("log")
            up.set_ylabel("speed-up over gloo")
            for ax in (bw, up):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("bytes")
                ax.grid(True, which="both", alpha=0.3)
            if i == 0 and j == 0:
                bw.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchpar.bench collectives", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="2,4", help="comma-separated (ignored under torchrun)")
    p.add_argument("--max-bytes", default="64M", type=parse_bytes)
    p.add_argument("--ops", default=None, type=lambda s: s.split(","),
                   help=f"comma-separated (default {','.join(OPS)}; all_reduce with --hosts)")
    p.add_argument("--budget", default=0.3, type=float, help="seconds per measurement point and backend")
    p.add_argument("--batches", default=30, type=int, help="most timed batches per point")
    p.add_argument("--transport", choices=["auto", "shm", "tcp"], default=None,
                   help="torchpar's transport (TORCHPAR_TRANSPORT; default auto: shared memory on one host)")
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--plot", help="write a PNG of busbw against size here")
    p.add_argument("--markdown", help="write a compact Markdown table (as in the README) here")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no per-point progress lines")
    p.add_argument("--sizes", type=lambda s: [parse_bytes(x) for x in s.split(",")],
                   help="comma-separated message sizes (default: 4 B to --max-bytes, x4)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds in which the systems take turns (default 1; 3 with --hosts)")
    hosts = add_host_arguments(p, ranks_per_host=2)
    hosts.add_argument("--systems", type=lambda s: s.split(","), default=None,
                       help=f"compared with --hosts (default {','.join(DEFAULT_SYSTEMS)}; "
                            f"any of {','.join(SYSTEMS)})")
    args = p.parse_args(argv)
    across_hosts = bool(args.hosts or args.worker_results)
    args.ops = args.ops or (["all_reduce"] if across_hosts else OPS)
    for op in args.ops:
        if op not in OPS:
            p.error(f"unknown op {op}; choose from {', '.join(OPS)}")
    if across_hosts:
        args.systems = args.systems or list(DEFAULT_SYSTEMS)
        args.rounds = args.rounds or 3
    else:
        args.systems, args.rounds = ["torchpar", "gloo"], args.rounds or 1
    for name in args.systems:
        if name not in SYSTEMS:
            p.error(f"unknown system {name}; choose from {', '.join(SYSTEMS)}")
    if args.hosts:
        from torchpar.bench._hosts_report import run_hosts
        return run_hosts(args)
    if args.worker_results:  # one rank of run_hosts' job (env:// rendezvous)
        import json

        import torchpar  # noqa: F401
        dist.init_process_group("torchpar", timeout=timedelta(seconds=600))
        results = run_rank(args)
        if dist.get_rank() == 0:
            with open(args.worker_results, "w") as f:
                json.dump(results, f)
        dist.destroy_process_group()
        return 0

    # Read by every rank's group, in this process (torchrun) or the ranks it spawns; put back
    # afterwards, so that a caller of main() (the tests) keeps its own setting.
    previous = os.environ.get("TORCHPAR_TRANSPORT")
    if args.transport:
        os.environ["TORCHPAR_TRANSPORT"] = args.transport
    try:
        return _run(args)
    finally:
        if previous is None:
            os.environ.pop("TORCHPAR_TRANSPORT", None)
        else:
            os.environ["TORCHPAR_TRANSPORT"] = previous


def _run(args):
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        import torchpar  # noqa: F401
        dist.init_process_group("torchpar", timeout=timedelta(seconds=600))
        results = run_rank(args)
        if dist.get_rank() == 0:
            report(results, args)
        dist.destroy_process_group()
        return 0
    results = []
    for world in [int(w) for w in args.world_sizes.split(",")]:
        print(f"world size {world}: running ...", flush=True)
        results += spawn_world(world, args)
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
