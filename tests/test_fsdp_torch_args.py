"""torch FSDP2's own arguments to torchpar's ``fully_shard``: a script written for
``torch.distributed.fsdp.fully_shard`` (``mp_policy``, ``ignored_params``, ``offload_policy``,
``shard_placement_fn``) runs unchanged and trains as torch's FSDP2 does, step for step, in the same
ranks (torch's on a gloo group); what torchpar cannot do is refused on every rank before anything
is sharded.
"""
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from test_fsdp import Net, _batch, _part, _pool
import copy

from torchpar.parallel import MixedPrecision, fully_shard, register_fsdp_forward_method

on_backends = pytest.mark.parametrize("backend", ["torchpar", "gloo"])
# make test's time budget: these gloo twins run in make test-slow (their torchpar twins stay).
SLOW_VARIANTS = {"test_float16_reduce_divides_around_the_sum_as_torch_fsdp2[gloo]",
                 "test_set_unshard_in_backward_skips_the_embeddings_backward_gather_as_torch_fsdp2[gloo]"}


def _shard_both(ctx, ours, theirs, root=None, **kwargs):
    """fully_shard with the same arguments on both stacks: each block, then the root (with
    ``root``'s arguments instead where given)."""
    mesh = DeviceMesh.from_group(ctx.gloo, "cpu")
    for b in ours.blocks:
        fully_shard(b, ctx.pg, **kwargs)
    fully_shard(ours, ctx.pg, **(root or kwargs))
    for b in theirs.blocks:
        torch_fully_shard(b, mesh=mesh, **kwargs)
    torch_fully_shard(theirs, mesh=mesh, **(root or kwargs))


def _full(p):
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _step_both(ctx, ours, theirs, steps, check, rtol, atol):
    """Both models step AdamW on this rank's part of each batch; after each step the full weights
    (and ``check``'s view of the outputs) agree."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        outs = []
        for m, o in zip((ours, theirs), opts):
            o.zero_grad()
            out = m(_part(x, ctx))
            outs.append(out)
            ((out.float() - _part(y, ctx)) ** 2).mean().backward()
            o.step()
        check(*outs)
        mine = ours.state_dict()
        theirs_full = {n: _full(p) for n, p in theirs.named_parameters()}
        assert list(mine) == list(theirs_full)
        for n, t in theirs_full.items():
            torch.testing.assert_close(mine[n], t, rtol=rtol, atol=atol, msg=lambda m: f"step {step}, {n}: {m}")


# ---- mp_policy: torch's MixedPrecisionPolicy ----

def _mp_policy_like_torch(ctx, output_dtype):
    torch.set_num_threads(1)
    ours, theirs = Net(), Net()
    blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # output_dtype on the root only (as usual: a block's float32 output would meet the next
    # module's bfloat16 weights).
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=output_dtype)
    _shard_both(ctx, ours, theirs, root={"mp_policy": root}, mp_policy=blocks,
                offload_policy=OffloadPolicy())  # torch's default offload policy, given explicitly
    # The shards keep the module's dtype (float32) under mp_policy, as in FSDP2.
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    for m in (ours, theirs):  # settings FSDP2 scripts call: accepted (here they change nothing)
        m.set_is_last_backward(True)
        m.set_reduce_scatter_unused_params(True)
        m.set_force_sum_reduction_for_comms(True)

    def check(a, b):
        assert a.dtype == b.dtype == (output_dtype or torch.bfloat16)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The same bfloat16 arithmetic and float32 reductions on both: equal to float32 rounding.
    _step_both(ctx, ours, theirs, 3, check, rtol=1e-5, atol=1e-6)


@on_backends
@pytest.mark.parametrize("output_dtype", [None, torch.float32], ids=["out-param", "out-float32"])
def test_mp_policy_trains_as_torch_fsdp2_with_the_same_policy(backend, output_dtype):
    _pool(backend, 2).run(_mp_policy_like_torch, output_dtype)


def _float16_reduce_like_torch(ctx):
    """A float16 reduce (mp_policy's reduce_dtype None: param_dtype's) of gradients whose sum
    over the ranks overflows float16 but whose mean does not: divided by ~sqrt(world) before the
    sum and the rest after, as FSDP2 does (audit finding: summed first, the gradients were inf)."""
    torch.set_num_threads(1)
    policy = MixedPrecisionPolicy(param_dtype=torch.float16)
    ours, theirs = nn.Linear(4, 2, bias=False), nn.Linear(4, 2, bias=False)
    theirs.load_state_dict(ours.state_dict())
    w0 = ours.weight.detach().clone()
    fully_shard(ours, ctx.pg, mp_policy=policy)
    torch_fully_shard(theirs, mesh=DeviceMesh.from_group(ctx.gloo, "cpu"), mp_policy=policy)
    x = torch.full((1, 4), 40000.0)  # each rank's weight gradient: 40000, float16's max is 65504
    for m in (ours, theirs):
        m(x).float().sum().backward()
        torch.optim.SGD(m.parameters(), lr=1e-6).step()
    mine, want = ours.state_dict()["weight"], _full(theirs.weight)
    torch.testing.assert_close(mine, w0 - 1e-6 * 40000, rtol=1e-6, atol=1e-7)  # the mean gradient: 40000
    torch.testing.assert_close(mine, want, rtol=0, atol=0)


@on_backends
def test_float16_reduce_divides_around_the_sum_as_torch_fsdp2(backend):
    _pool(backend, 2).run(_float16_reduce_like_torch)


class _Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(16, 8), nn.Linear(8, 1)

    def forward(self, idx):
        return self.fc(torch.tanh(self.emb(idx))).squeeze(-1)


def _unshard_in_backward_like_torch(ctx):
    """set_unshard_in_backward(False) on an embedding unit: its backward gathers nothing (its
    weight's gradient needs only the indices), and training equals torch FSDP2's with the same
    setting, step for step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ours = _Embedder()
    theirs = copy.deepcopy(ours)
    mesh = DeviceMesh.from_group(ctx.gloo, "cpu")
    fully_shard(ours.emb, ctx.pg)
    fully_shard(ours, ctx.pg)
    torch_fully_shard(theirs.emb, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    for m in (ours, theirs):
        m.emb.set_unshard_in_backward(False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, theirs)]
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + ctx.rank)
        idx, y = torch.randint(0, 16, (4, 5), generator=g), torch.randn(4, 5, generator=g)
        for m, o in zip((ours, theirs), opts):
            o.zero_grad()
            ((m(idx) - y) ** 2).mean().backward()
            o.step()
        mine = ours.state_dict()
        for n, p in theirs.named_parameters():
            torch.testing.assert_close(mine[n], _full(p), rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step}, {n}: {m}")
    unit = ours.emb._fsdp.index
    launches = [e for e in ours.fsdp_engine.trace() if tuple(e) == ("all_gather_launch", unit)]
    assert len(launches) == 1, ours.fsdp_engine.trace()  # the last step's forward only


@on_backends
def test_set_unshard_in_backward_skips_the_embeddings_backward_gather_as_torch_fsdp2(backend):
    _pool(backend, 2).run(_unshard_in_backward_like_torch)


class _Recorder(nn.Module):
    """Records the dtype its input arrives in, then computes in its weight's."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen = None

    def forward(self, x):
        self.seen = x.dtype
        return self.fc(x.to(self.fc.weight.dtype))


def _cast_forward_inputs(ctx, cast):
    torch.manual_seed(0)
    model = fully_shard(_Recorder(), ctx.pg, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, cast_forward_inputs=cast))
    out = model(torch.randn(3, 4))
    out.float().sum().backward()
    return str(model.seen), str(out.dtype), str(model.fc.weight.grad.dtype)


@pytest.mark.parametrize("cast", [True, False])
def test_cast_forward_inputs_false_leaves_the_inputs_alone(cast):
    seen, out, grad = _pool("torchpar", 2).run(_cast_forward_inputs, cast)[0]
    assert seen == ("torch.bfloat16" if cast else "torch.float32")
    # reduce_dtype None: reduced in param_dtype, then kept in the shard's dtype.
    assert (out, grad) == ("torch.bfloat16", "torch.float32")


# ---- ignored_params: left as they are ----

def _ignored_like_torch(ctx):
    torch.set_num_threads(1)
    ours, theirs = Net(), Net()
    ignored = [{m.blocks[1].fc1.weight, m.out.bias} for m in (ours, theirs)]
    mesh = DeviceMesh.from_group(ctx.gloo, "cpu")
    for b in ours.blocks:
        fully_shard(b, ctx.pg, ignored_params=ignored[0])
    fully_shard(ours, ctx.pg, ignored_params=ignored[0])
    for b in theirs.blocks:
        torch_fully_shard(b, mesh=mesh, ignored_params=ignored[1])
    torch_fully_shard(theirs, mesh=mesh, ignored_params=ignored[1])
    # Whole, plain parameters of the module, not pieces of a unit.
    assert ours.blocks[1].fc1.weight.shape == (14, 7) and ours.out.bias.shape == (3,)
    # Their gradients are this rank's own (not averaged), so they drift apart across ranks on both.
    _step_both(ctx, ours, theirs, 3, lambda a, b: None, rtol=1e-5, atol=1e-6)
    return ours.out.bias.detach().clone()


@on_backends
def test_ignored_params_stay_whole_and_unreduced_as_in_torch_fsdp2(backend):
    biases = _pool(backend, 2).run(_ignored_like_torch)
    assert not torch.equal(biases[0], biases[1])  # each rank trained its own


# ---- offload_policy and shard_placement_fn as far as a flat unit on CPU honours them ----

def _offload_and_placement_like_torch(ctx):
    torch.set_num_threads(1)
    ours, theirs = Net(), Net()
    _shard_both(ctx, ours, theirs, offload_policy=CPUOffloadPolicy(pin_memory=False),
                shard_placement_fn=lambda p: Shard(0) if p.dim() > 1 else None)
    _step_both(ctx, ours, theirs, 2, lambda a, b: None, rtol=1e-5, atol=1e-6)


def test_cpu_offload_and_shard0_placements_train_as_torch_fsdp2_on_cpu():
    _pool("torchpar", 2).run(_offload_and_placement_like_torch)


# ---- refused on every rank, before anything is sharded ----

REFUSED = {
    "dp_mesh_dims": (NotImplementedError, "dp_mesh_dims"),
    "shard_placement_fn": (NotImplementedError, "Shard(dim=1)"),
    "list": (NotImplementedError, "a list of modules"),
    "both_policies": (ValueError, "not both"),
    "wrong_policy_type": (TypeError, "mp_policy takes"),
    "wrong_offload_type": (TypeError, "offload_policy takes"),
    "bad_dtype": (TypeError, "mp_policy.param_dtype"),
}


def _refused(ctx, case):
    from torch.distributed.fsdp._fully_shard._fsdp_api import DataParallelMeshDims
    model = Net()
    kwargs = {
        "dp_mesh_dims": {"dp_mesh_dims": DataParallelMeshDims(shard="dp")},
        "shard_placement_fn": {"shard_placement_fn": lambda p: Shard(1) if p.dim() > 1 else None},
        "both_policies": {"mixed_precision": MixedPrecision(torch.bfloat16), "mp_policy": MixedPrecisionPolicy()},
        "wrong_policy_type": {"mp_policy": MixedPrecision(torch.bfloat16)},
        "wrong_offload_type": {"offload_policy": "cpu"},
        "bad_dtype": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.int8)},
    }.get(case, {})
    target = [model.blocks[0], model.blocks[1]] if case == "list" else model
    try:
        fully_shard(target, ctx.pg, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test names the type
        # Nothing was sharded: the model's parameters are its own, whole.
        assert not hasattr(model, "_fsdp") and model.inp.weight.shape == (7, 5)
        return type(e), str(e)
    return None


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_a_flat_unit_cannot_do_is_refused_on_every_rank(case):
    kind, text = REFUSED[case]
    for result in _pool("torchpar", 2).run(_refused, case):
        assert result is not None and result[0] is kind and text in result[1], result



# ---- register_fsdp_forward_method ----

class _Encoder(Net):
    def encode(self, x):
        """Uses the root's own parameters (inp) outside forward, and a block."""
        return self.blocks[0](self.inp(x)).sum(dim=1)


def _forward_method(ctx):
    torch.set_num_threads(1)
    model = _Encoder()
    ref = copy.deepcopy(model)
    for b in model.blocks:
        fully_shard(b, ctx.pg)
    fully_shard(model, ctx.pg)
    register_fsdp_forward_method(model, "encode")
    with torch.no_grad():
        torch.testing.assert_close(model.encode(torch.ones(2, 5)), ref.encode(torch.ones(2, 5)))
    x = torch.randn(2 * ctx.world_size, 5, generator=torch.Generator().manual_seed(3))
    model.encode(_part(x, ctx)).pow(2).mean().backward()
    ref.encode(x).pow(2).mean().backward()
    # The pieces are registered again after the method, holding the reduced gradients: the mean
    # over ranks of the parts' gradients, which is the whole batch's (the loss is a mean).
    pieces = dict(model.named_parameters())
    checked = 0
    for name, shard in model.sharded_state_dict().items():
        want = dict(ref.named_parameters())[name].grad
        if want is None or shard.local.numel() == 0:
            continue
        got = pieces[name].grad
        torch.testing.assert_close(got, want.flatten()[shard.start:shard.start + got.numel()],
                                   msg=lambda m: f"{name}: {m}")
        checked += 1
    assert checked >= 4  # inp and block 0's pieces on this rank
    torch.testing.assert_close(model.state_dict()["inp.weight"], ref.inp.weight.detach())


def test_a_registered_forward_method_gathers_and_reduces_as_forward():
    _pool("torchpar", 2).run(_forward_method)


def test_register_fsdp_forward_method_leaves_an_unsharded_module_alone():
    plain = nn.Linear(2, 2)
    register_fsdp_forward_method(plain, "forward")  # torch's is a no-op here too
    assert "forward" not in vars(plain)


def _missing_method(ctx):
    model = fully_shard(nn.Linear(2, 2), ctx.pg)
    with pytest.raises(ValueError, match="has no method 'encode'"):
        register_fsdp_forward_method(model, "encode")


def test_register_fsdp_forward_method_names_a_missing_method():
    _pool("torchpar", 2).run(_missing_method)


# ---- reset_iter_state: recovery after a raised forward ----

class _Flaky(Net):
    """Net whose forward raises when told to (after its blocks ran, mid-iteration)."""
    fail = False

    def forward(self, x):
        out = super().forward(x)
        if self.fail:
            raise RuntimeError("injected")
        return out


def _reset_after_failure(ctx, reset):
    torch.set_num_threads(1)
    model, ref = _Flaky(), Net()
    ref.load_state_dict(model.state_dict())
    for b in model.blocks:
        fully_shard(b, ctx.pg)
    fully_shard(model, ctx.pg)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    x, y = _batch(0, 4 * ctx.world_size)
    with model.no_sync():  # a first micro-batch accumulates, then the second one fails
        ((model(_part(x, ctx)) - _part(y, ctx)) ** 2).mean().backward()
    model.fail = True
    with pytest.raises(RuntimeError, match="injected"):
        model(_part(x, ctx))
    model.fail = False
    if reset:
        with pytest.raises(RuntimeError, match="on the root"):
            model.blocks[0].reset_iter_state()
        model.reset_iter_state()
        assert model.fsdp_engine.memory()["accumulators"] == 0
    # The next iteration: one batch, stepped; with the reset, equal to one process on that batch.
    x, y = _batch(1, 2 * ctx.world_size)
    opt.zero_grad()
    ((model(_part(x, ctx)) - _part(y, ctx)) ** 2).mean().backward()
    opt.step()
    ((ref(x) - y) ** 2).mean().backward()
    ref_opt.step()
    full, want = model.state_dict(), ref.state_dict()
    return all(torch.allclose(full[k], want[k], rtol=1e-5, atol=1e-6) for k in want)


def test_reset_iter_state_drops_the_failed_iterations_accumulated_gradients():
    pool = _pool("torchpar", 2)
    assert pool.run(_reset_after_failure, True) == [True, True]
    # Without it the no_sync sum from before the failure is reduced with the next backward.
    assert pool.run(_reset_after_failure, False) == [False, False]
