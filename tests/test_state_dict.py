"""torchpar.parallel.get_state_dict / set_state_dict: fully_shard and tensor-parallel models and
their optimizer state through torch.distributed.checkpoint, saved at one world size and resumed
at another.

Every rank trains on the same batch, so the sharded training equals one process's at any world
size: a run saved after 3 AdamW steps and resumed (at 1, 2, 3 or 4 ranks) must take its 4th step
to the uninterrupted single-process run's weights. fully_shard's unit sizes are odd, so runs cut
through rows and some ranks hold none of a parameter."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn import functional as F

from harness import get_pool
from test_fsdp import Net, _loss, _setup, _shard_model
from test_tensor_parallel_torch_plan import _Net, _plan
import torchpar.parallel as tp_sd
from torchpar.parallel import (DistributedDataParallel, fully_shard, get_state_dict, parallelize_module,
                               set_state_dict)

pytestmark = pytest.mark.timeout(180)
# In make test-slow (make test's time budget): the same round trips at other sizes run in make test.
SLOW_VARIANTS = {"test_a_dcp_checkpoint_resumes_at_another_world_size[2-2]",
                 "test_a_dcp_checkpoint_resumes_at_another_world_size[3-1]", "test_on_gloo"}

STEPS = 3


def _batch(step):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)


def _train(model, opt, steps):
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _reference():
    """The single-process run: STEPS steps, then one more."""
    model = Net()
    opt = _adamw(model)
    _train(model, opt, range(STEPS + 1))
    return model


def _save(ctx, path):
    _setup(ctx)
    model = _shard_model(Net(), ctx.pg)
    opt = _adamw(model)
    _train(model, opt, range(STEPS))
    model_sd, optim_sd = get_state_dict(model, opt)
    assert isinstance(model_sd["blocks.0.fc1.weight"], ShardedTensor)
    assert isinstance(optim_sd["state"]["blocks.0.fc1.weight"]["exp_avg"], ShardedTensor)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    # The optimizer's own state is left as it was (plain pieces) and trains on.
    assert not isinstance(opt.state[opt.param_groups[0]["params"][0]]["exp_avg"], ShardedTensor)
    _train(model, opt, [STEPS])
    return model.state_dict()


def _load_and_step(model, path, train=_train, optimizer=_adamw):
    """Loads the checkpoint into ``model`` and an optimizer over it (AdamW), and takes the next step."""
    opt = optimizer(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(model, opt, [STEPS])


def _resume(ctx, path):
    _setup(ctx)
    model = _shard_model(Net(seed=1), ctx.pg)  # other weights: all of them must come from the checkpoint
    _load_and_step(model, path)
    return model.state_dict()


def _assert_same(sd, ref):
    ref_sd = ref.state_dict()
    assert list(sd) == list(ref_sd)
    for name, value in sd.items():
        torch.testing.assert_close(value, ref_sd[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("save_at,resume_at", [(2, 2), (2, 4), (4, 3), (3, 1)])
def test_a_dcp_checkpoint_resumes_at_another_world_size(tmp_path, save_at, resume_at):
    path = str(tmp_path / "ckpt")
    ref = _reference()
    for sd in get_pool(save_at).run(_save, path):
        _assert_same(sd, ref)
    for sd in get_pool(resume_at).run(_resume, path):
        _assert_same(sd, ref)


def _hsdp_save(ctx, path):
    """HSDP on 4 ranks: two replicas of a 2-way shard (subgroups {0, 1}, {2, 3}), whose ranks in
    the shard group are not their global ranks (review: ShardedTensor placements need those)."""
    _setup(ctx)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard_model(Net(), None, mesh=mesh)
    opt = _adamw(model)
    _train(model, opt, range(STEPS))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return True


def test_a_hybrid_sharded_checkpoint_resumes_without_replicas(tmp_path):
    path = str(tmp_path / "ckpt")
    ref = _reference()
    get_pool(4).run(_hsdp_save, path)
    for sd in get_pool(2).run(_resume, path):
        _assert_same(sd, ref)


def _compiled(ctx, path):
    """torch.compile's wrapper names parameters '_orig_mod.*', which torch's state_dict functions
    drop: the units' parts must be found under the names torch gives (review: Adam's moments
    stayed plain tensors, and DCP kept one rank's)."""
    _setup(ctx)
    model = _shard_model(Net(), ctx.pg)
    opt = _adamw(model)
    compiled = torch.compile(model, backend="eager")
    _train(compiled, opt, range(STEPS))
    model_sd, optim_sd = get_state_dict(compiled, opt)
    assert isinstance(optim_sd["state"]["blocks.0.fc1.weight"]["exp_avg"], ShardedTensor)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dist.barrier(group=ctx.pg)
    return _resume(ctx, path)


def test_a_compiled_model_saves_its_parts_under_torchs_names(tmp_path):
    ref = _reference()
    for sd in get_pool(2).run(_compiled, str(tmp_path / "ckpt")):
        _assert_same(sd, ref)


def _round_trip(ctx, path):
    _save(ctx, path)
    dist.barrier(group=ctx.pg)
    return _resume(ctx, path)


def test_on_gloo(tmp_path):
    ref = _reference()
    for sd in get_pool(2, "gloo").run(_round_trip, str(tmp_path / "ckpt")):
        _assert_same(sd, ref)


def _refusals(ctx):
    _setup(ctx)
    model = _shard_model(Net(), ctx.pg)
    opt = _adamw(model)
    _train(model, opt, range(1))
    model_sd, optim_sd = get_state_dict(model, opt)
    other = _shard_model(Net(d=9), ctx.pg)  # another shape: other runs
    other_opt = _adamw(other)
    _train(other, other_opt, range(1))
    with pytest.raises(ValueError, match="get its state_dict from this model"):
        set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    plain = {k: torch.zeros(1) for k in model_sd}
    with pytest.raises(TypeError, match="not the ShardedTensor get_state_dict gave"):
        set_state_dict(model, opt, model_state_dict=plain, optim_state_dict=optim_sd)
    with pytest.raises(ValueError, match="broadcast_from_rank0 needs full_state_dict=True"):
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(broadcast_from_rank0=True))
    # A whole dict whose moment is flattened: refused on every rank before anything is loaded
    # (review: it loaded, and opt.step() failed on the rank holding none of that parameter).
    full_model, full_optim = get_state_dict(model, opt, options=FULL)
    key = "blocks.0.fc1.weight"
    flat = {**full_optim["state"][key], "exp_avg": full_optim["state"][key]["exp_avg"].reshape(-1)}
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=rf"'{key}.exp_avg' is \[98\], not a whole tensor of shape \[14, 7\]"):
        set_state_dict(model, opt, model_state_dict=full_model, options=FULL,
                       optim_state_dict={**full_optim, "state": {**full_optim["state"], key: flat}})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # From rank 0, what it cannot send (here the sharded form): every rank raises, none waits.
    mine = (model_sd, optim_sd) if ctx.rank == 0 else ({}, {})
    with pytest.raises(ValueError, match="rank 0's state dicts cannot be sent .*ShardedTensor"):
        set_state_dict(model, opt, model_state_dict=mine[0], optim_state_dict=mine[1],
                       options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Whole tensors where the options promise them: a part is refused by name.
    with pytest.raises(ValueError, match="not a whole tensor of shape"):
        set_state_dict(model, opt, model_state_dict={k: v.local_shards()[0].tensor if isinstance(v, ShardedTensor) else v
                                                     for k, v in model_sd.items()},
                       optim_state_dict=optim_sd, options=StateDictOptions(full_state_dict=True))


def test_a_state_dict_of_another_layout_or_not_sharded_is_refused():
    get_pool(2).run(_refusals)


# ---- tensor parallelism (torch's plan on torchpar's layers): shards as DTensors ----

def _tp_batch(step):
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randint(0, 16, (5, 2), generator=g), torch.randint(0, 16, (5, 2), generator=g)


def _tp_train(model, opt, steps):
    for step in steps:
        idx, target = _tp_batch(step)
        opt.zero_grad()
        F.cross_entropy(model(idx).flatten(0, 1), target.flatten()).backward()
        opt.step()


def _tp_model(ctx, seed=0):
    model = _Net()
    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(seed)
    # The head gathered: every rank's logits whole, so the loss is one process's.
    return parallelize_module(model, DeviceMesh.from_group(ctx.pg, "cpu"), _plan(None, gathered_head=True))


def _tp_save(ctx, path, two_d=False):
    """3 steps of the tensor-parallel model (or of _two_d_model's), saved through DCP; returns the
    whole state dicts."""
    _setup(ctx)
    model = _two_d_model(ctx) if two_d else _tp_model(ctx)
    opt = _adamw(model)
    _tp_train(model, opt, range(STEPS))
    model_sd, optim_sd = get_state_dict(model, opt)
    if two_d:
        assert isinstance(model_sd["fc1.weight"], ShardedTensor) and model_sd["fc1.weight"].shape == (32, 8)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))


def _tp_resume(ctx, path):
    _setup(ctx)
    model = _tp_model(ctx, seed=1)
    _load_and_step(model, path, _tp_train)
    idx, _ = _tp_batch(99)
    return model(idx).detach()


@pytest.mark.parametrize("save_at,resume_at", [(2, 4), (4, 1)])
def test_a_tensor_parallel_checkpoint_resumes_at_another_world_size(tmp_path, save_at, resume_at):
    path = str(tmp_path / "ckpt")
    ref = _Net()
    opt = _adamw(ref)
    _tp_train(ref, opt, range(STEPS + 1))
    expected = ref(_tp_batch(99)[0]).detach()
    get_pool(save_at).run(_tp_save, path)
    for logits in get_pool(resume_at).run(_tp_resume, path):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


# ---- torchpar's DDP: names without its module. level, as torch's functions give torch DDP's ----

def _ddp_save(ctx, path):
    _setup(ctx)
    model = DistributedDataParallel(Net(), process_group=ctx.pg)
    opt = _adamw(model)
    _train(model, opt, range(STEPS))
    model_sd, optim_sd = get_state_dict(model, opt)
    assert "blocks.0.fc1.weight" in model_sd and "blocks.0.fc1.weight" in optim_sd["state"], list(model_sd)[:3]
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return True


def _plain_resume(ctx, path):
    """Without the wrapper, in one process."""
    model = Net(seed=1)
    _load_and_step(model, path)
    return model.state_dict()


def _ddp_resume(ctx, path):
    _setup(ctx)
    model = DistributedDataParallel(Net(seed=1), process_group=ctx.pg)
    _load_and_step(model, path)
    return model.module.state_dict()


def test_a_checkpoint_saved_under_ddp_resumes_with_or_without_it(tmp_path):
    path = str(tmp_path / "ckpt")
    ref = _reference()
    get_pool(2).run(_ddp_save, path)
    for sd in get_pool(1).run(_plain_resume, path) + get_pool(2).run(_ddp_resume, path):
        _assert_same(sd, ref)


# ---- full_state_dict=True: the whole tensors, gathered; and loaded back from them ----

FULL = StateDictOptions(full_state_dict=True)


def _one_process_state_dicts(steps):
    model = Net()
    opt = _adamw(model)
    _train(model, opt, range(steps))
    return get_model_state_dict(model), get_optimizer_state_dict(model, opt)


def _assert_same_state_dicts(got, want):
    """Model and optimizer state dicts (torch's layout) equal, key by key."""
    (model_sd, optim_sd), (ref_model, ref_optim) = got, want
    assert list(model_sd) == list(ref_model)
    for key, value in model_sd.items():
        torch.testing.assert_close(value, ref_model[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert optim_sd["param_groups"] == ref_optim["param_groups"]
    assert list(optim_sd["state"]) == list(ref_optim["state"])
    for key, state in optim_sd["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(value, ref_optim["state"][key][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{key}.{name}: {m}")


def _full_get(ctx, offload):
    _setup(ctx)
    model = _shard_model(Net(), ctx.pg)
    opt = _adamw(model)
    _train(model, opt, range(STEPS))
    options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
    return get_state_dict(model, opt, options=options)


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_state_dict_gives_the_whole_model_and_optimizer_state(world_size):
    """Units whose runs cut rows, and ranks that hold none of a parameter: every rank gets the
    one-process run's parameters and AdamW moments whole; with cpu_offload=True rank 0 only."""
    want = _one_process_state_dicts(STEPS)
    for got in get_pool(world_size).run(_full_get, False):
        _assert_same_state_dicts(got, want)
    got = get_pool(world_size).run(_full_get, True)
    _assert_same_state_dicts(got[0], want)
    assert all(g == ({}, {}) for g in got[1:])


def _full_set(ctx, sds, from_rank0):
    _setup(ctx)
    # The harness hands every rank the same arguments in shared memory: the optimizer would
    # adopt tensors (each parameter's step count) that the other ranks step too.
    sds = copy.deepcopy(sds) if not from_rank0 or ctx.rank == 0 else ({}, {})
    model = _shard_model(Net(seed=1), ctx.pg)
    opt = _adamw(model)
    _train(model, opt, range(1))  # state to be replaced
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
    set_state_dict(model, opt, model_state_dict=sds[0], optim_state_dict=sds[1], options=options)
    _train(model, opt, [STEPS])
    return model.state_dict()


@pytest.mark.parametrize("world_size,from_rank0", [(2, False), (4, False), (3, True)])
def test_a_full_state_dict_loads_into_a_sharded_model(world_size, from_rank0):
    """One process's state after 3 steps, loaded whole (on every rank, or on rank 0 only with
    broadcast_from_rank0, the others passing empty dicts): each rank keeps its part, and the 4th
    step equals the uninterrupted run's."""
    ref = _reference()
    for sd in get_pool(world_size).run(_full_set, _one_process_state_dicts(STEPS), from_rank0):
        _assert_same(sd, ref)


def _split_save(ctx, path):
    """The model and the optimizer saved apart, through the split functions, and the model
    exported whole on rank 0."""
    _setup(ctx)
    model = _shard_model(Net(), ctx.pg)
    opt = _adamw(model)
    _train(model, opt, range(STEPS))
    model_sd = tp_sd.get_model_state_dict(model)
    assert isinstance(model_sd["blocks.0.fc1.weight"], ShardedTensor)
    dcp.save(model_sd, checkpoint_id=f"{path}/model")
    dcp.save(tp_sd.get_optimizer_state_dict(model, opt), checkpoint_id=f"{path}/optim")
    return tp_sd.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _split_resume(ctx, path, full):
    _setup(ctx)
    model = _shard_model(Net(seed=1), ctx.pg)
    opt = _adamw(model)
    if full:  # one process's whole state, as from an export: from rank 0
        sds = copy.deepcopy(full) if ctx.rank == 0 else ({}, {})
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        result = tp_sd.set_model_state_dict(model, sds[0], options=options)
        tp_sd.set_optimizer_state_dict(model, opt, sds[1], options=options)
    else:
        model_sd, optim_sd = tp_sd.get_model_state_dict(model), tp_sd.get_optimizer_state_dict(model, opt)
        dcp.load(model_sd, checkpoint_id=f"{path}/model")
        dcp.load(optim_sd, checkpoint_id=f"{path}/optim")
        result = tp_sd.set_model_state_dict(model, model_sd)
        tp_sd.set_optimizer_state_dict(model, opt, optim_sd)
    assert not result.missing_keys and not result.unexpected_keys, result
    _train(model, opt, [STEPS])
    return model.state_dict()


def test_the_split_functions_save_and_load_each_half(tmp_path):
    """torch's split functions (get/set_model_state_dict, get/set_optimizer_state_dict): the two
    halves saved apart at 2 ranks resume at 3; the model gathered whole on rank 0 only
    (cpu_offload) is the one-process run's; whole state dicts from rank 0 load at 3."""
    path, ref = str(tmp_path), _reference()
    want = _one_process_state_dicts(STEPS)
    got = get_pool(2).run(_split_save, path)
    assert list(got[0]) == list(want[0]) and got[1] == {}
    for key, value in got[0].items():
        assert value.device.type == "cpu"
        torch.testing.assert_close(value, want[0][key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    for sd in get_pool(3).run(_split_resume, path, None):
        _assert_same(sd, ref)
    for sd in get_pool(3).run(_split_resume, path, want):
        _assert_same(sd, ref)


def _tp_full(ctx, sds):
    _setup(ctx)
    model = _tp_model(ctx)
    opt = _adamw(model)
    _tp_train(model, opt, range(STEPS))
    got = get_state_dict(model, opt, options=FULL)
    resumed = _tp_model(ctx, seed=1)
    resumed_opt = _adamw(resumed)
    sds = copy.deepcopy(sds) if ctx.rank == 0 else ({}, {})  # (see _full_set)
    set_state_dict(resumed, resumed_opt, model_state_dict=sds[0], optim_state_dict=sds[1],
                   options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _tp_train(resumed, resumed_opt, [STEPS])
    return got, resumed(_tp_batch(99)[0]).detach()


def test_full_state_dict_of_tensor_parallel_layers():
    """Gathered at tp 2: one process's state after 3 steps; that state loaded from rank 0 at tp 2
    (broadcast_from_rank0): the 4th step's logits are one process's."""
    ref = _Net()
    opt = _adamw(ref)
    _tp_train(ref, opt, range(STEPS))
    want = get_model_state_dict(ref), get_optimizer_state_dict(ref, opt)
    sds = copy.deepcopy(want)
    _tp_train(ref, opt, [STEPS])
    expected = ref(_tp_batch(99)[0]).detach()
    for got, logits in get_pool(2).run(_tp_full, sds):
        _assert_same_state_dicts(got, sds)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def _crossed_groups(ctx):
    """4 ranks, units over crossing groups: blocks 0 and 2 over {0,1} / {2,3}, block 1 over
    {0,2} / {1,3}, the root over all four. Each rank's parts go to three groups, interleaved in
    its state dict's order; the gathers still line up, and the result is one process's."""
    _setup(ctx)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crossed = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = Net()
    for i, block in enumerate(model.blocks):
        fully_shard(block, crossed[ctx.rank % 2] if i == 1 else pairs[ctx.rank // 2])
    fully_shard(model, ctx.pg)
    opt = _adamw(model)
    _train(model, opt, range(STEPS))
    return get_state_dict(model, opt, options=FULL)


def test_full_state_dict_over_crossing_groups():
    want = _one_process_state_dicts(STEPS)
    for got in get_pool(4).run(_crossed_groups):
        _assert_same_state_dicts(got, want)


def _mismatch(ctx):
    """Rank 1's optimizer is another (no state: SGD without momentum): every rank raises, none
    waits in a gather."""
    _setup(ctx)
    model = _shard_model(Net(), ctx.pg)
    opt = _adamw(model) if ctx.rank == 0 else torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt, range(1))
    with pytest.raises(ValueError, match="hold different parts to gather"):
        get_state_dict(model, opt, options=FULL)
    # The optimizer half alone, rank 1's optimizer holding no state: it has nothing to gather
    # where rank 0 has moments, and must not leave rank 0 waiting.
    with pytest.raises(ValueError, match="hold different parts to gather"):
        tp_sd.get_optimizer_state_dict(model, opt, options=FULL)
    dist.barrier(group=ctx.pg)


def test_full_state_dict_with_different_optimizers_fails_on_every_rank():
    get_pool(2).run(_mismatch)


# ---- FSDP + TP (torchtitan's 2-D layout): a unit holding tensor-parallel shards ----

def _two_d_model(ctx, seed=0):
    """dp 2 x tp 2: torch's plan on the tp dim, then fully_shard over the dp dim (fc1 a unit of its
    own, the rest the root's)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _Net()
    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(seed)
    model = parallelize_module(model, mesh["tp"], _plan(None, gathered_head=True))
    fully_shard(model.fc1, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _two_d_resume(ctx, path, sds):
    _setup(ctx)
    model = _two_d_model(ctx, seed=1)
    if sds is None:
        _load_and_step(model, path, _tp_train)
    else:  # whole, from rank 0
        opt = _adamw(model)
        sds = copy.deepcopy(sds) if ctx.rank == 0 else ({}, {})
        set_state_dict(model, opt, model_state_dict=sds[0], optim_state_dict=sds[1],
                       options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        _tp_train(model, opt, [STEPS])
    return model(_tp_batch(99)[0]).detach()


def test_fsdp_over_tensor_parallel_layers_checkpoints_at_any_layout(tmp_path):
    """dp 2 x tp 2 (fully_shard over tensor-parallel layers, fc1's runs cutting its rows): gathered
    whole it is one process's state; saved through DCP it resumes in one process, at tp 4, and at
    dp 2 x tp 2, and one process's whole state loads into it from rank 0: each next step equals
    the uninterrupted run's."""
    path = str(tmp_path / "ckpt")
    ref = _Net()
    opt = _adamw(ref)
    _tp_train(ref, opt, range(STEPS))
    want = copy.deepcopy((get_model_state_dict(ref), get_optimizer_state_dict(ref, opt)))
    _tp_train(ref, opt, [STEPS])
    expected = ref(_tp_batch(99)[0]).detach()
    for got in get_pool(4).run(_tp_save, path, True):
        _assert_same_state_dicts(got, want)
    logits = get_pool(1).run(_tp_resume, path) + get_pool(4).run(_tp_resume, path)
    logits += get_pool(4).run(_two_d_resume, path, None) + get_pool(4).run(_two_d_resume, path, want)
    for got in logits:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---- Megatron's stride: ParallelSelfAttention's fused q/k/v rows, a slice of each block per rank ----

def _attention(ctx, layout, seed=0):
    """ParallelSelfAttention (its qkv a ColumnParallelLinear with stride 3) over the world
    ("tp"), or dp 2 x tp 2 with fully_shard over the dp dim ("2d"); the same weights at any tp."""
    from torchpar.parallel.tensor import ParallelSelfAttention
    torch.manual_seed(seed)
    if layout == "2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = ParallelSelfAttention(8, 4, group=mesh["tp"].get_group())
        return fully_shard(model, mesh=mesh["dp"])
    return ParallelSelfAttention(8, 4, group=ctx.pg)


def _attention_train(model, opt, steps):
    for step in steps:
        x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(4000 + step))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _sgd(model):
    # Not AdamW: k's bias gets no gradient in attention (softmax ignores a constant per query)
    # but rounding noise, which Adam's normalisation turns into steps that differ with tp.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _attention_run(ctx, layout, path, mode):
    """"save": 3 steps, then the whole state dicts (and a DCP checkpoint at ``path``); "resume":
    other weights, the checkpoint loaded, the 4th step; returns its output."""
    _setup(ctx)
    model = _attention(ctx, layout, seed=0 if mode == "save" else 1)
    opt = _sgd(model)
    if mode == "save":
        _attention_train(model, opt, range(STEPS))
        model_sd, optim_sd = get_state_dict(model, opt)
        if ctx.world_size > 1:
            assert isinstance(model_sd["qkv.weight"], ShardedTensor), type(model_sd["qkv.weight"])
        if path:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        return copy.deepcopy(get_state_dict(model, opt, options=FULL))
    _load_and_step(model, path, _attention_train, _sgd)
    return model(torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(99))).detach()


def test_fused_blocks_of_a_strided_column_parallel_layer_checkpoint_at_any_layout(tmp_path):
    """qkv's rows are q, k and v blocks, each rank holding a slice of each: gathered whole at tp 2
    and at dp 2 x tp 2 they are one process's (the blocks in order); saved at tp 2 and at 2 x 2,
    resumed at tp 4, in one process and at 2 x 2, the next step's output is the uninterrupted
    run's."""
    want = get_pool(1).run(_attention_run, "tp", str(tmp_path / "one"), "save")[0]
    expected = get_pool(1).run(_attention_run, "tp", str(tmp_path / "one"), "resume")[0]
    for layout, world, resume in (("tp", 2, [("tp", 4), ("tp", 1)]), ("2d", 4, [("2d", 4)])):
        path = str(tmp_path / layout)
        for got in get_pool(world).run(_attention_run, layout, path, "save"):
            _assert_same_state_dicts(got, want)
        for at, n in resume:
            for out in get_pool(n).run(_attention_run, at, path, "resume"):
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _flat_save(ctx, path):
    _setup(ctx)
    model = _two_d_model(ctx)
    opt = _adamw(model)
    _tp_train(model, opt, range(STEPS))
    optim_sd = tp_sd.get_optimizer_state_dict(model, opt, options=FLAT)
    assert isinstance(optim_sd["state.fc1.weight.exp_avg"], ShardedTensor), sorted(optim_sd)[:4]
    dcp.save({"model": tp_sd.get_model_state_dict(model), "optim": optim_sd}, checkpoint_id=path)
    full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    return copy.deepcopy(tp_sd.get_optimizer_state_dict(model, opt, options=full))


def _flat_resume(ctx, path, whole):
    _setup(ctx)
    model = _two_d_model(ctx, seed=1)
    opt = _adamw(model)
    if whole is None:
        model_sd, optim_sd = tp_sd.get_model_state_dict(model), tp_sd.get_optimizer_state_dict(model, opt, options=FLAT)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        tp_sd.set_model_state_dict(model, model_sd)
        tp_sd.set_optimizer_state_dict(model, opt, optim_sd, options=FLAT)
    else:  # one process's whole state, the optimizer's flattened, from rank 0
        sds = copy.deepcopy(whole) if ctx.rank == 0 else ({}, {})
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, flatten_optimizer_state_dict=True)
        set_state_dict(model, opt, model_state_dict=sds[0], optim_state_dict=sds[1], options=options)
    _tp_train(model, opt, [STEPS])
    return model(_tp_batch(99)[0]).detach()


def test_flattened_optimizer_state_dicts(tmp_path):
    """flatten_optimizer_state_dict=True (torch's flat keys, torchtitan's choice) at dp 2 x tp 2:
    the whole flat dict is one process's; saved flat through DCP it resumes, and one process's
    whole flat dict loads from rank 0: the next step equals the uninterrupted run's."""
    path = str(tmp_path / "ckpt")
    ref = _Net()
    opt = _adamw(ref)
    _tp_train(ref, opt, range(STEPS))
    want = copy.deepcopy(get_optimizer_state_dict(ref, opt, options=FLAT))
    whole = copy.deepcopy((get_model_state_dict(ref), want))
    _tp_train(ref, opt, [STEPS])
    expected = ref(_tp_batch(99)[0]).detach()
    for got in get_pool(4).run(_flat_save, path):
        assert sorted(got) == sorted(want)
        for key, value in got.items():
            if torch.is_tensor(value):
                torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
            else:
                assert value == want[key], key
    for logits in get_pool(4).run(_flat_resume, path, None) + get_pool(4).run(_flat_resume, path, whole):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
