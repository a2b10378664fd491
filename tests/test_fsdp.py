"""torchpar.parallel.fully_shard against single-process training, torch's FSDP2, and its own engine
trace (issue 19).

Every multi-rank test runs on the torchpar backend and on gloo, at world sizes 2 and 4. Each rank
trains on its part of a batch; the reference trains on the whole batch in one process (each rank
computes it locally from the same seeds). Unit sizes are odd, so flat parameters are padded and
shard boundaries cut through parameters.
"""
import contextlib
import copy

import pytest
import torch
from torch import nn

import torchpar
from harness import get_pool
from torchpar.parallel import FSDPModule, MixedPrecision, fully_shard
from torchpar.parallel.fsdp import Shard

BACKENDS = ["torchpar", "gloo"]
WORLD_SIZES = [2, 4]
multi_rank = pytest.mark.parametrize("world_size", WORLD_SIZES)
on_backends = pytest.mark.parametrize("backend", BACKENDS)


def _pool(backend, world_size):
    if backend == "torchpar" and not hasattr(torchpar._C, "ProcessGroupTorchpar"):
        pytest.skip("the torchpar backend is not built in this tree")
    return get_pool(world_size, backend)


# ---- a small residual network of blocks, identical on every rank (seeded) ----

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class SelfCheckpointingBlock(Block):
    """Activation checkpointing inside the unit (a GPT block's full recomputation): the
    recomputation in backward reads the module's parameters, which must be the gathered ones."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


class Net(nn.Module):
    def __init__(self, d=7, depth=3, seed=0, block=Block):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(block(d) for _ in range(depth))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _shard_model(model, group, **kwargs):
    for b in model.blocks:
        fully_shard(b, group, **kwargs)
    return fully_shard(model, group, **kwargs)


def _batch(step, n):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)


def _part(t, ctx):
    return t.chunk(ctx.world_size)[ctx.rank]


def _loss(out, y):
    return ((out.float() - y) ** 2).mean()


def _assert_matches(sd, ref, step, rtol=1e-5, atol=1e-6):
    ref_sd = ref.state_dict()
    assert list(sd) == list(ref_sd)
    for name, value in sd.items():
        torch.testing.assert_close(value, ref_sd[name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"step {step}, {name}: {m}")


def _step_both(ctx, sharded, reference, x, y, step):
    """One SGD/AdamW step of the sharded model on this rank's part of (x, y) and of the
    one-process reference on all of it; then their weights must match."""
    (model, opt), (ref, ref_opt) = sharded, reference
    opt.zero_grad()
    _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
    opt.step()
    ref_opt.zero_grad()
    _loss(ref(x), y).backward()
    ref_opt.step()
    _assert_matches(model.state_dict(), ref, step)


def _setup(ctx):
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores


# ---- training equals single-process training ----

def _train_vs_single_process(ctx, reshard_after_forward, steps=3):
    _setup(ctx)
    model = Net()
    ref = copy.deepcopy(model)
    _shard_model(model, ctx.pg, reshard_after_forward=reshard_after_forward)
    # The optimizer sees this rank's pieces: 1-D, together 1/W of each unit (padding aside).
    units = [m._fsdp.flat for m in model.modules() if isinstance(m, FSDPModule)]
    assert all(p.dim() == 1 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) <= sum(u.shard_numel for u in units)
    assert sum(u.numel for u in units) == sum(p.numel() for p in ref.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        opt.zero_grad()
        loss = _loss(model(_part(x, ctx)), _part(y, ctx))
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step()
        losses.append(loss.item())
        _assert_matches(model.state_dict(), ref, step)
    return losses


@on_backends
@multi_rank
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_training_equals_single_process(backend, world_size, reshard_after_forward):
    _pool(backend, world_size).run(_train_vs_single_process, reshard_after_forward)


def _unit_above_32_mib(ctx):
    """Two steps of a unit of 40 MiB, whose gathered parameters and packed gradients are mapped
    in huge pages (csrc/common/step_buffer.h), against one process."""
    _setup(ctx)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2560, 4096), nn.Tanh(), nn.Linear(4096, 3))
    ref = copy.deepcopy(model)
    fully_shard(model, ctx.pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    before = torchpar._C.step_buffer_bytes_mapped_total()
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * ctx.world_size, 2560, generator=g), torch.randn(2 * ctx.world_size, 3, generator=g)
        _step_both(ctx, (model, opt), (ref, ref_opt), x, y, step)
    return torchpar._C.step_buffer_bytes_mapped_total() - before


@on_backends
def test_unit_above_32_mib_takes_huge_pages_and_trains_like_one_process(backend):
    # Each step the forward's gathering (the root unit stays gathered into its backward) and
    # the packed gradients: 40 MiB each, at least.
    for mapped in _pool(backend, 2).run(_unit_above_32_mib):
        assert mapped >= 2 * 2 * 40 * 2 ** 20, mapped


# ---- same as torch's FSDP2 (torch.distributed.fsdp.fully_shard), gloo on CPU ----

def _train_vs_torch_fsdp2(ctx, steps=3):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    _setup(ctx)
    ours, theirs = Net(), Net()
    _shard_model(ours, ctx.pg)
    mesh = DeviceMesh.from_group(ctx.pg, "cpu")
    for b in theirs.blocks:
        torch_fully_shard(b, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    _train_both_against_torch(ctx, ours, theirs, [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, theirs)],
                              steps)


def _train_both_against_torch(ctx, ours, theirs, opts, steps):
    """Both models step on this rank's part of each batch; ours' full weights equal torch's."""
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        for m, o in zip((ours, theirs), opts):
            o.zero_grad()
            _loss(m(_part(x, ctx)), _part(y, ctx)).backward()
            o.step()
        full = {n: p.full_tensor() for n, p in theirs.named_parameters()}
        ours_sd = ours.state_dict()
        assert list(ours_sd) == list(full)
        for n in full:
            torch.testing.assert_close(ours_sd[n], full[n], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step}, {n}: {m}")


@multi_rank
def test_matches_torch_fsdp2_step_for_step(world_size):
    _pool("gloo", world_size).run(_train_vs_torch_fsdp2)


# ---- prefetch order and overlap, from the engine's events ----

def _step_trace(ctx):
    _setup(ctx)
    model = _shard_model(Net(depth=4), ctx.pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):  # the first records the forward order; the second prefetches by it
        x, y = _batch(step, 2 * ctx.world_size)
        opt.zero_grad()
        _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
        opt.step()
    return model.fsdp_engine.forward_order(), model.fsdp_engine.trace()


@on_backends
def test_prefetch_and_reduce_scatter_overlap_in_engine_trace(backend):
    order, trace = _pool(backend, 2).run(_step_trace)[0]
    # The root (unit 0: input and output layers) first, then blocks 1..4 as forward ran them.
    assert order == [0, 1, 2, 3, 4]
    ev = [tuple(e) for e in trace]
    at = {e: i for i, e in enumerate(ev)}   # last occurrence of each event

    def first(e):
        return ev.index(e)

    blocks = order[1:]
    for u, nxt in zip(blocks, blocks[1:]):
        # Forward: the next block's all-gather is launched before this block's forward ends and
        # waited for only when the next block starts: it travelled while this one computed.
        assert first(("pre_forward", u)) < first(("all_gather_launch", nxt)) < first(("post_forward", u))
        assert first(("post_forward", u)) < first(("all_gather_wait", nxt))
        assert first(("reshard", u)) < first(("pre_forward", nxt))  # freed after its forward
    back = list(reversed(blocks))
    # Backward: the root's pre-backward prefetches the last block; each block prefetches the one
    # before it in forward order.
    assert at[("pre_backward", 0)] < at[("all_gather_launch", back[0])] < at[("pre_backward", back[0])]
    for u, nxt in zip(back, back[1:]):
        assert at[("pre_backward", u)] < at[("all_gather_launch", nxt)] < at[("post_backward", u)]
        # The reduce-scatter of u is launched when its backward ends and waited for only after
        # the next unit's backward has run: it overlapped that computation.
        assert at[("post_backward", u)] < at[("reduce_scatter_launch", u)] < at[("pre_backward", nxt)]
        assert at[("post_backward", nxt)] < at[("reduce_scatter_wait", u)]
    # Every unit reduced once, the last wait before the end-of-backward callback finishes.
    for u in order:
        assert ev.count(("reduce_scatter_launch", u)) == 1 and ev.count(("reduce_scatter_wait", u)) == 1
    end = at[("finalize", -1)]
    assert at[("reduce_scatter_wait", 0)] < end
    assert all(kind == "reshard" for kind, _ in ev[end + 1:])  # then only freeing is left


# ---- reshard_after_forward frees the gathered storage ----

def _storage_sizes(ctx, reshard_after_forward, by_setter):
    _setup(ctx)
    if by_setter:  # sharded with the other setting, then set_reshard_after_forward
        model = _shard_model(Net(), ctx.pg, reshard_after_forward=not reshard_after_forward)
        model.set_reshard_after_forward(reshard_after_forward)
    else:
        model = _shard_model(Net(), ctx.pg, reshard_after_forward=reshard_after_forward)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def gathered_bytes():
        return [sum(p.untyped_storage().nbytes() for p in u._fsdp.unsharded[:1]) for u in units]

    before = gathered_bytes()
    x, y = _batch(0, 2 * ctx.world_size)
    loss = _loss(model(_part(x, ctx)), _part(y, ctx))
    after_forward = gathered_bytes()
    loss.backward()
    after_backward = gathered_bytes()
    full = [4 * u._fsdp.flat.padded_numel for u in units]
    return before, after_forward, after_backward, full


@on_backends
@pytest.mark.parametrize("by_setter", [False, True], ids=["argument", "setter"])
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_reshard_after_forward_frees_gathered_storage(backend, reshard_after_forward, by_setter):
    before, fwd, bwd, full = _pool(backend, 2).run(_storage_sizes, reshard_after_forward, by_setter)[0]
    assert before == [0] * len(full)
    # The root keeps its parameters for backward; blocks free theirs unless told not to.
    assert fwd[0] == full[0]
    assert fwd[1:] == ([0] * (len(full) - 1) if reshard_after_forward else full[1:])
    assert bwd == [0] * len(full)


# ---- gradient accumulation without communication ----

def _no_sync_accumulation(ctx, use_context):
    _setup(ctx)
    model = Net()
    ref = copy.deepcopy(model)
    _shard_model(model, ctx.pg)
    micro = [_batch(s, 2 * ctx.world_size) for s in range(3)]
    for i, (x, y) in enumerate(micro):
        last = i == len(micro) - 1
        if use_context and not last:
            with model.no_sync():
                _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
        else:
            model.set_requires_gradient_sync(last)
            _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
        if not last:  # nothing reduced yet
            assert all(p.grad is None for p in model.parameters())
        _loss(ref(x), y).backward()
    # This rank's pieces of the summed gradients.
    for u in (m._fsdp for m in model.modules() if isinstance(m, FSDPModule)):
        for _, _, i, name in u.sites:
            p = u.sharded[i]
            start, length = u.flat.shard_range(i)
            expected = ref.get_parameter(_full_name(model, u, name)).grad.reshape(-1)[start:start + length]
            torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _kept_between_micro_batches(ctx, reshard_after_forward):
    """set_reshard_after_backward(False) under gradient accumulation: a backward that does not
    sync leaves the units gathered, so the next micro-batch gathers only what its forward freed;
    the syncing backward frees everything (an optimizer step follows), and the next step's first
    forward gathers the stepped shards afresh: the weights stay equal to one process's."""
    _setup(ctx)
    model = Net()
    ref = copy.deepcopy(model)
    _shard_model(model, ctx.pg, reshard_after_forward=reshard_after_forward)
    model.set_reshard_after_backward(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    n = len(units)
    gathers = []
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for i in range(3):
            x, y = _batch(3 * step + i, 2 * ctx.world_size)
            model.set_requires_gradient_sync(i == 2)
            _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
            _loss(ref(x), y).backward()
            gathers.append(sum(e[0] == "all_gather_launch" for e in model.fsdp_engine.trace()))
            if i < 2:
                assert all(m._fsdp.flat.gathered() for m in units), "a non-syncing backward freed a unit"
        assert not any(m._fsdp.flat.gathered() for m in units), "the syncing backward kept a unit"
        opt.step()
        ref_opt.step()
        _assert_matches(model.state_dict(), ref, step)
    # The first micro-batch of a step gathers every unit; after it, with reshard_after_forward a
    # forward frees the blocks (not the root) and their backward gathers them again.
    again = n - 1 if reshard_after_forward else 0
    assert gathers == [n + again, again, again] * 2, gathers
    # reshard() frees a kept unit at once, and the next forward gathers it again.
    model.set_requires_gradient_sync(False)
    _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
    for m in units:
        m.reshard()
    assert not any(m._fsdp.flat.gathered() for m in units)
    with torch.no_grad():
        model(_part(x, ctx))
    assert sum(e[0] == "all_gather_launch" for e in model.fsdp_engine.trace()) == n


@on_backends
@multi_rank
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_reshard_after_backward_false_keeps_units_between_micro_batches(backend, world_size, reshard_after_forward):
    _pool(backend, world_size).run(_kept_between_micro_batches, reshard_after_forward)


def _kept_units_are_never_stale(ctx, fused):
    """Kept units (set_reshard_after_backward(False)) are kept only while every rank has them
    gathered from the current shards: a forward with grad and no backward, then the optimizer's
    step; a checkpoint loaded between micro-batches; a backward that raised on one rank only
    (review findings). Each time the next forward gathers afresh, on every rank alike."""
    _setup(ctx)
    model = _shard_model(Net(), ctx.pg, reshard_after_forward=False)
    model.set_reshard_after_backward(False)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # A fused optimizer writes the shards without bumping their version counters (review).
    opt = torch.optim.SGD(model.parameters(), lr=0.5, **({"fused": True} if fused else {"foreach": False}))
    x, y = _batch(0, 2 * ctx.world_size)
    x, y = _part(x, ctx), _part(y, ctx)

    def fresh_output():
        for m in units:
            m.reshard()
        with torch.no_grad():
            return model(x)

    def gathers():
        return sum(e[0] == "all_gather_launch" for e in model.fsdp_engine.trace())

    _loss(model(x), y).backward()      # syncs: frees every unit
    model(x)                           # a forward with grad and no backward leaves them gathered
    opt.step()                         # ... and the step writes the shards
    model.set_requires_gradient_sync(False)
    got = model(x)
    assert gathers() == len(units)
    torch.testing.assert_close(got.detach(), fresh_output(), rtol=0, atol=0)

    _loss(model(x), y).backward()      # no sync: every unit kept
    other = Net(seed=1)
    model.load_state_dict(other.state_dict())
    got = model(x)
    assert gathers() == len(units)
    torch.testing.assert_close(got.detach(), other(x), rtol=1e-6, atol=1e-6)

    _loss(model(x), y).backward()      # kept again; now a backward that raises on rank 0 only
    out = model(x)
    if ctx.rank == 0:
        out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected") if ctx.rank == 0 else contextlib.nullcontext():
        _loss(out, y).backward()
    got = model(x)  # every rank gathers again (the rank that raised keeps nothing): no hang
    assert gathers() == len(units)
    torch.testing.assert_close(got.detach(), fresh_output(), rtol=0, atol=0)

    # The same failure, in the model's backward or before it reaches the model (in the loss),
    # then a forward under no_grad: the rank that raised still counts its backward as pending
    # while the others do not; they agree whether a step begins (review findings).
    for where in ("model", "loss"):
        _loss(model(x), y).backward()
        out = model(x)
        loss = _loss(out, y)
        if ctx.rank == 0:
            (out if where == "model" else loss).register_hook(
                lambda g: (_ for _ in ()).throw(RuntimeError("injected")))
        with pytest.raises(RuntimeError, match="injected") if ctx.rank == 0 else contextlib.nullcontext():
            loss.backward()
        with torch.no_grad():
            got = model(x)
        total = torch.ones(1)
        torch.distributed.all_reduce(total, group=ctx.pg)  # pairs with the peer's, not with an agreement
        assert total.item() == ctx.world_size, where
        torch.testing.assert_close(got, fresh_output(), rtol=0, atol=0)

    # A forward with grad whose backward never runs, the optimizer's step, then a forward under
    # no_grad: it begins no step (a backward is pending) and must still not use the copies
    # gathered before the step, with keeping asked for or not (review finding).
    for keep in (False, True):
        model.set_reshard_after_backward(not keep)
        model.set_requires_gradient_sync(True)
        _loss(model(x), y).backward()
        model(x)
        opt.step()
        with torch.no_grad():
            got = model(x)
        torch.testing.assert_close(got, fresh_output(), rtol=0, atol=0, msg=lambda m: f"keep={keep}: {m}")


@on_backends
@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
def test_kept_units_are_never_stale_and_agree_across_ranks(backend, fused):
    _pool(backend, 2).run(_kept_units_are_never_stale, fused, timeout=60)


def _assert_shard_grads(model, ref, step):
    """Every FSDP unit's gradient shard equals its piece of the reference model's gradient."""
    for u in (m._fsdp for m in model.modules() if isinstance(m, FSDPModule)):
        for _, _, i, name in u.sites:
            start, length = u.flat.shard_range(i)
            expected = ref.get_parameter(_full_name(model, u, name)).grad
            if expected is None:  # no rank had a gradient for it: none is delivered
                assert u.sharded[i].grad is None, f"step {step}, {name}: {u.sharded[i].grad}"
                continue
            expected = expected.reshape(-1)[start:start + length]
            torch.testing.assert_close(u.sharded[i].grad, expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step}, {name}: {m}")


def _full_name(model, unit, name):
    for prefix, m in model.named_modules():
        if isinstance(m, FSDPModule) and m._fsdp is unit:
            return f"{prefix}.{name}" if prefix else name
    raise KeyError(name)


@on_backends
@multi_rank
@pytest.mark.parametrize("use_context", [True, False], ids=["no_sync", "set_requires_gradient_sync"])
def test_accumulation_without_sync_equals_synced_sum(backend, world_size, use_context):
    _pool(backend, world_size).run(_no_sync_accumulation, use_context)


def _divided_gradients(ctx):
    """set_gradient_divide_factor(1.0) on every unit but the root (it is not recursive): their
    gradients are the sum of the ranks' gradients, the root's their mean."""
    _setup(ctx)
    model = Net()
    ref = copy.deepcopy(model)
    _shard_model(model, ctx.pg)
    for block in model.blocks:
        block.set_gradient_divide_factor(1.0)
    x, y = _batch(0, 2 * ctx.world_size)
    _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
    for xr, yr in zip(x.chunk(ctx.world_size), y.chunk(ctx.world_size)):
        _loss(ref(xr), yr).backward()  # the sum of the ranks' gradients
    for name, p in ref.named_parameters():
        if not name.startswith("blocks."):
            p.grad /= ctx.world_size
    _assert_shard_grads(model, ref, 0)
    errors = []
    for bad in (0, -1.0, float("inf"), "2"):
        try:
            model.set_gradient_divide_factor(bad)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_gradient_divide_factor_replaces_the_mean_per_unit():
    for errors in _pool("torchpar", 2).run(_divided_gradients):
        assert len(errors) == 4 and all("positive finite number or None" in e for e in errors), errors


# ---- state_dict: full and sharded forms ----

def _train_and_save(ctx, steps=2):
    _setup(ctx)
    model = _shard_model(Net(), ctx.pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        opt.zero_grad()
        _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
        opt.step()
    full = model.state_dict()
    # Into the unsharded model: the same function.
    plain = Net(seed=1)
    plain.load_state_dict(full)
    x, _ = _batch(9, 4)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(x))
    # The sharded form loads back at the same world size.
    sharded = model.sharded_state_dict()
    assert all(isinstance(v, Shard) for v in sharded.values())
    other = _shard_model(Net(seed=2), ctx.pg)
    other.load_state_dict(sharded)
    _assert_matches(other.state_dict(), plain, "sharded")
    return {k: v.clone() for k, v in full.items()}, sharded


def _load_full(ctx, full):
    _setup(ctx)
    model = _shard_model(Net(seed=3), ctx.pg)
    model.load_state_dict(full)
    plain = Net(seed=4)
    plain.load_state_dict(full)
    _assert_matches(model.state_dict(), plain, "loaded")
    x, _ = _batch(9, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))


def _load_sharded_elsewhere(ctx, sharded):
    _setup(ctx)
    model = _shard_model(Net(seed=3), ctx.pg)
    try:
        model.load_state_dict(sharded)
    except ValueError as e:
        return str(e)
    return None


@on_backends
def test_state_dict_round_trips_across_world_sizes(backend):
    full, sharded = _pool(backend, 2).run(_train_and_save)[0]
    _pool(backend, 4).run(_load_full, full)   # saved at 2 ranks, loaded at 4
    errors = _pool(backend, 4).run(_load_sharded_elsewhere, sharded)
    assert all(e and "rank 0 of 2" in e and "of 4" in e and "inp.weight" in e for e in errors), errors


# ---- O2 mixed precision: bfloat16 compute, float32 master shards and reduction ----

def _bf16_vs_master_reference(ctx, steps=3, **shard_kwargs):
    _setup(ctx)
    model = Net()
    master = copy.deepcopy(model)                # the float32 master weights, one process
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _shard_model(model, ctx.pg, mixed_precision=policy, **shard_kwargs)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(master.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        opt.zero_grad()
        out = model(_part(x, ctx))
        assert out.dtype == torch.bfloat16
        _loss(out, _part(y, ctx)).backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        # Reference: a bfloat16 copy of the master weights computes each rank's part; the parts'
        # gradients are averaged in float32 and step the float32 master.
        ref_opt.zero_grad()
        for r in range(ctx.world_size):
            low = copy.deepcopy(master).to(torch.bfloat16)
            _loss(low(x.chunk(ctx.world_size)[r].bfloat16()), y.chunk(ctx.world_size)[r]).backward()
            for p, q in zip(master.parameters(), low.parameters()):
                g = q.grad.float() / ctx.world_size
                p.grad = g if p.grad is None else p.grad + g
        ref_opt.step()
        _assert_matches(model.state_dict(), master, step, rtol=1e-4, atol=1e-5)


@on_backends
@multi_rank
def test_bf16_mixed_precision_matches_float32_master_reference(backend, world_size):
    _pool(backend, world_size).run(_bf16_vs_master_reference)


# ---- parameters some or all ranks did not use ----

class _Sometimes(Net):
    """Net with a parameter no rank uses (``spare``) and one used where ``use`` is true."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(3, 3)
        self.sometimes = nn.Linear(3, 3)

    def forward(self, x, use):
        out = super().forward(x)
        return self.sometimes(out) if use else out


def _unused_vs_single_process(ctx, accumulate, steps=2):
    """Rank 0 uses ``sometimes`` (in the first micro-batch only, when accumulating: the one kept
    unreduced by no_sync or reduced within the replica only); no rank uses
    ``spare``. One process: the same per-rank losses, averaged. AdamW with weight decay steps a
    parameter whose .grad is zeros, and leaves one whose .grad is None, as one process does."""
    from torch.distributed.device_mesh import init_device_mesh
    _setup(ctx)
    model, ref = _Sometimes(), _Sometimes()
    ref.load_state_dict(model.state_dict())
    layout = ({"mesh": init_device_mesh("cpu", (2, ctx.world_size // 2))} if accumulate == "within replica"
              else {"group": ctx.pg})
    for b in model.blocks:
        fully_shard(b, **layout)
    fully_shard(model, **layout)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref))
    halves = (slice(0, 1), slice(1, 2)) if accumulate else (slice(0, 2),)
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        opt.zero_grad()
        ref_opt.zero_grad()
        for h, half in enumerate(halves):
            last = h == len(halves) - 1
            use = ctx.rank == 0 and h == 0
            sync = contextlib.nullcontext()
            if accumulate == "no_sync" and not last:
                sync = model.no_sync()
            model.set_requires_all_reduce(accumulate != "within replica" or last)
            with sync:
                (_loss(model(_part(x, ctx)[half], use), _part(y, ctx)[half]) / len(halves)).backward()
            for r in range(ctx.world_size):
                xr, yr = (t.chunk(ctx.world_size)[r][half] for t in (x, y))
                (_loss(ref(xr, r == 0 and h == 0), yr) / len(halves) / ctx.world_size).backward()
        assert model.spare.weight.grad is None and model.spare.bias.grad is None
        assert model.sometimes.weight.grad is not None
        opt.step()
        ref_opt.step()
        _assert_matches(model.state_dict(), ref, step)


@on_backends
@pytest.mark.parametrize("accumulate", [None, "no_sync"])
def test_a_parameter_no_rank_used_keeps_its_grad_as_one_process_does(backend, accumulate):
    _pool(backend, 2).run(_unused_vs_single_process, accumulate)


@on_backends
def test_unused_parameters_under_hybrid_sharding_that_reduces_within_the_replica(backend):
    _pool(backend, 4).run(_unused_vs_single_process, "within replica")


# ---- bad input: a clear error on every rank ----

def _differing_models(ctx):
    _setup(ctx)
    model = Net(d=7 if ctx.rank == 0 else 6)
    try:
        fully_shard(model.blocks[0], ctx.pg)
    except RuntimeError as e:
        return str(e)
    return None


def _load_other_model(ctx):
    _setup(ctx)
    model = _shard_model(Net(), ctx.pg)
    bad = Net(d=6).state_dict()
    try:
        model.load_state_dict(bad)
    except ValueError as e:
        return str(e)
    return None


def _tied_across_units(ctx):
    # One parameter in two units would be flattened twice: two shards trained apart, the tie
    # silently broken. Tied parameters must be in one unit (shard their common parent).
    _setup(ctx)
    model = Net()
    model.blocks[1].fc1.weight = model.blocks[0].fc1.weight
    try:
        _shard_model(model, ctx.pg)
    except ValueError as e:
        return str(e)
    return None


@on_backends
def test_bad_input_raises_on_every_rank(backend):
    errors = _pool(backend, 2).run(_tied_across_units)
    assert all(e and "'fc1.weight'" in e and "already sharded" in e for e in errors), errors
    errors = _pool(backend, 2).run(_differing_models)
    assert all(e and "differ across ranks" in e and "'ln.weight'" in e and "[7]" in e and "[6]" in e
               for e in errors), errors
    errors = _pool(backend, 2).run(_load_other_model)
    assert all(e and "'inp.weight'" in e and "[6, 5]" in e and "[7, 5]" in e for e in errors), errors


# ---- memory: parameters + gradients + optimizer state per rank ----

def _peak_memory(ctx, depth=16, d=16):
    _setup(ctx)
    model = _shard_model(Net(d=d, depth=depth), ctx.pg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine = model.fsdp_engine if model.fsdp_engine is not None else None

    def step(step_index):
        x, y = _batch(step_index, 2 * ctx.world_size)
        opt.zero_grad(set_to_none=True)
        _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
        opt.step()

    step(0)  # the optimizer state exists from here on
    engine = model.fsdp_engine
    engine.reset_peak_memory()
    step(1)
    opt_bytes = sum(v.nbytes for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.numel() > 1)
    measured = engine.peak_memory()["total"] + opt_bytes
    units = [m._fsdp.flat for m in model.modules() if isinstance(m, FSDPModule)]
    padded = sum(u.padded_numel for u in units)
    # Analytic: 1/W of parameters, gradients and Adam's two states (4 x 4 bytes per element),
    # plus the largest unit unsharded (its parameters and gradients, 2 x 4 bytes per element).
    analytic = 16 * padded // ctx.world_size + 8 * max(u.padded_numel for u in units)
    return measured, analytic, engine.peak_memory()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_peak_memory_is_the_shard_share_plus_one_unit(world_size):
    measured, analytic, breakdown = _pool("torchpar", world_size).run(_peak_memory)[0]
    assert analytic <= measured <= 1.10 * analytic, (measured, analytic, breakdown)


def _allocated_and_not_freed(prof):
    """{address: (bytes, the op that allocated it)} of what the profiled thread allocated inside the
    window and did not free there. By address, in time order: a free of a block allocated before
    the window (garbage of an earlier test, collected now) is no leftover of this one."""
    events = []

    def walk(node):
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append(node)
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = {}
    # A free and a new block at its address in the same nanosecond: the free first (review).
    for node in sorted(events, key=lambda n: (n.start_time_ns, n.extra_fields.alloc_size > 0)):
        fields = node.extra_fields
        if fields.alloc_size > 0:
            live[fields.ptr] = (fields.alloc_size, node.parent.name if node.parent else None)
        else:
            live.pop(fields.ptr, None)
    return live


def _step_frees_on_the_caller_thread(ctx):
    # Every buffer the engine and the backend allocate on the training thread during forward and
    # backward is freed there too: what the profiler saw allocated and not freed is exactly the
    # new gradients. The root's packed gradients used to be freed later on the backend's worker
    # thread (counted live into the optimizer step by `python -m torchpar.bench fsdp`; issue 19),
    # and so, now and then, were the outputs of the first step's unit-order all-gather (the
    # worker let go of the work after wait() returned). test_collectives.py's
    # test_async_inputs_released_by_wait pins both causes themselves.
    from torch.profiler import ProfilerActivity, profile
    _setup(ctx)
    model = _shard_model(Net(d=64, depth=3), ctx.pg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for i in range(6):
        x, y = _batch(i, 2 * ctx.world_size)
        opt.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
        left = _allocated_and_not_freed(prof)
        grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                 for p in model.parameters() if p.grad is not None}
        assert {ptr: size for ptr, (size, _) in left.items()} == grads, \
            (i, {ptr: v for ptr, v in left.items() if ptr not in grads}, sorted(grads.values()))
        opt.step()
    return True


def test_step_frees_its_buffers_on_the_training_thread():
    _pool("torchpar", 2).run(_step_frees_on_the_caller_thread)


# ---- forward/backward patterns beyond one forward then one backward (review of issue 19) ----

class CheckpointedNet(Net):
    """Net whose blocks run under activation checkpointing: their forward runs again inside
    backward, on parameters that must stay gathered until that backward is done."""

    def __init__(self, use_reentrant, **kwargs):
        super().__init__(**kwargs)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.use_reentrant)
        return self.out(x)


class CheckpointedNetNoEarlyStop(CheckpointedNet):
    """The recomputation runs the blocks' forward to its end (their forward hooks included)."""

    def forward(self, x):
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return super().forward(x)


def _run_pattern(model, x, y, pattern):
    if pattern == "backward_twice":  # two backward passes over one graph add their gradients
        loss = _loss(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
    elif pattern == "two_synced_backwards":  # accumulation without no_sync: each backward reduces
        for _ in range(2):
            _loss(model(x), y).backward()
    elif pattern == "no_grad_forward_before_backward":  # e.g. a metric between forward and backward
        loss = _loss(model(x), y)
        with torch.no_grad():
            model(x)
        loss.backward()
    elif pattern == "after_failed_backward":  # e.g. a batch skipped when its backward raised
        def fail(grad):
            raise RuntimeError("backward failed on purpose")

        def arm(module, args, out):
            out.register_hook(fail)

        handle = model.blocks[0].register_forward_hook(arm)
        with pytest.raises(RuntimeError, match="on purpose"):
            _loss(model(x), y).backward()
        handle.remove()
        if isinstance(model, FSDPModule):  # torch FSDP2's recovery: the pieces registered again
            model.reset_iter_state()
            _assert_pieces_registered(model)
        for p in model.parameters():
            p.grad = None
        _loss(model(x), y).backward()
    elif pattern == "after_failed_forward":  # e.g. a batch skipped when the model raised on it
        def fail(module, args):
            raise RuntimeError("forward failed on purpose")

        # Raised inside block 1's forward on every rank, after its unit was gathered and
        # registered: the pieces must be registered again all the same (review finding).
        handle = model.blocks[1].register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="on purpose"):
            model(x)
        handle.remove()
        if isinstance(model, FSDPModule):  # (the reference runs this pattern too)
            _assert_pieces_registered(model)
        with torch.no_grad():  # an evaluation in between
            model(x)
        _loss(model(x), y).backward()
    else:
        _loss(model(x), y).backward()


def _assert_pieces_registered(model, with_grads=False):
    """Outside forward the modules hold the pieces, not the gathered parameters (what the
    optimizer was built on, what ``clip_grad_norm_(model.parameters())`` reads)."""
    pieces = {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m._fsdp.sharded}
    registered = list(model.parameters())
    assert {id(p) for p in registered} == pieces
    if with_grads:
        assert all(p.grad is not None for p in registered)


def _pattern_grads_match(ctx, pattern, steps=2, **shard_kwargs):
    _setup(ctx)
    if pattern == "checkpoint_no_early_stop":
        model = CheckpointedNetNoEarlyStop(use_reentrant=False)
    elif pattern == "checkpoint_inside_unit":
        model = Net(block=SelfCheckpointingBlock)
    elif pattern.startswith("checkpoint"):
        model = CheckpointedNet(use_reentrant=pattern.endswith("reentrant"))
    else:
        model = Net()
    ref = copy.deepcopy(model)
    _shard_model(model, ctx.pg, **shard_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        opt.zero_grad()
        ref_opt.zero_grad()
        _run_pattern(model, _part(x, ctx), _part(y, ctx), pattern)
        _run_pattern(ref, x, y, pattern)
        _assert_pieces_registered(model, with_grads=True)
        _assert_shard_grads(model, ref, step)
        opt.step()
        ref_opt.step()
        _assert_matches(model.state_dict(), ref, step)


@on_backends
@pytest.mark.parametrize("pattern", ["checkpoint", "checkpoint_reentrant", "checkpoint_no_early_stop",
                                     "checkpoint_inside_unit", "backward_twice", "two_synced_backwards", "after_failed_backward",
                                     "after_failed_forward",
                                     "no_grad_forward_before_backward"])
def test_forward_backward_patterns_equal_single_process(backend, pattern):
    _pool(backend, 2).run(_pattern_grads_match, pattern)


def _checkpoint_trace(ctx):
    _setup(ctx)
    model = _shard_model(CheckpointedNet(use_reentrant=False, depth=4), ctx.pg)
    for step in range(2):
        x, y = _batch(step, 2 * ctx.world_size)
        _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
    return model.fsdp_engine.trace()


@pytest.mark.parametrize("backend", ["gloo"])
def test_checkpoint_recomputation_gathers_no_finished_unit(backend):
    # A recomputed forward must not prefetch the unit after it: that unit's backward is over, and
    # gathering it again would keep it (and with it every unit) gathered until backward ends.
    for trace in _pool(backend, 2).run(_checkpoint_trace):
        done = set()
        for kind, unit in trace:
            if kind == "post_backward":
                done.add(unit)
            assert not (kind == "all_gather_launch" and unit in done), trace


# ---- gradient hooks registered on a parameter before fully_shard ----

def _hooked_training(ctx, backend):
    """A hook registered on a parameter before sharding (sequence parallelism registers one that
    all-reduces the gradient over the tensor-parallel group) still acts on its gradient, and
    Megatron's ``sequence_parallel`` marker stays on the parameter."""
    _setup(ctx)
    group = ctx.pg if backend == "torchpar" else ctx.gloo
    model = Net()
    ref = copy.deepcopy(model)
    for m in (ref, model):
        m.blocks[0].ln.weight.register_hook(lambda g: 3 * g)
        m.blocks[0].ln.weight.sequence_parallel = True
    _shard_model(model, group)
    marked = getattr(model.blocks[0].ln.weight, "sequence_parallel", False)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    for step in range(2):
        x, y = _batch(step, 2 * ctx.world_size)
        _step_both(ctx, (model, opt), (ref, ref_opt), x, y, step)
    return marked


@on_backends
def test_parameter_hooks_and_markers_survive_sharding(backend):
    assert all(_pool(backend, 2).run(_hooked_training, backend)), "the sequence_parallel marker was dropped"


# ---- a parameter that gets a gradient on some ranks only (a data-dependent branch) ----

class GatedBlock(Block):
    """A block whose ``extra`` layer runs only when asked: its parameters get a gradient on the
    ranks whose data took the branch and none on the others."""

    def __init__(self, d):
        super().__init__(d)
        self.extra = nn.Linear(d, d)

    def forward(self, x, use_extra):
        x = super().forward(x)
        return x + self.extra(x) if use_extra else x


class BranchNet(Net):
    """Net with a gated block in the middle, taken when the batch's inputs sum above zero."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(7)
        self.blocks[1] = GatedBlock(self.out.in_features)

    def forward(self, x):
        use_extra = bool(x.sum() > 0)
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, use_extra) if isinstance(b, GatedBlock) else b(h)
        return self.out(h)


def _branch_batch(step, ctx):
    """Each rank's part shifted up or down, so that the branch is taken on some ranks only (and
    which ones changes with the step; in the last step, on none)."""
    x, y = _batch(step, 2 * ctx.world_size)
    takes = [(r + step) % 2 == 0 and step < 2 for r in range(ctx.world_size)]
    parts = [p + (3.0 if take else -3.0) for p, take in zip(x.chunk(ctx.world_size), takes)]
    return parts, y.chunk(ctx.world_size), takes


def _branch_grads_match(ctx, steps=3):
    _setup(ctx)
    model = BranchNet()
    ref = copy.deepcopy(model)
    _shard_model(model, ctx.pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    taken = []
    for step in range(steps):
        xs, ys, takes = _branch_batch(step, ctx)
        assert bool(xs[ctx.rank].sum() > 0) == takes[ctx.rank]
        taken.append(takes[ctx.rank])
        opt.zero_grad()
        _loss(model(xs[ctx.rank]), ys[ctx.rank]).backward()
        # One process running every rank's branch: the average of the ranks' gradients.
        ref_opt.zero_grad()
        for x, y in zip(xs, ys):
            _loss(ref(x), y).backward()
        for p in ref.parameters():  # a parameter no rank used keeps .grad None, in both
            p.grad = None if p.grad is None else p.grad / ctx.world_size
        _assert_shard_grads(model, ref, step)
        opt.step()
        ref_opt.step()
        _assert_matches(model.state_dict(), ref, step)
    return taken


@on_backends
@multi_rank
def test_parameters_with_gradients_on_some_ranks_only_equal_single_process(backend, world_size):
    # Hung before: a unit was reduced when its last parameter's gradient arrived, so a rank whose
    # branch left some without one reduced that unit at the end of backward instead, out of order
    # with the ranks that had them all.
    taken = _pool(backend, world_size).run(_branch_grads_match, timeout=60)
    assert [t[:2] for t in taken] == [[r % 2 == 0, r % 2 == 1] for r in range(world_size)]


# ---- a whole unit whose forward runs on some ranks only (a data-dependent skip) ----

class SkipNet(Net):
    """Net whose ``gated`` blocks run only when the batch's inputs sum above zero: the whole unit
    is skipped on the other ranks. The blocks are identical in size, so collectives of one paired
    with another's would go unnoticed by the backend (silently wrong before the engine followed
    skips; with blocks of different sizes it was a hang or a size-mismatch error)."""

    def __init__(self, gated, instead=(), **kwargs):
        super().__init__(depth=4, **kwargs)
        self.gated = gated
        self.instead = instead  # blocks run only when the gated ones are not

    def forward(self, x):
        take = bool(x.sum() > 0)
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if (take or i not in self.gated) and not (take and i in self.instead):
                h = b(h)
        return self.out(h)


def _skip_takes(step, world_size):
    # Step 0: rank 0 skips (its recorded order lacks the gated blocks), then the other way round,
    # then no rank takes the branch, then every rank does.
    if step < 2:
        return [(r + step) % 2 == 1 for r in range(world_size)]
    return [step == 3] * world_size


def _skip_grads_match(ctx, gated, reshard_after_forward, steps=4, instead=(), reduce_dtype=None):
    _setup(ctx)
    model = SkipNet(gated, instead)
    ref = copy.deepcopy(model)
    mp = {} if reduce_dtype is None else {"mixed_precision": MixedPrecision(reduce_dtype=reduce_dtype)}
    # A low-precision reduce rounds the summed gradients (and so the weights after SGD).
    tol = dict(rtol=1e-5, atol=1e-6) if reduce_dtype is None else dict(rtol=2e-2, atol=1e-2)
    _shard_model(model, ctx.pg, reshard_after_forward=reshard_after_forward, **mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    skipped = []
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        takes = _skip_takes(step, ctx.world_size)
        xs = [p + (3.0 if t else -3.0) for p, t in zip(x.chunk(ctx.world_size), takes)]
        ys = y.chunk(ctx.world_size)
        opt.zero_grad()
        _loss(model(xs[ctx.rank]), ys[ctx.rank]).backward()
        # One process running every rank's part: the average of the ranks' gradients; a block no
        # rank ran keeps no gradient.
        ref_opt.zero_grad()
        for xr, yr in zip(xs, ys):
            _loss(ref(xr), yr).backward()
        for p in ref.parameters():
            if p.grad is not None:
                p.grad /= ctx.world_size
        for u in (m._fsdp for m in model.modules() if isinstance(m, FSDPModule)):
            for _, _, i, name in u.sites:
                ref_grad = ref.get_parameter(_full_name(model, u, name)).grad
                if ref_grad is None:
                    assert u.sharded[i].grad is None, f"step {step}, {name}: a gradient for a unit no rank ran"
                    continue
                start, length = u.flat.shard_range(i)
                torch.testing.assert_close(u.sharded[i].grad, ref_grad.reshape(-1)[start:start + length],
                                           **tol, msg=lambda m: f"step {step}, {name}: {m}")
        opt.step()
        ref_opt.step()
        _assert_matches(model.state_dict(), ref, step, **tol)
        skipped.append([e for e in model.fsdp_engine.trace() if e[0] == "skipped_backward"])
    return skipped


@on_backends
@multi_rank
@pytest.mark.parametrize("gated,reshard_after_forward", [((1,), True), ((2, 3), True), ((1,), False)],
                         ids=["middle", "last_two", "middle-keep"])
def test_unit_run_on_some_ranks_only_equals_single_process(backend, world_size, gated, reshard_after_forward):
    # Hung before, or (equal block sizes) trained on another block's gathered parameters: the rank
    # that skipped a unit reduced it at the end of backward, out of order with the others.
    skipped = _pool(backend, world_size).run(_skip_grads_match, gated, reshard_after_forward, timeout=60)
    units = {1 + g for g in gated}  # unit 0 is the root, blocks follow
    for rank, per_step in enumerate(skipped):
        for step, events in enumerate(per_step):
            took = _skip_takes(step, world_size)[rank]
            assert {u for _, u in events} == (set() if took else units), (rank, step, events)


@on_backends
def test_units_skipped_on_different_ranks_equal_single_process(backend):
    # Each rank skips a different block in the first step (block 0 on one rank, block 1 on the
    # other: a per-rank branch between two experts). Raised in the first backward before: the
    # agreed order was one rank's with the other rank's block appended after the last unit, so
    # the ranks' backward slots did not line up.
    skipped = _pool(backend, 2).run(_skip_grads_match, (0,), True, 4, (1,), timeout=60)
    for rank, per_step in enumerate(skipped):
        for step, events in enumerate(per_step):
            took = _skip_takes(step, 2)[rank]
            assert {u for _, u in events} == ({2} if took else {1}), (rank, step, events)


def _skip_trace(ctx):
    _setup(ctx)
    model = _shard_model(SkipNet((0, 1)), ctx.pg)
    for step in range(2):  # rank 0 skips blocks 0 and 1 in the first step, rank 1 in the second
        x, y = _batch(step, 2 * ctx.world_size)
        take = _skip_takes(step, ctx.world_size)[ctx.rank]
        model.zero_grad()
        _loss(model(_part(x, ctx) + (3.0 if take else -3.0)), _part(y, ctx)).backward()
    return model.fsdp_engine.trace()


@on_backends
def test_units_skipped_in_forward_are_freed_before_the_next_unit_runs(backend):
    # Units 1 and 2 (blocks 0, 1), skipped by rank 1 in the second step, are gathered with the
    # others' stream and must be freed as the others free them, not held to the end of forward
    # (held before: every skipped unit gathered at once).
    trace = _pool(backend, 2).run(_skip_trace, timeout=60)[1]
    assert ("pre_forward", 1) not in trace and ("pre_forward", 3) in trace, trace
    for u in (1, 2):
        assert trace.index(("reshard", u)) < trace.index(("post_forward", 3)), trace


def _skip_eval_first_then_no_sync(ctx):
    _setup(ctx)
    model = SkipNet((1,))
    ref = copy.deepcopy(model)
    _shard_model(model, ctx.pg)
    x, _ = _batch(9, 2 * ctx.world_size)
    with torch.no_grad():  # the first forward (the order is agreed here) is an evaluation
        model(_part(x, ctx) + (3.0 if ctx.rank == 0 else -3.0))
    # Rank 1 runs the gated block only in the first micro-batch (without sync), rank 0 only in the
    # last (synced); no rank in the middle one.
    takes = [[r == 1 for r in range(ctx.world_size)], [False] * ctx.world_size,
             [r == 0 for r in range(ctx.world_size)]]
    for m, take in enumerate(takes):
        x, y = _batch(m, 2 * ctx.world_size)
        xs = [p + (3.0 if t else -3.0) for p, t in zip(x.chunk(ctx.world_size), take)]
        ys = y.chunk(ctx.world_size)
        model.set_requires_gradient_sync(m == len(takes) - 1)
        _loss(model(xs[ctx.rank]), ys[ctx.rank]).backward()
        for xr, yr in zip(xs, ys):
            (_loss(ref(xr), yr) / ctx.world_size).backward()
    _assert_shard_grads(model, ref, "accumulated")


@on_backends
def test_skipped_units_with_eval_first_and_accumulation_equal_single_process(backend):
    # The order agreed in a no_grad forward; a unit run by one rank only in a micro-batch without
    # sync and by the other only in the synced one: its gradients come from the accumulator.
    _pool(backend, 2).run(_skip_eval_first_then_no_sync, timeout=60)


@on_backends
@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_unit_run_on_some_ranks_only_with_low_precision_reduce(backend, reduce_dtype):
    # The tags travel in the reduce dtype: they must come back exact (and the grads right). Two
    # steps (rank 0 skips, then rank 1): further ones drift from the float32 reference by the
    # reduce's rounding alone (a run without any skip drifts as much).
    _pool(backend, 2).run(_skip_grads_match, (1, 2), True, 2, (), reduce_dtype, timeout=60)


class TwoBranchNet(Net):
    """Two blocks of one size summed, run in an order that depends on the data (and so on the
    rank): their backward passes, and reduce-scatters, come in different orders on different
    ranks. The engine cannot line these up; it must say so instead of mixing the two blocks."""

    def forward(self, x):
        h = self.inp(x)
        a, b = self.blocks[0], self.blocks[1]
        if x.sum() > 0:
            h = a(h) + b(h)
        else:
            h = b(h) + a(h)
        return self.out(self.blocks[2](h))


def _mismatched_backward(ctx, reshard_after_forward):
    import torch.distributed as dist
    _setup(ctx)
    # A group of its own: a collective a rank had launched when it raised must not pair with a
    # later test's.
    group = dist.new_group(backend=dist.get_backend(ctx.pg))
    model = _shard_model(TwoBranchNet(), group, reshard_after_forward=reshard_after_forward)
    x, y = _batch(0, 2 * ctx.world_size)
    x = _part(x, ctx) + (3.0 if ctx.rank % 2 == 0 else -3.0)
    try:
        _loss(model(x), _part(y, ctx)).backward()
    except RuntimeError as e:
        return str(e)
    return None


@on_backends
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_backward_in_different_orders_raises_on_every_rank(backend, reshard_after_forward):
    # Silently wrong before: the two blocks' reduce-scatters paired up crosswise.
    errors = _pool(backend, 2).run(_mismatched_backward, reshard_after_forward, timeout=60)
    for e in errors:
        assert e is not None and "went out of step" in e and "unit 1" in e and "unit 2" in e, errors
