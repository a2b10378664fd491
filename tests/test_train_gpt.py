"""examples/train_gpt.py (issue 20) as users run it: one process without torchrun (on --data,
clipping every step), 4 ranks under torchrun (2 x 2 x 1 and 1 x 2 x 2 with a loss-curve PNG), and
a layout that does not fit the world size refused by every rank before training."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

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


_KILLED_AFTER_STEP = """
import runpy, sys
from torchpar.models.parallel_gpt import ParallelGPT
train_step = ParallelGPT.train_step
def killed(self, *batch):
    if self.step == {kill}:
        raise KeyboardInterrupt("killed")
    return train_step(self, *batch)
ParallelGPT.train_step = killed
sys.exit(runpy.run_path({script!r}, run_name="train_gpt")["main"]({argv!r}))
"""


@pytest.mark.timeout(200)
def test_a_run_killed_after_a_periodic_checkpoint_resumes_as_if_it_had_not_stopped(tmp_path):
    """--save-every 5 of a 10-step run killed at step 7: --resume goes on from step 5 on the same
    learning-rate schedule (it follows --steps) to the uninterrupted run's final losses
    (audit finding: only a checkpoint at the end existed, so a resumed run always had another
    schedule), with dropout drawing the uninterrupted run's masks (the random state is in the
    checkpoint; before it was, the resumed run drew the first steps' masks again)."""
    ckpt = str(tmp_path / "ckpt")
    common = ["--model", "tiny", "--batch-size", "4", "--warmup", "2", "--dropout", "0.1", "--steps", "10",
              "--no-progress", "--eval-every", "100"]
    run = lambda out, *extra, code=None: subprocess.run(
        [sys.executable, *(["-c", code] if code else [SCRIPT]), *([] if code else [*common, "--out", str(tmp_path / out),
                                                                        *extra])],
        capture_output=True, text=True, timeout=100, env=ENV)
    whole = run("whole")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    killed = run(None, code=_KILLED_AFTER_STEP.format(kill=7, script=SCRIPT, argv=[
        *common, "--out", str(tmp_path / "killed"), "--save", ckpt, "--save-every", "5"]))
    assert killed.returncode != 0 and "killed" in killed.stderr, killed.stdout + killed.stderr
    assert open(os.path.join(ckpt, "latest")).read().strip() == "step_5"
    # Resumed as saved, and with full recomputation and GPipe (which change no random draw).
    for out, extra in (("resumed", []), ("recompute", ["--recompute", "full", "--schedule", "gpipe"])):
        resumed = run(out, "--resume", ckpt, *extra)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert "5 steps in" in resumed.stdout and "another learning-rate schedule" not in resumed.stderr
        assert "random streams start afresh" not in resumed.stderr, resumed.stderr
        # Every step's loss (loss.json: full precision), dropout drawing the uninterrupted run's masks.
        got = json.load(open(tmp_path / out / "loss.json"))["train"]
        want = json.load(open(tmp_path / "whole" / "loss.json"))["train"][5:]
        assert [s for s, _ in got] == [s for s, _ in want]
        torch.testing.assert_close([v for _, v in got], [v for _, v in want], rtol=1e-6, atol=0)
    # Other micro-batches: other draws; the streams start afresh, and the note says why.
    other = run("other", "--resume", ckpt, "--micro-batches", "4")
    assert other.returncode == 0 and "start afresh from --seed 0: the checkpoint's were saved at another layout " \
        "(microbatches 2 -> 4)" in other.stderr, other.stdout + other.stderr
    # The same checkpoint resumed under another --steps: the schedule differs, and says so.
    longer = run("longer", "--resume", ckpt, "--steps", "12")
    assert longer.returncode == 0 and "--steps 12 (the saved run's 10)" in longer.stderr, longer.stdout + longer.stderr


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["small corpus", "save inside data"] + [pytest.param(c, marks=pytest.mark.slow) for c in (
    "checkpoint at steps", "save over another run", "eval every 0", "out is a file", "interleaved at pp 1",
    "heads")])
def test_bad_arguments_are_refused_before_training(tmp_path, case):
    """Each refused before the first step with a message naming it (audit findings: these failed
    mid-run with a traceback, or after training, or trained nothing and exited 0)."""
    args = ["--model", "tiny", "--batch-size", "4", "--steps", "2", "--no-progress", "--out", str(tmp_path / "o")]
    if case == "small corpus":  # passes the 1000-byte floor; its validation split is shorter than a window
        (tmp_path / "d.txt").write_bytes(bytes(range(256)) * 8)
        args += ["--data", str(tmp_path / "d.txt"), "--seq-len", "256"]
        expect = "validation split has 205 bytes"
    elif case in ("save over another run", "checkpoint at steps"):  # a first run saved into c
        ok = subprocess.run([sys.executable, SCRIPT, *args, "--save", str(tmp_path / "c")], capture_output=True,
                            text=True, timeout=100, env=ENV)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        if case == "save over another run":
            args += ["--save", str(tmp_path / "c")]
            expect = "holds the checkpoints of another run"
        else:
            args += ["--resume", str(tmp_path / "c")]
            expect = "the checkpoint is at step 2, --steps 2: nothing to train"
    elif case == "eval every 0":
        args += ["--eval-every", "0"]
        expect = "--eval-every must be >= 1"
    elif case == "save inside data":
        (tmp_path / "corpus").mkdir()
        (tmp_path / "corpus" / "a.txt").write_text("text " * 1000)
        args += ["--data", str(tmp_path / "corpus"), "--save", str(tmp_path / "corpus" / "ckpt")]
        expect = "is inside --data"
    elif case == "out is a file":
        (tmp_path / "f").write_text("")
        args[-1] = str(tmp_path / "f")
        expect = "exists and is not a folder"
    elif case == "interleaved at pp 1":
        args += ["--schedule", "interleaved"]
        expect = "needs at least 2 pipeline ranks"
    else:
        args += ["--hidden", "30"]
        expect = "hidden 30 is not a multiple of heads 4"
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=100, env=ENV)
    assert out.returncode == 2 and expect in out.stderr and "steps in" not in out.stdout, out.stdout + out.stderr


@pytest.fixture(scope="module")
def script():
    """examples/train_gpt.py's functions, imported (its main() does not run)."""
    import runpy
    return runpy.run_path(SCRIPT, run_name="train_gpt")


@pytest.mark.parametrize("argv,expect", [
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"), (["--hidden", "0"], "--hidden must be >= 1, got 0"),
    (["--seq-len", "-1"], "--seq-len must be >= 1, got -1"), (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--steps", "0"], "--steps must be >= 1, got 0"), (["--save-every", "5"], "--save-every needs --save DIR")])
def test_bad_numbers_are_refused_by_the_argument_parser(script, capsys, argv, expect):
    """Audit findings: these crashed inside the model with a traceback (or, --steps 0, reported
    a loss of nan; --save-every without --save was ignored)."""
    with pytest.raises(SystemExit) as e:
        script["parse_args"](argv)
    assert e.value.code == 2 and expect in capsys.readouterr().err


def test_a_data_folder_skips_binary_files(script, tmp_path):
    """--data FOLDER reads its text files: an image or a checkpoint kept beside them is not
    trained on (audit finding: every file was read)."""
    (tmp_path / "a.txt").write_bytes(b"hello world\n" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_bytes(b"x = 1\n" * 200)
    (tmp_path / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" * 50)
    assert len(script["load_corpus"](str(tmp_path))) == 1200 + 1200

