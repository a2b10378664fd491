"""torch.distributed.pipelining's calling conventions on torchpar's pipeline: ``PipelineStage``'s
positional ``device`` and its static-shape arguments, keyword arguments to ``step``/``eval``
split into micro-batches and given to every stage of the rank, and ``return_outputs``.
"""
import copy

import pytest
import torch
from torch import nn

from test_pipeline import BACKENDS, SCHEDULES, _data, _mse, _pool
from torchpar.parallel.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                        ScheduleZeroBubble, get_schedule_class)


class _Masked(nn.Module):
    """A stage whose forward takes a per-sample mask and a plain scale by keyword."""

    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x, mask=None, scale=1.0, extra=()):
        for e in extra:  # tensors inside a container are split too (review finding)
            x = x + e
        return torch.tanh(self.lin(x)) * mask[:, None] * scale


def _with_kwargs(ctx, schedule):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.ModuleList([_Masked(), _Masked()])
    ref = copy.deepcopy(model)
    x, y = _data(0, 8)
    mask = (torch.arange(8) % 3 != 0).float()
    m = 4
    # One process: the mean over micro-batches of the micro-batches' losses (scale_grads).
    extra = [torch.randn(8, 8, generator=torch.Generator().manual_seed(2))]
    for xs, ys, ms, es in zip(x.chunk(m), y.chunk(m), mask.chunk(m), extra[0].chunk(m)):
        (_mse(ref[1](ref[0](xs, mask=ms, scale=0.5, extra=[es]), mask=ms, scale=0.5, extra=[es]), ys) / m).backward()
    stage = PipelineStage(copy.deepcopy(model[ctx.rank]), ctx.rank, 2, torch.device("cpu"), input_args=(x[:2],),
                          group=ctx.pg)
    sched = SCHEDULES[schedule](stage, m, loss_fn=_mse)
    first = ctx.rank == 0
    out = sched.step(*((x,) if first else ()), target=None if first else y, mask=mask, scale=0.5, extra=extra)
    for p, q in zip(stage.submod.parameters(), ref[ctx.rank].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    if not first:  # the output, and none with return_outputs=False
        with torch.no_grad():
            want = model[1](model[0](x, mask=mask, scale=0.5, extra=extra), mask=mask, scale=0.5, extra=extra)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    quiet = sched.step(*((x,) if first else ()), target=None if first else y, return_outputs=False, mask=mask)
    evaluated = sched.eval(*((x,) if first else ()), mask=mask, scale=0.5)
    return out is None, quiet is None, evaluated is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_step_keyword_arguments_reach_every_stage_per_micro_batch(backend, schedule):
    first, last = _pool(backend, 2).run(_with_kwargs, schedule)
    assert first == (True, True, True)       # the first stage returns nothing
    assert last == (False, True, False)      # the last returns the output unless told not to


def _caller_tensors_requiring_grad(ctx, schedule):
    """The batch and keyword tensors that require grad: each rank's copies receive what its
    stage's micro-batches send back into them."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.ModuleList([_Masked(), _Masked()])
    x, y = _data(0, 8)
    mask = torch.linspace(0.5, 1.5, 8)
    extra = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    mine = [t.clone().requires_grad_() for t in (x, mask, extra)]
    stage = PipelineStage(model[ctx.rank], ctx.rank, 2, group=ctx.pg)
    first = ctx.rank == 0
    SCHEDULES[schedule](stage, 4, loss_fn=_mse).step(*(mine[:1] if first else ()), target=None if first else y,
                                                     mask=mine[1], extra=[mine[2]])
    return [t.grad for t in mine]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_batch_and_keyword_tensors_that_require_grad_get_their_gradients(schedule):
    # ZB-H1's B differentiated only up to the stage's inputs: these tensors got nothing.
    first, last = _pool("torchpar", 2).run(_caller_tensors_requiring_grad, schedule)
    torch.manual_seed(0)
    model = nn.ModuleList([_Masked(), _Masked()])
    x, y = _data(0, 8)
    ref = [t.clone().requires_grad_() for t in (x, torch.linspace(0.5, 1.5, 8),
                                                 torch.randn(8, 8, generator=torch.Generator().manual_seed(2)))]
    for xs, ys, ms, es in zip(*(t.chunk(4) for t in (*ref[:1], y, *ref[1:]))):
        (_mse(model[1](model[0](xs, mask=ms, extra=[es]), mask=ms, extra=[es]), ys) / 4).backward()
    torch.testing.assert_close(first[0], ref[0].grad, rtol=1e-5, atol=1e-6)
    assert last[0] is None  # the last stage was given no batch
    for i in (1, 2):  # each stage used the keywords: the two ranks' parts add up to one process's
        torch.testing.assert_close(first[i] + last[i], ref[i].grad, rtol=1e-5, atol=1e-6)


def _kwarg_does_not_split(ctx):
    torch.set_num_threads(1)
    stage = PipelineStage(_Masked(), ctx.rank, 2, group=ctx.pg)
    x, y = _data(0, 8)
    try:
        ScheduleGPipe(stage, 4, loss_fn=_mse).step(*((x,) if ctx.rank == 0 else ()),
                                                   target=y if ctx.rank else None, mask=torch.ones(6))
    except ValueError as e:
        return str(e)
    return None


def test_a_keyword_tensor_that_does_not_split_is_refused_on_every_rank():
    for err in _pool("torchpar", 2).run(_kwarg_does_not_split):
        assert err and "keyword argument 'mask' has batch size 6" in err and "4 micro-batches" in err, err


def _positional_group(ctx):
    try:
        PipelineStage(_Masked(), ctx.rank, 2, ctx.pg)
    except TypeError as e:
        return str(e)
    return None


def test_a_group_passed_where_torch_takes_the_device_is_refused():
    for err in _pool("torchpar", 2).run(_positional_group):
        assert err and "fourth argument is the device" in err, err


def test_dw_builder_is_refused():
    with pytest.raises(NotImplementedError, match="dw_builder"):
        PipelineStage(_Masked(), 0, 1, dw_builder=lambda: None)


def test_get_schedule_class_reads_torch_names_case_insensitively():
    assert get_schedule_class("1f1b") is Schedule1F1B and get_schedule_class("GPipe") is ScheduleGPipe
    assert get_schedule_class("interleaved1F1B") is ScheduleInterleaved1F1B
    assert get_schedule_class("ZeroBubble") is ScheduleZeroBubble
    with pytest.raises(NotImplementedError, match="'ZBVZeroBubble' schedule is not generated"):
        get_schedule_class("ZBVZeroBubble")
    with pytest.raises(ValueError, match="unknown schedule name 'pipedream'"):
        get_schedule_class("pipedream")
