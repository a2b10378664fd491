"""fully_shard's explicit prefetching and unsharding, as torch's FSDP2 offers them:
``FSDPModule.unshard(async_op=...)`` / ``UnshardHandle``, ``set_modules_to_forward_prefetch`` and
``set_modules_to_backward_prefetch`` (fsdp_engine.h, "Explicit prefetching"). Training must stay
equal to one process; the engine's trace shows where the all-gathers went."""
import copy

import pytest
import torch
from torch import nn

from test_fsdp import Net, _assert_matches, _batch, _loss, _part, _pool, _setup, _shard_model, _step_both
from torchpar.parallel import FSDPModule, UnshardHandle

# gloo in make test-slow (make test's time budget).
on_backends = pytest.mark.parametrize("backend", ["torchpar", pytest.param("gloo", marks=pytest.mark.slow)])


def _train(ctx, model, ref, steps, before_forward=lambda model: None):
    """``steps`` SGD steps of the sharded ``model`` and the one-process ``ref``, weights compared
    after each; returns each step's engine trace."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    traces = []
    for step in range(steps):
        x, y = _batch(step, 2 * ctx.world_size)
        before_forward(model)
        _step_both(ctx, (model, opt), (ref, ref_opt), x, y, step)
        traces.append([tuple(e) for e in model.fsdp_engine.trace()])
    return traces


def _unshard_before_forward(ctx, async_op):
    _setup(ctx)
    model = Net()
    ref = copy.deepcopy(model)
    _shard_model(model, ctx.pg)
    seen = []

    def unshard(model):
        handle = model.unshard(async_op=async_op)
        assert isinstance(handle, UnshardHandle) == async_op
        if async_op:
            handle.wait()
        # The root's own parameters are the gathered ones now, the blocks' still pieces.
        seen.append((tuple(model.inp.weight.shape), model.inp.weight.detach().clone(),
                     tuple(model.blocks[0].fc1.weight.shape)))

    traces = _train(ctx, model, ref, 3, unshard)
    no_unshard = _train(ctx, _shard_model(copy.deepcopy(ref), ctx.pg), copy.deepcopy(ref), 2)
    return seen, traces, no_unshard


@on_backends
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_unshard_before_forward_is_not_gathered_again(backend, async_op):
    for seen, traces, no_unshard in _pool(backend, 2).run(_unshard_before_forward, async_op):
        for full_shape, value, block_shape in seen:
            assert full_shape == (7, 5) and value.shape == (7, 5) and len(block_shape) == 1
        # The root (unit 0) is gathered by forward without unshard(), not after it: the step
        # keeps the user's gather (begin_step would free it otherwise); in the first step too,
        # whose unshard() came before the engine existed.
        for trace in traces:
            assert ("all_gather_launch", 0) not in trace, trace
        assert ("all_gather_launch", 0) in no_unshard[1]


def _unshard_then_reshard(ctx):
    _setup(ctx)
    model = _shard_model(Net(), ctx.pg)
    full = [tuple(p.shape) for p in (model.unshard(), model.parameters())[1]]
    model.reshard()
    pieces = [tuple(p.shape) for p in model.parameters()]
    x, _ = _batch(0, 2)
    model(x)  # the engine starts with the unit sharded again
    return full, pieces


def test_reshard_after_unshard_gives_the_pieces_back():
    for full, pieces in _pool("torchpar", 2).run(_unshard_then_reshard):
        assert (7, 5) in full and all(len(s) == 1 for s in pieces)


def _late_wait_and_load(ctx):
    """Review findings: a handle waited after the forward registered the gathered parameters
    (the optimizer's zero_grad then missed the pieces: training drifted); load_state_dict after
    unshard() refused the full tensors, after loading part of them."""
    _setup(ctx)
    model = Net()
    ref = copy.deepcopy(model)
    _shard_model(model, ctx.pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        handle = model.unshard(async_op=True)
        x, y = _batch(step, 2 * ctx.world_size)
        loss = _loss(model(_part(x, ctx)), _part(y, ctx))
        handle.wait()  # late: the forward has waited already
        assert model.inp.weight.dim() == 1, "the gathered parameters came back after forward"
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step()
        _assert_matches(model.state_dict(), ref, step)
    fresh = Net(seed=1).state_dict()
    model.unshard()
    model.load_state_dict(fresh)
    _assert_matches(model.state_dict(), Net(seed=1), "load")


def test_a_late_wait_changes_nothing_and_a_load_after_unshard_loads():
    _pool("torchpar", 2).run(_late_wait_and_load)


def _explicit_prefetch(ctx):
    _setup(ctx)
    model = Net(depth=4)
    ref = copy.deepcopy(model)
    _shard_model(model, ctx.pg)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):  # the FSDP2 tutorial's pattern: two ahead, both ways
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
        block.set_modules_to_backward_prefetch(blocks[max(i - 2, 0):i][::-1])
    return _train(ctx, model, ref, 3)


@on_backends
def test_explicit_prefetch_launches_two_units_ahead_and_trains_as_single_process(backend):
    for traces in _pool(backend, 2).run(_explicit_prefetch):
        for step, ev in enumerate(traces):
            first = ev.index
            last = {e: i for i, e in enumerate(ev)}
            # Units 1..4 are the blocks. Forward (from the first step: the lists need no
            # recorded order): block 1's forward launches blocks 2 and 3 before it ends.
            assert first(("pre_forward", 1)) < first(("all_gather_launch", 3)) < first(("post_forward", 1)), step
            # Backward (the order is agreed at the first forward's end): block 4's backward
            # launches blocks 3 and 2 before block 3's starts.
            assert last[("pre_backward", 4)] < last[("all_gather_launch", 2)] < last[("pre_backward", 3)], step


def _bad_prefetch_lists(ctx):
    _setup(ctx)
    model, other = _shard_model(Net(), ctx.pg), _shard_model(Net(), ctx.pg)
    errors = []
    try:
        model.blocks[0].set_modules_to_forward_prefetch([nn.Linear(2, 2)])
    except TypeError as e:
        errors.append(str(e))
    x, _ = _batch(0, 2)
    model(x), other(x)  # both engines made
    try:
        model.blocks[0].set_modules_to_backward_prefetch([other.blocks[1]])
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_prefetch_lists_refuse_other_modules():
    for errors in _pool("torchpar", 2).run(_bad_prefetch_lists):
        assert len(errors) == 2, errors
        assert "fully_shard modules, got a Linear" in errors[0]
        assert "of another model" in errors[1]

