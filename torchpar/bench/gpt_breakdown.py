"""``python -m torchpar.bench gpt_breakdown``: where a step of ``bench gpt``'s two systems goes,
on one layout, as variants side by side in the same 4 rank processes (each round runs every
variant, in alternating order): the step's wall time (the slowest rank's, median), each rank's
CPU time per step (every thread of the process: compute, the backend's threads, gloo's), and
the optimizer step's and the after-step DDP average's wall time.

On a machine with fewer cores than ranks (this project's: 4 ranks on 2 cores) the sum of the
ranks' CPU time per step bounds the throughput, and it moves far less with the machine's load
than the wall time does.

A variant is ``torchpar`` or ``torch`` (as in ``bench gpt``) with flags joined by ``+``:
``sched`` (ParallelGPT at pp = 1 through the one-stage pipeline schedule, as before it ran its
micro-batches itself), ``loop`` / ``fused`` (torch.optim.AdamW's default per-parameter loop /
its fused implementation), ``unused`` (ParallelGPT's DDP stages built with
``find_unused_parameters=True``, which the pipeline executor arms before the last backward).
"""
import argparse
import contextlib
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from torchpar.bench._spawn import run_ranks


def _cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


@contextlib.contextmanager
def _variant(flags):
    import torchpar.models.parallel_gpt as pgpt
    real_adamw, real_ddp = torch.optim.AdamW, pgpt.DistributedDataParallel
    if "fused" in flags or "loop" in flags:
        fused = "fused" in flags

        class AdamW(real_adamw):
            def __init__(self, *args, **kwargs):
                kwargs.pop("foreach", None)
                kwargs["fused"] = fused or None
                super().__init__(*args, **kwargs)
        torch.optim.AdamW = AdamW
    if "unused" in flags:
        class DDP(real_ddp):
            def __init__(self, *args, **kwargs):
                kwargs["find_unused_parameters"] = True
                super().__init__(*args, **kwargs)
        pgpt.DistributedDataParallel = DDP
    try:
        yield
    finally:
        torch.optim.AdamW, pgpt.DistributedDataParallel = real_adamw, real_ddp


def _measure(rank, args):
    torch.set_num_threads(1)
    import torchpar.parallel.pipeline.schedules as schedules
    from torchpar.bench import gpt as bench
    from torchpar.models import GPTConfig

    cfg = GPTConfig(seq_len=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers)
    data = torch.randint(cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = (data[:, :-1], data[:, 1:])
    dp, tp, pp, fsdp, replicate = bench.parse_layout(args.layout)
    phases = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    schedules._average_gradients = timed("avg", schedules._average_gradients)
    made = {}
    for name in args.variants:
        system, *flags = name.split("+")
        with _variant(flags):
            step, _, opt = bench.MAKERS[system](cfg, dp, tp, pp, fsdp, 2 * pp, replicate)
        if system == "torchpar" and "sched" in flags:
            step.__self__.pipelined = True
        opt.step = timed("opt", opt.step)
        for _ in range(args.warmup):
            step(*batch)
        made[name] = step
    res = {v: [] for v in made}
    order = list(made)
    for round_ in range(args.steps):
        for v in (order if round_ % 2 == 0 else order[::-1]):
            dist.barrier()
            phases.clear()
            c0, t0 = _cpu_seconds(), time.perf_counter()
            made[v](*batch)
            res[v].append((time.perf_counter() - t0, _cpu_seconds() - c0, dict(phases)))
    everyone = [None] * args.world_size
    dist.all_gather_object(everyone, res)
    return everyone


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m torchpar.bench gpt_breakdown", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="4x1x1", help="[fsdp-]DPxTPxPP or hsdp-REPLICATExSHARDxTPxPP")
    ap.add_argument("--variants", default="torchpar,torch", help="comma-separated, e.g. torchpar+loop,torch")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    load = os.getloadavg()[0]
    everyone = run_ranks(_measure, args.world_size, "torchpar", (args,), timeout=1800, label="gpt breakdown",
                         pg_timeout=120)
    tokens = args.batch * args.seq
    print(f"{args.layout}, {args.steps} rounds, load {load:.1f} before, {os.getloadavg()[0]:.1f} after "
          f"({os.cpu_count()} cores); per rank: CPU ms per step | optimizer wall ms | DDP average after the step")
    for v in args.variants:
        walls = [max(r[v][i][0] for r in everyone) for i in range(args.steps)]
        cpus = [statistics.median(x[1] for x in r[v]) * 1e3 for r in everyone]
        opt = [statistics.median(x[2].get("opt", 0.0) for x in r[v]) * 1e3 for r in everyone]
        avg = [statistics.median(x[2].get("avg", 0.0) for x in r[v]) * 1e3 for r in everyone]
        step = statistics.median(walls)
        print(f"{v:>22}: step {step * 1e3:6.1f} ms ({tokens / step:,.0f} tok/s); CPU {' '.join(f'{c:.0f}' for c in cpus)}"
              f" (sum {sum(cpus):.0f}) | opt {' '.join(f'{c:.0f}' for c in opt)} | avg {' '.join(f'{c:.0f}' for c in avg)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
