"""``python -m torchpar.bench collectives --hosts N``: the collectives across test hosts
(network namespaces joined by a bridge, torchpar/bench/_hosts.py), on the plain link and on a
link shaped with ``tc tbf`` (issue 21).

One job of N x ``--ranks-per-host`` ranks per link; every rank runs the ordinary collectives
benchmark (``run_rank``) over one group per system, the systems taking turns round by round:

- ``torchpar``: the default group across hosts, shared memory within each host and TCP
  between them, hierarchical collectives (docs/hosts.md);
- ``torchpar_flat``: the same transport with the flat algorithms (TORCHPAR_HIERARCHICAL=0);
- ``torchpar_tcp``: TCP between every pair of ranks, same-host pairs too (TORCHPAR_TRANSPORT=tcp);
- ``gloo``: on the hosts' links (GLOO_SOCKET_IFNAME=eth0).

busbw follows nccl-tests (n = ranks). What the link carries is a different measure: each
host must send (and receive) at least bytes x 2(H-1)/H of an all-reduce over H hosts
((H-1)/H for all_gather and reduce_scatter, 1 for broadcast), whatever its ranks do inside
it; "link" is that over the time, as a share of the shaped rate.
"""
import os
import sys
import time

from torchpar.bench._hosts import check_options, rate_bits, run_job
from torchpar.bench._report import human_bytes, print_table, pyplot, write_json
from torchpar.bench.collectives import bus_factor


def host_factor(op, hosts):
    """The share of an op's bytes (nccl-tests sizing) that each host's link must carry."""
    return bus_factor(op, hosts)


def _worker_argv(args):
    argv = [sys.executable, "-m", "torchpar.bench", "collectives",
            "--ops", ",".join(args.ops), "--budget", str(args.budget), "--batches", str(args.batches),
            "--rounds", str(args.rounds), "--systems", ",".join(args.systems)]
    argv += ["--sizes", ",".join(map(str, args.sizes))] if args.sizes else ["--max-bytes", str(args.max_bytes)]
    return argv + ([] if args.progress else ["--quiet"])


def _run_link(args, link):
    """One job over fresh hosts; returns rank 0's rows."""
    rows = run_job(args.hosts, args.ranks_per_host, link, args.rate, _worker_argv(args), args.timeout,
                   on_line=(lambda line: print(f"  [{link}] {line}", flush=True)) if args.progress else None)
    for row in rows:
        row.update(link=link, hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                   rate=args.rate if link == "shaped" else None)
    return rows


def run_hosts(args):
    rate = check_options(args.links, args.rate)
    args.timeout = getattr(args, "timeout", None) or 3600
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    results = []
    for link in args.links:
        print(f"{link} link: {args.hosts} hosts x {args.ranks_per_host} ranks ...", flush=True)
        results += _run_link(args, link)
    report(results, args, rate, f"{started}, load average {load:.1f} at the start, "
                                f"{os.getloadavg()[0]:.1f} at the end")
    return 0


def report(results, args, rate, when):
    systems = args.systems
    base = "torchpar"
    peers = [s for s in systems if s != base]
    headers = ["link", "op", "size"] + [f"{s} us" for s in systems] + [f"{s}/{base}" for s in peers]
    headers += [f"{base} busbw GB/s", "link use"] if base in systems else []
    rows = []
    for r in results:
        f = bus_factor(r["op"], r["world_size"])
        hf = host_factor(r["op"], r["hosts"])
        for s in systems:
            r[f"{s}_busbw_GBps"] = r["bytes"] / r[s] * f / 1e9
            if r["link"] == "shaped":
                r[f"{s}_link_use"] = r["bytes"] * 8 / r[s] * hf / rate
        row = [r["link"] if r["link"] == "unshaped" else f"tbf {r['rate']}", r["op"], human_bytes(r["bytes"])]
        row += [f"{r[s] * 1e6:.1f}" for s in systems]
        if base in systems:
            row += [f"{r[s] / r[base]:.2f}x" for s in peers]
            row += [f"{r[f'{base}_busbw_GBps']:.3f}",
                    f"{r[f'{base}_link_use'] * 100:.0f}%" if r["link"] == "shaped" else ""]
        rows.append(row)
    print_table(f"collectives across {args.hosts} test hosts x {args.ranks_per_host} ranks (fp32, CPU; median per-call "
                f"time of {args.rounds} interleaved rounds, slowest rank); {when}\n"
                f"peer/{base}: the peer's time over torchpar's (above 1: torchpar faster). link use: bytes x "
                f"host share / time, over the tbf rate ({args.rate})", headers, rows)
    if base in systems and "gloo" in systems:
        slower = [r for r in results if r["gloo"] < r[base]]
        print(f"\n{base} slower than gloo: {len(slower)} of {len(results)} points" +
              "".join(f"\n  {r['link']} {r['op']} {human_bytes(r['bytes'])}: {r['gloo'] / r[base]:.2f}x"
                      for r in slower))
    if args.json:
        write_json(args.json, {"suite": "collectives", "hosts": args.hosts, "ranks_per_host": args.ranks_per_host,
                               "rate": args.rate, "when": when, "results": results})
    if args.plot:
        plot(results, systems, args.plot)


def plot(results, systems, path):
    """Per link and op: busbw of every system against size, and torchpar's speed-up over each."""
    plt = pyplot()
    if plt is None:
        return
    panels = sorted({(r["link"], r["op"]) for r in results}, key=lambda k: (k[1], k[0] != "unshaped"))
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7), squeeze=False)
    for j, (link, op) in enumerate(panels):
        pts = sorted((r for r in results if r["link"] == link and r["op"] == op), key=lambda r: r["bytes"])
        xs = [r["bytes"] for r in pts]
        bw, up = axes[0][j], axes[1][j]
        for s in systems:
            bw.plot(xs, [r[f"{s}_busbw_GBps"] for r in pts], "o-" if s == "torchpar" else ".--", label=s)
            if s != "torchpar" and "torchpar" in systems:
                up.plot(xs, [r[s] / r["torchpar"] for r in pts], ".-", label=f"{s} / torchpar")
        if link == "shaped":
            bw.axhline(rate_bits(pts[0]["rate"]) / 8e9, color="gray", lw=1, ls=":", label="tbf rate")
        bw.set_yscale("log")
        bw.set_title(f"{op}, {'tbf ' + str(pts[0]['rate']) if link == 'shaped' else 'veth'}", fontsize=9)
        bw.set_ylabel("busbw GB/s")
        up.axhline(1.0, color="gray", lw=1)
        up.set_yscale("log")
        up.set_ylabel("time over torchpar's")
        for ax in (bw, up):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes")
            ax.grid(True, which="both", alpha=0.3)
        if j == 0:
            bw.legend(fontsize=7)
            up.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
