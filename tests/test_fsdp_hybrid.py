"""Hybrid sharding (HSDP): ``fully_shard(mesh=<2-D mesh>)`` or ``replicate_group=``, 4 ranks as 2
replicas of 2 shards, against single-process training, torch's FSDP2 on the same mesh, and its own
engine trace; bad input. The model and helpers are test_fsdp's.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from test_fsdp import (BACKENDS, Block, Net, _assert_matches, _assert_shard_grads, _batch, _loss, _part, _pool, _setup,
                       _train_both_against_torch)
from torchpar.parallel import FSDPModule, MixedPrecision, fully_shard


def _shard(model, **kwargs):
    for b in model.blocks:
        fully_shard(b, **kwargs)
    return fully_shard(model, **kwargs)


def _layout(ctx, form, replicas):
    """fully_shard's keyword arguments for `replicas` x (world / replicas) ranks: a mesh, or the
    same groups by hand (replica r holds ranks [r*S, (r+1)*S); shard s of each replica pairs up)."""
    shards = ctx.world_size // replicas
    if form == "mesh":
        return {"mesh": init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))}
    groups = {}
    for r in range(replicas):  # every rank makes every group, in the same order
        groups[("shard", r)] = dist.new_group(list(range(r * shards, (r + 1) * shards)))
    for s in range(shards):
        groups[("replicate", s)] = dist.new_group(list(range(s, ctx.world_size, shards)))
    return {"group": groups[("shard", ctx.rank // shards)], "replicate_group": groups[("replicate", ctx.rank % shards)]}


def _train_vs_single_process(ctx, form, replicas, accumulate, mixed, steps=3):
    """Each rank trains on its 1/W of every batch (replicas are data parallel too); the weights
    equal one process training on the whole batch, step for step. `accumulate`: each step is two
    micro-batches, the first under no_sync ("no_sync": nothing communicated) or with
    set_requires_all_reduce(False) ("within replica": reduce-scattered, not all-reduced)."""
    _setup(ctx)
    model = Net()
    ref = copy.deepcopy(model)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    _shard(model, mixed_precision=mp, **_layout(ctx, form, replicas))
    units = [m._fsdp.flat for m in model.modules() if isinstance(m, FSDPModule)]
    assert {u.world_size for u in units} == {ctx.world_size // replicas}
    assert {u.replicas for u in units} == {replicas}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = _batch(step, 4 * ctx.world_size)
        xs, ys = _part(x, ctx), _part(y, ctx)
        opt.zero_grad()
        if accumulate == "no_sync":
            with model.no_sync():
                (_loss(model(xs[:2]), ys[:2]) / 2).backward()
            (_loss(model(xs[2:]), ys[2:]) / 2).backward()
        elif accumulate == "within replica":
            model.set_requires_all_reduce(False)
            (_loss(model(xs[:2]), ys[:2]) / 2).backward()
            events = [k for k, _ in model.fsdp_engine.trace()]
            assert "reduce_scatter_launch" in events and "all_reduce_launch" not in events, events
            model.set_requires_all_reduce(True)
            (_loss(model(xs[2:]), ys[2:]) / 2).backward()
        else:
            _loss(model(xs), ys).backward()
        ref_opt.zero_grad()
        if accumulate:  # the same two halves of every rank's part
            halves = [torch.cat([c[:2] for c in t.chunk(ctx.world_size)]) for t in (x, y)]
            rests = [torch.cat([c[2:] for c in t.chunk(ctx.world_size)]) for t in (x, y)]
            (_loss(ref(halves[0]), halves[1]) / 2 + _loss(ref(rests[0]), rests[1]) / 2).backward()
        else:
            _loss(ref(x), y).backward()
        if not mixed:  # the mean over every rank of every replica (AdamW would hide a wrong scale)
            _assert_shard_grads(model, ref, step)
        opt.step()
        ref_opt.step()
        tol = dict(rtol=2e-2, atol=2e-3) if mixed else {}
        _assert_matches(model.state_dict(), ref, step, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form,replicas,accumulate,mixed", [
    ("mesh", 2, None, False), ("groups", 2, None, False), ("mesh", 2, "no_sync", False),
    ("mesh", 2, "within replica", False), ("mesh", 2, None, True), ("mesh", 4, None, False)],
    ids=["2x2-mesh", "2x2-groups", "2x2-no_sync", "2x2-no_all_reduce", "2x2-bf16", "4x1-mesh"])
def test_hybrid_training_equals_single_process(backend, form, replicas, accumulate, mixed):
    _pool(backend, 4).run(_train_vs_single_process, form, replicas, accumulate, mixed)


def _vs_torch_hsdp(ctx, steps=3):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    _setup(ctx)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ours, theirs = _shard(Net(), mesh=mesh), Net()
    for b in theirs.blocks:
        torch_fully_shard(b, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    # SGD: a wrong gradient scale shows (Adam would normalise it away)
    _train_both_against_torch(ctx, ours, theirs,
                              [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)], steps)


def test_matches_torch_fsdp2_hybrid_sharding_step_for_step():
    _pool("gloo", 4).run(_vs_torch_hsdp)


def _trace(ctx):
    _setup(ctx)
    model = _shard(Net(depth=3), mesh=init_device_mesh("cpu", (2, 2)))
    x, y = _batch(0, 8)
    for _ in range(2):  # the second step runs in the agreed order
        _loss(model(_part(x, ctx)), _part(y, ctx)).backward()
    return model.fsdp_engine.trace()


@pytest.mark.parametrize("backend", BACKENDS)
def test_replica_all_reduce_follows_each_reduce_scatter_and_overlaps_the_next(backend):
    """Each unit's shard is all-reduced across the replicas once its reduce-scatter is done, and
    that all-reduce travels while the next unit's reduce-scatter is launched (one of each in
    flight); the last is waited on at the end."""
    for events in _pool(backend, 4).run(_trace):
        rs_wait = [u for k, u in events if k == "reduce_scatter_wait"]
        ar_launch = [u for k, u in events if k == "all_reduce_launch"]
        ar_wait = [u for k, u in events if k == "all_reduce_wait"]
        assert ar_launch == ar_wait == rs_wait and len(rs_wait) == 4, events
        where = {e: i for i, e in enumerate(events)}
        for i, u in enumerate(ar_launch):
            assert where[("reduce_scatter_wait", u)] < where[("all_reduce_launch", u)], events
            if i + 1 < len(ar_launch):  # still in flight when the next reduce-scatter goes out
                assert where[("reduce_scatter_launch", ar_launch[i + 1])] < where[("all_reduce_wait", u)], events
        assert events[-1] == ("finalize", -1) and events[-2] == ("all_reduce_wait", ar_launch[-1]), events


def _error_of(fn):
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def _bad_input(ctx):
    _setup(ctx)
    mesh = init_device_mesh("cpu", (2, 2))
    errors = {
        # only rank 1's model differs: rank 2 shares neither its shard nor its replicate group
        "one rank": _error_of(lambda: fully_shard(Net(d=6 if ctx.rank == 1 else 7), mesh=mesh)),
        "3-d": _error_of(lambda: fully_shard(Net(), mesh=init_device_mesh("cpu", (2, 1, 2)))),
        "both": _error_of(lambda: fully_shard(Net(), ctx.pg, mesh=mesh)),
        # replica 1 has a wider model than replica 0; each shard group agrees within itself
        "replicas differ": _error_of(lambda: fully_shard(Net(d=7 if ctx.rank < 2 else 6), mesh=mesh)),
    }
    # replica groups {0, 3} and {1, 2} pair shard 0 of one replica with shard 1 of the other
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    errors["crossed"] = _error_of(lambda: fully_shard(Net(), group=mesh.get_group(1),
                                                      replicate_group=crossed[0 if ctx.rank in (0, 3) else 1]))
    model = Net()
    fully_shard(model.blocks[0], group=mesh.get_group(1))  # not replicated, unlike the root
    fully_shard(model, mesh=mesh)
    errors["mixed units"] = _error_of(lambda: model(torch.randn(2, 5)))
    return errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_on_every_rank(backend):
    for rank, errors in enumerate(_pool(backend, 4).run(_bad_input)):
        assert "2 (replicate, shard) dimensions, got 3" in errors["3-d"], errors
        assert "not both" in errors["both"], errors
        e = errors["replicas differ"]
        assert e and "differ across replicas" in e and "'inp.weight'" in e and "[7, 5]" in e and "[6, 5]" in e, (rank, errors)
        assert "must all replicate over the same group" in errors["mixed units"], errors
        assert "pairs ranks that hold different shards" in errors["crossed"], errors
        assert errors["one rank"] and "differ" in errors["one rank"], (rank, errors)
        if rank == 2:
            assert "outside this rank's shard and replicate groups" in errors["one rank"], errors


class _OrderByData(torch.nn.Module):
    """Two blocks whose order follows the sign of the input: the first units of backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(5, 7)
        self.blocks = torch.nn.ModuleList(Block(7) for _ in range(2))
        self.out = torch.nn.Linear(7, 3)

    def forward(self, x):
        h = self.inp(x)
        a, b = self.blocks
        return self.out(a(h) + b(h) if x.sum() > 0 else b(h) + a(h))


def _one_replica_out_of_step(ctx):
    """Step 0: rank 0 alone runs the blocks in the other order, so its shard group's
    reduce-scatters pair different units and raise. The other replica's had paired rightly and
    waits in the all-reduce: it must raise in the same step (review: it waited, then paired with
    replica 0's next step, silently). Step 1, the same order everywhere: one process's gradients."""
    _setup(ctx)
    model = _OrderByData()
    ref = copy.deepcopy(model)
    _shard(model, mesh=init_device_mesh("cpu", (2, 2)))
    results = []
    for step in range(2):
        x, y = _batch(step, 2 * ctx.world_size)
        x = x - 3.0  # every rank's part sums below 0 ...
        xs = _part(x, ctx) + (6.0 if step == 0 and ctx.rank == 0 else 0.0)  # ... but rank 0's in step 0
        for p in model.parameters():
            p.grad = None
        try:
            _loss(model(xs), _part(y, ctx)).backward()
            results.append(None)
        except RuntimeError as e:
            results.append(str(e))
    ref.zero_grad()
    _loss(ref(x), y).backward()
    _assert_shard_grads(model, ref, 1)
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replica_whose_reduce_scatter_failed_fails_the_others(backend):
    for rank, (step0, step1) in enumerate(_pool(backend, 4).run(_one_replica_out_of_step)):
        assert step1 is None, (rank, step1)
        want = "reduce-scatters of the ranks went out of step" if rank < 2 else "all-reduces across replicas went out"
        assert step0 and want in step0, (rank, step0)
