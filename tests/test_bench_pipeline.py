"""``python -m torchpar.bench pipeline`` runs end to end on a tiny MLP: every schedule, ours and
torch's, timed in the same ranks; the activation memory it reports is the schedules' (1F1B holds
p of GPipe's m micro-batches), and the round-by-round ratio is consistent with its rounds (the
numbers themselves are the benchmark's business, not a test's)."""
import json

import pytest

from torchpar.bench import pipeline as bench_pipeline


@pytest.mark.timeout(180)
def test_bench_pipeline_runs_every_schedule(tmp_path, capsys):
    out, png = tmp_path / "pipeline.json", tmp_path / "pipeline.png"
    p, m, rounds = 2, 4, 3
    assert bench_pipeline.main(["--width", "32", "--depth", "4", "--batch", "8", "--microbatches", str(m),
                                "--rounds", str(rounds), "--steps", "1", "--warmup", "1",
                                "--json", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == set(bench_pipeline.OURS + bench_pipeline.THEIRS)
    for mode, r in results.items():
        assert r["step_ms"] > 0 and 0 <= r["bubble"] < 1, (mode, r)
        assert r["peak_activation_bytes"] > 0, mode
    # Saved-tensor bytes are exact: 1F1B holds at most p micro-batches on a rank where GPipe holds
    # all m (the peak is the heaviest rank's; the last stage's are larger, it keeps the loss's
    # inputs too), and torch's schedules hold what ours do.
    assert results["1f1b"]["peak_activation_bytes"] * m <= results["gpipe"]["peak_activation_bytes"] * p
    for ours, theirs in (("gpipe", "torch_gpipe"), ("1f1b", "torch_1f1b"), ("interleaved", "torch_interleaved"),
                         ("looped_bfs", "torch_looped_bfs")):
        assert results[ours]["peak_activation_bytes"] == results[theirs]["peak_activation_bytes"]
    paired = report["paired_1f1b_vs_torch_1f1b"]
    assert paired["rounds"] == rounds and 0 < paired["q1"] <= paired["median"] <= paired["q3"]
    assert report["targets"]["1f1b_over_gpipe_memory"]["met"]
    printed = capsys.readouterr().out
    assert "round by round" in printed and "issue targets:" in printed
