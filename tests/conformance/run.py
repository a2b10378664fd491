"""torchpar against PyTorch's own backend conformance suite (issue 23).

    python tests/conformance/run.py [--world-sizes 2,3] [--transports shm,tcp] [--cases a,b]

Runs torch/testing/_internal/distributed/distributed_test.py (the suite PyTorch judges
backends by) in three modes per world size, one process each (see suite.py):

    gloo               plain gloo: the oracle
    gloo-as-torchpar   gloo's cases, every "gloo" group created as "torchpar"
    plugin             BACKEND=torchpar, as PyTorch runs an out-of-tree backend

and, for each torchpar mode and transport (TORCHPAR_TRANSPORT), prints the cases gloo passes
and torchpar does not. A case listed in EXPECTED below is reported apart, with the reason;
anything else is a conformance failure and the exit status is 1.

gloo-as-torchpar runs only the cases that do not skip under gloo (under BACKEND=gloo the skip
decisions are gloo's anyway); the plugin runs every case, and a case it skips (gated on the
name "gloo" or on a feature) is not counted against it: gloo-as-torchpar runs those. Cases
and ranks run one at a time, ranks forked from one process per configuration: at most
(world size + 1) processes at once.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TORCHPAR_FROM = ROOT  # the checkout whose torchpar package is tested (--torchpar-from)

# Cases that gloo passes and torchpar cannot, by design of the test rather than of torchpar:
# (mode, case) -> why. "*" matches every mode. This is the only place such cases are listed.
EXPECTED = {
    ("gloo-as-torchpar", "test_get_backend"): (
        "asserts dist.get_backend(group) == BACKEND ('gloo'); the patched group is, "
        "truthfully, 'torchpar'"
    ),
}


def _expected(mode, case):
    return EXPECTED.get((mode, case)) or EXPECTED.get(("*", case))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(mode, world_size, transport, cases, out_dir, case_timeout, log):
    """Runs one configuration in its own process; returns {case: result}."""
    tag = f"{mode}-ws{world_size}" + (f"-{transport}" if mode != "gloo" else "")
    out = os.path.join(out_dir, tag + ".json")
    temp = tempfile.mkdtemp(prefix=f"conformance-{tag}-")
    for sub in ("barrier", "test_dir"):
        os.makedirs(os.path.join(temp, sub))
    env = dict(
        os.environ,
        CONFORMANCE_MODE=mode,
        BACKEND="torchpar" if mode == "plugin" else "gloo",
        WORLD_SIZE=str(world_size),
        TEMP_DIR=temp,
        INIT_METHOD="env://",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(case_timeout),
        TORCHPAR_TRANSPORT=transport,
        PYTHONPATH=os.pathsep.join([TORCHPAR_FROM, os.path.join(ROOT, "build", "pydeps"),
                                    os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    t0 = time.monotonic()
    with open(os.path.join(out_dir, tag + ".log"), "w") as lf:
        subprocess.run([sys.executable, os.path.join(HERE, "suite.py"), out, ",".join(cases or [])],
                       env=env, stdout=lf, stderr=subprocess.STDOUT, cwd=temp)
    secs = time.monotonic() - t0
    results = json.load(open(out)) if os.path.exists(out) else {}
    counts = {k: sum(r["outcome"] == k for r in results.values()) for k in ("pass", "fail", "skip")}
    print(f"{tag:32s} {counts['pass']:4d} pass {counts['fail']:4d} fail {counts['skip']:4d} skip"
          f"   {secs:6.0f} s", file=log, flush=True)
    return tag, results, secs


def compare(gloo, ours, mode):
    """(unexpected, expected): cases gloo passes and `ours` does not."""
    unexpected, expected = [], []
    for case in sorted(gloo):
        if gloo[case]["outcome"] != "pass":
            continue
        mine = ours.get(case)
        if mine is not None and mine["outcome"] == "pass":
            continue
        if mode == "plugin" and (mine is None or mine["outcome"] == "skip"):
            continue  # gated on gloo's name or feature: gloo-as-torchpar runs it instead
        outcome = mine["outcome"] if mine else "not run"
        why = _expected(mode, case)
        row = (case, outcome, why or (mine or {}).get("message", ""))
        (expected if why else unexpected).append(row)
    return unexpected, expected


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="2,3")
    p.add_argument("--transports", default="shm,tcp", help="TORCHPAR_TRANSPORT values (shm means auto here)")
    p.add_argument("--modes", default="gloo-as-torchpar,plugin")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--case-timeout", type=int, default=120, help="seconds per case before it fails")
    p.add_argument("--out", default=os.path.join(ROOT, "build", "conformance"))
    p.add_argument("--gloo-from", default="", help="reuse gloo's results (gloo-wsN.json) from this folder "
                   "of an earlier run instead of running gloo again")
    p.add_argument("--torchpar-from", default=ROOT, help="test the torchpar package of this checkout "
                   "(e.g. an older build, for before/after numbers)")
    args = p.parse_args(argv)
    global TORCHPAR_FROM
    TORCHPAR_FROM = os.path.abspath(args.torchpar_from)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    only = [c for c in args.cases.split(",") if c]
    log = sys.stdout
    t_start = time.monotonic()
    failures = 0
    summary = {}
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        reuse = os.path.join(args.gloo_from, f"gloo-ws{ws}.json") if args.gloo_from else ""
        if reuse and os.path.exists(reuse):
            gloo = json.load(open(reuse))
            if only:
                gloo = {c: r for c, r in gloo.items() if c in only}
        else:
            _, gloo, _ = run_config("gloo", ws, "auto", only, args.out, args.case_timeout, log)
        ran = [c for c, r in gloo.items() if r["outcome"] != "skip"]
        for transport in args.transports.split(","):
            tp = "auto" if transport == "shm" else transport
            for mode in [m for m in args.modes.split(",") if m]:
                # The plugin's gates differ from gloo's: it runs the whole list (or --cases).
                cases = only if mode == "plugin" else ran
                if not cases and mode != "plugin":
                    continue
                tag, ours, secs = run_config(mode, ws, tp, cases, args.out, args.case_timeout, log)
                unexpected, expected = compare(gloo, ours, mode)
                summary[tag] = {
                    "gloo_pass": sum(r["outcome"] == "pass" for r in gloo.values()),
                    "pass": sum(r["outcome"] == "pass" for r in ours.values()),
                    "fail": sum(r["outcome"] == "fail" for r in ours.values()),
                    "skip": sum(r["outcome"] == "skip" for r in ours.values()),
                    "gloo_passes_torchpar_not": [u[0] for u in unexpected],
                    "expected": [e[0] for e in expected],
                    "seconds": round(secs),
                }
                failures += len(unexpected)
                for case, outcome, why in unexpected:
                    print(f"  FAIL {tag}: {case} ({outcome}): {why}", file=log)
                for case, outcome, why in expected:
                    print(f"  expected {tag}: {case} ({outcome}): {why}", file=log)
    total = time.monotonic() - t_start
    summary["wall_seconds"] = round(total)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n{'configuration':32s} {'gloo pass':>9s} {'pass':>5s} {'fail':>5s} {'gloo-only':>9s} {'expected':>8s}")
    for tag, s in summary.items():
        if tag == "wall_seconds":
            continue
        print(f"{tag:32s} {s['gloo_pass']:9d} {s['pass']:5d} {s['fail']:5d} "
              f"{len(s['gloo_passes_torchpar_not']):9d} {len(s['expected']):8d}")
    print(f"wall time {total:.0f} s; {failures} case(s) gloo passes and torchpar does not, unexpectedly")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
