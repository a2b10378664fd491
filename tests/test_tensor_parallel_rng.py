"""Dropout under tensor parallelism (issue 17): torchpar.parallel.tensor.random, Megatron's RNG
tracker. Masks on activations split across the tensor-parallel ranks (each rank's heads, sequence
shards) differ between ranks; masks on replicated activations are the same on every rank; a fork
leaves the default generator as if nothing had been drawn inside it; torch.utils.checkpoint's
recomputation draws the same masks again; with dropout 0 the parallel model still equals the
dense one.

A mask is read off an output: with a residual r, ``r + dropout(y)`` equals r exactly where the
mask dropped y, and (almost surely) nowhere else.
"""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from harness import get_pool
from torchpar.models import GPT, GPTConfig
from torchpar.models.parallel_gpt import tensor_parallel_plan
from torchpar.nn import functional as TF
from torchpar.parallel import parallelize
from torchpar.parallel.tensor import (ParallelMLP, ParallelSelfAttention, get_rng_tracker,
                                      mark_sequence_parallel, model_parallel_seed,
                                      vocab_parallel_cross_entropy)
from torchpar.parallel.tensor.random import RNGStatesTracker
from tp_util import BACKENDS, group_for, seq_shard

# ---- the tracker alone (one process) ----


def _draw():
    return torch.empty((), dtype=torch.int64).random_()


def test_add_refuses_a_name_or_seed_twice_and_fork_an_unknown_name():
    tracker = RNGStatesTracker()
    tracker.add("a", 5)
    with pytest.raises(ValueError, match="'a' is already added"):
        tracker.add("a", 6)
    with pytest.raises(ValueError, match="seed 5 is already used"):
        tracker.add("b", 5)
    with pytest.raises(RuntimeError, match="'b' is not added.*model_parallel_seed"):
        with tracker.fork("b"):
            pass
    assert tracker.get_states() == {"a": 5}
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.set_states({"c": 9})
    assert tracker.get_states() == {"c": 9}


def test_fork_restores_the_default_generator_whatever_it_draws_inside():
    tracker = RNGStatesTracker()
    tracker.add("mp", 1234)
    torch.manual_seed(0)
    _draw()  # the one draw that keys a fork, the same on every rank
    want_state, want_next = torch.get_rng_state(), torch.rand(8)
    x = torch.ones(64, 8)
    for draws_inside in (lambda: None, lambda: torch.rand(1000),
                         lambda: F.dropout(x, 0.5), lambda: TF.bias_dropout_add(x, x[0], x, 0.5)):
        torch.manual_seed(0)
        with tracker.fork("mp"):
            draws_inside()
        assert torch.equal(torch.get_rng_state(), want_state)
        assert torch.equal(torch.rand(8), want_next)
    # and when the region raises
    torch.manual_seed(0)
    with pytest.raises(KeyError):
        with tracker.fork("mp"):
            torch.rand(10)
            raise KeyError("inside")
    assert torch.equal(torch.get_rng_state(), want_state)
    assert not torch.cuda.is_initialized()  # a CPU process never touches CUDA


def test_fork_streams_depend_on_the_seed_and_the_default_generator_only():
    a, b = RNGStatesTracker(), RNGStatesTracker()
    a.add("mp", 2718)
    b.add("mp", 2719)  # the next tp rank's seed

    def inside(tracker, seed):
        torch.manual_seed(seed)
        with tracker.fork("mp"):
            first = torch.rand(16)
        with tracker.fork("mp"):
            second = torch.rand(16)
        return first, second

    first, second = inside(a, 0)
    again = inside(a, 0)
    assert torch.equal(first, again[0]) and torch.equal(second, again[1])  # reproducible
    assert not torch.equal(first, second)  # two forks: two streams
    assert not torch.equal(first, inside(b, 0)[0])  # another rank's seed: another stream
    assert not torch.equal(first, inside(a, 1)[0])  # another default state: another stream
    torch.manual_seed(0)
    assert not torch.equal(first, torch.rand(16))  # not the default stream


def test_fork_swaps_and_restores_the_cuda_generator_once_cuda_is_initialised(monkeypatch):
    # No GPU here: a CPU generator stands in for the current device's CUDA generator, and the
    # torch.cuda calls fork makes say that CUDA is initialised.
    gpu = torch.Generator().manual_seed(11)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "default_generators", (gpu,))
    tracker = RNGStatesTracker()
    tracker.add("mp", 5)
    before = gpu.get_state()
    torch.manual_seed(0)
    with tracker.fork("mp"):
        cpu_inside, gpu_inside = torch.rand(8), torch.rand(8, generator=gpu)
        torch.rand(100, generator=gpu)
    assert torch.equal(gpu.get_state(), before)
    assert torch.equal(cpu_inside, gpu_inside)  # both keyed alike
    torch.manual_seed(0)
    with tracker.fork("mp"):
        assert torch.equal(torch.rand(8, generator=gpu), gpu_inside)  # reproducible
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with tracker.fork("mp"):
            pass


def test_fork_keys_the_fused_bias_dropout_add():
    tracker = RNGStatesTracker()
    tracker.add("mp", 77)
    x, r = torch.randn(32, 16), torch.randn(32, 16)
    bias = torch.zeros(16)
    masks = []
    for forked in (False, True, True):
        torch.manual_seed(3)
        with tracker.fork("mp") if forked else contextlib.nullcontext():
            masks.append(TF.bias_dropout_add(x, bias, r, 0.5) != r)
    assert not torch.equal(masks[0], masks[1]) and torch.equal(masks[1], masks[2])


# ---- masks across the ranks of a group ----

def _gather(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _same_everywhere(t, group):
    parts = _gather(t, group)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def _all_different(t, group):
    parts = _gather(t, group)
    return all(not torch.equal(parts[i], parts[j]) for i in range(len(parts)) for j in range(i))


def _identical_heads_attention(h, heads, **kw):
    # Every head has the same q/k/v weights, so each rank's heads compute the same numbers and
    # only the dropout masks can tell them apart.
    dense = nn.MultiheadAttention(h, heads)
    with torch.no_grad():
        d = h // heads
        for w in dense.in_proj_weight.view(3, heads, d, h):
            w.copy_(w[0].expand_as(w))
        dense.in_proj_bias.zero_()
    return dense


class _Dropout(nn.Module):
    """A plain module of a user's model whose dropout acts on whatever it is given."""

    def forward(self, x):
        return F.dropout(x, 0.5, self.training)


def _masks(ctx, backend):
    torch.set_num_threads(1)
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    s, b, h, heads = 8, 2, 16, tp
    torch.manual_seed(5)
    x, r = torch.randn(s, b, h), torch.randn(s, b, h)  # the same on every rank (replicated)
    model_parallel_seed(1234, group)
    found = {}
    for sp in (False, True):
        xs, rs = (seq_shard(x, rank, tp), seq_shard(r, rank, tp)) if sp else (x, r)
        dense_mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
        mlp = ParallelMLP.from_dense(dense_mlp, group, sequence_parallel=sp, dropout=0.5)
        found[f"mlp fused, sp={sp}"] = mlp(xs, residual=rs) != rs  # bias+dropout+add kernel
        mlp.fc2.bias = None
        found[f"mlp unfused, sp={sp}"] = mlp(xs) != 0  # F.dropout
        attn = ParallelSelfAttention.from_dense(_identical_heads_attention(h, heads), group,
                                                sequence_parallel=sp, dropout=0.5)
        found[f"attention output, sp={sp}"] = attn(xs, residual=rs) != rs
        attn.attention_dropout = 0.5
        probs = []
        attn.proj.register_forward_pre_hook(lambda m, args: probs.append(args[0]))
        attn(xs)
        found[f"attention probabilities, sp={sp}"] = probs[0]
    found["sequence-parallel nn.Dropout"] = mark_sequence_parallel(nn.Dropout(0.5), group)(torch.ones(s, b, h)) != 0
    found["plain nn.Dropout"] = nn.Dropout(0.5)(torch.ones(s, b, h)) != 0
    user = parallelize(nn.ModuleDict({"split": _Dropout(), "replicated": _Dropout()}),
                       {"split": "model_parallel_rng"}, group)
    found["parallelize model_parallel_rng"] = user["split"](torch.ones(s, b, h)) != 0
    found["parallelize, no entry"] = user["replicated"](torch.ones(s, b, h)) != 0
    user.eval()  # no dropout, no fork
    assert torch.equal(user["split"](x), x)
    split = {k for k in found if "sp=True" in k or "probabilities" in k or "sequence-parallel" in k
             or "model_parallel_rng" in k}
    result = {k: (_all_different(m, group) if k in split else _same_everywhere(m, group)) for k, m in found.items()}
    # The default generators stayed in lockstep: replicated masks drawn after all this agree too.
    result["default generator in lockstep afterwards"] = _same_everywhere(torch.rand(16), group)
    # A fork needs model_parallel_seed; replicated dropout does not.
    get_rng_tracker().reset()
    with pytest.raises(RuntimeError, match="model_parallel_seed"):
        mlp(xs, residual=rs)
    ParallelMLP.from_dense(dense_mlp, group, dropout=0.5)(x, residual=r)
    return result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_split_activations_get_masks_of_their_own_replicated_ones_the_same(world_size, backend):
    for result in get_pool(world_size).run(_masks, backend):
        wrong = [k for k, ok in result.items() if not ok]
        assert not wrong, wrong


# ---- recomputation (torch.utils.checkpoint) draws the same masks ----

def _run_layers(attn, mlp, x, how):
    def block(x):
        y = attn(x, residual=x)
        return mlp(y, residual=y)

    for p in (*attn.parameters(), *mlp.parameters()):
        p.grad = None
    x = x.detach().requires_grad_(True)
    model_parallel_seed(42, attn.group)
    if how == "none":
        out = block(x)
    else:  # "reentrant", "non-reentrant", or "no rng" (a control: recompute draws new masks)
        out = checkpoint(block, x, use_reentrant=how == "reentrant", preserve_rng_state=how != "no rng")
    out.square().sum().backward()
    return out.detach(), [x.grad] + [p.grad for p in (*attn.parameters(), *mlp.parameters())]


def _recompute(ctx, backend):
    torch.set_num_threads(1)
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    s, b, h = 8, 2, 16
    torch.manual_seed(0)
    dense_attn, dense_mlp = nn.MultiheadAttention(h, 4, dropout=0.3), nn.Sequential(
        nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
    x = torch.randn(s, b, h)
    out = {}
    for sp in (False, True):
        attn = ParallelSelfAttention.from_dense(dense_attn, group, sequence_parallel=sp, dropout=0.3)
        mlp = ParallelMLP.from_dense(dense_mlp, group, sequence_parallel=sp, dropout=0.3)
        xs = seq_shard(x, rank, tp) if sp else x
        want, want_grads = _run_layers(attn, mlp, xs, "none")
        for how in ("reentrant", "non-reentrant", "no rng"):
            got, grads = _run_layers(attn, mlp, xs, how)
            same = torch.equal(got, want) and all(torch.allclose(g, w, rtol=1e-5, atol=1e-6)
                                                  for g, w in zip(grads, want_grads))
            out[f"{how}, sp={sp}"] = same
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_recompute_draws_the_same_masks(backend):
    for result in get_pool(2).run(_recompute, backend):
        for name, same in result.items():
            # Without preserve_rng_state the recomputation draws other masks: the gradients then
            # differ, which shows the comparison can see a wrong mask.
            assert same == (not name.startswith("no rng")), (name, result)


# ---- torchpar.models.GPT through tensor_parallel_plan: recompute modes agree, dropout 0 is dense ----

CFG = GPTConfig.tiny(layers=2, dropout=0.2)


def _gpt_step(model, idx, target, group, seed):
    model.zero_grad(set_to_none=True)
    model_parallel_seed(seed, group)
    loss = vocab_parallel_cross_entropy(model(idx), target, group)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _gpt_recompute(ctx, backend, sp):
    torch.set_num_threads(1)
    group = group_for(ctx, backend)
    torch.manual_seed(0)
    dense = GPT(CFG)
    model = parallelize(copy.deepcopy(dense), tensor_parallel_plan(sp), group)
    g = torch.Generator().manual_seed(1)
    idx, target = (torch.randint(0, CFG.vocab_size, (CFG.seq_len, 2), generator=g) for _ in range(2))
    results = {}
    for mode in ("none", "selective", "full"):
        model.set_recompute(mode)
        results[mode] = _gpt_step(model, idx, target, group, seed=9)
    loss, grads = results["none"]
    for mode in ("selective", "full"):
        torch.testing.assert_close(results[mode][0], loss, rtol=0, atol=0, msg=lambda m: f"{mode} loss: {m}")
        for n, grad in grads.items():
            torch.testing.assert_close(results[mode][1][n], grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{mode} {n}: {m}")
    # Dropout is on: another seed is another loss.
    model.set_recompute("none")
    assert _gpt_step(model, idx, target, group, seed=10)[0] != loss
    # With dropout 0 (in training mode, forks and all) the parallel model is the dense one.
    for m in (*dense.modules(), *model.modules()):
        if hasattr(m, "dropout"):
            m.dropout = 0.0
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    want = dense(idx)
    F.cross_entropy(want.flatten(0, 1), target.flatten()).backward()
    torch.testing.assert_close(model(idx), want.chunk(tp, -1)[rank], rtol=1e-4, atol=1e-5)
    _, grads = _gpt_step(model, idx, target, group, seed=9)
    torch.testing.assert_close(grads["pos_emb.weight"], dense.pos_emb.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["blocks.0.ln1.weight"], dense.blocks[0].ln1.weight.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_recompute_reproduces_dropout_and_dropout_zero_equals_dense(backend, sp):
    get_pool(2).run(_gpt_recompute, backend, sp)


# ---- pipeline stages: Megatron's 100 * pp_rank offset ----

def _stage_masks(ctx, backend, with_pp_group):
    """4 ranks as 2 pipeline stages x 2 tp ranks: rank = 2 * stage + tp rank. One mask from the
    default stream (replicated activations), one from the model-parallel stream (split ones),
    each a fused bias+dropout+add and an F.dropout, gathered from every rank."""
    torch.set_num_threads(1)
    kw = {} if backend == "torchpar" else {"backend": "gloo"}
    tp_groups = [dist.new_group([0, 1], **kw), dist.new_group([2, 3], **kw)]
    pp_groups = [dist.new_group([0, 2], **kw), dist.new_group([1, 3], **kw)]
    stage, t = divmod(ctx.rank, 2)
    model_parallel_seed(1234, tp_groups[stage], pp_group=pp_groups[t] if with_pp_group else None)
    seeds = get_rng_tracker().get_states()
    expect = torch.Generator().manual_seed(1234 + (100 * stage if with_pp_group else 0))
    x, r = torch.ones(4, 2, 32), torch.zeros(4, 2, 32)
    default_stream_ok = torch.equal(torch.rand(8), torch.rand(8, generator=expect))

    def masks():  # F.dropout, and the fused kernel (its Philox key: one draw)
        return torch.cat([F.dropout(x, 0.5).flatten(), TF.bias_dropout_add(x, x[0, 0], r, 0.5, True).flatten()])

    replicated = masks()
    with get_rng_tracker().fork():
        split = masks()
    world = group_for(ctx, backend)
    return (seeds, default_stream_ok, _gather((replicated != 0).to(torch.uint8), world),
            _gather((split != 0).to(torch.uint8), world))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipeline_stages_draw_masks_of_their_own(backend):
    """With ``pp_group``: the default stream is ``seed + 100 * stage`` (Megatron's
    _set_random_seed), the same on the tp ranks of a stage and another on each stage; the
    model-parallel stream ``seed + 100 * stage + 2718 + tp rank``, a stream per rank. Without
    it (the seeding before), the stages repeat each other's masks in both streams."""
    for rank, (seeds, default_ok, replicated, split) in enumerate(
            get_pool(4).run(_stage_masks, backend, True)):
        stage, t = divmod(rank, 2)
        assert seeds == {"model-parallel-rng": 1234 + 100 * stage + 2718 + t}
        assert default_ok, f"rank {rank}: the default generator is not seeded 1234 + 100 * {stage}"
        assert torch.equal(replicated[0], replicated[1]) and torch.equal(replicated[2], replicated[3])
        assert not torch.equal(replicated[0], replicated[2])
        assert all(not torch.equal(split[i], split[j]) for i in range(4) for j in range(i))
    for seeds, default_ok, replicated, split in get_pool(4).run(_stage_masks, backend, False):
        assert default_ok
        assert all(torch.equal(replicated[0], m) for m in replicated)  # every stage the same masks
        assert torch.equal(split[0], split[2]) and torch.equal(split[1], split[3])
