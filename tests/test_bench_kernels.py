"""Smoke test of ``python -m torchpar.bench kernels``: it runs, and its report holds the fields
the README's table is made of (the numbers themselves are the bench's business, not a test's)."""
import json
import subprocess
import sys

import pytest

# The bench measures the copy-bandwidth ceiling (hundreds of DRAM-sized copies) even for one
# tiny shape: 40-70 s on the 2-core machine, minutes under load. So `make test-slow`.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(330)]


def test_kernels_bench_writes_its_report(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torchpar.bench", "kernels", "--shapes", "64x1024", "--dtypes",
         "float32", "bfloat16", "--reps", "1", "--no-compile", "--json", str(out),
         "--plot", str(tmp_path / "kernels.png")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ceiling" in proc.stdout
    assert (tmp_path / "kernels.png").stat().st_size > 0
    report = json.loads(out.read_text())
    assert report["copy_gbs"] > 0
    assert report["copy_gbs"] == max(report["copy_kinds_gbs"].values())
    assert set(report["copy_kinds_gbs"]) == {"plain", "streaming"}
    rows = report["results"]
    assert len(rows) == 3 * 2 * 2  # ops x dtypes x passes
    for row in rows:
        for key in ("torchpar_ms", "eager_ms", "gbs", "copy_gbs", "pct_copy", "compute_gbs",
                    "compute_pct_copy"):
            assert row[key] > 0, (row["op"], row["dtype"], row["pass"], key)


def test_kernels_bench_times_frozen_parameters_with_streamed_outputs(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torchpar.bench", "kernels", "--frozen", "--shapes", "64x1024",
         "--dtypes", "bfloat16", "--reps", "1", "--no-compile", "--streaming-stores", "always",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "frozen parameters" in proc.stdout
    report = json.loads(out.read_text())
    assert report["meta"]["frozen"] is True and len(report["results"]) == 3 * 2
    assert report["meta"]["streaming_store_bytes"] == 0
