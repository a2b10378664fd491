"""ParallelGPT and examples/train_gpt.py on GPUs (issue 20): ``device="cuda"`` / ``--device cuda``
puts each rank's stages on cuda:LOCAL_RANK, and the torchpar backend carries their tensors over
NCCL (the pipeline's headers stay on the CPU, on the shared-memory path of the same groups).

One rank per GPU, at the layouts the machine's GPU count allows (1, 2 or 4 ranks), against the
single-process CPU run of tests/test_gpt_3d.py: the same losses to GPU float32 precision
(other matmul and attention kernels), gradient clipping and tied embeddings included. Skipped
where there is no GPU (CI); `make test-gpu` runs them where there is one.
"""
import os
import subprocess
import sys

import pytest
import torch

from harness import get_pool
from test_gpt_3d import CFG, LR, STEPS, _batch, _reference_losses
from test_gpt_clip_grad import MAX_NORM as CLIP
from test_gpt_clip_grad import _reference as _reference_clipped
from torchpar.models import GPTConfig
from torchpar.models.parallel_gpt import Layout, ParallelGPT

HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not HAS_GPU, reason="no CUDA device on this machine")]
WORLD = min(torch.cuda.device_count(), 4) if HAS_GPU else 1
TIED = GPTConfig.tiny(tie_embeddings=True)

# name: (world size, layout, config, clip_grad)
CASES = {
    "1x1x1": (1, Layout(), CFG, 0.0),
    "1x1x1-clip": (1, Layout(microbatches=2), CFG, CLIP),
    "2x1x1": (2, Layout(dp=2), CFG, 0.0),
    "1x2x1-sp": (2, Layout(tp=2, sequence_parallel=True), CFG, CLIP),
    "1x1x2": (2, Layout(pp=2, microbatches=2), CFG, 0.0),
    "tied-1x1x2": (2, Layout(pp=2, microbatches=2), TIED, CLIP),
    "fsdp-2x1x1": (2, Layout(dp=2, fsdp=True), CFG, CLIP),
    "2x1x2": (4, Layout(dp=2, pp=2, microbatches=2), CFG, CLIP),
    "1x2x2": (4, Layout(tp=2, pp=2, microbatches=2), CFG, 0.0),
    "fsdp-2x2x1": (4, Layout(dp=2, tp=2, fsdp=True), CFG, CLIP),
    "tied-1x2x2": (4, Layout(tp=2, pp=2, microbatches=2), TIED, CLIP),
}


def _cuda_run(ctx, layout, cfg, clip):
    trainer = ParallelGPT(cfg, layout, lr=LR, optimizer="sgd", device="cuda", clip_grad=clip)
    here = torch.device("cuda", torch.cuda.current_device())
    devices = {p.device for m in trainer.modules for p in m.parameters()}
    losses = [trainer.train_step(*_batch(step)) for step in range(STEPS)]
    return here, devices, losses, trainer.eval_step(*_batch(99))


@pytest.mark.parametrize("name", list(CASES))
def test_layout_on_gpus_equals_single_process_cpu(name):
    world, layout, cfg, clip = CASES[name]
    if world > WORLD or WORLD % world:
        pytest.skip(f"a layout of {world} ranks on {WORLD} GPUs")
    if world < WORLD:
        layout = Layout(**{**layout.__dict__, "dp": layout.dp * WORLD // world})  # fill every GPU with dp
    want = _reference_clipped(cfg)[0] if clip else _reference_losses(cfg=cfg)
    for rank, (here, devices, losses, _) in enumerate(get_pool(WORLD).run(_cuda_run, layout, cfg, clip)):
        assert here == torch.device("cuda", rank % torch.cuda.device_count()), f"rank {rank}: current device {here}"
        assert devices == {here}, f"rank {rank}: parameters on {devices}"
        torch.testing.assert_close(losses, want, rtol=1e-3, atol=1e-4, msg=lambda m: f"rank {rank}: {m}")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")


def test_train_gpt_example_on_gpus(tmp_path):
    """torchrun, one rank per GPU, --device cuda with clipping (the default 1.0), a checkpoint
    saved on the GPUs and resumed at another layout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    layouts = {1: (["--dp", "1"], ["--dp", "1"]), 2: (["--pp", "2"], ["--tp", "2"]),
               4: (["--dp", "2", "--pp", "2"], ["--tp", "2", "--pp", "2"])}
    first, second = layouts[WORLD if WORLD in layouts else 1]
    nproc = WORLD if WORLD in layouts else 1
    ckpt = str(tmp_path / "ckpt")
    common = ["--model", "tiny", "--batch-size", "8", "--device", "cuda", "--no-progress", "--out", str(tmp_path)]

    def torchrun(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", SCRIPT,
               *common, *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=250, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    assert "4 steps in" in torchrun(*first, "--steps", "4", "--save", ckpt)
    out = torchrun(*second, "--steps", "6", "--resume", ckpt)
    assert "2 steps in" in out and ", cuda)" in out
