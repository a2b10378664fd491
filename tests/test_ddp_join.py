"""DistributedDataParallel.join(): uneven inputs across ranks, checked against torch's DDP
doing the same under its own join(), on the torchpar backend and on gloo."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from test_ddp import _batch, _loss, _mlp, _pool, _setup, multi_rank, on_backends
from torchpar.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.timeout(120)


def _uneven_steps(ctx):
    return 2 + 2 * ctx.rank  # rank 0 runs out first; the last rank trains longest


def _mlp_bn(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.BatchNorm1d(10), nn.Tanh(), nn.Linear(10, 3))


def _train_uneven(ctx, make_ddp, hook, batchnorm=False):
    model = _mlp_bn(5) if batchnorm else _mlp(5)
    ddp = make_ddp(model)
    if hook:
        ddp.register_comm_hook(ctx.pg, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for step in range(_uneven_steps(ctx)):
            x, y = _batch(100 * ctx.rank + step, 4)
            opt.zero_grad()
            _loss(ddp(x), y).backward()
            opt.step()
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def _join_matches_torch_ddp(ctx, find_unused, hook, batchnorm=False, static=False):
    _setup(ctx)
    kwargs = dict(process_group=ctx.pg, bucket_cap_mb=0.0002, find_unused_parameters=find_unused)
    ours = _train_uneven(ctx, lambda m: DDP(m, static_graph=static, **kwargs), hook, batchnorm)
    theirs = _train_uneven(ctx, lambda m: nn.parallel.DistributedDataParallel(m, **kwargs), hook, batchnorm)
    tol = dict(rtol=1e-3, atol=1e-4) if hook else {}
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **tol)
    # Every rank ends with the same model (the last joiner's).
    for p in ours:
        gathered = [torch.empty_like(p) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, p, group=ctx.pg)
        for g in gathered:
            assert torch.equal(g, p)


@on_backends
@multi_rank
@pytest.mark.parametrize("find_unused", [False, True], ids=["all_used", "find_unused"])
def test_uneven_inputs_train_like_torch_ddp_join(backend, world_size, find_unused):
    _pool(backend, world_size).run(_join_matches_torch_ddp, find_unused, False)


@on_backends
@multi_rank
def test_buffers_come_from_a_rank_still_training(backend, world_size):
    # BatchNorm's running statistics: each step broadcasts them from the highest rank still
    # training, as torch's DDP does; a joined rank's have stopped moving.
    _pool(backend, world_size).run(_join_matches_torch_ddp, False, False, True)


@on_backends
@multi_rank
def test_uneven_inputs_with_static_graph(backend, world_size):
    # Joined ranks shadow the first step's all-at-the-end reduction and its used flags too.
    _pool(backend, world_size).run(_join_matches_torch_ddp, False, False, False, True)


def _static_graph_joined_before_first_step(ctx):
    # Rank 0 has no batch in the first epoch: it shadows the step that records the static
    # graph, then trains in the second epoch and records its own gradient counts there.
    _setup(ctx)
    models = []
    for make in (lambda m: DDP(m, process_group=ctx.pg, bucket_cap_mb=0.0002, static_graph=True),
                 lambda m: nn.parallel.DistributedDataParallel(m, process_group=ctx.pg, bucket_cap_mb=0.0002)):
        model = _mlp(5)
        ddp = make(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for epoch, steps in enumerate((0 if ctx.rank == 0 else 2, 2)):
            with ddp.join():
                for step in range(steps):
                    x, y = _batch(100 * epoch + 10 * ctx.rank + step, 4)
                    opt.zero_grad()
                    _loss(ddp(x), y).backward()
                    opt.step()
        models.append(model)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b)


@on_backends
def test_static_graph_rank_joined_before_the_recording_step(backend):
    _pool(backend, 2).run(_static_graph_joined_before_first_step)


@on_backends
def test_uneven_inputs_with_a_comm_hook(backend):
    _pool(backend, 2).run(_join_matches_torch_ddp, False, True)


def _early_termination_raises_everywhere(ctx):
    _setup(ctx)
    ddp = DDP(_mlp(), process_group=ctx.pg)
    with pytest.raises(RuntimeError, match="exhausted"):
        with ddp.join(throw_on_early_termination=True):
            for step in range(_uneven_steps(ctx)):
                x, y = _batch(step, 4)
                _loss(ddp(x), y).backward()


@on_backends
def test_throw_on_early_termination_raises_on_every_rank(backend):
    _pool(backend, 2).run(_early_termination_raises_everywhere)


def _unsupported_divisor(ctx):
    ddp = DDP(_mlp(), process_group=ctx.pg)
    with pytest.raises(NotImplementedError, match="divide_by_initial_world_size=False"):
        ddp.join(divide_by_initial_world_size=False)


@on_backends
def test_dividing_by_the_joined_count_is_refused_by_name(backend):
    _pool(backend, 2).run(_unsupported_divisor)
