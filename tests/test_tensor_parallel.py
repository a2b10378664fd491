"""Tensor-parallel layers (issue 17) against the dense single-process modules they are sharded
from: outputs and every gradient (input, weights, biases), with and without sequence
parallelism, float32 and bfloat16, on the torchpar backend and on gloo, at tp = 1, 2, 4.

Every rank builds the dense module from the same seed and computes the dense result itself;
the tensor-parallel module is made with from_dense, and its results must equal the dense
ones (or this rank's shard of them).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from harness import get_pool
from torchpar import _C
from torchpar.parallel.tensor import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention,
                                      RowParallelLinear, VocabParallelEmbedding,
                                      linear_with_async_comm, vocab_parallel_cross_entropy)
from tp_util import BACKENDS, group_for, seq_shard, tolerances

# tp=1 needs its own one-rank pool; 2 and 4 are the multi-rank cases.
WORLD_SIZES = [1, 2, 4]
DTYPES = [torch.float32, torch.bfloat16]


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _close(name, got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), **tolerances(dtype), msg=lambda m: f"{name}: {m}")


def _check_linears(group, rank, tp, sp, dtype):
    s, b, h_in, h_out = 8, 2, 12, 16
    torch.manual_seed(0)
    dense = nn.Linear(h_in, h_out, dtype=dtype)
    x = torch.randn(s, b, h_in, dtype=dtype)
    gout = torch.randn(s, b, h_out, dtype=dtype)
    xd = _leaf(x)
    dense(xd).backward(gout)

    # Column: output features split; the output gathered unless sequence-parallel.
    col = ColumnParallelLinear.from_dense(dense, group, gather_output=not sp, sequence_parallel=sp)
    xt = _leaf(seq_shard(x, rank, tp) if sp else x)
    out = col(xt)
    want = dense(x) if not sp else dense(x).chunk(tp, -1)[rank]
    _close("column output", out, want, dtype)
    out.backward(gout if not sp else gout.chunk(tp, -1)[rank])
    _close("column input grad", xt.grad, seq_shard(xd.grad, rank, tp) if sp else xd.grad, dtype)
    _close("column weight grad", col.weight.grad, dense.weight.grad.chunk(tp, 0)[rank], dtype)
    _close("column bias grad", col.bias.grad, dense.bias.grad.chunk(tp, 0)[rank], dtype)

    # Column with stride 2 (two fused blocks, a gate/up projection): block i's slice r on rank
    # r, gathered back in the dense order.
    fused = ColumnParallelLinear.from_dense(dense, group, gather_output=not sp, sequence_parallel=sp, stride=2)
    xt = _leaf(seq_shard(x, rank, tp) if sp else x)
    out = fused(xt)
    want = dense(x) if not sp else torch.cat([b.chunk(tp, -1)[rank] for b in dense(x).chunk(2, -1)], -1)
    _close("column stride 2 output", out, want, dtype)
    out.backward(gout if not sp else torch.cat([b.chunk(tp, -1)[rank] for b in gout.chunk(2, -1)], -1))
    _close("column stride 2 input grad", xt.grad, seq_shard(xd.grad, rank, tp) if sp else xd.grad, dtype)
    _close("column stride 2 weight grad", fused.weight.grad,
           torch.cat([b.chunk(tp, 0)[rank] for b in dense.weight.grad.chunk(2, 0)]), dtype)

    # Row: input features split; output all-reduced (or reduce-scattered along the sequence).
    row = RowParallelLinear.from_dense(dense, group, sequence_parallel=sp)
    xt = _leaf(x.chunk(tp, -1)[rank])
    out = row(xt)
    _close("row output", out, seq_shard(dense(x), rank, tp) if sp else dense(x), dtype)
    out.backward(seq_shard(gout, rank, tp) if sp else gout)
    _close("row input grad", xt.grad, xd.grad.chunk(tp, -1)[rank], dtype)
    _close("row weight grad", row.weight.grad, dense.weight.grad.chunk(tp, 1)[rank], dtype)
    _close("row bias grad", row.bias.grad, dense.bias.grad, dtype)

    # Row with a full input (input_is_parallel=False, split inside), not sequence-parallel.
    row = RowParallelLinear.from_dense(dense, group, input_is_parallel=False)
    xt = _leaf(x)
    out = row(xt)
    _close("row(full input) output", out, dense(x), dtype)
    out.backward(gout)
    _close("row(full input) input grad", xt.grad, xd.grad, dtype)

    # to_dense round trip.
    for layer in (col, fused, row):
        back = layer.to_dense()
        assert torch.equal(back.weight, dense.weight) and torch.equal(back.bias, dense.bias)


def _check_embedding(group, rank, tp, sp, dtype):
    s, b, vocab, h = 8, 2, 16, 6
    torch.manual_seed(1)
    dense = nn.Embedding(vocab, h, dtype=dtype)
    idx = torch.randint(0, vocab, (s, b))
    gout = torch.randn(s, b, h, dtype=dtype)
    dense(idx).backward(gout)
    emb = VocabParallelEmbedding.from_dense(dense, group, sequence_parallel=sp)
    out = emb(idx)
    _close("embedding output", out, seq_shard(dense(idx), rank, tp) if sp else dense(idx), dtype)
    out.backward(seq_shard(gout, rank, tp) if sp else gout)
    _close("embedding weight grad", emb.weight.grad, dense.weight.grad.chunk(tp, 0)[rank], dtype)
    assert torch.equal(emb.to_dense().weight, dense.weight)


def _check_cross_entropy(group, rank, tp, dtype):
    s, b, vocab = 6, 3, 16
    torch.manual_seed(2)
    logits = torch.randn(s, b, vocab, dtype=dtype) * 3
    target = torch.randint(0, vocab, (s, b))
    target[0, 0] = target[3, 2] = -100
    target[1, 1] = 7
    for smoothing in (0.0, 0.1):
        for reduction in ("mean", "sum", "none"):
            ld = _leaf(logits)
            want = F.cross_entropy(ld.float().flatten(0, 1), target.flatten(), label_smoothing=smoothing,
                                   reduction=reduction)
            want = want.view(s, b) if reduction == "none" else want
            g = torch.randn_like(want)
            want.backward(g)
            lt = _leaf(logits.chunk(tp, -1)[rank])
            got = vocab_parallel_cross_entropy(lt, target, group, label_smoothing=smoothing, reduction=reduction)
            what = f"cross entropy (smoothing {smoothing}, {reduction})"
            _close(what, got, want, dtype)
            got.backward(g)
            _close(what + " grad", lt.grad, ld.grad.chunk(tp, -1)[rank], dtype)


def _check_mlp(group, rank, tp, sp, dtype):
    s, b, h = 8, 2, 8
    torch.manual_seed(3)
    dense = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(dtype)
    x, r = torch.randn(s, b, h, dtype=dtype), torch.randn(s, b, h, dtype=dtype)
    gout = torch.randn(s, b, h, dtype=dtype)
    xd, rd = _leaf(x), _leaf(r)
    (dense(xd) + rd).backward(gout)
    mlp = ParallelMLP.from_dense(dense, group, sequence_parallel=sp)
    shard = (lambda t: seq_shard(t, rank, tp)) if sp else (lambda t: t)
    xt, rt = _leaf(shard(x)), _leaf(shard(r))
    out = mlp(xt, residual=rt)  # fused bias+GeLU, fused bias+dropout+add
    _close("mlp output", out, shard(dense(x) + r), dtype)
    out.backward(shard(gout))
    _close("mlp input grad", xt.grad, shard(xd.grad), dtype)
    _close("mlp residual grad", rt.grad, shard(rd.grad), dtype)
    _close("mlp fc1 weight grad", mlp.fc1.weight.grad, dense[0].weight.grad.chunk(tp, 0)[rank], dtype)
    _close("mlp fc1 bias grad", mlp.fc1.bias.grad, dense[0].bias.grad.chunk(tp, 0)[rank], dtype)
    _close("mlp fc2 weight grad", mlp.fc2.weight.grad, dense[2].weight.grad.chunk(tp, 1)[rank], dtype)
    _close("mlp fc2 bias grad", mlp.fc2.bias.grad, dense[2].bias.grad, dtype)
    back = mlp.to_dense()
    for got, want in zip(back.parameters(), dense.parameters()):
        assert torch.equal(got, want)


def _check_attention(group, rank, tp, sp, dtype):
    s, b, h, heads = 8, 2, 16, 4
    torch.manual_seed(4)
    dense = nn.MultiheadAttention(h, heads, dtype=dtype)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)  # True: not attended
    x = torch.randn(s, b, h, dtype=dtype)
    gout = torch.randn(s, b, h, dtype=dtype)
    xd = _leaf(x)
    dense(xd, xd, xd, attn_mask=mask, need_weights=False)[0].backward(gout)
    attn = ParallelSelfAttention.from_dense(dense, group, sequence_parallel=sp)
    shard = (lambda t: seq_shard(t, rank, tp)) if sp else (lambda t: t)
    xt = _leaf(shard(x))
    out = attn(xt)
    with torch.no_grad():
        want = dense(x, x, x, attn_mask=mask, need_weights=False)[0]
    _close("attention output", out, shard(want), dtype)
    out.backward(shard(gout))
    _close("attention input grad", xt.grad, shard(xd.grad), dtype)
    # qkv rows of this rank's heads: q, k and v each split by heads.
    wq, wk, wv = dense.in_proj_weight.grad.chunk(3, 0)
    want_qkv = torch.cat([t.chunk(tp, 0)[rank] for t in (wq, wk, wv)])
    _close("attention qkv weight grad", attn.qkv.weight.grad, want_qkv, dtype)
    bq, bk, bv = dense.in_proj_bias.grad.chunk(3, 0)
    _close("attention qkv bias grad", attn.qkv.bias.grad, torch.cat([t.chunk(tp, 0)[rank] for t in (bq, bk, bv)]), dtype)
    _close("attention proj weight grad", attn.proj.weight.grad, dense.out_proj.weight.grad.chunk(tp, 1)[rank], dtype)
    _close("attention proj bias grad", attn.proj.bias.grad, dense.out_proj.bias.grad, dtype)
    back = attn.to_dense()
    got = dict(back.named_parameters())
    for name, want in dense.named_parameters():
        assert torch.equal(got[name], want), name


def _all_layers(ctx, backend, dtype):
    torch.set_num_threads(1)
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    for sp in (False, True):
        _check_linears(group, rank, tp, sp, dtype)
        _check_embedding(group, rank, tp, sp, dtype)
        _check_mlp(group, rank, tp, sp, dtype)
        _check_attention(group, rank, tp, sp, dtype)
    _check_cross_entropy(group, rank, tp, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layers_equal_dense(world_size, backend, dtype):
    get_pool(world_size).run(_all_layers, backend, dtype)


# ---- the overlap of the input gradient's reduction with the weight gradient ----

def _trace_column_backward(ctx, backend, sp, overlap):
    torch.set_num_threads(1)
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    dense = nn.Linear(8, 16)
    x = torch.randn(4, 2, 8)
    layer = ColumnParallelLinear.from_dense(dense, group, sequence_parallel=sp)
    out = linear_with_async_comm(_leaf(seq_shard(x, rank, tp) if sp else x), layer.weight, layer.bias,
                                 group, sequence_parallel=sp, overlap=overlap)
    _C.tp_set_tracing(True)
    out.sum().backward()
    trace = _C.tp_trace()
    _C.tp_set_tracing(False)
    return trace


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sp", [False, True], ids=["allreduce", "sequence_parallel"])
def test_backward_overlaps_input_grad_reduction_with_weight_grad(backend, sp):
    what = "reduce_scatter grad_input" if sp else "all_reduce grad_input"
    for trace in get_pool(2).run(_trace_column_backward, backend, sp, True):
        events = [e for e in trace if e[1] != "all_gather input"]
        # Launched before the weight-gradient matmul begins, waited for only after it ends.
        assert events == [("launch", what), ("wgrad_begin", ""), ("wgrad_end", ""), ("wait", what),
                          ("done", what)], trace
        if sp:  # the input, not kept from forward, is gathered again while grad_input is computed
            assert trace[:3] == [("launch", "all_gather input"), ("wait", "all_gather input"),
                                 ("done", "all_gather input")], trace
    for trace in get_pool(2).run(_trace_column_backward, backend, sp, False):
        events = [e for e in trace if e[1] != "all_gather input"]
        assert events == [("launch", what), ("wait", what), ("done", what), ("wgrad_begin", ""),
                          ("wgrad_end", "")], trace


# ---- bad input: a clear error on every rank, before any collective, and the group lives on ----

def _errors(ctx, backend):
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    messages = []

    def expect(exc, fn):
        with pytest.raises(exc) as info:
            fn()
        messages.append(str(info.value))

    expect(ValueError, lambda: ColumnParallelLinear(8, 7, group=group))
    expect(ValueError, lambda: RowParallelLinear(9, 8, group=group))
    expect(ValueError, lambda: VocabParallelEmbedding(15, 8, group))
    expect(ValueError, lambda: ParallelSelfAttention(12, 3, group=group))
    expect(ValueError, lambda: ParallelMLP(8, 31, group=group))
    # Sequence length differing across ranks: caught by the shape check, not a hang.
    col = ColumnParallelLinear(8, 8, group=group)
    expect(ValueError, lambda: col(torch.randn(4 + 2 * rank, 2, 8)))
    col_sp = ColumnParallelLinear(8, 8, sequence_parallel=True, group=group)
    expect(ValueError, lambda: col_sp(torch.randn(2 + rank, 2, 8)))
    emb = VocabParallelEmbedding(16, 8, group, sequence_parallel=True)
    expect(ValueError, lambda: emb(torch.zeros(3, 2, dtype=torch.long)))  # 3 tokens over 2 ranks
    expect(ValueError, lambda: emb(torch.zeros(2 + 2 * rank, 2, dtype=torch.long)))
    logits = torch.randn(4 + rank, 8)
    expect(ValueError, lambda: vocab_parallel_cross_entropy(logits, torch.zeros(4 + rank, dtype=torch.long), group))
    # The group still works.
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    assert t.tolist() == [tp] * 3
    return messages


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_on_every_rank(backend):
    per_rank = get_pool(2).run(_errors, backend)
    for messages in per_rank:
        assert "out_features (7)" in messages[0] and "(2)" in messages[0], messages[0]
        assert "in_features (9)" in messages[1]
        assert "num_embeddings" in messages[2] and "(15)" in messages[2]
        assert "num_attention_heads (3)" in messages[3]
        assert "ffn_hidden_size (31)" in messages[4]
        assert "different sizes" in messages[5] and "rank 0: [4, 2, 8]" in messages[5] and "rank 1: [6, 2, 8]" in messages[5]
        assert "different sizes" in messages[6]
        assert "sequence length" in messages[7] and "(3, 2)" in messages[7]
        assert "different sizes" in messages[8]
        assert "different sizes" in messages[9]


# ---- review findings: each case below failed before its fix ----

def _all_targets_ignored(ctx, backend):
    # A micro-batch of padding only: F.cross_entropy's mean is nan (0/0) but its gradient is
    # zero; a nan gradient here would poison every weight after one step.
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(5)
    logits, target = torch.randn(4, 8), torch.full((4,), -100)
    for smoothing in (0.0, 0.1):
        ld = _leaf(logits)
        want = F.cross_entropy(ld, target, label_smoothing=smoothing)
        want.backward()
        lt = _leaf(logits.chunk(tp, -1)[rank])
        got = vocab_parallel_cross_entropy(lt, target, group, label_smoothing=smoothing)
        assert got.isnan() and want.isnan()
        got.backward()
        assert torch.equal(lt.grad, ld.grad.chunk(tp, -1)[rank]), lt.grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_all_targets_ignored_has_zero_grad(backend):
    get_pool(2).run(_all_targets_ignored, backend)


def _mlp_from_dense_other_activation(ctx, backend):
    # from_dense must compute the dense module's function or refuse: ParallelMLP's activation is
    # the exact (erf) GeLU, so a ReLU or tanh-GeLU MLP is an error, not a silent substitution.
    group = group_for(ctx, backend)
    for act in (nn.ReLU(), nn.GELU(approximate="tanh"), nn.SiLU()):
        dense = nn.Sequential(nn.Linear(8, 16), act, nn.Linear(16, 8))
        with pytest.raises(TypeError, match=type(act).__name__):
            ParallelMLP.from_dense(dense, group)
    ParallelMLP.from_dense(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 8)), group)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mlp_from_dense_refuses_other_activations(backend):
    get_pool(2).run(_mlp_from_dense_other_activation, backend)


def _megatron_init_method(ctx):
    """Megatron's init_method fills the whole weight (the same draws on every rank) before it is
    split; biases start at zero, as Megatron's."""
    init = lambda w: nn.init.normal_(w, std=0.02, generator=torch.Generator().manual_seed(5))  # noqa: E731
    col = ColumnParallelLinear(8, 16, group=ctx.pg, init_method=init)
    row = RowParallelLinear(16, 8, group=ctx.pg, init_method=init)
    emb = VocabParallelEmbedding(32, 8, ctx.pg, init_method=init)
    for layer, shape, dim in ((col, (16, 8), 0), (row, (8, 16), 1), (emb, (32, 8), 0)):
        full = torch.empty(shape)
        init(full)
        torch.testing.assert_close(layer.weight, full.chunk(2, dim)[ctx.rank])
    assert not col.bias.any() and not row.bias.any()


def test_megatron_init_method_initialises_the_whole_weight_then_splits_it():
    get_pool(2).run(_megatron_init_method)


def _row_sequence_mismatch(ctx, backend):
    # A RowParallelLinear used on its own (input_is_parallel=True, its default): ranks whose
    # sequence lengths differ used to reach the all-reduce / reduce-scatter with different sizes
    # (gloo aborts the process). Inside ParallelMLP / ParallelSelfAttention the column layer
    # before it has checked the same sizes already.
    group = group_for(ctx, backend)
    rank = dist.get_rank(group)
    messages = []
    for sp in (False, True):
        row = RowParallelLinear(8, 8, group=group, sequence_parallel=sp)
        with pytest.raises(ValueError, match="different sizes") as info:
            row(torch.randn(4 + 2 * rank, 2, 4))
        messages.append(str(info.value))
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    return messages


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_linear_sequence_mismatch_raises_on_every_rank(backend):
    for messages in get_pool(2).run(_row_sequence_mismatch, backend):
        assert all("RowParallelLinear input" in m and "rank 1: [6, 2, 4]" in m for m in messages), messages


def _attention_from_dense_add_zero_attn(ctx, backend):
    # add_zero_attn appends a zero key and value that ParallelSelfAttention does not have: the
    # shard would compute other numbers than the dense module, so from_dense must refuse it.
    group = group_for(ctx, backend)
    with pytest.raises(TypeError, match="add_zero_attn"):
        ParallelSelfAttention.from_dense(nn.MultiheadAttention(8, 2, add_zero_attn=True), group)


@pytest.mark.parametrize("backend", ["torchpar"])
def test_attention_from_dense_refuses_add_zero_attn(backend):
    get_pool(2).run(_attention_from_dense_add_zero_attn, backend)


def _cross_entropy_target_mismatch_on_one_rank(ctx, backend):
    # Only rank 1's target disagrees with its logits: it used to raise alone, before the shape
    # check's collective, leaving rank 0 inside it. Every rank must raise, and the group live on.
    group = group_for(ctx, backend)
    rank = dist.get_rank(group)
    with pytest.raises(ValueError, match="target") as info:
        vocab_parallel_cross_entropy(torch.randn(4, 8), torch.zeros(4 + rank, dtype=torch.long), group)
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    return str(info.value)


@pytest.mark.parametrize("backend", ["torchpar"])  # gloo aborts the process on the old mismatch
def test_cross_entropy_target_mismatch_on_one_rank_raises_everywhere(backend):
    for message in get_pool(2).run(_cross_entropy_target_mismatch_on_one_rank, backend):
        assert "different sizes" in message and "rank 1: [5]" in message, message


def _cross_entropy_target_out_of_range(ctx, backend):
    # F.cross_entropy raises for a target outside [0, V); the vocabulary-parallel loss used to
    # count it as a logit of 0 on every rank and return a finite, meaningless loss.
    group = group_for(ctx, backend)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    target = torch.tensor([1, 40, -100, 3])
    with pytest.raises(IndexError, match="40"):
        vocab_parallel_cross_entropy(torch.randn(4, 16).chunk(tp, -1)[rank], target, group)
    t = torch.ones(3)
    dist.all_reduce(t, group=group)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_target_out_of_range_raises(backend):
    get_pool(2).run(_cross_entropy_target_out_of_range, backend)


def _embedding_id_out_of_range(ctx, backend, sequence_parallel):
    # nn.Embedding raises for an id outside [0, V); no rank held it, so the sum was a row of zeros.
    group = group_for(ctx, backend)
    emb = VocabParallelEmbedding(16, 4, group, sequence_parallel=sequence_parallel)
    for bad in (16, -1):
        with pytest.raises(IndexError, match=f"token id {bad} is out of range for the vocabulary of 16"):
            emb(torch.tensor([[1, 2], [bad, 3]]))
    t = torch.ones(3)
    dist.all_reduce(t, group=group)  # the group goes on
    return emb(torch.tensor([[1, 2], [15, 0]])).shape


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_embedding_id_out_of_range_raises_on_every_rank(sequence_parallel):
    shapes = get_pool(2).run(_embedding_id_out_of_range, "torchpar", sequence_parallel)
    assert shapes == [(1, 2, 4) if sequence_parallel else (2, 2, 4)] * 2
