"""A small GPT written with plain nn modules, made tensor-parallel by
torchpar.parallel.parallelize (issue 17): its logits, loss and every gradient equal the
dense model's, with and without sequence parallelism, float32 and bfloat16; ten optimizer
steps equal the dense model's ten; a bad plan is an error naming the entry; and tp=2 x dp=2
on 4 ranks (our DDP over the dp groups) trains like one process.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import get_pool
from torchpar.parallel import DistributedDataParallel as DDP
from torchpar.parallel import parallelize
from torchpar.parallel.tensor import vocab_parallel_cross_entropy
from tp_util import (BACKENDS, GPT, dense_loss, expected_param_grads, gpt_plan, group_for, new_groups,
                     tolerances)

VOCAB, SEQ, BATCH = 32, 8, 2


def _data(step, batch=BATCH):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (SEQ, batch), generator=g)
    return idx, torch.randint(0, VOCAB, (SEQ, batch), generator=g)


def _models(group, sp, dtype, fused_qkv=False):
    torch.manual_seed(0)
    dense = GPT(VOCAB, fused_qkv=fused_qkv).to(dtype)
    tp_model = parallelize(copy.deepcopy(dense), gpt_plan(sp, fused_qkv), group)
    return dense, tp_model


def _gpt_grads(ctx, backend, sp, dtype, fused_qkv=False):
    torch.set_num_threads(1)
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    dense, model = _models(group, sp, dtype, fused_qkv)
    idx, target = _data(0)
    want_logits = dense(idx)
    dense_loss(want_logits, target).backward()
    logits = model(idx)
    tol = tolerances(dtype)
    torch.testing.assert_close(logits.float(), want_logits.chunk(tp, -1)[rank].float(), **tol)
    loss = vocab_parallel_cross_entropy(logits, target, group)
    torch.testing.assert_close(loss, dense_loss(want_logits, target), **tol)
    loss.backward()
    for name, p, q, shard in expected_param_grads(model, dense, rank, tp):
        torch.testing.assert_close(p.grad.float(), shard(q.grad).float(), **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parallelized_gpt_equals_dense(world_size, backend, sp, dtype):
    get_pool(world_size).run(_gpt_grads, backend, sp, dtype)


# ---- a fused q/k/v projection (one nn.Linear(h, 3h), GPT-2's c_attn): plan style "colwise:3" ----

@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parallelized_fused_qkv_gpt_equals_dense(world_size, backend, sp):
    """Each rank's shard of qkv is its heads' q, k and v: logits, loss and every gradient (qkv's
    compared block by block) equal the dense model's."""
    get_pool(world_size).run(_gpt_grads, backend, sp, torch.float32, True)


def _fused_qkv_round_trip_and_naive_split(ctx, backend):
    torch.set_num_threads(1)
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    dense, model = _models(group, False, torch.float32, fused_qkv=True)
    for i, block in enumerate(model.blocks):
        qkv = dense.blocks[i].attn.qkv
        back = block.attn.qkv.to_dense()
        assert torch.equal(back.weight, qkv.weight) and torch.equal(back.bias, qkv.bias)
        q, k, v = qkv.weight.chunk(3)
        assert torch.equal(block.attn.qkv.weight, torch.cat([t.chunk(tp)[rank] for t in (q, k, v)]))
    # A plain "colwise" split of the concatenation gives rank 0 all of q and half of k: wrong.
    naive_plan = {**gpt_plan(False, fused_qkv=True), "blocks.*.attn.qkv": "colwise"}
    naive = parallelize(copy.deepcopy(dense), naive_plan, group)
    idx, _ = _data(0)
    want = dense(idx).chunk(tp, -1)[rank]
    assert torch.allclose(model(idx), want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(naive(idx), want, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_qkv_round_trips_exactly_and_naive_colwise_does_not_match(backend):
    get_pool(2).run(_fused_qkv_round_trip_and_naive_split, backend)


def _gpt_training(ctx, backend, sp, steps):
    torch.set_num_threads(1)
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    dense, model = _models(group, sp, torch.float32)
    # SGD with momentum, not Adam: the key bias's gradient is exactly zero in exact arithmetic
    # (softmax ignores a constant per query), so both runs hold rounding noise there, which
    # Adam's normalisation would blow up into different steps.
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    ref_opt = torch.optim.SGD(dense.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for step in range(steps):
        idx, target = _data(step)
        opt.zero_grad()
        loss = vocab_parallel_cross_entropy(model(idx), target, group)
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref = dense_loss(dense(idx), target)
        ref.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step} loss: {m}")
        losses.append(loss.item())
    for name, p, q, shard in expected_param_grads(model, dense, rank, tp):
        torch.testing.assert_close(p, shard(q), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} after {steps} steps: {m}")
    return losses


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ten_sgd_steps_equal_dense(backend, sp):
    losses = get_pool(2).run(_gpt_training, backend, sp, 10)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]


def _bad_plans(ctx, backend):
    group = group_for(ctx, backend)
    model = GPT(VOCAB)
    messages = []
    for plan, exc in (({"blocks.*.mlp.fc3": "colwise"}, ValueError),
                      ({"blocks.*.mlp": "colwise"}, TypeError),
                      ({"tok_emb": "rowwise"}, TypeError),
                      ({"blocks.*.attn.q_proj": "sequence"}, TypeError),
                      ({"lm_head": "diagonal"}, ValueError),
                      ({"blocks.*.attn.q_proj": "colwise:0"}, ValueError),
                      ({"blocks.*.attn.q_proj": "rowwise:2"}, ValueError),
                      # q_proj's 16 outputs are not 3 equal blocks
                      ({"blocks.*.attn.q_proj": "colwise:3"}, ValueError),
                      # two entries giving one module different styles: not "the last one wins"
                      ({"blocks.*.mlp.fc1": "colwise", "blocks.0.mlp.fc1": "rowwise"}, ValueError)):
        with pytest.raises(exc) as info:
            parallelize(model, plan, group)
        messages.append(str(info.value))
    assert all(isinstance(m, nn.Linear) for m in (model.lm_head, model.blocks[0].mlp.fc1))  # untouched
    return messages


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_plan_names_the_entry(backend):
    for messages in get_pool(2).run(_bad_plans, backend):
        assert "'blocks.*.mlp.fc3'" in messages[0] and "matches no module" in messages[0]
        assert "'blocks.0.mlp'" in messages[1] and "MLP" in messages[1]
        assert "'tok_emb'" in messages[2] and "Embedding" in messages[2]
        assert "'blocks.0.attn.q_proj'" in messages[3] and "Linear" in messages[3]
        assert "'diagonal'" in messages[4]
        assert "'colwise:0'" in messages[5] and "colwise:N" in messages[5], messages[5]
        assert "'rowwise:2'" in messages[6]
        assert "3 equal fused blocks" in messages[7] and "(16)" in messages[7], messages[7]
        assert "'blocks.0.mlp.fc1'" in messages[8] and "'blocks.*.mlp.fc1'" in messages[8], messages[8]


# ---- tp=2 x dp=2 on 4 ranks: tp inner (ranks 2d, 2d+1), dp outer; groups from explicit
# new_group calls on each backend, or from torch's init_device_mesh ----

def _tp_dp_training(ctx, backend, sp, steps):
    torch.set_num_threads(1)
    if backend == "device_mesh":  # torch's 2-D mesh over the default (torchpar) group
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    else:
        tp_group = new_groups([[0, 1], [2, 3]], backend)
        dp_group = new_groups([[0, 2], [1, 3]], backend)
    assert dist.get_process_group_ranks(tp_group) == ([0, 1] if dist.get_rank() < 2 else [2, 3])
    tp_rank, dp_rank = dist.get_rank(tp_group), dist.get_rank(dp_group)
    torch.manual_seed(0)
    dense = GPT(VOCAB)
    model = DDP(parallelize(copy.deepcopy(dense), gpt_plan(sp), tp_group), process_group=dp_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(dense.parameters(), lr=0.5)
    for step in range(steps):
        idx, target = _data(step, batch=4)
        mine = slice(2 * dp_rank, 2 * dp_rank + 2)  # this dp rank's half of the batch (dim 1)
        opt.zero_grad()
        vocab_parallel_cross_entropy(model(idx[:, mine]), target[:, mine], tp_group).backward()
        opt.step()
        ref_opt.zero_grad()
        dense_loss(dense(idx), target).backward()
        ref_opt.step()
    for name, p, q, shard in expected_param_grads(model.module, dense, tp_rank, 2):
        torch.testing.assert_close(p, shard(q), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} after {steps} steps: {m}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("backend", BACKENDS + ["device_mesh"])
def test_tp2_dp2_with_ddp_trains_like_one_process(backend, sp):
    get_pool(4).run(_tp_dp_training, backend, sp, 3)


# ---- tied weights (GPT-2's lm_head.weight is tok_emb.weight) ----

def _tied_gpt(ctx, backend):
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    dense = GPT(VOCAB)
    dense.lm_head.weight = dense.tok_emb.weight
    model = parallelize(copy.deepcopy(dense), gpt_plan(False), group)
    # The vocab embedding and the colwise head shard the same rows: the tie survives.
    assert model.lm_head.weight is model.tok_emb.weight
    idx, target = _data(0)
    dense_loss(dense(idx), target).backward()
    vocab_parallel_cross_entropy(model(idx), target, group).backward()
    torch.testing.assert_close(model.tok_emb.weight.grad, dense.tok_emb.weight.grad.chunk(tp, 0)[rank],
                               **tolerances(torch.float32))
    # A weight shared by modules sharded differently (or one not sharded) cannot stay tied.
    bad = GPT(VOCAB)
    bad.blocks[1].attn.q_proj.weight = bad.blocks[0].attn.q_proj.weight
    with pytest.raises(ValueError, match="shared") as info:
        parallelize(bad, {"blocks.0.attn.q_proj": "colwise"}, group)
    return str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parallelize_keeps_tied_weights(backend):
    for message in get_pool(2).run(_tied_gpt, backend):
        assert "'blocks.0.attn.q_proj'" in message and "'blocks.1.attn.q_proj'" in message, message
