"""torchpar.optim.ZeroRedundancyOptimizer (ZeRO-1) and DDP(shard_gradients=True) (ZeRO-2)
against single-process training and torch's ZeroRedundancyOptimizer.

Each rank trains on its shard of a batch; the reference trains on the whole batch in one
process (every rank computes it locally, from the same seeds). Runs on the torchpar backend
and on gloo, at world sizes 2 and 4.
"""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import torchpar
from harness import get_pool
from torchpar import _C
from torchpar.optim import DynamicLossScaler, MixedPrecisionOptimizer, ZeroRedundancyOptimizer
from torchpar.parallel import DistributedDataParallel as DDP
from torchpar.parallel import MixedPrecision

BACKENDS = ["torchpar", "gloo"]
multi_rank = pytest.mark.parametrize("world_size", [2, 4])
on_backends = pytest.mark.parametrize("backend", BACKENDS)
STAGES = pytest.mark.parametrize("stage", [1, 2])


def _pool(backend, world_size):
    if backend == "torchpar" and not hasattr(torchpar._C, "ProcessGroupTorchpar"):
        pytest.skip("the torchpar backend is not built in this tree")
    return get_pool(world_size, backend)


def _group(ctx, backend):
    return ctx.pg if backend == "torchpar" else ctx.gloo


# ---- models and data, identical on every rank ----

def _mlp(seed=0):
    # Parameters of many sizes, so shards are uneven and buckets hold several.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 12), nn.LayerNorm(12),
                         nn.Tanh(), nn.Linear(12, 3))


def _batch(step, n):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _shard(t, ctx):
    return t.chunk(ctx.world_size)[ctx.rank]


def _loss(out, y):
    return ((out.float() - y.float()) ** 2).mean()


def _assert_close(model, ref, step, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"step {step}, {name}: {m}")


def _wrap(ctx, group, model, stage, lr=1e-2, cap_mb=0.0002, **kwargs):
    """ZeRO-1: our DDP all-reduces, the optimizer shards state. ZeRO-2: DDP reduce-scatters.
    A cap of 0.0002 MiB (~52 floats) gives several buckets, each holding several parameters."""
    ddp = DDP(model, process_group=group, bucket_cap_mb=cap_mb, shard_gradients=stage == 2,
              mixed_precision=kwargs.pop("ddp_mixed_precision", None))
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, group, lr=lr,
                                  bucket_cap_mb=cap_mb, **kwargs)
    return ddp, opt


def _train_vs_single_process(ctx, backend, stage, steps=3):
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    model = _mlp()
    ref = copy.deepcopy(model)
    ddp, opt = _wrap(ctx, group, model, stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    owned = opt.optim.param_groups[0]["params"]
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        opt.zero_grad()
        _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            if stage == 2 and not any(p is o for o in owned):
                assert p.grad is None, "ZeRO-2: a gradient this rank does not own was kept"
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        opt.step()
        ref_opt.step()
        _assert_close(model, ref, step)
    return len(owned)


@on_backends
@multi_rank
@STAGES
def test_training_equals_single_process(backend, world_size, stage):
    owned = _pool(backend, world_size).run(_train_vs_single_process, backend, stage)
    assert sum(owned) == 8 and all(n > 0 for n in owned)  # every parameter stepped once


def _train_vs_torch_zero(ctx, backend, stage):
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    ours_model, torch_model = _mlp(3), _mlp(3)
    ours, opt = _wrap(ctx, group, ours_model, stage, parameters_as_bucket_view=True)
    theirs = nn.parallel.DistributedDataParallel(torch_model, process_group=group)
    ref_opt = TorchZero(theirs.parameters(), torch.optim.AdamW, group, True, lr=1e-2)  # torch's positional order
    for step in range(3):
        x, y = _batch(step, 2 * ctx.world_size)
        for ddp, o in ((ours, opt), (theirs, ref_opt)):
            o.zero_grad()
            _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
            o.step()
        _assert_close(ours_model, torch_model, step)


@on_backends
@STAGES
def test_matches_torch_zero_redundancy_optimizer(backend, stage):
    _pool(backend, 2).run(_train_vs_torch_zero, backend, stage)


# ---- the layout: balanced by size, deterministic ----

def test_shards_are_balanced_by_size_and_laid_out_rank_by_rank():
    sizes = [100, 10, 60, 40, 30, 30, 5]
    params = [torch.zeros(n) for n in sizes]
    [(indices, owners, offsets, shard)] = _C.zero_shard_buckets(params, [list(range(7))], 2)
    load = [sum(sizes[i] for i, r in zip(indices, owners) if r == rank) for rank in range(2)]
    assert sorted(load) == [135, 140] and shard == 140  # greedy largest-first: 100+30+5 | 60+40+30+10
    assert owners == sorted(owners)  # rank 0's segment first
    for i, r, off in zip(indices, owners, offsets):  # each inside its owner's segment
        assert r * shard <= off and off + sizes[i] <= (r + 1) * shard
    assert _C.zero_shard_buckets(params, [list(range(7))], 2) == [(indices, owners, offsets, shard)]


# ---- optimizer-state memory per rank ----

def _state_bytes(ctx, backend, stage):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # 8 equal parameters: shards divide exactly, so each rank holds exactly 1/W.
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(8)])
    ddp, opt = _wrap(ctx, _group(ctx, backend), model, stage, cap_mb=25)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    opt.zero_grad()
    _loss(ddp(x), y).backward()
    opt.step()
    grad_bytes = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    return opt.optimizer_state_bytes(), grad_bytes


@on_backends
@multi_rank
@STAGES
def test_optimizer_state_per_rank_is_one_over_world_size(backend, world_size, stage):
    results = _pool(backend, world_size).run(_state_bytes, backend, stage)
    # AdamW: exp_avg and exp_avg_sq (16x16 float32 each) and a float32 step per parameter.
    full_state = 8 * (2 * 16 * 16 * 4 + 4)
    full_grads = 8 * 16 * 16 * 4
    for state, grads in results:
        assert state == full_state // world_size
        assert grads == (full_grads // world_size if stage == 2 else full_grads)


# ---- ZeRO-2: gradient memory during backward ----

def _zero2_peak_grad_bytes(ctx, backend):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(4 * ctx.world_size)])
    # Buckets of one 1 KiB parameter per rank: several buckets, each split evenly.
    ddp, opt = _wrap(ctx, _group(ctx, backend), model, 2, cap_mb=ctx.world_size * 1024 / 2 ** 20)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    for step in range(2):  # the second step is measured (the first allocates the shards)
        if step == 1:
            ddp.reducer.reset_peak_grad_bytes()
        opt.zero_grad()
        _loss(ddp(x), y).backward()
        opt.step()
    layout = ddp.reducer.shard_layout()
    shards = sum(4 * shard_numel for _, _, _, shard_numel in layout)
    full = [4 * shard_numel * ctx.world_size for _, _, _, shard_numel in layout]
    return ddp.reducer.peak_grad_bytes(), ddp.reducer.bucket_bytes(), shards, full


@on_backends
@multi_rank
def test_zero2_frees_each_full_bucket_once_reduce_scattered(backend, world_size):
    # Before: every bucket's full gradient buffer lived until backward ended, so the peak held
    # all of them (the whole model's gradients) beside the shards.
    for peak, after, shards, full in _pool(backend, world_size).run(_zero2_peak_grad_bytes, backend):
        assert len(full) >= 4
        param = 16 * 16 * 4
        # Analytic: the 1/W shards, one bucket in flight, one filling, one gradient being copied.
        assert shards + max(full) <= peak <= shards + 2 * max(full) + param, (peak, shards, full)
        assert peak < shards + sum(full)
        assert after == shards  # between steps, only the shards


def _zero2_bucket_above_32_mib(ctx, backend):
    """Two steps with one parameter of 32 MiB, whose bucket (W whole-parameter segments) is
    mapped in huge pages (csrc/common/step_buffer.h); the second under the profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Embedding(4096, 2048)
    ref = copy.deepcopy(model)
    ddp, _ = _wrap(ctx, _group(ctx, backend), model, 2, cap_mb=25)
    owner = ddp.reducer.shard_layout()[0][1][0]
    idx = torch.arange(64 * ctx.world_size).reshape(ctx.world_size, 64)
    bucket_bytes = 4096 * 2048 * 4 * ctx.world_size
    mapped = _C.step_buffer_bytes_mapped_total()
    seen = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            (ddp(idx[ctx.rank]).float() ** 2).sum().mul(step + 1).backward()
        seen = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        ref.zero_grad(set_to_none=True)
        (ref(idx).float() ** 2).sum().mul((step + 1) / ctx.world_size).backward()
        if ctx.rank == owner:
            torch.testing.assert_close(model.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)
        else:
            assert model.weight.grad is None
    # Mapped (the allocator would give the profiler the same two events), once a step.
    mapped = _C.step_buffer_bytes_mapped_total() - mapped
    return bucket_bytes in seen and -bucket_bytes in seen and mapped == 2 * bucket_bytes


@on_backends
def test_zero2_bucket_above_32_mib_is_exact_and_seen_by_the_profiler(backend):
    # The bucket's buffer bypasses the CPU allocator; the profiler's memory events (what
    # `bench fsdp` measures peaks with) must still see it allocated and freed.
    assert all(_pool(backend, 2).run(_zero2_bucket_above_32_mib, backend))


# ---- state dicts ----

def _state_dict_round_trip(ctx, backend, stage, saved=None):
    """Train 2 steps, save the consolidated state (or load ``saved``, from another world
    size), train 2 more; the reference trains the same 4 steps in one process."""
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    model = _mlp()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(4):
        ref_opt.zero_grad()
        x, y = _batch(step, 4)
        _loss(ref(x), y).backward()
        ref_opt.step()
        if step == 1:
            ref_state = copy.deepcopy(ref_opt.state_dict())
    if saved is None:
        ddp, opt = _wrap(ctx, group, model, stage)
        for step in range(2):
            x, y = _batch(step, 4)
            opt.zero_grad()
            _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
            opt.step()
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            opt.state_dict()
        opt.consolidate_state_dict(to=ctx.world_size - 1)
        sd = opt.state_dict() if ctx.rank == ctx.world_size - 1 else None
        objs = [(copy.deepcopy(model.state_dict()), sd)]
        dist.broadcast_object_list(objs, src=ctx.world_size - 1, group=group)
        model_sd, sd = objs[0]
        # The consolidated state is the single-process optimizer's.
        for k, entry in ref_state["state"].items():
            for name, value in entry.items():
                torch.testing.assert_close(sd["state"][k][name], value, rtol=1e-5, atol=1e-7)
        assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in ref_state["param_groups"]]
    else:
        model_sd, sd = saved
    model = _mlp(seed=5)  # fresh, different weights: everything must come from the state dicts
    model.load_state_dict(model_sd)
    ddp, opt = _wrap(ctx, group, model, stage)
    opt.load_state_dict(sd)
    for step in range(2, 4):
        x, y = _batch(step, 4)
        opt.zero_grad()
        _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
        opt.step()
    _assert_close(model, ref, 3)
    return model_sd, sd


@on_backends
@STAGES
def test_state_dict_round_trip_and_across_world_sizes(backend, stage):
    saved = _pool(backend, 4).run(_state_dict_round_trip, backend, stage)[0]
    _pool(backend, 2).run(_state_dict_round_trip, backend, stage, saved)


def _sharded_state_dict_at_other_size(ctx, backend, saved):
    model = _mlp()
    _, opt = _wrap(ctx, _group(ctx, backend), model, 1)
    if saved is None:
        return opt.sharded_state_dict()
    with pytest.raises(ValueError, match=r"shard of a group of 4 ranks; this is rank \d of 2"):
        opt.load_state_dict(saved)
    bad = {"state": {}, "param_groups": [{**saved["param_groups"][0], "params": [0, 1]}]}
    with pytest.raises(ValueError, match=r"groups of sizes \[2\]; this optimizer's are \[8\]"):
        opt.load_state_dict(bad)


@on_backends
def test_sharded_state_dict_from_another_world_size_is_refused(backend):
    saved = _pool(backend, 4).run(_sharded_state_dict_at_other_size, backend, None)[0]
    _pool(backend, 2).run(_sharded_state_dict_at_other_size, backend, saved)


# ---- bad input: an error on every rank ----

def _different_params(ctx, backend):
    model = _mlp()
    params = list(model.parameters())
    if ctx.rank == ctx.world_size - 1:
        params = params[:-1] + [nn.Parameter(torch.zeros(5))]
    with pytest.raises(RuntimeError, match=r"parameter list differs across ranks at "
                                           r"parameter 7 \('#7'.*shape \(3,\).*shape \(5,\)"):
        ZeroRedundancyOptimizer(params, torch.optim.AdamW, _group(ctx, backend), lr=1.0)


def _wrong_optimizer(ctx, backend):
    group = _group(ctx, backend)
    model = _mlp()
    ddp = DDP(model, process_group=group, shard_gradients=True)
    with pytest.raises(ValueError, match=r"has 7 of the 8 parameters.*missing '0.weight'"):
        ZeroRedundancyOptimizer(list(model.parameters())[1:], torch.optim.AdamW, group, lr=1.0)
    # An optimizer on a copy of the model: DDP refuses to train, rather than drop the shards.
    ZeroRedundancyOptimizer(copy.deepcopy(model).parameters(), torch.optim.AdamW, group, lr=1.0)
    with pytest.raises(RuntimeError, match="no torchpar.optim.ZeroRedundancyOptimizer was built"):
        ddp(torch.randn(2, 6))
    with pytest.raises(NotImplementedError, match="overlap_with_ddp"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, group, False, True, lr=1.0)


@on_backends
@multi_rank
def test_bad_input_raises_on_every_rank(backend, world_size):
    pool = _pool(backend, world_size)
    pool.run(_different_params, backend)
    pool.run(_wrong_optimizer, backend)


# ---- add_param_group ----

def _add_param_group(ctx, backend):
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    model = _mlp()
    ref = copy.deepcopy(model)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt = ZeroRedundancyOptimizer(params[:4], torch.optim.AdamW, group, lr=1e-2, bucket_cap_mb=0.0002)
    ref_opt = torch.optim.AdamW(ref_params[:4], lr=1e-2)
    for step in range(3):
        if step == 1:
            opt.add_param_group({"params": params[4:], "lr": 3e-2})
            ref_opt.add_param_group({"params": ref_params[4:], "lr": 3e-2})
        x, y = _batch(step, 4)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(m(x), y).backward()
            o.step()
        _assert_close(model, ref, step)


@on_backends
def test_add_param_group_trains_like_one_process(backend):
    _pool(backend, 2).run(_add_param_group, backend)


# ---- O2 mixed precision ----

def _bf16_o2(ctx, backend, stage):
    """bfloat16 parameters and compute, float32 masters in the optimizer, float32 reduction,
    against float32 single-process training: within bfloat16's rounding of the weights."""
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    model = _mlp()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    policy = MixedPrecision(param_dtype=torch.bfloat16)
    if stage == 0:  # DDP O2, not sharded
        ddp = DDP(model, process_group=group, mixed_precision=policy)
        opt = MixedPrecisionOptimizer(ddp.parameters(), torch.optim.AdamW, policy, lr=1e-2,
                                      process_group=group)
    else:
        ddp, opt = _wrap(ctx, group, model, stage, mixed_precision=policy, ddp_mixed_precision=policy)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    params, ref_params = list(model.parameters()), list(ref.parameters())
    worst = []
    for step in range(4):
        x, y = _batch(step, 2 * ctx.world_size)
        opt.zero_grad()
        _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step()
        diffs = []
        for k, m in opt._masters.items():
            assert m.dtype == torch.float32
            assert torch.equal(params[k], m.to(torch.bfloat16))  # parameters are the rounded masters
            diffs.append((m - ref_params[k]).abs())
        d = torch.cat([t.reshape(-1) for t in diffs])
        worst.append((d.max().item(), d.mean().item()))
    # Masters are float32 state of the shard only: 4 bytes per owned element.
    return opt.optimizer_state_bytes() - opt.optimizer_state_bytes(masters=False), worst


@on_backends
@pytest.mark.parametrize("stage", [0, 1, 2], ids=["ddp", "zero1", "zero2"])
def test_bfloat16_o2_tracks_float32_training(backend, stage):
    results = _pool(backend, 2).run(_bf16_o2, backend, stage)
    n = sum(p.numel() for p in _mlp().parameters())
    assert sum(r[0] for r in results) == (2 if stage == 0 else 1) * 4 * n
    # Adam normalises each gradient element, so one whose float32 gradient is near zero may
    # step the other way under bfloat16 rounding (2 lr apart per step); on average the masters
    # stay within bfloat16's rounding of the weights (2^-9 of |w| ~ 0.3).
    for _, worst in results:
        for step, (largest, mean) in enumerate(worst):
            assert largest < 4 * 1e-2 and mean < 1e-3, f"step {step}: max {largest}, mean {mean}"


def _fp16_overflow_skips_everywhere(ctx, backend, stage):
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    model = _mlp()
    policy = MixedPrecision(param_dtype=torch.float16)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=2)
    ddp, opt = _wrap(ctx, group, model, stage, mixed_precision=policy, ddp_mixed_precision=policy,
                     loss_scaler=scaler)
    params = list(model.parameters())
    owner = {k: r for layout, index in opt._layouts for k, r in zip(index, layout.owner())}
    history = []
    for step in range(4):
        x, y = _batch(step, 2 * ctx.world_size)
        before = [p.detach().clone() for p in params]
        opt.zero_grad()
        scaler.scale(_loss(ddp(_shard(x, ctx)), _shard(y, ctx))).backward()
        if step == 1:
            # An overflow only the last rank can see: in a gradient it alone steps.
            k = max(k for k, r in owner.items() if r == ctx.world_size - 1)
            if ctx.rank == ctx.world_size - 1:
                params[k].grad.view(-1)[0] = float("inf")
        opt.step()
        changed = any(not torch.equal(a, p) for a, p in zip(before, params))
        history.append((scaler.last_step_skipped, changed, scaler.scale_value))
        assert all(torch.isfinite(p).all() for p in params)
    return history


@on_backends
@STAGES
def test_float16_loss_scaler_skips_an_overflowing_step_on_every_rank(backend, stage):
    histories = _pool(backend, 2).run(_fp16_overflow_skips_everywhere, backend, stage)
    expected = [(False, True, 1024.0), (True, False, 512.0), (False, True, 512.0), (False, True, 1024.0)]
    assert histories == [expected] * 2


# ---- ZeRO-2 with the rest of DDP: no_sync accumulation, unused parameters ----

class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.body, self.unused = _mlp(2), nn.Linear(6, 3)

    def forward(self, x):
        return self.body(x)


def _zero2_no_sync_and_unused(ctx, backend):
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    model = _WithUnused()
    ref = copy.deepcopy(model)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.0002, shard_gradients=True,
              find_unused_parameters=True)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, group, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):  # the first micro-batch accumulates locally, the second syncs
            x, y = _batch(10 * step + micro, 2 * ctx.world_size)
            if micro == 0:
                with ddp.no_sync():
                    _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
            else:
                _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
            _loss(ref(x), y).backward()
        assert all(p.grad is None for p in model.unused.parameters())
        opt.step()
        ref_opt.step()
        _assert_close(model, ref, step)


@on_backends
def test_zero2_accumulates_under_no_sync_and_skips_unused_parameters(backend):
    _pool(backend, 2).run(_zero2_no_sync_and_unused, backend)


ACCUMULATION = {  # per step: how each of its micro-batches' backward runs
    "synced": ["sync", "sync"],               # torch's DDP adds each averaged gradient into .grad
    "no_sync_then_synced": ["sync", "no_sync", "sync"],
    "zero_grad_to_zeros": ["sync", "sync"],   # zero_grad(set_to_none=False) between steps
    "one_grad_reset_by_hand": ["sync", "reset", "sync"],
    "reduced_in_float64": ["sync", "sync"],   # .grad a cast copy of the float64 shard
    # The gated layer: used everywhere, then nowhere, then on rank 0's rows only.
    "partly_unused": ["sync", "sync_gate_off", "sync_gate_rank0"],
    # A backward outside DDP's forward (a penalty on the weights) after the synchronised one: .grad
    # is the average plus the penalty's gradient, as with torch's DDP (review finding).
    "penalty_after_sync": ["sync", "penalty", "sync", "penalty"],
    "penalty_after_sync_zero_grad_to_zeros": ["sync", "penalty"],
    "create_graph": ["sync_create_graph", "sync_create_graph"],  # autograd adds out of place
}


class _Gated(nn.Module):
    """_mlp, then a Linear applied only to the rows ``gate`` selects (not called at all when
    it selects none: its parameters get no gradient on that rank)."""

    def __init__(self):
        super().__init__()
        self.body = _mlp()
        self.gated = nn.Linear(3, 3)

    def forward(self, x, gate):
        out = self.body(x)
        if gate.any():
            out = out.clone()
            out[gate] = self.gated(out[gate])
        return out


def _assert_owned_grads(model, ref, owned, where):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if id(p) in owned:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}, {name}: {m}")


def _accumulation(ctx, backend, stage, how):
    """Gradient accumulation over several backwards that each synchronise, without zero_grad()
    between them (torch's DDP adds each backward's averaged gradient into .grad), in each of the
    ways ACCUMULATION lists: mixed with no_sync() backwards and local ones (a penalty), with
    zero_grad(set_to_none=False), one .grad set to None by hand, another reduce dtype, a layer
    some backwards do not reach, create_graph=True."""
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    model = _Gated()
    ref = copy.deepcopy(model)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.0002, shard_gradients=stage == 2,
              grad_reduce_dtype=torch.float64 if how == "reduced_in_float64" else None,
              find_unused_parameters=how == "partly_unused")
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, group, lr=1e-2, bucket_cap_mb=0.0002)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    owned = {id(p) for p in (opt.optim.param_groups[0]["params"] if stage == 2 else model.parameters())}
    n = 2 * ctx.world_size
    for step in range(3):
        to_none = not how.endswith("zero_grad_to_zeros")
        opt.zero_grad(set_to_none=to_none)
        ref_opt.zero_grad(set_to_none=to_none)
        for micro, kind in enumerate(ACCUMULATION[how]):
            if kind == "reset":  # the first weight's gradient dropped on every rank and in the reference
                model.body[0].weight.grad = None
                ref.body[0].weight.grad = None
                continue
            if kind == "penalty":  # the same on every rank: a local gradient, not averaged
                for m in (model, ref):
                    (0.1 * sum((p ** 2).sum() for p in m.body.parameters())).backward()
                _assert_owned_grads(model, ref, owned, f"step {step}, micro {micro}")
                continue
            x, y = _batch(10 * step + micro, n)
            gate = torch.full((n,), kind != "sync_gate_off")
            if kind == "sync_gate_rank0":
                gate[2:] = False
            create_graph = kind == "sync_create_graph"
            with ddp.no_sync() if kind == "no_sync" else contextlib.nullcontext():
                _loss(ddp(_shard(x, ctx), _shard(gate, ctx)), _shard(y, ctx)).backward(create_graph=create_graph)
            _loss(ref(x, gate), y).backward(create_graph=create_graph)
            if kind == "no_sync":
                continue
            _assert_owned_grads(model, ref, owned, f"step {step}, micro {micro}")
            for name, p in model.body.named_parameters():  # (gated: None where no rank used it since the sum began)
                assert id(p) in owned or p.grad is None, name
        opt.step()
        ref_opt.step()
        _assert_close(model, ref, step)


@on_backends
@multi_rank
@STAGES
@pytest.mark.parametrize("how", sorted(ACCUMULATION))
def test_accumulation_over_synchronised_backwards_equals_one_process(backend, world_size, stage, how):
    """ZeRO-2 (stage 2) and our DDP's all-reduce under ZeRO-1 (stage 1)."""
    _pool(backend, world_size).run(_accumulation, backend, stage, how)


def _o2_load_when_a_rank_owns_nothing(ctx, backend):
    """Review finding: load_state_dict all-gathered only on ranks owning an O2 master, so a
    rank owning no parameter (2 parameters, 4 ranks) skipped the collective the others ran."""
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    policy = MixedPrecision(param_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(torch.bfloat16)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, group, lr=1e-2,
                                  mixed_precision=policy)
    assert bool(opt._local) == (ctx.rank < 2)  # weight and bias: ranks 2 and 3 own nothing
    sd = {"state": {}, "param_groups": opt._groups_for_saving()}
    opt.load_state_dict(sd)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(ctx.rank)).to(torch.bfloat16)
    model(x).float().sum().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


@on_backends
def test_o2_load_state_dict_when_a_rank_owns_no_parameter(backend):
    results = _pool(backend, 4).run(_o2_load_when_a_rank_owns_nothing, backend, timeout=30)
    for r in results[1:]:
        for p, q in zip(r, results[0]):
            assert torch.equal(p, q)


def _uneven_steps(rank):
    return 2 + rank  # rank 0 runs out first; the last rank trains longest


def _train_uneven(ctx, backend, stage, how):
    """Rank r trains 2 + r steps under join(); a joined rank shadows the others' collectives,
    DDP's and the optimizer's (hung in step() before: it never entered the all-gather)."""
    from torch.distributed.algorithms.join import Join

    torch.set_num_threads(1)
    group = _group(ctx, backend)
    model = _mlp()
    ref = copy.deepcopy(model)
    ddp, opt = _wrap(ctx, group, model, stage)
    joinables = {"ddp.join()": None, "model first": [ddp, opt], "optimizer first": [opt, ddp],
                 "model only": [ddp], "zero_grad after forward": None}[how]
    with ddp.join() if joinables is None else Join(joinables):
        for step in range(_uneven_steps(ctx.rank)):
            x, y = _batch(100 * ctx.rank + step, 4)
            if how == "zero_grad after forward":  # the forward runs with last step's .grad held
                loss = _loss(ddp(x), y)
                opt.zero_grad()
                loss.backward()
            else:
                opt.zero_grad()
                _loss(ddp(x), y).backward()
            opt.step()
    _train_uneven_reference(ctx, ref, _uneven_steps)
    _assert_close(model, ref, "end")


def _train_uneven_reference(ctx, ref, steps_of, clips_at=None):
    """One process: each step, the gradients of the ranks still training (rank r trains
    ``steps_of(r)`` steps), divided by the whole group's size (divide_by_initial_world_size, as
    torch's DDP.join()), clipped to 0.05 in the steps ``clips_at(step)`` says (each of which
    must clip), then AdamW."""
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(max(steps_of(r) for r in range(ctx.world_size))):
        ref_opt.zero_grad()
        for r in range(ctx.world_size):
            if step < steps_of(r):
                x, y = _batch(100 * r + step, 4)
                _loss(ref(x), y).backward()
        for p in ref.parameters():
            p.grad /= ctx.world_size
        if clips_at is not None and clips_at(step):
            assert torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05) > 0.1
        ref_opt.step()


@on_backends
@multi_rank
@STAGES
@pytest.mark.parametrize("how", ["ddp.join()", "model first", "optimizer first", "model only",
                                 "zero_grad after forward"])
def test_uneven_inputs_under_join_train_like_one_process(backend, world_size, stage, how):
    _pool(backend, world_size).run(_train_uneven, backend, stage, how, timeout=60)


def _optimizer_joined_without_its_ddp(ctx, backend):
    """Join([optimizer]) without the DDP that reduces its gradients cannot work (the joined rank
    would not shadow the backward's collectives): every rank raises, at the same collective."""
    from torch.distributed.algorithms.join import Join

    ddp, opt = _wrap(ctx, _group(ctx, backend), _mlp(), 1)
    with pytest.raises(RuntimeError, match=r"Join\(\[ddp, optimizer\]\)"):
        with Join([opt]):
            for step in range(_uneven_steps(ctx.rank)):
                x, y = _batch(step, 4)
                _loss(ddp(x), y).backward()
                opt.step()


@on_backends
def test_optimizer_joined_without_its_ddp_raises_on_every_rank(backend):
    _pool(backend, 2).run(_optimizer_joined_without_its_ddp, backend, timeout=30)


def _wrong_shard_on_one_rank(ctx, backend):
    """Review finding: a sharded state_dict meant for another rank raised on that rank only,
    while the others went on into load_state_dict's parameter all-gather and hung."""
    _, opt = _wrap(ctx, _group(ctx, backend), _mlp(), 1)
    objs = [opt.sharded_state_dict()]
    dist.broadcast_object_list(objs, src=0, group=_group(ctx, backend))  # rank 0's shard for all
    match = "rank 0's shard" if ctx.rank != 0 else "failed on rank 1"
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(objs[0])


@on_backends
def test_load_state_dict_error_on_one_rank_raises_on_every_rank(backend):
    _pool(backend, 2).run(_wrong_shard_on_one_rank, backend, timeout=30)


def _sharded_state_dict_other_layout(ctx, backend):
    """Review finding: a sharded_state_dict loaded into an optimizer sharded differently (same
    world size, another bucket_cap_mb) silently gave the parameters a rank now owns, but did
    not then, fresh state. The saved ownership is checked instead."""
    group = _group(ctx, backend)
    model = _mlp()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, group, lr=1e-2,
                                  bucket_cap_mb=0.0002)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    saved = opt.sharded_state_dict()
    other = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, group, lr=1e-2)
    assert other._local != opt._local  # one bucket instead of several: other shards
    with pytest.raises(ValueError, match="own(s|ed) parameters"):
        other.load_state_dict(saved)
    opt.load_state_dict(saved)  # the same layout still loads


@on_backends
def test_sharded_state_dict_from_another_layout_is_refused(backend):
    _pool(backend, 2).run(_sharded_state_dict_other_layout, backend, timeout=30)


# ---- gradient clipping: ZeroRedundancyOptimizer.clip_grad_norm_ ----

CLIP = {2.0: 0.05, float("inf"): 0.01}  # max_norm per norm type: every step below clips


def _clip_vs_single_process(ctx, backend, stage, norm_type, steps=4):
    """float32: each step clipped with ``opt.clip_grad_norm_``, against one process clipping the
    whole batch's gradients with torch's function, then plain AdamW. Per step: the loss, the
    norm, this rank's clipped gradients, then every parameter after the step."""
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    max_norm = CLIP[norm_type]
    model = _mlp()
    ref = copy.deepcopy(model)
    ddp, opt = _wrap(ctx, group, model, stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    owned = {id(p) for p, _ in opt.stepped_tensors()}
    norms = []
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        opt.zero_grad()
        loss = _loss(ddp(_shard(x, ctx)), _shard(y, ctx))
        loss.backward()
        norm = opt.clip_grad_norm_(max_norm, norm_type)
        ref_opt.zero_grad()
        ref_loss = _loss(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        assert ref_norm > 2 * max_norm, f"step {step}: norm {ref_norm} would not clip"
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=group)
        torch.testing.assert_close(mean_loss / ctx.world_size, ref_loss.detach(), rtol=1e-5, atol=1e-7)
        assert norm.dtype == torch.float32
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if id(p) in owned:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8,
                                           msg=lambda m: f"step {step}, {name}: {m}")
        opt.step()
        ref_opt.step()
        _assert_close(model, ref, step)
        norms.append(norm.item())
    return norms


@on_backends
@multi_rank
@STAGES
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["2", "inf"])
def test_clip_grad_norm_equals_single_process(backend, world_size, stage, norm_type):
    """Each parameter counted once (on its owner), summed (max for inf) over the group: a norm
    counting ZeRO-1's replicated gradients on every rank would be sqrt(W) too large (2-norm),
    one counting only this rank's shard too small."""
    norms = _pool(backend, world_size).run(_clip_vs_single_process, backend, stage, norm_type)
    assert all(n == norms[0] for n in norms)  # the same on every rank


def _low_precision_reference(model, ctx, x, y, dtype, scale=1.0):
    """What DDP's O2 leaves each owner, computed in one process: each rank's 16-bit gradient of
    its shard of the batch (of the loss times ``scale``), widened to float32, divided by W,
    summed, rounded to ``dtype`` (DDP's reduction), then widened again into a float32 master
    gradient and divided by ``scale`` (the loss scaler)."""
    total = [torch.zeros(p.shape) for p in model.parameters()]
    losses = []
    for r in range(ctx.world_size):
        model.zero_grad(set_to_none=True)
        xr, yr = x.chunk(ctx.world_size)[r], y.chunk(ctx.world_size)[r]
        loss = _loss(model(xr.to(dtype)), yr)
        (loss * scale).backward()
        losses.append(loss.item())
        for t, p in zip(total, model.parameters()):
            t += p.grad.float() / ctx.world_size
    model.zero_grad(set_to_none=True)
    return [t.to(dtype).float() / scale for t in total], sum(losses) / len(losses)


def _clip_o2_vs_masters(ctx, backend, stage, norm_type, dtype, steps=4):
    """O2 (bfloat16 / float16 with a loss scaler): the clipped tensors are the float32 master
    gradients, after unscaling, and the step uses them. Against one process holding the same
    16-bit model and float32 masters: DDP's gradients (``_low_precision_reference``), clipped as
    float32 masters with torch's function, AdamW on the masters, rounded back."""
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    max_norm = CLIP[norm_type]
    policy = MixedPrecision(param_dtype=dtype)
    model = _mlp()
    scaler = DynamicLossScaler(init_scale=2.0 ** 8, growth_interval=1000) if dtype == torch.float16 else None
    if stage == 0:  # DDP O2, unsharded: every rank holds every master (no sum over the group)
        ddp = DDP(model, process_group=group, mixed_precision=policy)
        opt = MixedPrecisionOptimizer(ddp.parameters(), torch.optim.AdamW, policy, lr=1e-2,
                                      process_group=group, loss_scaler=scaler)
    else:
        ddp, opt = _wrap(ctx, group, model, stage, mixed_precision=policy, ddp_mixed_precision=policy,
                         loss_scaler=scaler)
    ref = copy.deepcopy(model)  # the 16-bit parameters
    masters = [p.detach().float().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    params = list(model.parameters())
    index = {id(p): k for k, p in enumerate(params)}
    scale = scaler.scale_value if scaler is not None else 1.0
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        opt.zero_grad()
        loss = _loss(ddp(_shard(x, ctx)), _shard(y, ctx))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        before = [p.grad.detach().clone() if p.grad is not None else None for p in params]
        norm = opt.clip_grad_norm_(max_norm, norm_type)
        grads, ref_loss = _low_precision_reference(ref, ctx, x, y, dtype, scale)
        for m, g in zip(masters, grads):
            m.grad = g
        ref_norm = torch.nn.utils.clip_grad_norm_(masters, max_norm, norm_type)
        assert ref_norm > 2 * max_norm, f"step {step}: norm {ref_norm} would not clip"
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0, msg=lambda m: f"step {step}: {m}")
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss, group=group)
        torch.testing.assert_close(mean_loss.item() / ctx.world_size, ref_loss, rtol=1e-6, atol=1e-7)
        for p, m in opt.stepped_tensors():
            k = index[id(p)]
            assert m.dtype == torch.float32 and m is not p
            # The float32 master gradient is clipped; the 16-bit one is as backward left it.
            torch.testing.assert_close(m.grad, masters[k].grad, rtol=1e-6, atol=0,
                                       msg=lambda msg: f"step {step}, #{k}: {msg}")
            assert torch.equal(p.grad, before[k])
        opt.step()
        ref_opt.step()
        with torch.no_grad():
            for q, m in zip(ref.parameters(), masters):
                q.copy_(m)
        for p, m in opt.stepped_tensors():
            k = index[id(p)]
            torch.testing.assert_close(m, masters[k], rtol=1e-6, atol=1e-7,
                                       msg=lambda msg: f"step {step}, master #{k}: {msg}")
        for k, (p, q) in enumerate(zip(params, ref.parameters())):
            assert torch.equal(p, q), f"step {step}: parameter #{k} is not the rounded master"
    return norm.item()


@on_backends
@multi_rank
@pytest.mark.parametrize("stage", [0, 1, 2], ids=["ddp", "zero1", "zero2"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["2", "inf"])
def test_clip_grad_norm_under_bfloat16_o2_clips_the_float32_masters(backend, world_size, stage, norm_type):
    _pool(backend, world_size).run(_clip_o2_vs_masters, backend, stage, norm_type, torch.bfloat16)


@on_backends
@STAGES
def test_clip_grad_norm_under_float16_clips_after_unscaling(backend, stage):
    """float16 with a loss scaler of 256: the norm and the clipped master gradients are those of
    the unscaled gradients (clipping before the division would see a norm 256 times larger)."""
    _pool(backend, 2).run(_clip_o2_vs_masters, backend, stage, 2.0, torch.float16)


def _clip_overflow(ctx, backend, stage):
    """An overflow only the owner can see: every rank's clip_grad_norm_ returns a non-finite
    norm, and the step is skipped everywhere."""
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    policy = MixedPrecision(param_dtype=torch.float16)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10)
    model = _mlp()
    ddp, opt = _wrap(ctx, group, model, stage, mixed_precision=policy, ddp_mixed_precision=policy,
                     loss_scaler=scaler)
    params = list(model.parameters())
    owner = {k: r for layout, index in opt._layouts for k, r in zip(index, layout.owner())}
    before = [p.detach().clone() for p in params]
    x, y = _batch(0, 2 * ctx.world_size)
    scaler.scale(_loss(ddp(_shard(x, ctx)), _shard(y, ctx))).backward()
    k = max(k for k, r in owner.items() if r == ctx.world_size - 1)
    if ctx.rank == ctx.world_size - 1:
        params[k].grad.view(-1)[0] = float("inf")
    norm = opt.clip_grad_norm_(0.05)
    opt.step()
    assert not torch.isfinite(norm)
    assert scaler.last_step_skipped and scaler.scale_value == 512.0
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    # The next step clips and steps normally.
    opt.zero_grad()
    scaler.scale(_loss(ddp(_shard(x, ctx)), _shard(y, ctx))).backward()
    assert torch.isfinite(opt.clip_grad_norm_(0.05))
    opt.step()
    assert not scaler.last_step_skipped
    assert any(not torch.equal(a, p) for a, p in zip(before, params))


@on_backends
@STAGES
def test_clip_grad_norm_of_an_overflowing_step_is_not_finite_and_the_step_is_skipped(backend, stage):
    _pool(backend, 2).run(_clip_overflow, backend, stage)


@on_backends
@STAGES
def test_clip_grad_norm_under_join(backend, stage):
    """Under ddp.join(), every rank clipping every step it trains: the result is one process
    clipping the active ranks' gradients / W (_clip_uneven_schedule)."""
    _pool(backend, 4).run(_clip_uneven_schedule, backend, stage, _uneven_steps, _always, timeout=60)


# ---- clipping under join(): the joined ranks follow the active ranks' clipping ----

def _clip_uneven_schedule(ctx, backend, stage, steps_of, clips_at):
    """Under ddp.join(): rank r trains ``steps_of(r)`` steps, clipping (2-norm, 0.05) in the
    steps ``clips_at(step)`` says. A joined rank must take part in the clip all-reduce of
    whatever the ranks still training do, whatever it did itself (nothing at all, or no
    clipping before it joined). Against one process: the active ranks' gradients / W."""
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    model = _mlp()
    ref = copy.deepcopy(model)
    ddp, opt = _wrap(ctx, group, model, stage)
    with ddp.join():
        for step in range(steps_of(ctx.rank)):
            x, y = _batch(100 * ctx.rank + step, 4)
            opt.zero_grad()
            _loss(ddp(x), y).backward()
            if clips_at(step):
                opt.clip_grad_norm_(0.05)
            opt.step()
    _train_uneven_reference(ctx, ref, steps_of, clips_at)
    _assert_close(model, ref, "end")


def _no_batches_on_rank0(rank):
    return 0 if rank == 0 else 1 + rank


def _always(step):
    return True


def _from_step_2(step):
    return step >= 2


@on_backends
@STAGES
def test_clip_grad_norm_under_join_with_a_rank_without_batches(backend, stage):
    """Rank 0 has no batch at all, so it never clipped: it still shadows the others' clipping
    (hung before: it followed only its own last step's clip_grad_norm_)."""
    _pool(backend, 4).run(_clip_uneven_schedule, backend, stage, _no_batches_on_rank0, _always, timeout=90)


@on_backends
@STAGES
def test_clip_grad_norm_under_join_clipping_starts_after_a_rank_joined(backend, stage):
    """Warm-up without clipping: rank 0 (2 steps) joined before the others start clipping at
    step 2; it shadows their clipping anyway."""
    _pool(backend, 4).run(_clip_uneven_schedule, backend, stage, _uneven_steps, _from_step_2, timeout=90)


def _clip_uneven_mismatch(ctx, backend):
    """Under join(), ranks still training that clip with different norm types raise on every
    rank (the joined one too) instead of mixing a SUM with a MAX."""
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    ddp, opt = _wrap(ctx, group, _mlp(), 1)
    try:
        with ddp.join():
            for step in range(1 if ctx.rank == 0 else 3):
                x, y = _batch(step, 4)
                opt.zero_grad()
                _loss(ddp(x), y).backward()
                opt.clip_grad_norm_(0.05, 2.0 if ctx.rank == 1 or step == 0 else float("inf"))
                opt.step()
    except RuntimeError as e:
        assert "same max_norm and norm_type" in str(e), e
        return "raised"
    return "no error"


@pytest.mark.parametrize("backend", ["gloo"])
def test_clip_grad_norm_under_join_with_different_norm_types_raises_everywhere(backend):
    assert _pool(backend, 4).run(_clip_uneven_mismatch, backend, timeout=90) == ["raised"] * 4


# ---- a stale preparation: clip, step skipped, gradients reset and recomputed ----

def _clip_skip_reset(ctx, backend, stage, dtype, how):
    """clip_grad_norm_, no step() (as a loop skipping a non-finite norm would), the gradients
    reset (model.zero_grad() or p.grad = None) and computed again on another batch, clipped
    again: the norm is the new gradients' and step() steps with them (the first clip's master
    gradients were reused before). Against one process holding the O2 state."""
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    policy = MixedPrecision(param_dtype=dtype)
    model = _mlp()
    scaler = DynamicLossScaler(init_scale=2.0 ** 8, growth_interval=1000) if dtype == torch.float16 else None
    ddp, opt = _wrap(ctx, group, model, stage, mixed_precision=policy, ddp_mixed_precision=policy,
                     loss_scaler=scaler)
    ref = copy.deepcopy(model)
    masters = [p.detach().float().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    scale = scaler.scale_value if scaler is not None else 1.0
    params = list(model.parameters())
    index = {id(p): k for k, p in enumerate(params)}

    def backward(step):
        x, y = _batch(step, 2 * ctx.world_size)
        loss = _loss(ddp(_shard(x, ctx)), _shard(y, ctx))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return x, y

    opt.zero_grad()
    backward(0)
    first = opt.clip_grad_norm_(0.05)
    # No step(). The gradients are reset behind the optimizer's back, then computed again.
    if how == "model.zero_grad()":
        model.zero_grad()
    else:
        for p in params:
            p.grad = None
    x, y = backward(1)
    norm = opt.clip_grad_norm_(0.05)
    grads, _ = _low_precision_reference(ref, ctx, x, y, dtype, scale)
    for m, g in zip(masters, grads):
        m.grad = g
    ref_norm = torch.nn.utils.clip_grad_norm_(masters, 0.05)
    assert abs(first.item() - ref_norm.item()) > 1e-3 * ref_norm.item()  # the batches differ
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    opt.step()
    ref_opt.step()
    assert scaler is None or not scaler.last_step_skipped
    for p, m in opt.stepped_tensors():
        k = index[id(p)]
        torch.testing.assert_close(m, masters[k], rtol=1e-6, atol=1e-7, msg=lambda msg: f"master #{k}: {msg}")


@on_backends
@STAGES
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("how", ["model.zero_grad()", "p.grad = None"])
def test_clip_grad_norm_after_a_skipped_step_and_reset_gradients_is_fresh(backend, stage, dtype, how):
    _pool(backend, 2).run(_clip_skip_reset, backend, stage, dtype, how)


# ---- the inf-norm of a NaN gradient on one rank is nan on every rank ----

def _nan_on_one_rank(ctx, backend, nan_rank, norm_type):
    from torchpar.parallel import clip_grad_norm_

    group = _group(ctx, backend)
    torch.manual_seed(ctx.rank)
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(5)
    if ctx.rank == nan_rank:
        params[1].grad[2] = float("nan")
    return clip_grad_norm_(params, 1.0, norm_type, groups=[group]).item()


@on_backends
@pytest.mark.parametrize("nan_rank", [0, 1])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["2", "inf"])
def test_clip_grad_norm_of_a_nan_on_one_rank_is_nan_everywhere(backend, nan_rank, norm_type):
    """As torch.nn.utils.clip_grad_norm_ on the whole gradient, which returns nan: MAX alone
    drops a NaN (NCCL) or keeps it by the ranks' order (gloo)."""
    ref = torch.tensor([1.0, float("nan")])
    assert torch.isnan(torch.linalg.vector_norm(ref, norm_type))
    norms = _pool(backend, 2).run(_nan_on_one_rank, backend, nan_rank, norm_type)
    assert all(n != n for n in norms), norms


# ---- the loss scaler's flag is reduced on the optimizer's device ----

def test_loss_scaler_reduces_its_flag_on_the_given_device(monkeypatch):
    """A rank holding no gradient (owning no parameter) has no gradient to take the device
    from: the caller's device (the optimizer's join_device), not the CPU, under NCCL."""
    class Reduced(Exception):
        pass

    def fake_all_reduce(t, op=None, group=None):
        raise Reduced(t.device)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    scaler = DynamicLossScaler()
    with pytest.raises(Reduced) as seen:
        scaler.unscale_and_check([], device=torch.device("meta"))
    assert seen.value.args[0] == torch.device("meta")


def _scaler_device_of_an_empty_rank(ctx, backend):
    torch.set_num_threads(1)
    group = _group(ctx, backend)
    model = nn.Linear(3, 1)  # 2 parameters on 4 ranks: two ranks own nothing
    policy = MixedPrecision(param_dtype=torch.float16)
    scaler = DynamicLossScaler(init_scale=2.0 ** 4)
    ddp, opt = _wrap(ctx, group, model, 1, mixed_precision=policy, ddp_mixed_precision=policy,
                     loss_scaler=scaler)
    seen = []
    for name in ("any_rank_found", "unscale_and_check"):
        if hasattr(scaler, name):
            real = getattr(scaler, name)

            def spy(*args, _real=real, **kwargs):
                seen.append(kwargs.get("device"))
                return _real(*args, **kwargs)
            setattr(scaler, name, spy)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    scaler.scale(_loss(ddp(x), y)).backward()
    opt.step()
    return len(opt.stepped_tensors()), seen == [opt.join_device]


@pytest.mark.parametrize("backend", ["gloo"])
def test_zero_reduces_the_overflow_flag_on_its_join_device_on_a_rank_owning_nothing(backend):
    results = _pool(backend, 4).run(_scaler_device_of_an_empty_rank, backend)
    assert sorted(n for n, _ in results) == [0, 0, 1, 1]
    assert all(ok for _, ok in results), results


# ---- counted and groups: a model split over two "stages", each a ZeRO group of 2 ----

NOT_COUNTED = {"0.bias", "3.weight", "5.bias"}  # e.g. a tied or tensor-parallel-replicated copy counted elsewhere


def _clip_counted_groups(ctx, stage, norm_type, steps=3):
    """4 ranks: stage s = rank // 2 holds the model _mlp(seed=s), trained by a DDP + ZeRO
    group of 2 ranks ({0, 1}, {2, 3}), on its own batches. clip_grad_norm_ with ``counted``
    leaving out two parameters and ``groups=[the other stage's rank of this position]``
    ({0, 2}, {1, 3}): the norm is that of both stages' counted gradients, every gradient
    scaled. Against one process holding both stages' models."""
    torch.set_num_threads(1)
    dp_groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    cross = [dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo")]
    s, pos = divmod(ctx.rank, 2)
    max_norm = CLIP[norm_type]
    model = _mlp(seed=s)
    refs = [_mlp(seed=t) for t in range(2)]
    ddp = DDP(model, process_group=dp_groups[s], bucket_cap_mb=0.0002, shard_gradients=stage == 2)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, dp_groups[s], lr=1e-2,
                                  bucket_cap_mb=0.0002)
    ref_opt = torch.optim.AdamW([p for r in refs for p in r.parameters()], lr=1e-2)
    counted = [p for n, p in model.named_parameters() if n not in NOT_COUNTED]
    owned = {id(p) for p, _ in opt.stepped_tensors()}
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(10 * s + step, 4)
        _loss(ddp(x.chunk(2)[pos]), y.chunk(2)[pos]).backward()
        norm = opt.clip_grad_norm_(max_norm, norm_type, counted=counted, groups=[cross[pos]])
        ref_opt.zero_grad()
        for t, r in enumerate(refs):
            xt, yt = _batch(10 * t + step, 4)
            _loss(r(xt), yt).backward()
        grads = [p.grad for r in refs for n, p in r.named_parameters() if n not in NOT_COUNTED]
        ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]),
                                            norm_type)
        assert ref_norm > 2 * max_norm
        torch.nn.utils.clip_grads_with_norm_([p for r in refs for p in r.parameters()], max_norm, ref_norm)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0, msg=lambda m: f"step {step}: {m}")
        for (name, p), q in zip(model.named_parameters(), refs[s].parameters()):
            if id(p) in owned:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8,
                                           msg=lambda m: f"step {step}, {name}: {m}")
        opt.step()
        ref_opt.step()
        _assert_close(model, refs[s], step)
    return norm.item()


@STAGES
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["2", "inf"])
def test_clip_grad_norm_with_counted_and_groups_equals_single_process(stage, norm_type):
    """Counting every parameter (ignoring ``counted``) or summing over the ZeRO group only
    (ignoring ``groups``) gives another norm."""
    norms = _pool("gloo", 4).run(_clip_counted_groups, stage, norm_type)
    assert all(n == norms[0] for n in norms)
