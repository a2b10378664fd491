"""DistributedDataParallel.register_comm_hook: torch's hook contract, checked against torch's
DDP running the same hook, on the torchpar backend and on gloo."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

from test_ddp import (_assert_same_params, _batch, _loss, _mlp, _pool, _setup, _shard, _train_side_by_side,
                      multi_rank, on_backends)
from torchpar.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.timeout(120)
SLOW_VARIANTS = {"test_post_local_sgd_hook_matches_torch_ddp_with_the_same_hook[gloo]"}  # make test's budget

# (torch's bf16_compress_hook refuses to run without CUDA and NCCL.)
HOOKS = {
    "allreduce": default_hooks.allreduce_hook,
    "fp16_compress": default_hooks.fp16_compress_hook,
}


def _train_with_hook_vs_torch_ddp(ctx, hook_name, **options):
    _setup(ctx)
    ours_model, torch_model = _mlp(2), _mlp(2)
    ours = DDP(ours_model, process_group=ctx.pg, bucket_cap_mb=0.0002, **options)
    theirs = nn.parallel.DistributedDataParallel(torch_model, process_group=ctx.pg, bucket_cap_mb=0.0002,
                                                 **options)
    ours.register_comm_hook(ctx.pg, HOOKS[hook_name])
    theirs.register_comm_hook(ctx.pg, HOOKS[hook_name])
    # Compressed sums round differently where the two DDPs' buckets cut the tensors
    # differently (the ring splits each bucket by position); averaging errors are 2x.
    tol = None if hook_name == "allreduce" else dict(rtol=1e-3, atol=1e-4)
    _train_side_by_side(ctx, (ours, theirs), (ours_model, torch_model), steps=4, per_rank=3, tol=tol)


@on_backends
@multi_rank
@pytest.mark.parametrize("hook_name", list(HOOKS))
def test_torch_default_hooks_match_torch_ddp_with_the_same_hook(backend, world_size, hook_name):
    _pool(backend, world_size).run(_train_with_hook_vs_torch_ddp, hook_name)


def _hook_with_options(ctx, option):
    _train_with_hook_vs_torch_ddp(ctx, "fp16_compress", **{option: True})


@on_backends
@pytest.mark.parametrize("option", ["gradient_as_bucket_view", "find_unused_parameters"])
def test_a_hook_combines_with_the_ddp_options(backend, option):
    _pool(backend, 2).run(_hook_with_options, option)


def _power_sgd_vs_torch_ddp(ctx):
    _setup(ctx)
    ours_model, torch_model = _mlp(2), _mlp(2)
    ours = DDP(ours_model, process_group=ctx.pg, bucket_cap_mb=0.0002)
    theirs = nn.parallel.DistributedDataParallel(torch_model, process_group=ctx.pg, bucket_cap_mb=0.0002)
    for ddp in (ours, theirs):
        # Rank 1 with error feedback and warm start (the defaults); vanilla all-reduce for the
        # first two steps, then compressed: the switch happens inside the run.
        state = powerSGD_hook.PowerSGDState(process_group=ctx.pg, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, min_compression_rate=0.5)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    _train_side_by_side(ctx, (ours, theirs), (ours_model, torch_model), steps=5, per_rank=3,
                        tol=dict(rtol=1e-5, atol=1e-6))


# PowerSGD's hooks issue collectives from their futures' callbacks and wait on them there
# (Vogels et al. 2019; torch's powerSGD_hook.py). On the torchpar backend such a callback runs
# its collective where it stands (docs/backend.md); on gloo torch's own DDP with this hook
# times out (the callback waits on gloo's worker for work queued behind it), so torchpar only.
# (torch 2.13's batched_powerSGD_hook fails its own assertion in _orthogonalize under torch's
# DDP too: it hands it a 2-D Q.)
@multi_rank
def test_power_sgd_hook_matches_torch_ddp_with_the_same_hook(world_size):
    _pool("torchpar", world_size).run(_power_sgd_vs_torch_ddp)


def _post_local_sgd_vs_torch_ddp(ctx):
    """Post-local SGD (Lin et al. 2020): global all-reduce for two steps, then only within
    subgroups of two ranks (torch's ``new_subgroups``): the pairs' models part, as under torch's."""
    _setup(ctx)
    subgroup, _ = dist.new_subgroups(group_size=2, group=ctx.pg)
    ours_model, torch_model = _mlp(2), _mlp(2)
    ours = DDP(ours_model, process_group=ctx.pg, bucket_cap_mb=0.0002)
    theirs = nn.parallel.DistributedDataParallel(torch_model, process_group=ctx.pg, bucket_cap_mb=0.0002)
    for ddp in (ours, theirs):
        state = post_localSGD_hook.PostLocalSGDState(process_group=ctx.pg, subgroup=subgroup, start_localSGD_iter=2)
        ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
    _train_side_by_side(ctx, (ours, theirs), (ours_model, torch_model), steps=4, per_rank=3)
    mine = torch.cat([p.detach().flatten() for p in ours_model.parameters()])
    every = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(every, mine, group=ctx.pg)
    assert torch.equal(every[0], every[1]) and not torch.equal(every[0], every[2])
    dist.destroy_process_group(subgroup)


@on_backends
def test_post_local_sgd_hook_matches_torch_ddp_with_the_same_hook(backend):
    _pool(backend, 4).run(_post_local_sgd_vs_torch_ddp)


def _averaging_hook(state, bucket):
    """A stateful hook: records what it is given, then all-reduces and averages."""
    state["calls"].append((bucket.index(), bucket.is_last(), len(bucket.parameters()),
                           bucket.buffer().numel(), sum(p.numel() for p in bucket.parameters())))
    group = state["group"]
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(group.size()))


def _custom_hook_sees_each_bucket_once_in_order(ctx):
    _setup(ctx)
    model, ref = _mlp(3), _mlp(3)
    ddp = DDP(model, process_group=ctx.pg, bucket_cap_mb=0.0002)
    state = {"group": ctx.pg, "calls": []}
    ddp.register_comm_hook(state, _averaging_hook)
    n_buckets = len(ddp.reducer.bucket_indices())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref))
    for step in range(3):
        x, y = _batch(step, 2 * ctx.world_size)
        state["calls"].clear()
        opt.zero_grad()
        _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step()
        _assert_same_params(model, ref, step)
        assert [c[0] for c in state["calls"]] == list(range(n_buckets))
        assert [c[1] for c in state["calls"]] == [False] * (n_buckets - 1) + [True]
        assert all(c[2] >= 1 and c[3] == c[4] for c in state["calls"])


@on_backends
@multi_rank
def test_a_stateful_hook_sees_every_bucket_once_in_order_and_trains_like_one_process(backend, world_size):
    _pool(backend, world_size).run(_custom_hook_sees_each_bucket_once_in_order)


def _failing_hook(state, bucket):
    raise ValueError(f"hook refuses bucket {bucket.index()}")


def _hook_error_reaches_backward(ctx):
    _setup(ctx)
    ddp = DDP(_mlp(), process_group=ctx.pg)
    ddp.register_comm_hook(None, _failing_hook)
    x, y = _batch(0, 2)
    with pytest.raises(Exception, match="hook refuses bucket 0"):
        _loss(ddp(x), y).backward()


def _registration_rules(ctx):
    _setup(ctx)
    ddp = DDP(_mlp(), process_group=ctx.pg)
    with pytest.raises(TypeError, match="must be callable"):
        ddp.register_comm_hook(None, "allreduce")
    ddp.register_comm_hook(ctx.pg, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook(ctx.pg, default_hooks.allreduce_hook)
    late = DDP(_mlp(), process_group=ctx.pg)
    x, y = _batch(0, 2)
    _loss(late(x), y).backward()
    with pytest.raises(RuntimeError, match="before the first backward"):
        late.register_comm_hook(ctx.pg, default_hooks.allreduce_hook)


@on_backends
def test_an_error_in_the_hook_is_raised_by_backward(backend):
    _pool(backend, 2).run(_hook_error_reaches_backward)


@on_backends
def test_a_hook_is_registered_once_and_before_the_first_backward(backend):
    _pool(backend, 2).run(_registration_rules)
