"""examples/train_gpt.py (issue 20) as users run it: one process without torchrun (on --data), 4 ranks
under torchrun (2 x 2 x 1 and 1 x 2 x 2 with a loss-curve PNG), and a layout that does not fit
the world size refused by every rank before training."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _torchrun(nproc, *args, timeout=200):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.timeout(120)
def test_single_process_run(tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--steps", "4", "--eval-every", "2",
                          "--batch-size", "4", "--no-progress", "--out", str(tmp_path),
                          "--data", os.path.join(ROOT, "docs")],
                         capture_output=True, text=True, timeout=100, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 steps in" in out.stdout and (tmp_path / "loss.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [["--dp", "2", "--tp", "2"], ["--tp", "2", "--pp", "2", "--sequence-parallel"]],
                         ids=["2x2x1", "1x2x2-sp"])
def test_torchrun_four_ranks(tmp_path, layout):
    out = _torchrun(4, *layout, "--model", "tiny", "--steps", "6", "--eval-every", "3", "--batch-size", "8",
                    "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 steps in" in out.stdout and f"loss curve: {tmp_path / 'loss.png'}" in out.stdout
    assert (tmp_path / "loss.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bad_layout_is_refused_on_every_rank(tmp_path):
    out = _torchrun(4, "--dp", "3", "--tp", "2", "--model", "tiny", "--steps", "2", "--out", str(tmp_path))
    assert out.returncode != 0
    for rank in range(4):
        assert re.search(rf"rank {rank}\): error: GPT layout: dp x tp x pp = 3 x 2 x 1 = 6, but the world size is 4",
                         out.stderr), out.stderr
