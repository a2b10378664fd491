"""examples/train_gpt.py (issue 20) as users run it: one process without torchrun (on --data,
clipping every step), 4 ranks under torchrun (2 x 2 x 1 and 1 x 2 x 2 with a loss-curve PNG), and
a layout that does not fit the world size refused by every rank before training."""
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
    """With --clip-grad 0.01, below any gradient norm here: the last step's norm is reported,
    above the bound it was clipped to."""
    out = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--steps", "4", "--eval-every", "2",
                          "--batch-size", "4", "--no-progress", "--out", str(tmp_path), "--clip-grad", "0.01",
                          "--data", os.path.join(ROOT, "docs")],
                         capture_output=True, text=True, timeout=100, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 steps in" in out.stdout and (tmp_path / "loss.png").stat().st_size > 1000
    norm = re.search(r"gradient norm at the last step: ([0-9.]+) \(clipped to 0.01\)", out.stdout)
    assert norm and float(norm.group(1)) > 0.01, out.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [["--dp", "2", "--tp", "2"], ["--tp", "2", "--pp", "2", "--sequence-parallel"],
                                    ["--dp", "4", "--fsdp", "--dp-replicate", "2"]],
                         ids=["2x2x1", "1x2x2-sp", "hsdp-2x2x1x1"])
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


def _final_losses(stdout):
    m = re.search(r"final train loss ([0-9.]+), validation loss ([0-9.]+)", stdout)
    assert m, stdout
    return float(m.group(1)), float(m.group(2))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_save_then_resume_at_another_layout(tmp_path):
    """--save after 4 steps at 2 x 1 x 2, --resume at 1 x 2 x 2 up to step 8 (AdamW, warm-up then
    cosine: the schedule goes on from the step): the same final losses as 8 steps in one process."""
    ckpt, common = str(tmp_path / "ckpt"), ["--model", "tiny", "--batch-size", "8", "--warmup", "3", "--no-progress"]
    out = _torchrun(4, "--dp", "2", "--pp", "2", *common, "--steps", "4", "--save", ckpt, "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    out = _torchrun(4, "--tp", "2", "--pp", "2", *common, "--steps", "8", "--resume", ckpt, "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 steps in" in out.stdout
    single = subprocess.run([sys.executable, SCRIPT, *common, "--steps", "8", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=200, env=ENV)
    assert single.returncode == 0, single.stdout + single.stderr
    assert _final_losses(out.stdout) == pytest.approx(_final_losses(single.stdout), rel=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_of_another_model_is_refused_on_every_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = _torchrun(4, "--dp", "4", "--model", "tiny", "--steps", "2", "--batch-size", "8", "--no-progress",
                    "--save", ckpt, "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    out = _torchrun(4, "--dp", "4", "--model", "tiny", "--layers", "2", "--steps", "4", "--batch-size", "8",
                    "--resume", ckpt, "--out", str(tmp_path))
    assert out.returncode != 0
    for rank in range(4):
        assert re.search(rf"rank {rank}\): error: checkpoint .* is of another model: layers = 4 in the checkpoint, "
                         r"2 here", out.stderr), out.stderr
