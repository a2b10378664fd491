"""``python -m torchpar.bench tp`` runs end to end on a tiny block, and the bytes our layers send
per step equal the benchmark's analytic count (the number the write-up reports)."""
import json

import pytest

from torchpar.bench import tp as bench_tp


def test_bench_tp_bytes_equal_analytic(tmp_path):
    out = tmp_path / "tp.json"
    assert bench_tp.main(["--backends", "gloo", "--tp", "2", "--width", "32", "--heads", "4", "--seq", "8",
                          "--rounds", "1", "--warmup", "0", "--scaling-width", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"]["gloo"]["2"]
    for sp in (False, True):
        got = result["ours/sp" if sp else "ours/tp"]["bytes"]
        assert got == pytest.approx(bench_tp.analytic_bytes(8, 1, 32, 2, sp), rel=1e-12), (sp, got)
        assert result["dtensor/sp" if sp else "dtensor/tp"]["median_ms"] > 0
