"""torchpar.models.checkpoint (issue 20): a ParallelGPT checkpoint written with
torch.distributed.checkpoint at one dp x tp x pp layout resumes at another with the losses of
the uninterrupted single-process run: the weights, the optimizer state (SGD's momentum: the
second step after the resume depends on it) and the step all come back. 4 ranks, the tiny
model and batches of tests/test_gpt_3d.py; the resumed trainer is built from another seed, so
only the checkpoint can give it the right weights.
"""
import dataclasses
import re

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from harness import get_pool
from test_gpt_3d import CFG, LR, _batch, _reference_losses
from torchpar.models import GPTConfig
from torchpar.models.checkpoint import load_checkpoint, save_checkpoint
from torchpar.models.parallel_gpt import Layout, ParallelGPT

pytestmark = pytest.mark.timeout(300)

SAVED_AT = 3  # steps before the checkpoint
AFTER = 2     # steps run after it (the second shows the momentum was restored)

LAYOUTS = {
    "2x1x2": Layout(dp=2, pp=2, microbatches=2),
    "1x2x2": Layout(tp=2, pp=2, microbatches=2),
    "4x1x1": Layout(dp=4),
    "1x1x4": Layout(pp=4, microbatches=4),
    "fsdp-2x2x1": Layout(dp=2, tp=2, fsdp=True),
    "fsdp-2x1x2": Layout(dp=2, pp=2, fsdp=True, microbatches=2),
    "sp-1x2x2": Layout(tp=2, pp=2, sequence_parallel=True, microbatches=2),
    "fsdp-sp-2x2x1": Layout(dp=2, tp=2, fsdp=True, sequence_parallel=True),
    "interleaved-1x2x2": Layout(tp=2, pp=2, schedule="interleaved", microbatches=2),
    "hsdp-2x2x1x1": Layout(dp=4, fsdp=True, dp_replicate=2),  # replicate x shard x tp x pp
}


def _train_and_save(ctx, layout, path, optimizer="sgd", dtype="float32", cfg=CFG):
    """SAVED_AT steps, the checkpoint, then AFTER more steps (the run without a restart)."""
    torch.set_num_threads(1)
    layout = Layout(**{**layout.__dict__, "dtype": dtype})
    trainer = ParallelGPT(cfg, layout, lr=LR, optimizer=optimizer)
    for step in range(SAVED_AT):
        trainer.train_step(*_batch(step))
    save_checkpoint(path, trainer)
    return [trainer.train_step(*_batch(step)) for step in range(SAVED_AT, SAVED_AT + AFTER)]


def _resume(ctx, layout, path, optimizer="sgd", cfg=CFG, dtype="float32"):
    torch.set_num_threads(1)
    layout = Layout(**{**layout.__dict__, "dtype": dtype})
    trainer = ParallelGPT(cfg, layout, lr=LR, optimizer=optimizer, seed=1)  # other weights than seed 0's
    try:
        step = load_checkpoint(path, trainer)
    except ValueError as e:
        return str(e)
    assert trainer.step == step
    return step, [trainer.train_step(*_batch(s)) for s in range(step, step + AFTER)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{layout name: checkpoint folder} written at 2x1x2 (DDP + 1F1B) and at fully_shard + SP
    2x2x1, each after SAVED_AT steps."""
    out = {}
    for name in ("2x1x2", "fsdp-sp-2x2x1"):
        path = str(tmp_path_factory.mktemp("ckpt") / name)
        get_pool(4).run(_train_and_save, LAYOUTS[name], path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def want():
    return _reference_losses(SAVED_AT + AFTER)[SAVED_AT:]


def _check_resumed(results, want):
    for rank, result in enumerate(results):
        assert not isinstance(result, str), f"rank {rank}: {result}"
        step, losses = result
        assert step == SAVED_AT, f"rank {rank}: resumed at step {step}"
        torch.testing.assert_close(losses, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank}: {m}")


@pytest.mark.parametrize("saved_at,resume_at", [
    ("2x1x2", "2x1x2"),
    ("2x1x2", "1x2x2"),
    ("2x1x2", "4x1x1"),
    ("2x1x2", "fsdp-2x2x1"),
    ("2x1x2", "sp-1x2x2"),
    ("fsdp-sp-2x2x1", "1x1x4"),
    ("2x1x2", "hsdp-2x2x1x1"),
    pytest.param("fsdp-sp-2x2x1", "fsdp-2x1x2", marks=pytest.mark.slow),
    pytest.param("fsdp-sp-2x2x1", "interleaved-1x2x2", marks=pytest.mark.slow),
    pytest.param("2x1x2", "fsdp-sp-2x2x1", marks=pytest.mark.slow),
])
def test_resume_at_another_layout_continues_the_single_process_run(saved, want, saved_at, resume_at):
    _check_resumed(get_pool(4).run(_resume, LAYOUTS[resume_at], saved[saved_at]), want)


@pytest.mark.parametrize("name,dtype,dropout", [
    ("fsdp-2x1x2", "float32", 0.0), ("1x2x2", "float32", 0.0), ("sp-1x2x2", "float32", 0.1),
    pytest.param("2x2x1", "bfloat16", 0.0, marks=pytest.mark.slow),
    pytest.param("hsdp-2x2x1x1", "bfloat16", 0.0, marks=pytest.mark.slow)])
def test_adamw_round_trip_at_the_same_layout(tmp_path, name, dtype, dropout):
    """AdamW's two moments and step count, and under O2 the float32 masters: a resume at the same
    layout continues exactly as the run that did not stop. With dropout, each rank's random state
    comes back too (the default generator of its stage and its model-parallel seed: the resumed
    trainer is built from another seed), so the masks are the uninterrupted run's."""
    layout = LAYOUTS.get(name) or Layout(dp=2, tp=2)
    cfg = dataclasses.replace(CFG, dropout=dropout)
    path = str(tmp_path / "ckpt")
    pool = get_pool(4)
    continued = pool.run(_train_and_save, layout, path, "adamw", dtype, cfg)
    for rank, result in enumerate(pool.run(_resume, layout, path, "adamw", cfg, dtype)):
        assert not isinstance(result, str), f"rank {rank}: {result}"
        torch.testing.assert_close(result[1], continued[rank], rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"rank {rank}: {m}")


def test_hybrid_sharded_checkpoint_resumes_at_another_layout(tmp_path, want):
    """Saved at 2 replicas x 2 shards: the replicas' equal shards are written once (DCP drops
    the duplicate boxes), and a resume at tp x pp continues the single-process run."""
    path = str(tmp_path / "ckpt")
    pool = get_pool(4)
    pool.run(_train_and_save, LAYOUTS["hsdp-2x2x1x1"], path)
    _check_resumed(pool.run(_resume, LAYOUTS["1x2x2"], path), want)


@pytest.mark.parametrize("cfg,optimizer,message", [
    (GPTConfig.tiny(hidden=64), "sgd", r"of another model: hidden = 32 in the checkpoint, 64 here"),
    (GPTConfig.tiny(layers=2, heads=2), "sgd", r"heads = 4 in the checkpoint, 2 here; layers = 4 in the checkpoint, 2"),
    (CFG, "adamw", r"optimizer SGD in the checkpoint, AdamW here"),
])
def test_checkpoint_of_another_model_is_refused_on_every_rank(saved, cfg, optimizer, message):
    layout = Layout(dp=2, tp=2)
    for rank, err in enumerate(get_pool(4).run(_resume, layout, saved["2x1x2"], optimizer, cfg)):
        assert isinstance(err, str) and re.search(message, err), f"rank {rank}: {err!r}"


def test_missing_checkpoint_is_refused_on_every_rank(tmp_path):
    for rank, err in enumerate(get_pool(4).run(_resume, Layout(dp=4), str(tmp_path / "nothing"))):
        assert isinstance(err, str) and "not a torch.distributed.checkpoint folder" in err, f"rank {rank}: {err!r}"


TIED = GPTConfig.tiny(tie_embeddings=True)


@pytest.mark.parametrize("saved_at,resume_at", [
    ("2x1x2", "1x2x2"),
    ("fsdp-sp-2x2x1", "1x1x4"),
    pytest.param("2x1x2", "4x1x1", marks=pytest.mark.slow),
    pytest.param("fsdp-2x1x2", "sp-1x2x2", marks=pytest.mark.slow),
])
def test_tied_embeddings_resume_across_layouts(tmp_path, saved_at, resume_at):
    """The tied embedding is saved once, as the dense model's tok_emb.weight, whether the saving
    layout held one parameter (pp = 1) or two copies (pp > 1, the last stage's in lm_head); a
    resume at either kind of layout reads it into every copy, with its momentum."""
    path = str(tmp_path / "ckpt")
    pool = get_pool(4)
    pool.run(_train_and_save, LAYOUTS[saved_at], path, "sgd", "float32", TIED)
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    assert "model.tok_emb.weight" in saved and "optim.tok_emb.weight.momentum_buffer" in saved
    assert not any(k.startswith(("model.lm_head", "optim.lm_head")) for k in saved), sorted(saved)
    want = _reference_losses(SAVED_AT + AFTER, cfg=TIED)[SAVED_AT:]
    _check_resumed(pool.run(_resume, LAYOUTS[resume_at], path, "sgd", TIED), want)


def _save_untrained(ctx, layout, path):
    torch.set_num_threads(1)
    save_checkpoint(path, ParallelGPT(CFG, layout, lr=LR, optimizer="sgd"))


def test_checkpoint_before_the_first_step(tmp_path):
    """Saved before any step (no optimizer state yet): the resume starts at step 0 from the
    seed-0 weights with fresh momentum, as the single-process run does."""
    path = str(tmp_path / "ckpt")
    pool = get_pool(4)
    pool.run(_save_untrained, LAYOUTS["4x1x1"], path)
    want = _reference_losses(AFTER)
    for rank, result in enumerate(pool.run(_resume, LAYOUTS["1x2x2"], path)):
        assert not isinstance(result, str), f"rank {rank}: {result}"
        assert result[0] == 0
        torch.testing.assert_close(result[1], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank}: {m}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_issues_eight_rank_layouts_resume_each_other(tmp_path, want):
    """Issue 20's own example, on 8 ranks: saved at 2x2x2, resumed at 1x2x4 and at 4x1x2; and
    saved at hybrid sharding 2x2x2x1 (2 replicas of 2 shards, tp 2), resumed at 2x2x2. Each
    continues the single-process run."""
    pool = get_pool(8)
    for saved_at, resume_ats in ((Layout(dp=2, tp=2, pp=2, microbatches=2),
                                  [Layout(tp=2, pp=4, microbatches=4), Layout(dp=4, pp=2, microbatches=2)]),
                                 (Layout(dp=4, tp=2, fsdp=True, dp_replicate=2),
                                  [Layout(dp=2, tp=2, pp=2, microbatches=2)])):
        path = str(tmp_path / f"ckpt-{saved_at.dp}-{saved_at.dp_replicate}")
        pool.run(_train_and_save, saved_at, path)
        for layout in resume_ats:
            _check_resumed(pool.run(_resume, layout, path), want)
