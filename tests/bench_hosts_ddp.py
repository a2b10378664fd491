"""DDP across two test hosts (torchpar/bench/_hosts.py), one rank each, on an unshaped and on a shaped
link: torchpar's overlapped DDP against the no-overlap baseline (issue 21).

    sudo python tests/bench_hosts_ddp.py [--rate 1gbit] [--width 1024 --depth 4 --batch 768] [--timeline]

Each host runs one rank (this machine's cores are shared, so one rank per core); the link
is a veth pair through a bridge, shaped with `tc qdisc ... tbf rate RATE burst 256kb latency
10ms` on both ends. Prints the median step time of each mode (ms), the speed-up of torchpar's
DDP over the baseline, and the most any overlap could give (``overlap_bound``); ``--timeline``
adds when each bucket was ready and reduced in a few steps of torchpar's DDP.

The default batch makes the backward about as long as the shaped link's transfer of the 16 MiB
of gradients (about 140 ms on this machine in 2026-11), where overlap has the most to hide: a
backward much shorter than the transfer leaves overlap little to win (batch 256: at most 1.22x).
"""
import argparse
import json
import os
import subprocess
import sys
import time

from torchpar.bench._hosts import Hosts, start_ranks, worker_env
from torchpar.bench.ddp import format_timeline

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hosts_worker.py")


def run(shaped, args):
    with Hosts(2) as hosts:
        if shaped:
            for h in hosts:
                h.shape(rate=args.rate)
        # The defaults, not the tests' small buffers (whatever this shell sets applies).
        env = worker_env(HOSTS_TIMEOUT=600, BENCH_WIDTH=args.width, BENCH_DEPTH=args.depth, BENCH_BATCH=args.batch,
                         BENCH_STEPS=args.steps, BENCH_ROUNDS=args.rounds, BENCH_BUCKET_MB=args.bucket_cap_mb,
                         BENCH_TIMELINE=int(args.timeline))
        procs = start_ranks(hosts, [1, 1], [sys.executable, WORKER, "ddp_bench"], env,
                            output=lambda rank: subprocess.PIPE)
        outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    found = {}
    for line in outs[0].splitlines():
        for what in ("bench", "timeline"):
            if line.startswith(f"HOSTS {what} "):
                found[what] = json.loads(line[len(f"HOSTS {what} "):])
    if "bench" not in found or (args.timeline and "timeline" not in found):
        raise SystemExit("no result:\n" + "\n".join(o[-3000:] for o in outs))
    return found["bench"], found.get("timeline")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=768, help="samples per rank")
    ap.add_argument("--bucket-cap-mb", type=float, default=4)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per mode per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--links", default="unshaped,shaped")
    ap.add_argument("--timeout", type=float, default=500)
    ap.add_argument("--timeline", action="store_true", help="then print 3 steps' bucket timeline (rank 0)")
    args = ap.parse_args()
    why = Hosts.unavailable()
    if why:
        raise SystemExit(f"no test hosts: {why}")
    params = args.depth * (args.width * args.width + args.width)
    print(f"DDP across 2 hosts x 1 rank, MLP {args.depth}x{args.width} ({params * 4 / 2**20:.0f} MiB of fp32 "
          f"gradients), batch {args.batch}, bucket {args.bucket_cap_mb} MB, median of {args.steps * args.rounds} "
          f"steps (ms); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}")
    head = ["link", "torchpar_ddp", "torch_ddp", "no_overlap", "compute_only", "comm_only", "comm_flat", "overlap_bound",
            "no_overlap/ours", "no_overlap/bound"]
    print("".join(f"{h:>17}" for h in head))
    for link in args.links.split(","):
        t, timeline = run(link == "shaped", args)
        name = f"tbf {args.rate}" if link == "shaped" else "veth"
        print(f"{name:>17}" + "".join(f"{t[m]:>17.1f}" for m in head[1:-2]) +
              f"{t['no_overlap'] / t['torchpar_ddp']:>16.2f}x{t['no_overlap'] / t['overlap_bound']:>16.2f}x", flush=True)
        for line in format_timeline(timeline or []):
            print(f"{'':>17}{line}", flush=True)
    print("overlap_bound: the least step time any overlap can reach (torchpar/bench/ddp.py): the first gradient's\n"
          "time in compute_only plus comm_flat, or compute_only if longer; no_overlap/bound is the most it can gain.")


if __name__ == "__main__":
    main()
