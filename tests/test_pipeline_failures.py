"""A stage that fails mid-step: every pipeline rank raises promptly, naming the failed stage.

Without it, a rank whose stage raises leaves its neighbours waiting for messages it will never
send, and ranks two stages away waiting on those neighbours, until the group's timeout. The
groups here time out after ``TIMEOUT`` s, and each test is stopped (failed) after ``BOUND`` s,
far sooner: every rank must have raised by then, with an error that names the stage and
pipeline rank that failed and what it raised. (No time is measured: the bound only tells a
prompt failure from one at the group's timeout.) A rank that had finished the failed step
before the failure raises at the start of the next one.

torchpar: the failed rank's process stays alive (a training loop that logs and checkpoints),
so nothing but the pipeline's own abort of the group can tell its peers. gloo cannot reach a
peer's pending receive from another process while that process lives (its ``abort`` leaves
the connections open), so there the failed rank exits, as an uncaught exception makes it do,
and its peers learn why from the store (docs/pipeline.md, "Failures").
"""
import copy
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchpar
from harness import spawn
from torchpar.parallel.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe


# In make test-slow (make test's time budget): variants of cases whose other variants run in make test.
SLOW_VARIANTS = {"test_fully_shard_groups_survive_a_step_that_failed_before_running[one pipeline]",
                 "test_data_parallel_peers_of_a_failed_armed_pipeline_are_not_left_in_its_reduction[torchpar-forward]",
                 "test_a_stage_that_raises_fails_every_rank_promptly[torchpar-4-2-7-forward]",
                 "test_fully_shard_peers_of_a_failed_pipeline_fail_at_once[forward-hybrid]",
                 "test_data_parallel_peers_of_a_failed_armed_pipeline_are_not_left_in_its_reduction"
                 "[torchpar-after its reduction]",
                 "test_a_stage_that_raises_fails_every_rank_promptly[torchpar-3-0-8-backward]"}

TIMEOUT = 900  # the group's: a rank that waits this long has missed the failure
BOUND = 90     # each test's, far below TIMEOUT
BACKENDS = ["torchpar", "gloo"]
# For make test's time budget (each case spawns fresh ranks): the gloo variant of a case whose
# torchpar variant runs in make test goes to make test-slow.
BACKENDS_GLOO_SLOW = ["torchpar", pytest.param("gloo", marks=pytest.mark.slow)]


def _mse(out, y):
    return ((out - y) ** 2).mean()


class _Raises(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


class _FailsOnCall(nn.Module):
    """A Linear whose ``n``-th forward (or the backward of its ``n``-th forward) raises."""

    def __init__(self, n, where):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.n, self.where, self.calls = n, where, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.n and self.where == "forward":
            raise RuntimeError("boom in forward")
        y = self.lin(x)
        return _Raises.apply(y) if self.calls == self.n else y


def _init(rank, world_size, init_file, backend):
    if backend == "torchpar" and not hasattr(torchpar._C, "ProcessGroupTorchpar"):
        pytest.skip("the torchpar backend is not built in this tree")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=TIMEOUT))


def _first_error(sched, rank, p, x, y, steps):
    """Runs up to ``steps`` steps; returns (step, error type, message) for the first that
    raised, or None."""
    for step in range(steps):
        try:
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == p - 1 else None)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return step, type(e).__name__, str(e)
    return None


def _answer(backend, world_size, result):
    """On torchpar, keep every process alive until all have answered (so no peer learns of
    the failure from a process exit); on gloo, let each go as soon as it has."""
    if backend != "torchpar":
        return result
    store = dist.distributed_c10d._get_default_store()
    store.add("answered", 1)
    while store.add("answered", 0) < world_size:  # the test's bound stops a rank that never answers
        time.sleep(0.05)
    return result


def _shm_left(pid):
    """Shared-memory segments a group made by process ``pid`` left in /dev/shm."""
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"torchpar-{pid}-"))


def _stage_raises(rank, world_size, init_file, backend, failing, where, call):
    _init(rank, world_size, init_file, backend)
    try:
        torch.manual_seed(0)
        mod = _FailsOnCall(call, where) if rank == failing else nn.Linear(8, 8)
        sched = Schedule1F1B(PipelineStage(mod, rank, world_size), 4, loss_fn=_mse)
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        result = _answer(backend, world_size, _first_error(sched, rank, world_size, x, y, steps=3))
    finally:
        dist.destroy_process_group()
    return result, _shm_left(os.getpid())


# (p, failing rank, its failing forward call, where): call 7 is micro-batch 2 of step 1
# (m = 4), in the middle of every rank's step; the backward of stage 0's call 8 is the last
# action of step 1, after the other ranks have finished it (they raise at the start of step 2).
# On gloo the failure travels as processes exit, one stage at a time: p >= 3 is slow there.
CASES = [(p, failing, 7, where) for p, failing in [(2, 1), (3, 1), (4, 2)] for where in ["forward", "backward"]]
CASES.append((3, 0, 8, "backward"))
PARAMS = [pytest.param(backend, *case, marks=[pytest.mark.slow] if backend == "gloo" and case[0] >= 3 else [])
          for backend in BACKENDS for case in CASES]


@pytest.mark.timeout(BOUND)
@pytest.mark.parametrize("backend,world_size,failing,call,where", PARAMS)
def test_a_stage_that_raises_fails_every_rank_promptly(backend, world_size, failing, call, where):
    results = spawn(_stage_raises, world_size, backend, failing, where, call, timeout=BOUND)
    for rank, (result, shm_left) in enumerate(results):
        assert result is not None, f"rank {rank} finished three steps although stage {failing} raised"
        step, kind, msg = result
        assert step == 1 or (step == 2 and rank != failing), f"rank {rank}, step {step}: {msg}"
        assert f"boom in {where}" in msg, f"rank {rank}: {msg}"
        if rank != failing:
            assert f"pipeline stage {failing} (pipeline rank {failing}) failed in the {where}" in msg, \
                f"rank {rank}: {msg}"
        assert shm_left == [], f"rank {rank} left {shm_left} in /dev/shm"
    if call == 8:  # the others had finished step 1
        assert [r[0][0] for r in results] == [1] + [2] * (world_size - 1), results


class _ShrinksOnSecondStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.lin(x)
        return out if self.calls <= 2 else out[:, :4]


def _shape_changes(rank, world_size, init_file, backend):
    _init(rank, world_size, init_file, backend)
    try:
        torch.manual_seed(0)
        mod = _ShrinksOnSecondStep() if rank == 0 else nn.Linear(8, 8)
        sched = ScheduleGPipe(PipelineStage(mod, rank, world_size), 2, loss_fn=_mse)
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        return _answer(backend, world_size, _first_error(sched, rank, world_size, x, y, steps=3))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(BOUND)
@pytest.mark.parametrize("backend", ["torchpar", pytest.param("gloo", marks=pytest.mark.slow)])
def test_a_shape_change_reaches_ranks_two_stages_away(backend):
    """Stage 0's output narrows in the second step under the same input shape: stages 0 and 1
    see it in the header and raise; stage 2, which only waits on stage 1, must hear of it."""
    results = spawn(_shape_changes, 3, backend, timeout=BOUND)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} finished three steps"
        step, kind, msg = result
        assert step == 1 and "(2, 4)" in msg and "(2, 8)" in msg, f"rank {rank}: {kind}: {msg}"


class _Interrupted(nn.Module):
    """A Linear whose ``n``-th forward is interrupted by Ctrl-C (SIGINT to its own process)."""

    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.n, self.calls = n, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.n:
            signal.raise_signal(signal.SIGINT)  # KeyboardInterrupt at the next bytecode, as for Ctrl-C
        return self.lin(x)


def _interrupted(rank, world_size, init_file, backend):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever the spawner set
    _init(rank, world_size, init_file, backend)
    try:
        torch.manual_seed(0)
        mod = _Interrupted(7) if rank == 1 else nn.Linear(8, 8)
        sched = Schedule1F1B(PipelineStage(mod, rank, world_size), 4, loss_fn=_mse)
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        result = None
        for step in range(3):
            try:
                sched.step(*((x,) if rank == 0 else ()), target=y if rank == world_size - 1 else None)
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt is what the test inspects
                result = step, type(e).__name__, str(e)
                break
        return _answer(backend, world_size, result)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(BOUND)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_mid_step_reaches_the_peers(backend):
    """Review finding: a KeyboardInterrupt in stage 1's forward (micro-batch 2 of step 1) was
    neither published nor did it abort the group, so stage 0 waited until the timeout."""
    results = spawn(_interrupted, 2, backend, timeout=BOUND)
    assert results[1] is not None and results[1][:2] == (1, "KeyboardInterrupt"), results
    assert results[0] is not None and results[0][0] == 1, results
    assert "pipeline stage 1 (pipeline rank 1) failed in the forward of micro-batch 2: KeyboardInterrupt" \
        in results[0][2], results


def _one_rank_made_another_schedule(rank, world_size, init_file, backend):
    _init(rank, world_size, init_file, backend)
    try:
        torch.manual_seed(0)
        stage = PipelineStage(_FailsOnCall(7, "forward") if rank == 1 else nn.Linear(8, 8), rank, world_size)
        if rank == 0:
            ScheduleGPipe(stage, 2, loss_fn=_mse)  # made over the same group, never stepped
        sched = Schedule1F1B(stage, 4, loss_fn=_mse)
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        return _answer(backend, world_size, _first_error(sched, rank, world_size, x, y, steps=3))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(BOUND)
def test_the_reason_reaches_ranks_that_made_different_numbers_of_schedules():
    """Review finding: the reason's store key counted the schedules made over the group in each
    process, so a rank that had made one more looked under another key and lost the reason."""
    results = spawn(_one_rank_made_another_schedule, 2, "torchpar", timeout=BOUND)
    assert results[1][:2] == (1, "RuntimeError") and "boom in forward" in results[1][2], results
    assert "pipeline stage 1 (pipeline rank 1) failed in the forward of micro-batch 2" in results[0][2], results


def _agreement_fails_after_a_peer_ran_ahead(rank, world_size, init_file):
    _init(rank, world_size, init_file, "torchpar")
    try:
        sched = Schedule1F1B(PipelineStage(nn.Linear(8, 8), rank, world_size), 2, loss_fn=_mse)
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:  # as in the second step: agreed, ran ahead, failed, published
            sched._failure._publish(2, "pipeline stage 0 (pipeline rank 0) failed in the forward: boom")
            store.set("published", "1")
            return None
        store.wait(["published"])

        def aborted(*_):  # the agreement this rank was still completing when rank 0 aborted
            raise RuntimeError("torchpar all_gather failed: the group was aborted by rank 0")
        sched._agree = aborted
        try:
            sched.step(target=y)
        except RuntimeError as e:
            return str(e)
        return "no error"
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(BOUND)
def test_a_rank_still_in_the_agreement_raises_the_reason_of_a_peer_that_ran_ahead():
    """Seen in a full test run: the first stage agreed, ran ahead, failed and aborted the group
    while the next one still completed the step's agreement; that one looked for the reason
    under the previous step's key only and raised the bare abort."""
    msg = spawn(_agreement_fails_after_a_peer_ran_ahead, 2, timeout=BOUND)[1]
    assert "pipeline rank 1 stopped waiting for its peers because pipeline stage 0 (pipeline rank 0) " \
           "failed in the forward: boom" in msg, msg


_RAISE = {"on": False}  # per process


class _RaisesWhileOn(torch.autograd.Function):
    """Identity whose backward raises while ``_RAISE["on"]``."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _RAISE["on"]:
            raise RuntimeError("boom in the armed backward")
        return g


class _RaisesInTheLastBackward(nn.Module):
    """Linear, Tanh, Linear; between them, in the step's last micro-batch, an identity whose
    backward raises while ``_RAISE["on"]``: the second Linear's gradient hooks have fired by then."""

    def __init__(self, m):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.m, self.calls = m, 0

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.a(x))
        if self.calls % self.m == 0:
            h = _RaisesWhileOn.apply(h)
        return self.b(h)


def _ddp_after_a_raising_armed_backward(rank, world_size, init_file, backend):
    """pp=2 x dp=2 (pipelines {0,1}, {2,3}; data parallel {0,2}, {1,3}): stage 1's DDP is armed
    before its last backward, which raises. The step fails; a new pipeline group and schedule
    over the same DDP modules must then give the one-process gradients."""
    _init(rank, world_size, init_file, backend)
    try:
        from torchpar.parallel import DistributedDataParallel as DDP
        pps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        dp_rank, stage_index, m = rank // 2, rank % 2, 4
        _RAISE["on"] = True
        torch.manual_seed(0)
        whole = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), _RaisesInTheLastBackward(m))
        ddp = DDP(copy.deepcopy(whole[stage_index]), process_group=dps[rank % 2], find_unused_parameters=True)
        x, y = torch.randn(16, 8), torch.randn(16, 8)
        xs, ys = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        args, kw = ((xs,) if stage_index == 0 else ()), {"target": ys if stage_index == 1 else None}
        sched = Schedule1F1B(PipelineStage(ddp, stage_index, 2, group=pps[dp_rank]), m, loss_fn=_mse)
        try:
            sched.step(*args, **kw)
            failed = None
        except RuntimeError as e:
            failed = str(e)
        assert failed is not None and ("boom in the armed backward" in failed), failed
        _RAISE["on"] = False
        _step_again_equals_one_process(ddp, whole, stage_index, dp_rank, m, x, y)
    finally:
        dist.destroy_process_group()


def _step_again_equals_one_process(ddp, whole, stage_index, dp_rank, m, x, y):
    """After a failed step of pp=2 x dp=2: a step with new pipeline groups (the failure aborted
    the first) over the same DDP modules gives the gradients of ``whole`` in one process."""
    ddp.zero_grad(set_to_none=True)
    pps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    xs, ys = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
    args, kw = ((xs,) if stage_index == 0 else ()), {"target": ys if stage_index == 1 else None}
    Schedule1F1B(PipelineStage(ddp, stage_index, 2, group=pps[dp_rank]), m, loss_fn=_mse).step(*args, **kw)
    ref = copy.deepcopy(whole)
    _mse(ref(x), y).backward()
    for (name, p), q in zip(ddp.module.named_parameters(), ref[stage_index].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda msg: f"{name}: {msg}")


@pytest.mark.timeout(BOUND)
def test_ddp_stage_works_after_its_armed_backward_raised():
    """Review finding: the reducer armed before the last backward stayed armed when that
    backward raised, and the next step's first (no_sync) backward failed in it."""
    spawn(_ddp_after_a_raising_armed_backward, 4, "torchpar", timeout=BOUND)


class _FailsOnRankOne(nn.Module):
    """Linear, Tanh, Linear. Where ``fail`` says: "forward" raises in the second forward;
    "armed backward" in the step's last backward, between the Linears, after the second
    Linear's gradient hooks have fired (with a bucket per parameter, its buckets are launched);
    "after its reduction" in a callback of that backward queued after the reducer's. While
    failing, the first micro-batch also uses ``c``, which nothing else uses: after the failed
    step it must count as unused again (its gradient None, as in one process)."""

    def __init__(self, m):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.m, self.calls, self.fail = m, 0, None

    def forward(self, x):
        self.calls += 1
        if self.fail == "forward" and self.calls == 2:
            raise RuntimeError("boom in forward")
        h = torch.tanh(self.a(x))
        if self.fail and self.calls == 1:
            h = h + self.c(h)
        if self.fail == "armed backward" and self.calls % self.m == 0:
            h = _Raises.apply(h)
        if self.fail == "after its reduction" and self.calls % self.m == 0:
            h.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(_boom_in_callback))
        return self.b(h)


def _boom_in_callback():
    raise RuntimeError("boom in a callback")


def _data_parallel_peers_of_a_failed_pipeline(rank, world_size, init_file, dp_backend, where, armed):
    """pp=2 x dp=2 (pipelines {0,1}, {2,3}; data parallel {0,2}, {1,3}), each stage in our DDP:
    only rank 1's stage raises, in its second forward or (``where``) in its last backward.
    Ranks 0 and 1 raise the pipeline's error; ranks 2 and 3, whose own pipeline finished, raise
    that their data-parallel peer failed instead of waiting for it (until its process exits, or
    the group's timeout): in the average after the step, or (``armed``: find_unused_parameters,
    a bucket per parameter) in the reduction of their armed last backward, for buckets ranks 0
    and 1 then issue as zeros. Then every rank goes on, with new pipeline groups over the same
    DDP modules and data-parallel groups, and the next step's gradients are one process's."""
    _init(rank, world_size, init_file, "torchpar")
    try:
        from torchpar.parallel import DistributedDataParallel as DDP
        pps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dps = [dist.new_group([0, 2], backend=dp_backend), dist.new_group([1, 3], backend=dp_backend)]
        dp_rank, stage_index, m = rank // 2, rank % 2, 4
        torch.manual_seed(0)
        whole = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), _FailsOnRankOne(m))
        ddp = DDP(copy.deepcopy(whole[stage_index]), process_group=dps[stage_index], find_unused_parameters=armed,
                  bucket_cap_mb=1e-6 if armed else None)
        if rank == 1:
            ddp.module.fail = where
        x, y = torch.randn(16, 8), torch.randn(16, 8)
        xs, ys = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        args, kw = ((xs,) if stage_index == 0 else ()), {"target": ys if stage_index == 1 else None}
        sched = Schedule1F1B(PipelineStage(ddp, stage_index, 2, group=pps[dp_rank]), m, loss_fn=_mse)
        try:
            sched.step(*args, **kw)
            error = None
        except RuntimeError as e:
            error = str(e)
        ddp.module.fail = None
        _step_again_equals_one_process(ddp, whole, stage_index, dp_rank, m, x, y)
        return error
    finally:
        dist.destroy_process_group()


def _check_data_parallel_outcome(errors, where):
    """Ranks 1 and 3 raise (rank 1 its own error); ranks 0 and 2 too, except where stage 0
    received its last gradient before stage 1 failed (after its reduction): then both may have
    finished the step (rank 0 hears of the failure at its pipeline's next step)."""
    assert "boom in" in (errors[1] or ""), errors[1]
    for rank in (2, 3):
        if rank == 2 and where == "after its reduction" and errors[0] is None:
            assert errors[2] is None, errors[2]
            continue
        assert f"the step failed on its data-parallel peer(s) rank {rank - 2}" in (errors[rank] or ""), errors[rank]
    if where != "after its reduction" or errors[0] is not None:
        assert "boom in" in (errors[0] or ""), errors[0]


@pytest.mark.timeout(BOUND)
@pytest.mark.parametrize("dp_backend", BACKENDS_GLOO_SLOW)
def test_data_parallel_peers_of_a_failed_pipeline_raise_and_go_on(dp_backend):
    """Review finding (docs/pipeline.md): a failure in one pipeline left the same stage's
    replicas in the other pipelines waiting in their data-parallel average."""
    errors = spawn(_data_parallel_peers_of_a_failed_pipeline, 4, dp_backend, "forward", False, timeout=BOUND)
    _check_data_parallel_outcome(errors, "forward")


@pytest.mark.timeout(BOUND)
@pytest.mark.parametrize("where", ["forward", "armed backward", "after its reduction"])
@pytest.mark.parametrize("dp_backend", BACKENDS_GLOO_SLOW)
def test_data_parallel_peers_of_a_failed_armed_pipeline_are_not_left_in_its_reduction(dp_backend, where):
    """A limit docs/pipeline.md listed: a stage armed before its last backward gave its
    data-parallel peers no way to learn of a failure in another pipeline; they waited in that
    backward's reduction until the failed process exited or the group's timeout, or completed it
    with the failed rank's next step (mixed gradients, no error)."""
    errors = spawn(_data_parallel_peers_of_a_failed_pipeline, 4, dp_backend, where, True, timeout=BOUND)
    _check_data_parallel_outcome(errors, where)


def _fully_shard_pipelines(rank, last_stage, m=4, dp_backend=None, hybrid=False):
    """pp=2 x dp=2 (pipelines {0,1}, {2,3}; data parallel {0,2}, {1,3}), each stage of
    ``Sequential(Sequential(Linear, Tanh), last_stage())`` (made after seeding: the same on every
    rank) fully_shard over its data-parallel pair (``hybrid``: sharded over the rank alone and
    replicated over the pair, HSDP), in a Schedule1F1B of ``m`` micro-batches; each pipeline
    trains on its half of one batch."""
    from types import SimpleNamespace
    from torchpar.parallel import fully_shard
    pps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2], backend=dp_backend), dist.new_group([1, 3], backend=dp_backend)]
    alone = [dist.new_group([r]) for r in range(4)]
    dp_rank, stage_index = rank // 2, rank % 2
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), last_stage())
    groups = dict(group=alone[rank], replicate_group=dps[stage_index]) if hybrid else dict(group=dps[stage_index])
    module = fully_shard(copy.deepcopy(whole[stage_index]), **groups)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    xs, ys = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
    sched = Schedule1F1B(PipelineStage(module, stage_index, 2, group=pps[dp_rank]), m, loss_fn=_mse)
    return SimpleNamespace(whole=whole, module=module, sched=sched, x=x, y=y, xs=xs, stage_index=stage_index,
                           dp_rank=dp_rank, dps=dps, pps=pps, args=(xs,) if stage_index == 0 else (),
                           kw={"target": ys if stage_index == 1 else None})


def _trained_as_one_process(t):
    """After the step: an SGD step on the stage equals one on the whole model in one process."""
    torch.optim.SGD(t.module.parameters(), lr=0.1).step()
    ref = copy.deepcopy(t.whole)
    _mse(ref(t.x), t.y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    want = ref[t.stage_index].state_dict()
    for name, got in t.module.state_dict().items():  # gathered: a collective over the pair
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-6, msg=lambda msg: f"{name}: {msg}")


def _fully_shard_after_a_failed_step(rank, world_size, init_file):
    """pp=2 x dp=2 as above, each stage fully_shard over its data-parallel pair: its units
    accumulate the micro-batches' gradients and reduce in the stage's last backward. Stage 1's
    third backward raises, in both pipelines; after it, a new pipeline group over the same
    modules must give the one-process gradients, not those plus the failed step's partial sums.
    The data-parallel groups are gloo's, which a failed step leaves as they are (a torchpar group
    it aborts: the test below)."""
    _init(rank, world_size, init_file, "torchpar")
    try:
        t = _fully_shard_pipelines(rank, lambda: _FailsOnCall(3, "backward"), dp_backend="gloo")
        with pytest.raises(RuntimeError, match="boom in backward"):
            t.sched.step(*t.args, **t.kw)
        assert t.module._fsdp.flat.requires_grad_sync and t.module._fsdp.flat.accumulator is None
        t.module.zero_grad(set_to_none=True)
        pps = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # the failed step aborted the first
        Schedule1F1B(PipelineStage(t.module, t.stage_index, 2, group=pps[t.dp_rank]), 4, loss_fn=_mse).step(
            *t.args, **t.kw)
        t.whole[1].n = 0  # the one-process run must not raise
        _trained_as_one_process(t)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(BOUND)
def test_fully_shard_stage_after_a_failed_step_reduces_only_the_next_steps_gradients():
    """Review finding: the units' accumulators kept the failed step's micro-batch sums, which
    the next step's last backward reduce-scattered with its own."""
    spawn(_fully_shard_after_a_failed_step, 4, timeout=BOUND)


def _data_parallel_peers_of_a_failed_fully_shard_pipeline(rank, world_size, init_file, where, hybrid):
    """pp=2 x dp=2 as above, each stage fully_shard over its torchpar data-parallel pair; only
    rank 1's stage raises, in its second forward or in its last backward, before its unit's
    reduce-scatter. Rank 3, the same stage in the other pipeline, waits in that reduce-scatter
    for rank 1: it must fail at once, with rank 1's error, because rank 1 aborts the group (its
    step cannot issue the rest); its pipeline then fails too. Every rank raises, the
    data-parallel groups are unusable (a clear error, not a hang), nothing is left in /dev/shm.
    ``hybrid``: the pair is each stage's replicate group (HSDP), rank 3 waits in the all-reduce."""
    _init(rank, world_size, init_file, "torchpar")
    try:
        t = _fully_shard_pipelines(rank, lambda: _FailsOnRankOne(4), hybrid=hybrid)
        if rank == 1:
            t.module.fail = where
        dps, stage_index = t.dps, t.stage_index
        try:
            t.sched.step(*t.args, **t.kw)
            error = None
        except Exception as e:  # noqa: BLE001 - the test inspects it
            error = f"{type(e).__name__}: {e}"
        try:
            dist.all_reduce(torch.ones(1), group=dps[stage_index])
            after = None
        except Exception as e:  # noqa: BLE001 - the test inspects it
            after = str(e)
        result = _answer("torchpar", world_size, (error, after))
    finally:
        dist.destroy_process_group()
    return result, _shm_left(os.getpid())


@pytest.mark.timeout(BOUND)
@pytest.mark.parametrize("hybrid", [False, True], ids=["sharded", "hybrid"])
@pytest.mark.parametrize("where", ["forward", pytest.param("armed backward", marks=pytest.mark.slow)])
def test_fully_shard_peers_of_a_failed_pipeline_fail_at_once(where, hybrid):
    """A limit docs/pipeline.md listed: with fully_shard stages, a failure in one pipeline left
    the same stage's replicas in the others waiting in a unit's collective until the failed
    process exited or the group's timeout (or, were the failed rank to step again, pairing it
    with its next step's collectives)."""
    results = spawn(_data_parallel_peers_of_a_failed_fully_shard_pipeline, 4, where, hybrid, timeout=BOUND)
    for rank, ((error, after), shm_left) in enumerate(results):
        assert error is not None and "boom in" in error, f"rank {rank}: {error}"
        # A rank that aborted the group finds it shut down; the others, aborted.
        assert after is not None and ("the group was aborted by rank" in after or "has been shut down" in after), \
            f"rank {rank}: {after}"
        assert shm_left == [], f"rank {rank} left {shm_left} in /dev/shm"
    error3 = results[3][0][0]
    # Rank 1 is rank 0 of the data-parallel group {1, 3}: the backend names group ranks.
    assert f"the group was aborted by rank 0: RuntimeError: boom in {where.split()[-1]} [the step of Schedule1F1B's " \
        "pipeline rank 1 (global rank 1) failed" in error3, error3


def _fully_shard_after_bad_input(rank, world_size, init_file, who, hybrid):
    """pp=2 x dp=2, fully_shard stages over torchpar data-parallel pairs. In the first step
    the first stage's batch does not split into the micro-batches, on pipeline 0 only or on
    both (``who``): nothing has run, so no group is aborted: every rank raises (those of
    pipeline 1, if their own input was right, that their data-parallel peers failed to start),
    and the next step, with right input, trains as one process (review: the groups were
    aborted, and the next step failed on them)."""
    _init(rank, world_size, init_file, "torchpar")
    try:
        t = _fully_shard_pipelines(rank, lambda: nn.Linear(8, 8), hybrid=hybrid)
        bad = who == "both" or t.dp_rank == 0
        with pytest.raises((ValueError, RuntimeError)) as raised:
            t.sched.step(*((t.xs[:-1],) if bad and t.args else t.args), **t.kw)
        message = str(raised.value)
        if bad:
            assert "does not split into 4 micro-batches" in message, message
        else:
            assert "the step failed to start on its data-parallel peer(s)" in message, message
        t.sched.step(*t.args, **t.kw)
        _trained_as_one_process(t)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(BOUND)
@pytest.mark.parametrize("who,hybrid", [("one pipeline", False), ("both", False),
                                       pytest.param("one pipeline", True, marks=pytest.mark.slow)],
                         ids=["one pipeline", "both", "one pipeline, hybrid"])
def test_fully_shard_groups_survive_a_step_that_failed_before_running(who, hybrid):
    spawn(_fully_shard_after_bad_input, 4, who, hybrid, timeout=BOUND)


def _hybrid_stage_bad_input_on_one_rank(rank, world_size, init_file, backend):
    """Four one-stage pipelines, their stage sharded over a 2 x 2 mesh (shard {0,1}, {2,3};
    replicate {0,2}, {1,3}); rank 0's batch does not split into the micro-batches. Rank 3 shares
    no group with rank 0: the agreement must reach it through rank 1 or 2 (review: with one
    exchange per group it started its actions, and the step after failed too, or on gloo every
    rank waited until the timeout). Every rank raises; the next step runs and equals one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchpar.parallel import fully_shard
    _init(rank, world_size, init_file, backend)
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        alone = [dist.new_group([r]) for r in range(world_size)]
        torch.manual_seed(0)
        whole = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        module = fully_shard(copy.deepcopy(whole), mesh=mesh)
        x, y = torch.randn(16, 8), torch.randn(16, 8)
        xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        sched = Schedule1F1B(PipelineStage(module, 0, 1, group=alone[rank]), 2, loss_fn=_mse)
        with pytest.raises((ValueError, RuntimeError)) as raised:
            sched.step(xs[:-1] if rank == 0 else xs, target=ys)
        sched.step(xs, target=ys)
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        ref = copy.deepcopy(whole)
        _mse(ref(x), y).backward()
        for n, p in module.named_parameters():  # this rank's piece of each gradient
            unit = module._fsdp
            i = [site[3] for site in unit.sites].index(n)
            start, length = unit.flat.shard_range(i)
            want = ref.get_parameter(n).grad.reshape(-1)[start:start + length]
            torch.testing.assert_close(grads[n], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        return _answer(backend, world_size, str(raised.value))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(BOUND)
@pytest.mark.parametrize("backend", BACKENDS_GLOO_SLOW)
def test_hybrid_sharded_stages_agree_across_the_whole_mesh(backend):
    errors = spawn(_hybrid_stage_bad_input_on_one_rank, 4, backend, timeout=BOUND)
    assert "does not split into 2 micro-batches" in errors[0], errors[0]
    for rank in (1, 2, 3):
        assert "the step failed to start on its data-parallel peer(s) rank 0" in errors[rank], (rank, errors[rank])
