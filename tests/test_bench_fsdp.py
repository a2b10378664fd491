"""Smoke test of ``python -m torchpar.bench fsdp`` on a tiny GPT: it runs both systems on both
backends and writes its report (the numbers are the bench's business, not a test's)."""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_fsdp_bench_writes_its_report(tmp_path):
    out = tmp_path / "fsdp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torchpar.bench", "fsdp", "--dim", "32", "--layers", "2", "--heads", "2",
         "--vocab", "128", "--seq", "8", "--rounds", "1", "--json", str(out), "--plot", str(tmp_path / "fsdp.png")],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    assert "time / torch_fsdp2" in proc.stdout
    assert (tmp_path / "fsdp.png").stat().st_size > 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"torchpar", "gloo"}
    for per_backend in results.values():
        assert {"fsdp", "torch_fsdp2"} <= set(per_backend)
        for row in per_backend.values():
            assert row["median_ms"] > 0 and row["peak_bytes"] > 0 and row["fwd_bwd_peak_bytes"] > 0


def test_fsdp_bench_runs_hybrid_sharding_at_4_ranks(tmp_path):
    out = tmp_path / "hsdp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torchpar.bench", "fsdp", "--world-size", "4", "--systems", "hsdp,torch_hsdp,torch_fsdp2",
         "--backends", "torchpar", "--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "128", "--seq", "8",
         "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    assert "hsdp / torch_hsdp" in proc.stdout
    assert set(json.loads(out.read_text())["results"]["torchpar"]) == {"hsdp", "torch_hsdp", "torch_fsdp2"}


def test_fsdp_bench_across_test_hosts(tmp_path):
    """``--hosts 2`` (2 ranks each): one job per link over network-namespace hosts (as root);
    rank 0's results come back keyed by link."""
    from torchpar.bench._hosts import Hosts
    why = Hosts.unavailable()
    if why:
        pytest.skip(f"no test hosts: {why}")
    out = tmp_path / "hosts.json"
    # --timeout below the subprocess's: a stuck job is ended by the bench, which removes its hosts.
    # "torch_fsdp2" alone: the ranks must not also run "fsdp" (a substring of it).
    proc = subprocess.run(
        [sys.executable, "-m", "torchpar.bench", "fsdp", "--hosts", "2", "--links", "unshaped",
         "--systems", "torch_fsdp2,hsdp", "--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "128",
         "--seq", "8", "--rounds", "1", "--timeout", "200", "--json", str(out)],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 4 and data["meta"]["hosts"] == 2
    assert set(data["results"]) == {"veth"} and set(data["results"]["veth"]) == {"torch_fsdp2", "hsdp"}
