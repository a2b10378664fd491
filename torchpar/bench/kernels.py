"""Fused kernels against eager PyTorch and torch.compile: ``python -m torchpar.bench kernels``.

For each op, shape and dtype, times the forward and forward+backward of
  torchpar   the fused op (torch.ops.torchpar.*),
  eager      the unfused PyTorch composite (for layer_norm: torch's own layer_norm),
  compile    torch.compile of that same composite,
all in one run, and reports achieved GB/s = bytes the op must move / time, beside the copy
bandwidth (read + write; the faster of ``dst.copy_(src)`` and a copy with non-temporal stores)
timed in the same rounds as the op: the roofline of a memory-bound op (llm.c's way of
reporting kernels). ``--device cuda`` runs the same on the
GPU (the CUDA build), each call timed with CUDA events.
"""
import argparse
import ctypes
import datetime
import json
import os
import platform
import random
import sys
import time

import torch
import torch.nn.functional as TF

import torchpar
import torchpar.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
P_DROP = 0.1

# Bytes each op must move, in units of one activation tensor (rows x cols elements):
# forward reads and writes; backward reads dy (and x where the math needs it) and writes dx.
# Parameters, per-row statistics and dbias are a vector each: negligible, not counted.
TRAFFIC = {
    #                 fwd  bwd
    "layer_norm": (2, 3),        # x -> y ; dy, x -> dx
    "bias_gelu": (2, 3),         # x -> y ; dy, x -> dx
    "bias_dropout_add": (3, 2),  # x, residual -> out ; dy -> dx (d residual is dy itself)
}


def reuse_freed_memory():
    """Make glibc keep freed activations for reuse, for every peer alike.

    By default glibc serves blocks of >= 32 MiB with a fresh mmap and unmaps them on free,
    so each op call page-faults its whole output in (about 5 ms per 32 MiB on the 2-core
    dev machine, more than the kernels themselves): the bench would time the kernel's page
    zeroing. Training frameworks avoid this with a caching allocator; raising the mmap and
    trim thresholds does the same here. ``--malloc default`` measures without it.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_trim_threshold, 2**31 - 1) and libc.mallopt(m_mmap_threshold, 2**30))


def _composite(op):
    if op == "layer_norm":
        return lambda x, w, b, r: TF.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    if op == "bias_gelu":
        return lambda x, w, b, r: TF.gelu(x + b, approximate="none")
    return lambda x, w, b, r: r + TF.dropout(x + b, P_DROP, training=True)


def _fused(op):
    if op == "layer_norm":
        return lambda x, w, b, r: F.layer_norm(x, [x.shape[-1]], w, b, 1e-5)
    if op == "bias_gelu":
        return lambda x, w, b, r: F.bias_gelu(x, b, "none")
    return lambda x, w, b, r: F.bias_dropout_add(x, b, r, P_DROP, True)


def _grad_inputs(op, frozen=False):
    """Tensors that get a gradient in the forward+backward timing: the input, and the
    parameters unless `frozen` (adapter or LoRA fine-tuning freezes them).

    bias_dropout_add's residual is left out: its gradient is dy itself for every peer, but as
    a leaf it would get a copy of dy (autograd cannot hand a leaf a tensor the caller still
    holds), 2 more tensors of traffic that a model never pays, where the residual is an
    activation whose gradient dy simply flows on."""
    if frozen:
        return (0,)
    return {"layer_norm": (0, 1, 2), "bias_gelu": (0, 2), "bias_dropout_add": (0, 2)}[op]


def _llc_bytes():
    try:
        return os.sysconf("SC_LEVEL3_CACHE_SIZE") or (32 << 20)
    except (ValueError, OSError):
        return 32 << 20


class _CacheFlush:
    """Streams twice the last-level cache through memory, so the next call reads its inputs
    from DRAM. The ops' tensors (32 MiB each) are about this CPU's L3 (and a GPU's L2):
    without it, the peer timed right after one that read the same input finds part of it in
    cache, and the order of the round-robin decides who gains."""

    def __init__(self, device="cpu"):
        device = torch.device(device)
        llc = (torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda"
               else _llc_bytes())
        self.buf = torch.empty(2 * llc // 4, dtype=torch.float32, device=device)

    def __call__(self):
        self.buf.fill_(1.0)


class _CpuTimer:
    def __call__(self, fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


class _CudaTimer:
    """GPU seconds of one call, between two CUDA events on the current stream.

    A sleep kernel runs first, long enough for the CPU to queue the whole call behind it, so
    the events time the call's kernels back to back, as in a training step where the CPU runs
    ahead of the GPU. Without it an op of 20-60 us would be timed at the CPU's launch speed
    (autograd's, or torch.compile's guards), the same for every peer, and no kernel compared.
    """

    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.sleep_cycles = 1 << 20
        self.cycles_per_s = self._cycles_per_second()

    def _cycles_per_second(self):
        torch.cuda.synchronize()
        self.start.record()
        torch.cuda._sleep(self.sleep_cycles)
        self.end.record()
        self.end.synchronize()
        return self.sleep_cycles / (self.start.elapsed_time(self.end) * 1e-3)

    def __call__(self, fn):
        torch.cuda._sleep(self.sleep_cycles)
        t0 = time.perf_counter()
        self.start.record()
        fn()
        self.end.record()
        queued = time.perf_counter() - t0
        self.end.synchronize()
        # The next sleep covers twice the longest queueing time seen (the warm-up calls set it;
        # a call that outran its sleep is timed long, never short, and the best is taken).
        self.sleep_cycles = max(self.sleep_cycles, int(2 * queued * self.cycles_per_s))
        return self.start.elapsed_time(self.end) * 1e-3


def _timer(device):
    return _CudaTimer() if torch.device(device).type == "cuda" else _CpuTimer()


def _time(fns, reps, warmup=2, flush=None, device="cpu"):
    """Best of `reps` for each of `fns`, taken round-robin: on a shared 2-core machine the
    neighbours' load then falls on every peer alike, and the best sample is the one they
    left alone. `flush` (untimed) runs before each timed call. Each round visits the peers
    in a new (seeded) order: a call can slow the one after it despite the flush (the peer
    timed after torch.compile's forward+backward ran 25-35 % slower in a fixed order,
    whichever peer it was), so no peer may always follow the same one."""
    timer = _timer(device)
    for fn in fns:
        for _ in range(warmup):
            timer(fn)
    best = [float("inf")] * len(fns)
    order = list(range(len(fns)))
    shuffle = random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)
        for k in order:
            if flush:
                flush()
            best[k] = min(best[k], timer(fns[k]))
    return best


def copies(nbytes, device="cpu"):
    """Copies of float32 arrays of ``nbytes``, by kind: "plain", ``dst.copy_(src)``, whose
    ordinary stores first read each line they write; and on the CPU "streaming", torchpar's
    copy with the non-temporal stores its kernels write large outputs with
    (torchpar._C.copy_streaming_), which skips that read."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    kinds = {"plain": lambda: dst.copy_(src)}
    if torch.device(device).type == "cpu":
        kinds["streaming"] = lambda: torchpar._C.copy_streaming_(dst, src)
    return kinds


def _copy_rate(nbytes, seconds):
    """GB/s of a copy of ``nbytes`` taking ``seconds``: bytes read + written."""
    return 2 * nbytes / seconds / 1e9


def copy_bandwidth(nbytes, reps, device="cpu"):
    """GB/s of each kind of copy (copies), timed alternately."""
    kinds = copies(nbytes, device)
    times = _time(list(kinds.values()), reps, device=device)
    return {kind: _copy_rate(nbytes, t) for kind, t in zip(kinds, times)}


def _best(*measured):
    """The best GB/s per copy kind over several measurements of copy_bandwidth."""
    return {kind: max(m[kind] for m in measured) for kind in measured[0]}


# STREAM's rule: arrays well beyond the last-level cache, so the copy measures DRAM. The
# ops' own tensors (32 MiB each, 2-3 per call) are about the size of this CPU's L3, so the
# copy of one op-sized array is reported too: it is partly served from L3.
DRAM_COPY_BYTES = 256 << 20


def measure(op, rows, cols, dtype, reps, use_compile, device="cpu", frozen=False, copy_fns=None):
    """Best times of each peer's forward and forward+backward, {peer: {mode: s}}; with
    `copy_fns` (copies(DRAM_COPY_BYTES)) the copies too, timed in the same rounds as the ops,
    {"copy": {kind: s}}: this machine's memory bandwidth changes from second to second, so
    each op is held against the copy of its own rounds."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g).to(device, dtype)
    w = torch.randn(cols, generator=g).to(device, dtype)
    b = torch.randn(cols, generator=g).to(device, dtype)
    r = torch.randn(rows, cols, generator=g).to(device, dtype)
    dy = torch.randn(rows, cols, generator=g).to(device, dtype)
    args = [x, w, b, r]
    peers = {"torchpar": _fused(op), "eager": _composite(op)}
    if use_compile:
        torch._dynamo.reset()
        peers["compile"] = torch.compile(_composite(op), dynamic=False)
    grad_idx = _grad_inputs(op, frozen)
    names, fns = [], []
    for name, fn in peers.items():
        leaves = [a.detach().requires_grad_(i in grad_idx) for i, a in enumerate(args)]

        def fwd(fn=fn):
            with torch.no_grad():
                fn(*args)

        def fwd_bwd(fn=fn, leaves=leaves):
            for t in leaves:
                t.grad = None
            fn(*leaves).backward(dy)

        names += [(name, "fwd"), (name, "fwd_bwd")]
        fns += [fwd, fwd_bwd]
    for kind, fn in (copy_fns or {}).items():
        names.append(("copy", kind))
        fns.append(fn)
    out = {}
    for (name, mode), t in zip(names, _time(fns, reps, flush=_CacheFlush(device), device=device)):
        out.setdefault(name, {})[mode] = t
    return out


def _kernel_calls(op, x, w, b, r, dy, frozen=False):
    """The fused forward and backward kernels of `op` as plain calls, without autograd; the
    backward asks for the parameters' gradients unless `frozen`."""
    ops, cols, params = torch.ops.torchpar, x.shape[-1], not frozen
    if op == "layer_norm":
        _, mean, rstd = ops.layer_norm_fwd(x, [cols], w, b, 1e-5)
        return (lambda: ops.layer_norm_fwd(x, [cols], w, b, 1e-5),
                lambda: ops.layer_norm_bwd(dy, x, [cols], mean, rstd, w, b, [True, params, params]))
    if op == "bias_gelu":
        return (lambda: ops.bias_gelu(x, b, "none"),
                lambda: ops.bias_gelu_bwd(dy, x, b, "none", params))
    seed = ops.bias_dropout_add_fwd(x, b, r, P_DROP, True)[1]
    return (lambda: ops.bias_dropout_add_fwd(x, b, r, P_DROP, True),
            lambda: ops.bias_dropout_add_bwd(dy, seed, P_DROP, True, params))


def compute_cost(op, cols, dtype, reps=200, frozen=False):
    """ns per element on one core of `op`'s forward and backward kernels with data in cache:
    the arithmetic alone, which bounds an op however fast memory is. The slope between two
    cache-resident sizes (96 and 32 rows of 1024 columns' worth), so the per-call overhead
    cancels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for elems in (32 * 1024, 96 * 1024):
            rows = max(1, elems // cols)
            g = torch.Generator().manual_seed(0)
            x, r, dy = (torch.randn(rows, cols, generator=g).to(dtype) for _ in range(3))
            w, b = (torch.randn(cols, generator=g).to(dtype) for _ in range(2))
            times.append((rows * cols, _time(list(_kernel_calls(op, x, w, b, r, dy, frozen)), reps)))
        (n0, t0), (n1, t1) = times
        return tuple((b1 - b0) / (n1 - n0) * 1e9 for b0, b1 in zip(t0, t1))
    finally:
        torch.set_num_threads(threads)


def run(args):
    torch.set_num_threads(args.threads or torch.get_num_threads())
    dev = args.device
    on_cpu = dev == "cpu"
    args.malloc_reuse = on_cpu and args.malloc == "reuse" and reuse_freed_memory()
    args.load_before = os.getloadavg()[0]
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    elem_bytes_max = max(rows * cols for rows, cols in shapes) * 4
    # Many short samples: a copy takes milliseconds, so a neighbour's burst spoils few.
    copy_dram = copy_bandwidth(DRAM_COPY_BYTES, max(args.reps, 100), dev)
    copy_op_sized = copy_bandwidth(elem_bytes_max, max(args.reps, 200), dev)
    copy_fns = copies(DRAM_COPY_BYTES, dev)
    results = []
    for op in args.ops:
        for rows, cols in shapes:
            for dname in args.dtypes:
                dtype = DTYPES[dname]
                t = measure(op, rows, cols, dtype, args.reps, not args.no_compile, dev, args.frozen,
                            copy_fns)
                # The roofline of these rows: the faster kind of copy in the same rounds.
                copy_kinds = {kind: _copy_rate(DRAM_COPY_BYTES, s) for kind, s in t.pop("copy").items()}
                # The in-cache arithmetic bound is a CPU notion (per core, times the threads).
                cost = compute_cost(op, cols, dtype, frozen=args.frozen) if on_cpu else None
                elem = torch.empty((), dtype=dtype).element_size()
                act = rows * cols * elem
                fwd_units, bwd_units = TRAFFIC[op]
                for mode, units in (("fwd", fwd_units), ("fwd_bwd", fwd_units + bwd_units)):
                    row = {"op": op, "shape": f"{rows}x{cols}", "dtype": dname, "pass": mode,
                           "bytes": units * act, "copy_gbs": max(copy_kinds.values()),
                           "copy_kinds_gbs": copy_kinds}
                    for peer, times in t.items():
                        row[f"{peer}_ms"] = times[mode] * 1e3
                    row["gbs"] = row["bytes"] / (row["torchpar_ms"] * 1e-3) / 1e9
                    if cost:  # the GB/s the arithmetic alone allows on all threads (memory for free)
                        ns = cost[0] if mode == "fwd" else cost[0] + cost[1]
                        row["compute_ns_per_elem"] = ns
                        row["compute_gbs"] = units * elem * torch.get_num_threads() / ns
                        row["compute_pct_copy"] = 100 * row["compute_gbs"] / row["copy_gbs"]
                    row["pct_copy"] = 100 * row["gbs"] / row["copy_gbs"]
                    row["x_eager"] = row["eager_ms"] / row["torchpar_ms"]
                    if "compile_ms" in row:
                        row["x_compile"] = row["compile_ms"] / row["torchpar_ms"]
                    results.append(row)
                print(f"measured {op} {rows}x{cols} {dname}", file=sys.stderr, flush=True)
    # The copy alone, in a window before the ops and one after (the better of the two): what
    # memory gave when nothing else of this run ran, printed beside the rows' own copies.
    copy_dram = _best(copy_dram, copy_bandwidth(DRAM_COPY_BYTES, max(args.reps, 100), dev))
    copy_op_sized = _best(copy_op_sized, copy_bandwidth(elem_bytes_max, max(args.reps, 200), dev))
    copy_gbs = max(copy_dram.values())
    print_header(copy_dram, copy_op_sized, elem_bytes_max, dev, args.frozen)
    for row in results:
        print_row(row)
    args.load_after = os.getloadavg()[0]
    print(f"load average (1 min) before / after the run: {args.load_before:.2f} / "
          f"{args.load_after:.2f} on {os.cpu_count()} cores (this run adds up to {torch.get_num_threads()}; the rest is neighbours)")
    return {"copy_gbs": copy_gbs, "copy_op_sized_gbs": max(copy_op_sized.values()),
            "copy_kinds_gbs": copy_dram, "copy_op_sized_kinds_gbs": copy_op_sized, "results": results,
            "meta": meta(args)}


def meta(args):
    gpu = torch.cuda.get_device_name(args.device) if args.device != "cpu" else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": args.device,
            "gpu": gpu, "cpu": platform.processor() or platform.machine(), "reps": args.reps,
            "dropout_p": P_DROP, "frozen": args.frozen, "malloc_reuse": args.malloc_reuse,
            "load_before": args.load_before, "load_after": args.load_after,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torchpar_cpu_kernels": torchpar._C.cpu_kernels_isa(),
            "streaming_store_bytes": torchpar._C.streaming_store_bytes()}


HEADER = (f"{'op':<17}{'shape':>10}{'dtype':>9}{'pass':>8}{'torchpar':>10}{'eager':>9}"
          f"{'compile':>9}{'x eager':>9}{'x comp':>8}{'GB/s':>7}{'copy':>7}{'%copy':>7}{'ceiling':>9}")


def print_header(copy_dram, copy_op_sized, op_bytes, device="cpu", frozen=False):
    cache = "L3" if device == "cpu" else "L2"

    def kinds(gbs):
        return " / ".join(f"{gbs[k]:.1f}" for k in gbs) + f" GB/s {' / '.join(gbs)}"

    print(f"copy bandwidth (read+write; plain: dst.copy_(src), streaming: non-temporal stores), "
          f"best of a window before and one after the ops: {kinds(copy_dram)} with "
          f"{DRAM_COPY_BYTES >> 20} MiB arrays (DRAM), {kinds(copy_op_sized)} with "
          f"{op_bytes >> 20} MiB arrays (partly in {cache}); each row's %copy is against the "
          f"faster {DRAM_COPY_BYTES >> 20} MiB copy timed in the same rounds as its op (column copy)")
    if device == "cpu":
        print(f"torch's kernels: {torch.backends.cpu.get_cpu_capability()}; torchpar: "
              f"{torchpar._C.cpu_kernels_isa()}; {torch.get_num_threads()} threads; times in ms, "
              "best of --reps; x eager / x comp = peer time / torchpar time; ceiling = the %copy "
              "torchpar's arithmetic alone allows (its kernels timed on one core with data in "
              "cache, times the threads)")
    else:
        print(f"{torch.cuda.get_device_name(device)}: times in ms between CUDA events, best of "
              "--reps; x eager / x comp = peer time / torchpar time")
    if frozen:
        print("frozen parameters: fwd_bwd gives the input's gradient alone")
    print(HEADER)


def print_row(row):
    comp = f"{row['compile_ms']:>9.2f}" if "compile_ms" in row else f"{'-':>9}"
    xcomp = f"{row['x_compile']:>8.2f}" if "x_compile" in row else f"{'-':>8}"
    ceiling = f"{row['compute_pct_copy']:>9.0f}" if "compute_pct_copy" in row else f"{'-':>9}"
    print(f"{row['op']:<17}{row['shape']:>10}{row['dtype']:>9}{row['pass']:>8}"
          f"{row['torchpar_ms']:>10.2f}{row['eager_ms']:>9.2f}{comp}{row['x_eager']:>9.2f}"
          f"{xcomp}{row['gbs']:>7.1f}{row['copy_gbs']:>7.1f}{row['pct_copy']:>7.0f}{ceiling}", flush=True)


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    peers = [p for p in ("torchpar", "eager", "compile") if f"{p}_ms" in rows[0]]
    labels = [f"{r['op']}\n{r['shape']} {r['dtype']}\n{r['pass']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.7), 5))
    width = 0.8 / len(peers)
    for k, peer in enumerate(peers):
        gbs = [r["bytes"] / (r[f"{peer}_ms"] * 1e-3) / 1e9 for r in rows]
        ax.bar([i + k * width for i in range(len(rows))], gbs, width, label=peer)
    # torchpar's compute ceiling over its bar; far above the copies it is drawn at the top.
    top = 1.05 * max(r["copy_gbs"] for r in rows)
    xs = [i for i, r in enumerate(rows) if "compute_gbs" in r]
    ceil = {i: rows[i]["compute_gbs"] for i in xs}
    below = [i for i in xs if ceil[i] <= top]
    above = [i for i in xs if ceil[i] > top]
    if below:
        ax.scatter(below, [ceil[i] for i in below], marker="_", s=200, color="k", zorder=3,
                   label="torchpar's compute ceiling")
    if above:
        ax.scatter(above, [top] * len(above), marker="^", s=30, color="k", zorder=3,
                   label="ceiling above the copy")
    # Each row's copy, timed in the same rounds as its op, and 60 % of it.
    centers = [i + 0.4 - width / 2 for i in range(len(rows))]
    ax.hlines([r["copy_gbs"] for r in rows], [c - 0.45 for c in centers], [c + 0.45 for c in centers],
              color="k", linestyle="--", label="copy in the same rounds (the faster kind)")
    ax.hlines([0.6 * r["copy_gbs"] for r in rows], [c - 0.45 for c in centers],
              [c + 0.45 for c in centers], color="grey", linestyle=":", label="60% of that copy")
    ax.set_xticks(centers)
    ax.set_xticklabels(labels, fontsize=6, rotation=90)
    ax.set_ylabel("achieved GB/s (bytes the op must move / time)")
    where = report["meta"].get("gpu") or f"{report['meta']['threads']} threads"
    ax.set_title(f"torchpar fused kernels, {report['meta']['date']}, {where}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


# --streaming-stores: the output size from which the CPU kernels use non-temporal stores.
STREAMING = {"auto": -1, "always": 0, "never": 2**62}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m torchpar.bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", default=list(TRAFFIC), choices=list(TRAFFIC))
    ap.add_argument("--shapes", nargs="+", default=["8192x1024", "2048x4096"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions (the best is reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--malloc", choices=["reuse", "default"], default="reuse",
                    help="reuse: keep freed activations in glibc's heap (see reuse_freed_memory)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG of GB/s per peer")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (the CUDA build on a GPU)")
    ap.add_argument("--frozen", action="store_true",
                    help="parameters take no gradient (adapter or LoRA fine-tuning): the "
                         "forward+backward gives the input's alone")
    ap.add_argument("--cpu-kernels", metavar="ISA", choices=["AVX2", "AVX512", "AVX512_BF16"],
                    help="run torchpar's CPU kernels built for ISA (default: the widest this CPU runs)")
    ap.add_argument("--streaming-stores", choices=list(STREAMING), default="auto",
                    help="how torchpar's CPU kernels write outputs: auto (non-temporal stores for "
                         "outputs of at least half the last-level cache), always, or never")
    args = ap.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device here (torch {torch.__version__})")
    if args.cpu_kernels:
        torchpar._C.set_cpu_kernels_isa(args.cpu_kernels)
    torchpar._C.set_streaming_store_bytes(STREAMING[args.streaming_stores])
    report = run(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
