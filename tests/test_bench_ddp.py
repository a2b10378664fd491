"""``python -m torchpar.bench ddp`` runs end to end on a tiny MLP: every mode timed, the overlap
bound consistent with the modes it is made of, and the bucket timeline of ``--timeline``
accounting for every gradient byte in each step (issue 21's DDP overlap measurements)."""
import json
import sys
import time

import pytest

from torchpar.bench import ddp as bench_ddp


def test_bench_ddp_bound_and_timeline(tmp_path, capsys):
    out = tmp_path / "ddp.json"
    width, depth = 64, 3
    assert bench_ddp.main(["--backends", "torchpar", "--width", str(width), "--depth", str(depth),
                           "--rounds", "1", "--steps", "2", "--bucket-cap-mb", "0.01", "--timeline",
                           "--json", str(out), "--plot", str(tmp_path / "ddp.png")]) == 0
    assert (tmp_path / "ddp.png").stat().st_size > 0
    result = json.loads(out.read_text())["results_ms"]["torchpar"]
    ms = result["median"]
    assert set(bench_ddp.MODES) <= set(ms) and all(ms[m] > 0 for m in bench_ddp.MODES)
    assert ms["overlap_bound"] >= max(ms["compute_only"], ms["comm_flat"])
    grad_bytes = depth * (width * width + width) * 4
    assert len(result["timeline"]) == 3
    for row in result["timeline"]:
        buckets = row["buckets"]
        assert len(buckets) > 1  # 10 KB buckets: one per layer at least
        assert sum(b["bytes"] for b in buckets) == grad_bytes
        assert all(row["forward"] <= b["ready"] <= b["done"] <= row["step"] for b in buckets)
    printed = capsys.readouterr().out
    assert "naive/bound" in printed and "link idle" in printed


def test_bench_ddp_across_test_hosts(tmp_path):
    """``--hosts 2``: one job per link over network-namespace hosts (as root), each rank running
    the benchmark's own measurement; rank 0's results come back keyed by link."""
    from torchpar.bench._hosts import Hosts
    why = Hosts.unavailable()
    if why:
        pytest.skip(f"no test hosts: {why}")
    out = tmp_path / "ddp_hosts.json"
    assert bench_ddp.main(["--hosts", "2", "--links", "unshaped", "--width", "64", "--depth", "2",
                           "--rounds", "1", "--steps", "1", "--timeline", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 2 and data["meta"]["hosts"] == 2
    veth = data["results_ms"]["veth"]
    assert all(veth["median"][m] > 0 for m in bench_ddp.MODES)
    assert len(veth["timeline"]) == 3


def test_a_hosts_job_past_its_timeout_fails_naming_it():
    """run_job, under every ``--hosts`` benchmark: a rank that never finishes ends the job at
    its timeout with a clear error (leaving the hosts kills it), not a wait without end."""
    from torchpar.bench._hosts import Hosts, run_job
    why = Hosts.unavailable()
    if why:
        pytest.skip(f"no test hosts: {why}")
    start = time.monotonic()
    with pytest.raises(SystemExit, match=r"did not finish within 3 s"):
        run_job(2, 1, "unshaped", "1gbit", [sys.executable, "-c", "print('started', flush=True); "
                                            "import time; time.sleep(120)"], timeout=3)
    assert time.monotonic() - start < 60
