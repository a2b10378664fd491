"""The examples run as users run them: under torchrun."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["torchpar", "gloo"])
def test_train_ddp_example_keeps_replicas_identical(backend):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "examples", "train_ddp.py"), "--steps", "20", "--width", "64", "--backend", backend]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "replicas identical after 20 steps" in out.stdout
