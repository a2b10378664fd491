"""The benchmark suites the README names that no other test runs end to end, on tiny sizes:
``collectives`` (both transports), ``zero`` and ``gpt_breakdown`` run, time both sides in the
same ranks and write their reports, and what they report exactly (bytes) is what the systems
hold. The timings are the benchmarks' business, not a test's."""
import json
import os

import pytest

from torchpar.bench import collectives as bench_collectives
from torchpar.bench import gpt_breakdown as bench_gpt_breakdown
from torchpar.bench import zero as bench_zero

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_bench_collectives_times_both_backends(tmp_path, transport):
    out = tmp_path / "collectives.json"
    before = os.environ.get("TORCHPAR_TRANSPORT")
    ops = ["all_reduce", "all_gather_into_tensor", "broadcast"]
    assert bench_collectives.main(["--world-sizes", "2", "--sizes", "4096,65536", "--ops", ",".join(ops),
                                   "--budget", "0.05", "--batches", "2", "--transport", transport, "--quiet",
                                   "--json", str(out), "--plot", str(tmp_path / "c.png"),
                                   "--markdown", str(tmp_path / "c.md")]) == 0
    rows = json.loads(out.read_text())["results"]
    assert sorted((r["op"], r["bytes"]) for r in rows) == sorted((op, b) for op in ops for b in (4096, 65536))
    for r in rows:
        assert r["transport"] == transport and r["world_size"] == 2
        assert r["torchpar"] > 0 and r["gloo"] > 0 and r["speedup"] > 0, r
    assert (tmp_path / "c.png").stat().st_size > 0 and "all_reduce" in (tmp_path / "c.md").read_text()
    # --transport applies to the ranks it spawns, not to the rest of this process (it did, and
    # the tests after this one ran over TCP).
    assert os.environ.get("TORCHPAR_TRANSPORT") == before


def test_bench_zero_reports_the_sharded_bytes(tmp_path):
    out = tmp_path / "zero.json"
    assert bench_zero.main(["--backends", "torchpar", "--width", "32", "--depth", "2", "--batch", "2",
                            "--seq", "8", "--steps", "1", "--rounds", "1", "--json", str(out),
                            "--plot", str(tmp_path / "zero.png")]) == 0
    assert (tmp_path / "zero.png").stat().st_size > 0
    got = json.loads(out.read_text())["results"]["torchpar"]
    assert set(got) == {"ddp", "zero1", "zero2", "torch-zero"}
    assert all(r["step_ms"] > 0 for r in got.values())
    ddp = got["ddp"]
    # Two ranks: each holds half of AdamW's state under every ZeRO (a few bytes of per-shard
    # step counters aside), and ZeRO-2 half of the gradients too.
    for system in ("zero1", "zero2", "torch-zero"):
        assert got[system]["state_bytes"] == pytest.approx(ddp["state_bytes"] / 2, rel=1e-2), system
    assert got["zero2"]["grad_bytes"] == pytest.approx(ddp["grad_bytes"] / 2, rel=1e-2)
    assert got["zero1"]["grad_bytes"] == ddp["grad_bytes"]


def test_bench_gpt_breakdown_runs_both_stacks(capsys):
    assert bench_gpt_breakdown.main(["--layout", "2x1x2", "--variants", "torchpar,torchpar+loop,torch",
                                     "--hidden", "32", "--heads", "2", "--layers", "2", "--seq", "8",
                                     "--batch", "8", "--warmup", "1", "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    for variant in ("torchpar:", "torchpar+loop:", "torch:"):
        line = next(ln for ln in printed.splitlines() if ln.strip().startswith(variant))
        assert "tok/s" in line and "CPU" in line, line
