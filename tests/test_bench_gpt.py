"""Smoke test of ``python -m torchpar.bench gpt`` on a tiny GPT at three layouts: both systems run
(torch's side with its fused AdamW too, whose kernel refuses a group that mixes DTensors and plain
tensors, as 1x2x2 has without DDP) and the report is written (the numbers are the bench's business)."""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_gpt_bench_writes_its_report(tmp_path):
    out = tmp_path / "gpt.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torchpar.bench", "gpt", "--layouts", "2x1x2,1x2x2,fsdp-2x2x1,hsdp-2x2x1x1",
         "--hidden", "32", "--heads", "2", "--layers", "2", "--seq", "8", "--batch", "8", "--warmup", "1",
         "--steps", "1",
         "--json", str(out), "--plot", str(tmp_path / "gpt.png"), "--markdown", str(tmp_path / "gpt.md")],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    assert "tok/s torchpar / torch" in proc.stdout
    assert (tmp_path / "gpt.png").stat().st_size > 0
    assert "| 2x1x2 |" in (tmp_path / "gpt.md").read_text()
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"2x1x2", "1x2x2", "fsdp-2x2x1", "hsdp-2x2x1x1"}
    for row in results.values():
        assert set(row) == {"torchpar", "torch"}
        assert row["torchpar"]["tokens_per_s"] > 0 and min(row["torchpar"]["peak_bytes_per_rank"]) > 0
        assert "error" not in row["torch"], row["torch"]
        assert row["torch"]["tokens_per_s"] > 0
        paired = row["torchpar"]["paired_speedup"]  # one round: its ratio is the quartiles too
        assert paired["rounds"] == 1 and paired["q1"] == paired["median"] == paired["q3"] > 0
