"""DistributedDataParallel with sparse gradients (``nn.Embedding(sparse=True)``,
``nn.EmbeddingBag(sparse=True)``): each such weight has a bucket of its own, all-reduced as a
sparse tensor. Checked against torch's DDP where torch's runs the case, and against one process
(every rank's gradients averaged, computed locally from the same seeds) where it does not.

On the torchpar backend only: gloo's sparse all_reduce corrupts memory when it runs beside
dense ones (a DDP's buckets), in torch's DDP and ours alike (docs/ddp.md, "Sparse gradients"),
so gloo runs of these cases fail now and then with a rank killed by SIGABRT or SIGSEGV."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from test_ddp import _assert_same_params, _pool, _setup, multi_rank
from test_pipeline import SCHEDULES, _mse, _pp_by_dp
from torchpar.parallel import DistributedDataParallel as DDP
from torchpar.parallel.pipeline import PipelineStage

pytestmark = pytest.mark.timeout(120)

VOCAB, DIM = 30, 4


class _Recommender(nn.Module):
    """Two sparse tables and a dense head. ``tied``: the head also reads the first table's
    weight densely, so autograd leaves that weight a dense gradient (sparse + dense)."""

    def __init__(self, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.users = nn.Embedding(VOCAB, DIM, sparse=True)
        self.items = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
        self.head = nn.Linear(2 * DIM, 1)
        self.tied = tied

    def forward(self, users, items, use_items=True):
        u = self.users(users).sum(1)
        i = self.items(items) if use_items else torch.zeros_like(u)
        out = self.head(torch.cat([u, i], 1))
        if self.tied:
            out = out + (u @ self.users.weight.t()).mean(1, keepdim=True)
        return out


def _batch(step, rank, n=3):
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randint(VOCAB, (n, 2), generator=g), torch.randint(VOCAB, (n, 3), generator=g),
            torch.randn(n, 1, generator=g))


def _loss(model, step, rank, use_items=True):
    users, items, y = _batch(step, rank)
    return ((model(users, items, use_items) - y) ** 2).mean()


# A row's sum over 4 ranks rounds differently when it is added up in another order (seen:
# 8e-6 after 4 steps); a wrong average is off by the row's size.
TOL = dict(rtol=1e-4, atol=1e-5)


def _vs_torch_ddp(ctx, options, hook):
    _setup(ctx)
    ours_model, torch_model = _Recommender(), _Recommender()
    ours = DDP(ours_model, process_group=ctx.pg, bucket_cap_mb=0.0001, **options)
    theirs = nn.parallel.DistributedDataParallel(torch_model, process_group=ctx.pg, bucket_cap_mb=0.0001, **options)
    if hook:
        ours.register_comm_hook(ctx.pg, default_hooks.allreduce_hook)
        theirs.register_comm_hook(ctx.pg, default_hooks.allreduce_hook)
    opts = [torch.optim.SGD(d.parameters(), lr=0.1) for d in (ours, theirs)]
    for step in range(4):
        for ddp, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            _loss(ddp, step, ctx.rank).backward()
        assert ours_model.users.weight.grad.is_sparse and ours_model.items.weight.grad.is_sparse
        for opt in opts:
            opt.step()
        _assert_same_params(ours_model, torch_model, step, **TOL)


@multi_rank
@pytest.mark.parametrize("options", [{}, {"static_graph": True}, {"gradient_as_bucket_view": True},
                                     {"find_unused_parameters": True}], ids=["plain", "static", "view", "unused"])
def test_sparse_embeddings_train_like_torch_ddp(world_size, options):
    _pool("torchpar", world_size).run(_vs_torch_ddp, options, False)


def test_sparse_buckets_go_through_a_comm_hook_as_with_torch_ddp():
    _pool("torchpar", 2).run(_vs_torch_ddp, {}, True)


def _vs_one_process(ctx, case):
    """Cases torch's DDP does not run: a sparse weight that some ranks (or none) use in a step
    (torch's raises "Expected sparse gradient to be defined"), and one that also gets a dense
    gradient; and no_sync micro-batches, summed sparse gradients."""
    _setup(ctx)
    model, ref = _Recommender(tied=case == "tied"), _Recommender(tied=case == "tied")
    ddp = DDP(model, process_group=ctx.pg, find_unused_parameters=case == "unused")
    opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

    def used(step, rank):  # "unused": the item table on no rank at step 1, on rank 0 only at step 2
        return case != "unused" or (step != 1 and (step != 2 or rank == 0))

    micro = 2 if case == "no_sync" else 1
    for step in range(4):
        opt.zero_grad()
        for m in range(micro):
            key = step * micro + m
            if m < micro - 1:
                with ddp.no_sync():
                    _loss(ddp, key, ctx.rank, used(step, ctx.rank)).backward()
            else:
                _loss(ddp, key, ctx.rank, used(step, ctx.rank)).backward()
        ref_opt.zero_grad()
        for r in range(ctx.world_size):
            for m in range(micro):
                (_loss(ref, step * micro + m, r, used(step, r)) / ctx.world_size).backward()
        if case == "unused" and step == 1:  # used nowhere: .grad stays None, as torch's DDP leaves it
            assert model.items.weight.grad is None and ref.items.weight.grad is None
        else:
            grad = model.items.weight.grad
            assert grad.is_sparse and grad.is_coalesced()
            torch.testing.assert_close(grad.to_dense(), ref.items.weight.grad.to_dense(), **TOL)
        # Tied: autograd summed the sparse and the dense gradient into a dense one; it stays dense.
        assert model.users.weight.grad.is_sparse == (case != "tied")
        opt.step()
        ref_opt.step()
        _assert_same_params(model, ref, step, **TOL)


@multi_rank
@pytest.mark.parametrize("case", ["unused", "tied", "no_sync"])
def test_sparse_gradients_equal_one_process(world_size, case):
    _pool("torchpar", world_size).run(_vs_one_process, case)


def _uneven_inputs(ctx):
    """join(): rank 0 runs out of batches one step early and shadows the last step with an
    empty sparse gradient; every rank ends with the others' average (its share zero)."""
    _setup(ctx)
    model, ref = _Recommender(), _Recommender()
    ddp = DDP(model, process_group=ctx.pg)
    opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    steps = lambda rank: 2 if rank == 0 else 3  # noqa: E731
    with ddp.join():
        for step in range(steps(ctx.rank)):
            opt.zero_grad()
            _loss(ddp, step, ctx.rank).backward()
            opt.step()
    for step in range(3):
        ref_opt.zero_grad()
        for r in range(ctx.world_size):
            if step < steps(r):
                (_loss(ref, step, r) / ctx.world_size).backward()
        ref_opt.step()
    _assert_same_params(model, ref, "end", **TOL)


def test_uneven_inputs_under_join_reduce_empty_sparse_shares():
    _pool("torchpar", 2).run(_uneven_inputs)


def _sharded(ctx):
    with pytest.raises(RuntimeError,
                       match=r"'users.weight' gets sparse gradients .*shard_gradients=True"):
        DDP(_Recommender(), process_group=ctx.pg, shard_gradients=True)
    dist.barrier(group=ctx.pg)  # every rank raised and the group still works


def test_sparse_gradients_with_shard_gradients_are_refused_on_every_rank():
    _pool("torchpar", 2).run(_sharded)


def _pipelined(ctx, backend, name):
    """pp=2 x dp=2 (test_pipeline's groups), the sparse table on stage 0, every stage a DDP:
    armed, so its reducer reduces in the last backward (1F1B; find_unused_parameters=True is
    what lets the executor arm it), or averaged after the step (ZB-H1, whose weight passes run
    after the last backward). Gradients equal one process's on the whole batch."""
    _setup(ctx)
    pp, dp = _pp_by_dp(ctx, backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM, sparse=True), nn.Flatten(), nn.Linear(2 * DIM, 8), nn.Tanh(),
                          nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    parts = [nn.Sequential(*list(copy.deepcopy(model))[:3]), nn.Sequential(*list(copy.deepcopy(model))[3:])]
    stage_index = ctx.rank % 2
    ddp = DDP(parts[stage_index], process_group=dp, find_unused_parameters=True)
    schedule = SCHEDULES[name](PipelineStage(ddp, stage_index, 2, group=pp), 4, loss_fn=_mse)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randint(VOCAB, (16, 2), generator=g), torch.randn(16, 1, generator=g)
    _mse(ref(x), y).backward()
    xs, ys = x.chunk(2)[ctx.rank // 2], y.chunk(2)[ctx.rank // 2]
    schedule.step(*((xs,) if stage_index == 0 else ()), target=ys if stage_index == 1 else None)
    ref_part = list(ref)[:3] if stage_index == 0 else list(ref)[3:]
    ref_params = [p for m in ref_part for p in m.parameters()]
    for (pname, p), q in zip(ddp.module.named_parameters(), ref_params):
        assert p.grad.is_sparse == q.grad.is_sparse, pname
        torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{pname}: {m}")


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_a_pipeline_stage_with_a_sparse_table_equals_one_process(name):
    _pool("torchpar", 4).run(_pipelined, "torchpar", name)
