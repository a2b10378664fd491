"""all_reduce across two test hosts (tests/netns.py) with two ranks each: the hierarchical
collectives over the mixed transport (shared memory inside each host, TCP between the
hosts' leaders), the flat algorithms over the same transport (TORCHPAR_HIERARCHICAL=0),
TCP between every pair (TORCHPAR_TRANSPORT=tcp, the baseline) and gloo, in one job (issue 21).

    sudo python tests/bench_hosts_allreduce.py [--sizes 4K,64K,1M,16M] [--rounds 5] [--rate 1gbit]

Prints the median time per call (us) of each, and the baseline's time over the
hierarchical one.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns import Hosts  # noqa: E402
from test_hosts import STORE_PORT, WORKER, _env  # noqa: E402


def parse_size(text):
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def run(args, sizes):
    with Hosts(2) as hosts:
        if args.rate:
            for h in hosts:
                h.shape(rate=args.rate)
        procs, rank = [], 0
        for h in hosts:
            for local in range(2):
                env = _env(RANK=rank, WORLD_SIZE=4, LOCAL_RANK=local, LOCAL_WORLD_SIZE=2,
                           MASTER_ADDR=hosts[0].address, MASTER_PORT=STORE_PORT, HOSTS_TIMEOUT=args.group_timeout,
                           BENCH_SIZES=",".join(map(str, sizes)), BENCH_ROUNDS=args.rounds,
                           GLOO_SOCKET_IFNAME="eth0")  # else gloo takes the hostname, which every namespace shares
                for k in ("TORCHPAR_SHM_SLOT_BYTES", "TORCHPAR_SHM_RING_BYTES", "TORCHPAR_ONESHOT_MAX_BYTES",
                          "TORCHPAR_P2P_CHUNK_BYTES"):
                    env.pop(k)  # the defaults, not the tests' small buffers
                procs.append(h.popen([sys.executable, WORKER, "allreduce_bench"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env))
                rank += 1
        result = None
        for line in procs[0].stdout:  # rank 0's points as they come
            if line.startswith("HOSTS point ") or os.environ.get("BENCH_VERBOSE"):
                print("  ", line.rstrip(), flush=True)
            if line.startswith("HOSTS bench "):
                result = json.loads(line[len("HOSTS bench "):])
        outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if result is None:
        raise SystemExit("no result:\n" + "\n".join(o[-3000:] for o in outs))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rate", default="", help="shape each link with tc tbf at this rate (e.g. 1gbit)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--group-timeout", type=float, default=120, help="each group's timeout (s)")
    args = ap.parse_args()
    why = Hosts.unavailable()
    if why:
        raise SystemExit(f"no test hosts: {why}")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(f"all_reduce of float32, 2 hosts x 2 ranks ({'tbf ' + args.rate if args.rate else 'veth'}), median time "
          f"per call (us) of {args.rounds} rounds; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load {os.getloadavg()[0]:.1f}")
    result = run(args, sizes)
    head = ["bytes", "hier", "mixed_flat", "tcp", "gloo", "tcp/hier", "gloo/hier"]
    print("".join(f"{h:>12}" for h in head))
    for size in sizes:
        t = result[str(size)]
        print(f"{size:>12}" + "".join(f"{t[m]:>12.1f}" for m in head[1:5]) +
              f"{t['tcp'] / t['hier']:>11.2f}x{t['gloo'] / t['hier']:>11.2f}x", flush=True)


if __name__ == "__main__":
    main()
