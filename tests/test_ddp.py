"""torchpar.parallel.DistributedDataParallel against single-process training and torch's DDP.

Every multi-rank test runs on the torchpar backend and on gloo (the oracle), at world sizes
2 and 4. Each rank trains on its shard of a batch; the reference trains on the whole batch
in one process (every rank computes it locally, from the same seeds), and parameters must
agree after every step.
"""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchpar
from harness import get_pool, transport_env
from torchpar import _C
from torchpar.parallel import DistributedDataParallel as DDP


# In make test-slow (make test's time budget): the 4-rank TCP twin of a case run over shared memory.
SLOW_VARIANTS = {"test_training_equals_single_process_for_every_bucket_size[copy-0-8-4-torchpar-over-tcp]"}

BACKENDS = ["torchpar", "gloo"]
# The core equivalence tests also run with the torchpar backend over its TCP transport.
TCP = "torchpar-over-tcp"
WORLD_SIZES = [2, 4]


def _pool(backend, world_size):
    if backend == "torchpar" and not hasattr(torchpar._C, "ProcessGroupTorchpar"):
        pytest.skip("the torchpar backend is not built in this tree yet (no _C.ProcessGroupTorchpar)")
    if backend == TCP:
        return get_pool(world_size, "torchpar", env=transport_env("tcp"))
    return get_pool(world_size, backend)


multi_rank = pytest.mark.parametrize("world_size", WORLD_SIZES)
on_backends = pytest.mark.parametrize("backend", BACKENDS)
on_backends_and_tcp = pytest.mark.parametrize("backend", BACKENDS + [TCP])


# ---- models and data, identical on every rank (seeded) ----

def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 12), nn.LayerNorm(12),
                         nn.Tanh(), nn.Linear(12, 3)).to(dtype)


def _batch(step, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g).to(dtype), torch.randn(n, 3, generator=g).to(dtype)


def _shard(t, ctx):
    return t.chunk(ctx.world_size)[ctx.rank]


def _loss(out, y):
    return ((out.float() - y.float()) ** 2).mean()


def _assert_same_params(model, ref, step, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"step {step}, {name}: {m}")


def _setup(ctx):
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores


def _step_shard_and_whole(ctx, ddp, opt, ref, ref_opt, x, y, loss=_loss, set_to_none=True):
    """One step of the DDP replica on this rank's shard and of the reference on the whole
    batch; with a mean loss their averaged gradients are the same."""
    opt.zero_grad(set_to_none=set_to_none)
    loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
    opt.step()
    ref_opt.zero_grad()
    loss(ref(x), y).backward()
    ref_opt.step()


def _train_like_one_process(ctx, model, steps=3, lr=0.2, **ddp_kwargs):
    """SGD steps of DDP(model) on this rank's shard beside one process on the whole batch;
    the parameters must agree after each step."""
    ref = copy.deepcopy(model)
    ddp = DDP(model, **{"process_group": ctx.pg, **ddp_kwargs})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=lr) for m in (ddp, ref))
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        _step_shard_and_whole(ctx, ddp, opt, ref, ref_opt, x, y)
        _assert_same_params(model, ref, step)
    return ddp


def _train_side_by_side(ctx, ddps, models, steps, per_rank=2, tol=None):
    """SGD steps of two DDP wrappers on the same shards; their modules must agree after each."""
    opts = [torch.optim.SGD(d.parameters(), lr=0.1) for d in ddps]
    for step in range(steps):
        x, y = _batch(step, per_rank * ctx.world_size)
        for ddp, opt in zip(ddps, opts):
            opt.zero_grad()
            _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
            opt.step()
        _assert_same_params(*models, step, **(tol or {}))


# ---- training equals single-process training on the whole batch ----

def _train_vs_single_process(ctx, bucket_cap_mb, as_view, steps=4):
    _setup(ctx)
    model = _mlp()
    ref = copy.deepcopy(model)
    ddp = DDP(model, process_group=ctx.pg, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(step, 4 * ctx.world_size)
        # Both ways of zeroing: they matter for bucket views.
        _step_shard_and_whole(ctx, ddp, opt, ref, ref_opt, x, y, set_to_none=step % 2 == 0)
        _assert_same_params(model, ref, step)
        if as_view:
            views = ddp.reducer.bucket_tensors()
            for p in model.parameters():
                assert any(p.grad.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                           for v in views), "gradient_as_bucket_view: .grad is not a bucket view"
    return len(ddp.reducer.bucket_indices())


# bucket_cap_mb 0: one parameter per bucket; 0.0002 MiB (~52 floats): three; 25: one.
@on_backends_and_tcp
@multi_rank
@pytest.mark.parametrize("bucket_cap_mb,expected_buckets", [(0, 8), (0.0002, 3), (25, 1)])
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
def test_training_equals_single_process_for_every_bucket_size(backend, world_size, bucket_cap_mb,
                                                              expected_buckets, as_view):
    counts = _pool(backend, world_size).run(_train_vs_single_process, bucket_cap_mb, as_view)
    assert counts == [expected_buckets] * world_size


# ---- same as torch's DDP, step for step ----

def _train_vs_torch_ddp(ctx):
    _setup(ctx)
    ours_model, torch_model = _mlp(1), _mlp(1)
    ours = DDP(ours_model, process_group=ctx.pg, bucket_cap_mb=0.0002)
    theirs = nn.parallel.DistributedDataParallel(torch_model, process_group=ctx.pg, bucket_cap_mb=0.0002)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert len(list(ours.parameters())) == len(list(theirs.parameters()))
    opt = torch.optim.Adam(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(theirs.parameters(), lr=1e-2)
    for step in range(5):
        x, y = _batch(step, 3 * ctx.world_size)
        for ddp, o in ((ours, opt), (theirs, ref_opt)):
            o.zero_grad()
            _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
            o.step()
        _assert_same_params(ours_model, torch_model, step)
    theirs.load_state_dict(ours.state_dict())


@on_backends_and_tcp
@multi_rank
def test_matches_torch_ddp_step_for_step(backend, world_size):
    _pool(backend, world_size).run(_train_vs_torch_ddp)


# ---- gradients arriving out of bucket order ----

class _RegisteredBackwards(nn.Module):
    """Layers registered in the reverse of their use, so the first buckets (filled from
    the last registered parameters) get their gradients last."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(10)
        self.third = nn.Linear(8, 3)   # parameters 0, 1
        self.second = nn.Linear(8, 8)  # parameters 2, 3
        self.first = nn.Linear(6, 8)   # parameters 4, 5

    def forward(self, x):
        return self.third(torch.tanh(self.second(torch.tanh(self.first(x)))))


def _train_out_of_order(ctx, as_view):
    _setup(ctx)
    model = _RegisteredBackwards()
    ref = copy.deepcopy(model)
    ddp = DDP(model, process_group=ctx.pg, bucket_cap_mb=0, gradient_as_bucket_view=as_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    traces, buckets = [], []
    for step in range(3):
        x, y = _batch(step, 2 * ctx.world_size)
        buckets.append(ddp.reducer.bucket_indices())
        _step_shard_and_whole(ctx, ddp, opt, ref, ref_opt, x, y)
        _assert_same_params(model, ref, step)
        traces.append(ddp.reducer.trace())
    for trace in traces:
        launches = [e for e in trace if e[0] == "launch"]
        assert launches == [("launch", b) for b in range(len(launches))]
    # Step 0, registration order: bucket 0 holds first.bias, among the last gradients; the
    # full buckets of `third` and `second` wait for it, so nothing overlaps.
    assert buckets[0][0] == [5]
    assert all(traces[0].index(("launch", 0)) > traces[0].index(("ready", i)) for i in (0, 1, 2, 3, 5))
    # Then the buckets follow the order seen in step 0: bucket 0 goes out while the
    # gradients of `first` are still to come.
    assert buckets[1][0] in ([0], [1]) and buckets[2] == buckets[1]
    assert traces[1].index(("launch", 0)) < min(traces[1].index(("ready", i)) for i in (4, 5))


@on_backends
@multi_rank
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
def test_buckets_are_rebuilt_in_gradient_order(backend, world_size, as_view):
    _pool(backend, world_size).run(_train_out_of_order, as_view)


# ---- another group than the default one; the reducer's lifetime ----

def _train_on_explicit_group(ctx):
    _setup(ctx)
    _train_like_one_process(ctx, _mlp(8), steps=2, lr=0.1, process_group=ctx.gloo, bucket_cap_mb=0.0002)


@on_backends
@multi_rank
def test_explicit_process_group(backend, world_size):
    _pool(backend, world_size).run(_train_on_explicit_group)


def _backward_after_wrapper_is_gone(ctx):
    _setup(ctx)
    import gc
    model = _mlp(9)
    ref = copy.deepcopy(model)
    ddp = DDP(model, process_group=ctx.pg)
    del ddp
    gc.collect()
    # The hooks are removed with the reducer: a plain backward stays local, and nothing
    # calls into the freed reducer.
    x, y = _batch(ctx.rank, 2)
    _loss(model(x), y).backward()
    _loss(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


@on_backends
def test_hooks_are_removed_with_the_wrapper(backend):
    _pool(backend, 2).run(_backward_after_wrapper_is_gone)


# ---- tied weights ----

class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(20, 8)
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.embed.weight  # one Parameter used twice

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


def _train_tied(ctx):
    _setup(ctx)
    model = _TiedLM()
    ref = copy.deepcopy(model)
    ddp = DDP(model, process_group=ctx.pg, bucket_cap_mb=0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 20, (4 * ctx.world_size, 5), generator=g)
        _step_shard_and_whole(ctx, ddp, opt, ref, ref_opt, tokens, tokens,
                              loss=lambda out, t: nn.functional.cross_entropy(out.flatten(0, 1), t.flatten()))
        _assert_same_params(model, ref, step)
    assert model.out.weight is model.embed.weight


@on_backends
@multi_rank
def test_tied_weights_are_reduced_once(backend, world_size):
    _pool(backend, world_size).run(_train_tied)


# ---- activation checkpointing ----

class _Checkpointed(nn.Module):
    """The middle block recomputes its activations in backward (torch.utils.checkpoint)."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(12)
        self.reentrant = reentrant
        self.first, self.block, self.last = nn.Linear(6, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.last(h)


def _train_checkpointed(ctx, reentrant):
    _setup(ctx)
    _train_like_one_process(ctx, _Checkpointed(reentrant), bucket_cap_mb=0)


@on_backends
@multi_rank
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_trains_like_one_process(backend, world_size, reentrant):
    _pool(backend, world_size).run(_train_checkpointed, reentrant)


class _CheckpointedHead(nn.Module):
    """A reentrant checkpoint around the last layers: their gradients arrive first, inside the
    checkpoint's nested backward, which ends before the outer one reaches `first`."""

    def __init__(self, extra=False):
        super().__init__()
        self.first, self.head = nn.Linear(6, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 3))
        self.extra = nn.Linear(3, 3) if extra else None  # never used in forward

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.head, self.first(x), use_reentrant=True)


def _train_reentrant_head(ctx, as_view):
    _setup(ctx)
    torch.manual_seed(0)
    _train_like_one_process(ctx, _CheckpointedHead(), bucket_cap_mb=0, gradient_as_bucket_view=as_view)


@on_backends
@multi_rank
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
def test_reentrant_checkpoint_around_the_last_layers_trains_like_one_process(backend, world_size, as_view):
    _pool(backend, world_size).run(_train_reentrant_head, as_view)


def _reentrant_head_with_unused_parameter(ctx, first_trainable):
    _setup(ctx)
    model = _CheckpointedHead(extra=True)
    model.first.requires_grad_(first_trainable)
    ddp = DDP(model, process_group=ctx.pg, bucket_cap_mb=0)
    x, y = _batch(0, 4)
    if first_trainable:
        # The outer backward's own gradients queue the check at its end.
        with pytest.raises(RuntimeError, match="find_unused_parameters=True") as err:
            _loss(ddp(x), y).backward()
    else:
        # Every gradient arrived inside the checkpoint: the missing one is reported by the
        # next forward, as torch's DDP does. (A reentrant checkpoint needs an input that
        # requires grad.)
        x.requires_grad_()
        _loss(ddp(x), y).backward()
        with pytest.raises(RuntimeError, match="find_unused_parameters=True") as err:
            ddp(x)
    assert "extra.weight" in str(err.value)


@on_backends
@pytest.mark.parametrize("first_trainable", [True, False], ids=["outer_grads", "only_nested_grads"])
def test_reentrant_checkpoint_with_an_unused_parameter_raises_clear_error(backend, first_trainable):
    _pool(backend, 2).run(_reentrant_head_with_unused_parameter, first_trainable)


# ---- frozen parameters ----

def _train_frozen(ctx):
    _setup(ctx)
    model = _mlp(3)
    model[0].weight.requires_grad_(False)
    model[3].bias.requires_grad_(False)
    frozen = [model[0].weight.clone(), model[3].bias.clone()]
    ref = copy.deepcopy(model)
    ddp = DDP(model, process_group=ctx.pg, bucket_cap_mb=0.0002)
    assert sum(len(b) for b in ddp.reducer.bucket_indices()) == len(list(model.parameters())) - 2
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        x, y = _batch(step, 2 * ctx.world_size)
        _step_shard_and_whole(ctx, ddp, opt, ref, ref_opt, x, y)
        _assert_same_params(model, ref, step)
        assert torch.equal(model[0].weight, frozen[0]) and torch.equal(model[3].bias, frozen[1])
        assert model[0].weight.grad is None and model[3].bias.grad is None


@on_backends
@multi_rank
def test_frozen_parameters_stay_unchanged(backend, world_size):
    _pool(backend, world_size).run(_train_frozen)


# ---- parameters unused in a step ----

class _Branchy(nn.Module):
    """`always` is used on every rank, `rank0` only on rank 0, `never` on no rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.always = nn.Linear(6, 3)
        self.rank0 = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3)

    def forward(self, x, use_rank0):
        out = self.always(x)
        return out + self.rank0(x) if use_rank0 else out


def _train_unused(ctx):
    _setup(ctx)
    ours_model, torch_model = _Branchy(), _Branchy()
    ours = DDP(ours_model, process_group=ctx.pg, bucket_cap_mb=0, find_unused_parameters=True)
    theirs = nn.parallel.DistributedDataParallel(torch_model, process_group=ctx.pg, bucket_cap_mb=0,
                                                 find_unused_parameters=True)
    # weight_decay tells a None gradient (parameter skipped) from a zero one (decayed).
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.SGD(theirs.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(3):
        x, y = _batch(step, 2 * ctx.world_size)
        use = ctx.rank == 0 and step != 1  # step 1: unused on every rank
        for ddp, o in ((ours, opt), (theirs, ref_opt)):
            o.zero_grad()
            _loss(ddp(_shard(x, ctx), use), _shard(y, ctx)).backward()
            o.step()
        _assert_same_params(ours_model, torch_model, step)
        assert ours_model.never.weight.grad is None
        assert (ours_model.rank0.weight.grad is None) == (torch_model.rank0.weight.grad is None)


def _unused_without_flag(ctx):
    _setup(ctx)
    ddp = DDP(_Branchy(), process_group=ctx.pg)
    x, y = _batch(0, 2)
    with pytest.raises(RuntimeError, match="find_unused_parameters=True") as err:
        _loss(ddp(x, False), y).backward()
    assert "never.weight" in str(err.value) and "rank0.weight" in str(err.value)


@on_backends
@multi_rank
def test_unused_parameters_match_torch_ddp(backend, world_size):
    _pool(backend, world_size).run(_train_unused)


@on_backends
def test_unused_parameters_without_flag_raise_clear_error(backend):
    _pool(backend, 2).run(_unused_without_flag)


# ---- gradients reduced where they lie ----

def _in_place_reduction(ctx):
    # On the torchpar backend, copy mode hands the gradients themselves to
    # all_reduce_coalesced: the flat buckets are never written. Other backends copy in and out.
    _setup(ctx)
    torch.manual_seed(0)
    model = _mlp(2)
    # A transposed weight gets a transposed (non-contiguous) gradient: copied into its bucket.
    model[0].weight = nn.Parameter(model[0].weight.detach().t().contiguous().t())
    ddp = _train_like_one_process(ctx, model, steps=2, bucket_cap_mb=0.0002)
    # Only the bucket holding the strided gradient made its flat tensor (torchpar).
    allocated = ddp.reducer.bucket_bytes()
    strided_bucket = next(b for b in ddp.reducer.bucket_indices() if 0 in b)
    assert allocated == (4 * sum(list(model.parameters())[i].numel() for i in strided_bucket)
                         if dist.get_backend(ctx.pg) == "torchpar" else 4 * sum(p.numel() for p in model.parameters()))
    touched = [bool(b.any()) for b in ddp.reducer.bucket_tensors()]
    strided = ddp.reducer.bucket_indices().index(next(b for b in ddp.reducer.bucket_indices() if 0 in b))
    return touched, strided


@on_backends
def test_copy_mode_reduces_gradients_in_place_on_torchpar(backend):
    for touched, strided in _pool(backend, 2).run(_in_place_reduction):
        if backend == "torchpar":
            assert touched == [k == strided for k in range(len(touched))]
        else:
            assert all(touched)


# ---- static_graph ----

def _static_unused_matches_torch(ctx, as_view):
    # `never` gets no gradient in any step and `rank0` only on rank 0, without
    # find_unused_parameters: static_graph's first step records that.
    _setup(ctx)
    ours_model, torch_model = _Branchy(), _Branchy()
    kwargs = dict(process_group=ctx.pg, bucket_cap_mb=0, static_graph=True,
                  gradient_as_bucket_view=as_view)
    ours = DDP(ours_model, **kwargs)
    theirs = nn.parallel.DistributedDataParallel(torch_model, **kwargs)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.SGD(theirs.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(4):
        x, y = _batch(step, 2 * ctx.world_size)
        for ddp, o in ((ours, opt), (theirs, ref_opt)):
            o.zero_grad()
            out = ddp(_shard(x, ctx), ctx.rank == 0)
            out.mul_(1.0)  # outputs may be modified in place, in the recording step too
            _loss(out, _shard(y, ctx)).backward()
            o.step()
        _assert_same_params(ours_model, torch_model, step)
        assert ours_model.never.weight.grad is None
    # After the first step, buckets launch during backward again (bucket 0 before finalize).
    events = [e for e in ours.reducer.trace() if e[0] != "ready"]
    assert events[0] == ("launch", 0) and events[-1] == ("finalize", -1)


@on_backends
@multi_rank
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
def test_static_graph_with_always_unused_parameters_matches_torch_ddp(backend, world_size, as_view):
    _pool(backend, world_size).run(_static_unused_matches_torch, as_view)


class _SharedCheckpointed(nn.Module):
    """One block applied twice, each time inside a reentrant checkpoint: its parameters get
    two gradients per step, the second inside the second nested backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.inp, self.block, self.out = nn.Linear(6, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(2):
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        return self.out(h)


def _static_shared_checkpoint(ctx, static):
    _setup(ctx)
    if static:
        _train_like_one_process(ctx, _SharedCheckpointed(), bucket_cap_mb=0, static_graph=True)
        return
    ddp = DDP(_SharedCheckpointed(), process_group=ctx.pg, bucket_cap_mb=0)
    x, y = _batch(0, 2 * ctx.world_size)
    with pytest.raises(RuntimeError, match="got a gradient twice"):
        _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()


@on_backends
@multi_rank
@pytest.mark.parametrize("static", [True, False], ids=["static_graph", "dynamic"])
def test_parameters_checkpointed_twice_need_static_graph(backend, world_size, static):
    _pool(backend, world_size).run(_static_shared_checkpoint, static)


def _static_graph_changes(ctx):
    _setup(ctx)
    ddp = DDP(_Branchy(), process_group=ctx.pg, bucket_cap_mb=0, static_graph=True)
    x, y = _batch(0, 2)
    _loss(ddp(x, False), y).backward()  # records: rank0 unused
    with pytest.raises(RuntimeError, match="static_graph=True") as err:
        _loss(ddp(x, True), y).backward()  # now rank0 gets a gradient it did not before
    assert "'rank0." in str(err.value) and "graph changed" in str(err.value)


@on_backends
def test_static_graph_that_changes_raises_clear_error(backend):
    _pool(backend, 2).run(_static_graph_changes)


# ---- no_sync() accumulation ----

def _train_no_sync(ctx, as_view):
    _setup(ctx)
    model = _mlp(5)
    ref = copy.deepcopy(model)
    ddp = DDP(model, process_group=ctx.pg, bucket_cap_mb=0.0002, gradient_as_bucket_view=as_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        micro = [_batch(10 * step + k, 2 * ctx.world_size) for k in range(3)]
        opt.zero_grad()
        with ddp.no_sync():
            for x, y in micro[:-1]:
                _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
        local = [p.grad.clone() for p in model.parameters()]
        x, y = micro[-1]
        _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
        opt.step()
        ref_opt.zero_grad()
        for x, y in micro:
            _loss(ref(x), y).backward()
        ref_opt.step()
        _assert_same_params(model, ref, step)
    # Inside no_sync the gradients were this rank's own, not yet averaged.
    return [t.sum().item() for t in local]


@on_backends
@multi_rank
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
def test_no_sync_accumulates_then_averages_the_sum(backend, world_size, as_view):
    sums = _pool(backend, world_size).run(_train_no_sync, as_view)
    assert sums[0] != sums[1], "gradients inside no_sync() were already synchronised"


# ---- bfloat16 parameters, float32 reduction ----

def _bf16_fp32_reduce(ctx):
    _setup(ctx)
    model = _mlp(6, torch.bfloat16)
    ref = copy.deepcopy(model)
    ddp = DDP(model, process_group=ctx.pg, bucket_cap_mb=0.0002, grad_reduce_dtype=torch.float32)
    assert all(b.dtype == torch.float32 for b in ddp.reducer.bucket_tensors())
    x, y = _batch(0, 4 * ctx.world_size, torch.bfloat16)
    _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
    # Expected: every rank's bfloat16 gradient, averaged in float32, rounded once to bf16.
    total = [torch.zeros_like(p, dtype=torch.float32) for p in ref.parameters()]
    for r in range(ctx.world_size):
        ref.zero_grad()
        _loss(ref(x.chunk(ctx.world_size)[r]), y.chunk(ctx.world_size)[r]).backward()
        for t, p in zip(total, ref.parameters()):
            t += p.grad.float() / ctx.world_size
    for p, t in zip(model.parameters(), total):
        assert p.grad.dtype == torch.bfloat16
        # float32 sums may round differently in another order; one bf16 ulp of slack.
        torch.testing.assert_close(p.grad, t.to(torch.bfloat16), rtol=2 ** -7, atol=1e-6)


@on_backends
@multi_rank
def test_bfloat16_parameters_reduce_in_float32(backend, world_size):
    _pool(backend, world_size).run(_bf16_fp32_reduce)


def _bf16_native_reduce(ctx):
    _setup(ctx)
    model = _mlp(6, torch.bfloat16)
    ref = copy.deepcopy(model).float()
    ddp = DDP(model, process_group=ctx.pg, bucket_cap_mb=0.0002)
    assert all(b.dtype == torch.bfloat16 for b in ddp.reducer.bucket_tensors())
    x, y = _batch(0, 4 * ctx.world_size, torch.bfloat16)
    _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
    _loss(ref(x.float()), y.float()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.bfloat16
        torch.testing.assert_close(p.grad.float(), q.grad, rtol=0.05, atol=0.02)


@on_backends
@multi_rank
def test_bfloat16_parameters_reduce_in_bfloat16_by_default(backend, world_size):
    _pool(backend, world_size).run(_bf16_native_reduce)


# ---- overlap: the first bucket is launched while backward still runs ----

def _launch_order(ctx):
    _setup(ctx)
    model = _mlp(7)
    ddp = DDP(model, process_group=ctx.pg, bucket_cap_mb=0.0002)
    x, y = _batch(0, 2 * ctx.world_size)
    _loss(ddp(_shard(x, ctx)), _shard(y, ctx)).backward()
    return ddp.reducer.trace(), ddp.reducer.bucket_indices()


@on_backends
@multi_rank
def test_first_bucket_launches_before_backward_ends(backend, world_size):
    for trace, buckets in _pool(backend, world_size).run(_launch_order):
        assert len(buckets) > 1
        first_launch = trace.index(("launch", 0))
        later = [i for b in buckets[1:] for i in b]
        # Gradients of later buckets were still being computed when bucket 0 went out.
        assert any(trace.index(("ready", i)) > first_launch for i in later), trace
        assert trace.index(("ready", 0)) > first_launch  # the first layer's gradient comes last
        assert [e for e in trace if e[0] == "launch"] == [("launch", b) for b in range(len(buckets))]
        assert trace[-1] == ("finalize", -1)


# ---- construction: broadcast and model check ----

def _broadcast_at_construction(ctx):
    _setup(ctx)
    torch.manual_seed(ctx.rank)  # a different model on every rank
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(ctx.rank))
    ddp = DDP(model, process_group=ctx.pg)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=ctx.pg)
    assert list(ddp.state_dict()) == list(theirs.state_dict())
    at_construction = [t.clone() for t in ddp.state_dict().values()]
    # broadcast_buffers: rank 0's buffers are broadcast again before every forward.
    model[1].running_mean.add_(float(ctx.rank))
    ddp(torch.ones(3, 4))
    return at_construction, [t.clone() for t in ddp.state_dict().values()]


def _buffer_sync_beside_torch(ctx):
    """Which forwards broadcast rank 0's buffers, beside torch's DDP on the same ranks: a step,
    an eval forward under no_grad, no_sync() micro-batches, steps (review finding: ours decided
    by the current forward, torch's by the previous one)."""
    _setup(ctx)
    seen = {}
    for name, wrap in (("torchpar", lambda m: DDP(m, process_group=ctx.pg)),
                       ("torch", lambda m: nn.parallel.DistributedDataParallel(m, process_group=ctx.gloo))):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        ddp = wrap(model)
        trace = []
        for step, mode in enumerate(["step", "eval", "step", "no_sync", "no_sync", "step", "eval", "eval"]):
            x = (torch.arange(12.0).view(3, 4) + step) * (ctx.rank + 1)
            if mode == "eval":
                with torch.no_grad():
                    trace.append(ddp(x).sum().item())
            else:
                with ddp.no_sync() if mode == "no_sync" else contextlib.nullcontext():
                    ddp(x).sum().backward()
            trace.append(model[1].running_mean.tolist())
        seen[name] = trace
    return seen


@pytest.mark.parametrize("world_size", [2])
def test_buffers_are_broadcast_at_the_forwards_torch_broadcasts_at(world_size):
    for seen in _pool("torchpar", world_size).run(_buffer_sync_beside_torch):
        torch.testing.assert_close(seen["torchpar"], seen["torch"], rtol=1e-6, atol=1e-6)


@on_backends
@multi_rank
def test_construction_broadcasts_rank0_parameters_and_buffers(backend, world_size):
    results = _pool(backend, world_size).run(_broadcast_at_construction)
    for when in range(2):
        states = [r[when] for r in results]
        for state in states[1:]:
            for a, b in zip(states[0], state):
                assert torch.equal(a, b)


def _mismatched_model(ctx, kind):
    _setup(ctx)
    odd = ctx.rank == ctx.world_size - 1
    layers = [nn.Linear(4, 5), nn.Linear(5, 2)]
    if kind == "shape" and odd:
        layers[1] = nn.Linear(5, 3)
    if kind == "count" and odd:
        layers.append(nn.Linear(2, 2))
    try:
        DDP(nn.Sequential(*layers), process_group=ctx.pg)
    except RuntimeError as e:
        return str(e)
    return None


@on_backends
@multi_rank
@pytest.mark.parametrize("kind,first_bad", [("shape", "'1.weight'"), ("count", "parameter 4")])
def test_mismatched_models_raise_on_every_rank(backend, world_size, kind, first_bad):
    errors = _pool(backend, world_size).run(_mismatched_model, kind)
    for rank, err in enumerate(errors):
        assert err is not None, f"rank {rank} did not raise"
        assert "differs across ranks" in err and first_bad in err, err


# ---- bucket assignment (no process group) ----

def test_buckets_fill_in_reverse_order_with_a_small_first_bucket():
    params = [torch.zeros(n) for n in (100, 10, 250, 50, 300, 5)]  # float32: 4 bytes each
    # A bucket closes once it holds >= its cap: 40 bytes for the first, 1200 for the others.
    assert _C.ddp_assign_buckets(params, 1200, 40) == [[5, 4], [3, 2], [1, 0]]
    assert _C.ddp_assign_buckets(params, 0, 0) == [[5], [4], [3], [2], [1], [0]]
    assert _C.ddp_assign_buckets(params, 1 << 30, 1 << 30) == [[5, 4, 3, 2, 1, 0]]


def test_buckets_split_by_dtype_and_count_reduce_dtype_bytes():
    params = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)]
    assert _C.ddp_assign_buckets(params, 1 << 20, 1 << 20) == [[2, 1], [0]]
    # 4 bf16 are 8 bytes, but 16 once held as float32: a 16-byte cap closes after one.
    assert _C.ddp_assign_buckets(params[1:], 16, 16) == [[1, 0]]
    assert _C.ddp_assign_buckets(params[1:], 16, 16, torch.float32) == [[1], [0]]


def test_buckets_follow_an_explicit_order():
    params = [torch.zeros(n) for n in (10, 10, 10, 10)]
    assert _C.ddp_assign_buckets(params, 80, 40, order=[1, 3, 0, 2]) == [[1], [3, 0], [2]]
    with pytest.raises(RuntimeError, match="each of the 4 parameters once"):
        _C.ddp_assign_buckets(params, 80, 40, order=[1, 1, 0, 2])
    with pytest.raises(RuntimeError, match="lists 3 of 4"):
        _C.ddp_assign_buckets(params, 80, 40, order=[1, 0, 2])


# ---- torch's constructor, argument for argument ----

def _torch_signature(ctx):
    _setup(ctx)
    model, ref = _mlp(7), _mlp(7)
    # Positional, in torch's order: device_ids, output_device, dim, broadcast_buffers,
    # init_sync, process_group, bucket_cap_mb; static_graph accepted as a hint.
    ddp = DDP(model, None, None, 0, True, True, ctx.pg, 0.0002, static_graph=True)
    ref_ddp = nn.parallel.DistributedDataParallel(ref, None, None, 0, True, True, ctx.pg, 0.0002,
                                                   static_graph=True)
    _train_side_by_side(ctx, (ddp, ref_ddp), (model, ref), steps=3)


@on_backends
def test_torch_constructor_arguments_in_torch_order(backend):
    _pool(backend, 2).run(_torch_signature)


def _torch_213_arguments(ctx):
    """torch 2.13's newer constructor arguments: a 1-D device_mesh for the group,
    forward_sync_buffers (broadcast_buffers' new name), and its speed settings."""
    from torch.distributed.device_mesh import DeviceMesh
    _setup(ctx)
    mesh = DeviceMesh.from_group(ctx.pg, "cpu")
    model, ref = _mlp(7), _mlp(7)
    kwargs = dict(device_mesh=mesh, forward_sync_buffers=True, skip_all_reduce_unused_params=True,
                  batched_grad_copy=True)
    ddp, theirs = DDP(model, **kwargs), nn.parallel.DistributedDataParallel(ref, **kwargs)
    assert ddp.process_group is mesh.get_group(0) and ddp.broadcast_buffers
    assert (ddp.device_ids, ddp.bucket_bytes_cap) == (theirs.device_ids, theirs.bucket_bytes_cap)
    _train_side_by_side(ctx, (ddp, theirs), (model, ref), steps=2)
    # At init, buffers are synced unless the old name said False, as in torch.
    seen = {}
    for name, kw in (("broadcast_buffers=False", {"broadcast_buffers": False}),
                     ("forward_sync_buffers=False", {"forward_sync_buffers": False})):
        for cls in (DDP, nn.parallel.DistributedDataParallel):
            m = nn.BatchNorm1d(3)
            m.running_mean.fill_(float(ctx.rank))
            cls(m, process_group=ctx.pg, **kw)
            seen[name, cls.__module__] = float(m.running_mean[0])
    with pytest.raises(NotImplementedError, match="bucket_cap_mb_list"):
        DDP(_mlp(), process_group=ctx.pg, bucket_cap_mb_list=[1, 25])
    with pytest.raises(ValueError, match="not both"):
        DDP(_mlp(), process_group=ctx.pg, device_mesh=mesh)
    return seen


@on_backends
def test_torch_213_constructor_arguments_train_as_torch_ddp(backend):
    for rank, seen in enumerate(_pool(backend, 2).run(_torch_213_arguments)):
        for (name, _), value in seen.items():
            assert value == (rank if name == "broadcast_buffers=False" else 0), (name, seen)


def _ignored_like_torch(ctx):
    """torch's ignore list: the last layer's parameters start as each rank's own and train on
    each rank's own gradient, on both stacks alike; the rest is synced and averaged."""
    _setup(ctx)
    model, ref = _mlp(7), _mlp(7)
    for m in (model, ref):
        with torch.no_grad():
            m[5].weight.add_(float(ctx.rank))
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(m, ["5.weight", "5.bias"])
    ddps = (DDP(model, process_group=ctx.pg), nn.parallel.DistributedDataParallel(ref, process_group=ctx.pg))
    assert ddps[0].parameters_to_ignore == {"5.weight", "5.bias"}
    _train_side_by_side(ctx, ddps, (model, ref), steps=2)
    return float(model[5].weight[0, 0]), float(model[0].weight[0, 0])


@on_backends
def test_torch_ignore_list_leaves_those_parameters_to_each_rank_as_torch_ddp(backend):
    (ignored0, synced0), (ignored1, synced1) = _pool(backend, 2).run(_ignored_like_torch)
    assert synced0 == synced1 and ignored0 != ignored1


def _constructor_refusals(ctx):
    with pytest.raises(ValueError, match="be None for a CPU module"):
        DDP(_mlp(), device_ids=[0], process_group=ctx.pg)
    with pytest.raises(ValueError, match="output_device needs device_ids"):
        DDP(_mlp(), output_device=0, process_group=ctx.pg)
    with pytest.raises(TypeError, match="must be a torchpar.parallel.MixedPrecision"):
        DDP(_mlp(), process_group=ctx.pg, mixed_precision=object())
    # init_sync=False: no check, no broadcast; each rank keeps its own initial weights.
    ddp = DDP(_mlp(seed=ctx.rank), process_group=ctx.pg, init_sync=False)
    w = ddp.module[0].weight.detach().clone()
    others = [torch.empty_like(w) for _ in range(ctx.world_size)]
    dist.all_gather(others, w, group=ctx.pg)
    assert not torch.equal(others[0], others[1])


@on_backends
def test_constructor_refuses_what_it_cannot_honour_and_init_sync_false_skips_the_broadcast(backend):
    _pool(backend, 2).run(_constructor_refusals)
