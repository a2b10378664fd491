"""ParallelGPT: a step that raises on one rank alone raises on every rank, promptly.

A rank whose step raises owes its peers collectives: at pp = 1 its DDP peers wait in the last
backward's reduction, its fully_shard peers in a unit's all-gather or reduce-scatter, its tensor-
parallel peers (at any pp) in a tp all-reduce; before, they waited there until the group's timeout,
or until the failed rank's process exited. Now the failed rank frees them (DDP: the owed buckets,
zeros; tp and fully_shard groups: aborted with its error as the reason) and joins the step's
closing all-reduce with its failure flag up, so that every rank raises (ParallelGPT._fail). The
world group times out after ``TIMEOUT`` s, the mesh's groups after torch's default (30 min), and
each test is stopped after ``BOUND`` s: no time is measured, the bound only tells a prompt failure
from one at a timeout (as tests/test_pipeline_failures.py does).
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import torchpar
from harness import spawn
from test_gpt_3d import CFG, LR, STEPS, _batch, _reference_losses
from torchpar.models.parallel_gpt import Layout, ParallelGPT, _peer_lost

TIMEOUT = 900  # the groups': a rank that waits this long has missed the failure
BOUND = 90     # each test's, far below TIMEOUT


def _init(rank, world_size, init_file, backend):
    if backend == "torchpar" and not hasattr(torchpar._C, "ProcessGroupTorchpar"):
        pytest.skip("the torchpar backend is not built in this tree")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=TIMEOUT))


def _first_block(trainer):
    return next(iter(trainer.parts[0].blocks.values()))


def _make_it_raise(trainer, where):
    """A hook on this rank's first block: its first forward raises, or the backward of the
    step's last micro-batch (2 micro-batches: the second call), after the later blocks'
    gradients were reduced, part-way through a DDP stage's synchronised backward."""
    calls = [0]

    def forward(module, args):
        raise RuntimeError("boom in forward")

    def backward(module, grad_output):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("boom in backward")
    block = _first_block(trainer)
    if where == "forward":
        return block.register_forward_pre_hook(forward)
    return block.register_full_backward_pre_hook(backward)


def _one_rank_raises(rank, world_size, init_file, backend, layout, failing, where, steps_after):
    """Rank ``failing`` raises in step 0; returns (this rank's error, the losses of
    ``steps_after`` steps run afterwards)."""
    _init(rank, world_size, init_file, backend)
    torch.set_num_threads(1)
    trainer = ParallelGPT(CFG, layout, lr=LR, optimizer="sgd")
    hook = _make_it_raise(trainer, where) if rank == failing else None
    error = None
    try:
        trainer.train_step(*_batch(0))
    except RuntimeError as e:
        error = str(e)
    if hook is not None:
        hook.remove()
    # Every process stays alive until every rank has raised (a training loop that logs and goes
    # on): a process that exits releases its peers by itself (the backend sees it go).
    store = dist.distributed_c10d._get_default_store()
    store.add("raised", 1)
    while store.add("raised", 0) < world_size:
        time.sleep(0.05)
    return error, [trainer.train_step(*_batch(step)) for step in range(steps_after)]


def _check_every_rank_raised(results, failing, where):
    for rank, (error, _) in enumerate(results):
        assert error is not None, f"rank {rank} did not raise"
        if rank == failing:
            assert f"boom in {where}" in error, f"rank {rank}: {error}"
        else:  # the failure's reason (a tp or fully_shard group's abort), or a peer's step failed
            assert f"boom in {where}" in error or "the step failed on" in error, f"rank {rank}: {error}"


@pytest.mark.timeout(BOUND)
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("backend", ["torchpar", "gloo"])
def test_ddp_peers_of_a_rank_failing_alone_at_pp_1_raise_and_go_on(backend, where):
    """4x1x1 (DDP, 2 micro-batches): rank 1 raises alone, before its synchronised backward or
    part-way through it. Its peers raise instead of waiting in that backward's reduction (they
    did until the group's timeout); the optimizer does not step anywhere, and the next steps on
    every rank equal the single-process run's."""
    results = spawn(_one_rank_raises, 4, backend, Layout(dp=4, microbatches=2), 1, where, STEPS, timeout=BOUND)
    _check_every_rank_raised(results, 1, where)
    for rank, (error, losses) in enumerate(results):
        if rank != 1:
            assert "the step failed on rank(s) 1 " in error and "the next step zeroes them" in error, error
        torch.testing.assert_close(losses, _reference_losses(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {m}")


# (layout, failing rank, where): under tensor parallelism (any pp) and fully_shard (pp = 1) the
# failed rank's groups are aborted, so the model cannot go on; each rank must raise.
ABORTING = {
    # tp peer rank 0 waits in a tp all-reduce; the other replica (2, 3) in DDP's reduction.
    "2x2x1": (Layout(dp=2, tp=2, microbatches=2), 1, "forward"),
    # 2 replicas of 2 shards: rank 1's shard group {0, 1} and replicate group {1, 3} aborted.
    "hsdp-2x2x1x1": (Layout(dp=4, fsdp=True, dp_replicate=2, microbatches=2), 1, "backward"),
    # fully_shard over the whole world: DeviceMesh's group for it is the default group, aborted.
    "fsdp-4x1x1": (Layout(dp=4, fsdp=True, microbatches=2), 2, "forward"),
    # pp = 2, tp = 2: stage 1's tp rank 0 raises; its tp peer (rank 3) waited in a tp all-reduce
    # until the timeout, and stage 0's rank 1 on it (the schedule aborts pipeline groups only).
    "1x2x2": (Layout(tp=2, pp=2, microbatches=2), 2, "forward"),
    "2x1x2": (Layout(dp=2, pp=2, microbatches=2), 3, "backward"),
}
SLOW = {"fsdp-4x1x1", "2x1x2", "hsdp-2x2x1x1", "1x2x2"}
# make test's time budget (each case spawns fresh ranks): these run in make test-slow.
SLOW_VARIANTS = {"test_ddp_peers_of_a_rank_failing_alone_at_pp_1_raise_and_go_on[gloo-forward]",
                 "test_ddp_peers_of_a_rank_failing_alone_at_pp_1_raise_and_go_on[gloo-backward]",
                 "test_ddp_peers_of_a_rank_failing_alone_at_pp_1_raise_and_go_on[torchpar-backward]"}


@pytest.mark.timeout(BOUND)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in ABORTING])
def test_every_rank_raises_when_one_fails_alone(name):
    layout, failing, where = ABORTING[name]
    results = spawn(_one_rank_raises, 4, "torchpar", layout, failing, where, 0, timeout=BOUND)
    _check_every_rank_raised(results, failing, where)


def test_a_stuck_or_gone_peer_is_not_waited_for_again():
    """Review finding: a rank whose collective timed out (a peer stuck) joined the closing
    all-reduce, which waited for that peer too: a second timeout. It recognises the cause in
    its error, in the error's causes and in a reason relayed by an abort or a pipeline."""
    timeout = RuntimeError("torchpar all_reduce failed: Timed out after 10000 ms: timed out waiting for rank 3")
    relayed = RuntimeError("Schedule1F1B: pipeline rank 0 stopped waiting for its peers because pipeline stage 1 "
                           "failed in the forward: DistBackendError: ... timed out waiting for rank 3")
    wrapped = RuntimeError("boom")
    wrapped.__cause__ = RuntimeError("rank 2 (pid 7) has exited; the group cannot continue")
    assert _peer_lost(timeout) and _peer_lost(relayed) and _peer_lost(wrapped)
    assert not _peer_lost(RuntimeError("the group was aborted by rank 1: RuntimeError: boom in forward"))
