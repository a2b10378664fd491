"""``torchpar.parallel.parallelize_module`` with torch's own plan (``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``) against torch's ``parallelize_module`` with the same
plan, in the same ranks (torch's on a gloo mesh): the same local outputs, gradients and weights,
with and without sequence parallelism; what torchpar's layers do not compute is refused.
"""
import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel)
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module
from torch.nn import functional as F

from harness import get_pool
from torchpar.parallel import parallelize_module
from tp_util import BACKENDS, group_for


class _Net(nn.Module):
    """Token embedding, a LayerNorm'd MLP with a residual, a final norm and a head; [s, b] ids."""

    def __init__(self, vocab=16, hidden=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(h))))
        return self.head(self.ln_f(h))


def _plan(sequence_dim, gathered_head=False):
    """torch's plan for _Net: without sequence parallelism (None), or with it on ``sequence_dim``
    (0: [s, b, h], Megatron's; 1: [b, s, h], torch's default); the head's logits sharded, or
    gathered whole (torchtitan's head without loss parallelism)."""
    head_out = Replicate() if gathered_head else Shard(-1)
    if sequence_dim is None:
        return {"emb": RowwiseParallel(input_layouts=Replicate()), "fc1": ColwiseParallel(),
                "fc2": RowwiseParallel(), "head": ColwiseParallel(output_layouts=head_out)}
    seq = Shard(sequence_dim)
    return {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "ln": SequenceParallel(sequence_dim=sequence_dim), "fc1": ColwiseParallel(input_layouts=seq),
            "fc2": RowwiseParallel(output_layouts=seq), "ln_f": SequenceParallel(sequence_dim=sequence_dim),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=head_out)}


def _local(t, like=None):
    """A DTensor's local part (laid out as ``like``, a parameter, where given: a gradient may
    come back in another placement)."""
    if not isinstance(t, DTensor):
        return t
    return (t.redistribute(t.device_mesh, like.placements) if like is not None else t).to_local()


def _like_torch(ctx, backend, sequence_dim, gathered_head):
    torch.set_num_threads(1)
    group = group_for(ctx, backend)
    ours, theirs = _Net(), _Net()
    plan = _plan(sequence_dim, gathered_head)
    with torch.no_grad():  # the planned modules start apart on each rank, alike on both stacks:
        for m in (ours, theirs):  # src_data_rank=0 (both stacks' default) takes rank 0's
            g = torch.Generator().manual_seed(100 + ctx.rank)
            # (torch's SequenceParallel takes each rank's norm as it is: those start alike)
            for name in (n for n, style in plan.items() if not isinstance(style, SequenceParallel)):
                for p in m.get_submodule(name).parameters():
                    p.add_(torch.randn(p.shape, generator=g) * ctx.rank)
    parallelize_module(ours, DeviceMesh.from_group(group, "cpu"), plan)
    torch_parallelize_module(theirs, DeviceMesh.from_group(ctx.gloo, "cpu"), _plan(sequence_dim, gathered_head))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    idx = torch.randint(0, 16, (6, 2), generator=torch.Generator().manual_seed(1))  # [s, b]
    if sequence_dim == 1:
        idx = idx.t().contiguous()  # [b, s]
    for step in range(2):
        outs = []
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            out = m(idx)
            outs.append(out)
            out.pow(2).mean().backward()  # a local loss of each rank's logits shard, the same on both
        torch.testing.assert_close(outs[0], _local(outs[1]), rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, _local(q.grad, q), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step}, {name}.grad: {m}")
        for opt in opts:
            opt.step()
    return [tuple(p.shape) for p in ours.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sequence_dim,gathered_head", [(None, False), (0, False), (1, False), (None, True),
                                                        (1, True)],
                         ids=["tp", "tp-sp-seq-first", "tp-sp-batch-first", "tp-gathered", "tp-sp-batch-first-gathered"])
def test_torch_plan_computes_what_torch_parallelize_module_computes(backend, sequence_dim, gathered_head):
    shapes = get_pool(2, "torchpar").run(_like_torch, backend, sequence_dim, gathered_head)[0]
    assert shapes[0] == (8, 8) and shapes[3] == (16, 8)  # the vocabulary and fc1's outputs split in two


def _loss_parallel_like_torch(ctx, backend, sequence_dim):
    """torchtitan's head for loss parallelism: ColwiseParallel(output_layouts=Shard(-1),
    use_local_output=False) gives vocabulary-sharded DTensor logits, and torch's loss_parallel()
    takes the cross entropy over them without gathering; the loss and every gradient as torch's
    stack computes them, and the loss as one process computes it."""
    torch.set_num_threads(1)
    dense, ours, theirs = _Net(), _Net(), _Net()

    def plan():
        p = _plan(sequence_dim)
        p["head"] = ColwiseParallel(input_layouts=p["head"].input_layouts[0], output_layouts=Shard(-1),
                                    use_local_output=False)
        return p
    parallelize_module(ours, DeviceMesh.from_group(group_for(ctx, backend), "cpu"), plan())
    torch_parallelize_module(theirs, DeviceMesh.from_group(ctx.gloo, "cpu"), plan())
    gen = torch.Generator().manual_seed(1)
    idx, target = torch.randint(0, 16, (6, 2), generator=gen), torch.randint(0, 16, (6, 2), generator=gen)
    if sequence_dim == 1:
        idx, target = idx.t().contiguous(), target.t().contiguous()
    expected = F.cross_entropy(dense(idx).flatten(0, 1), target.flatten())
    losses = []
    for m in (ours, theirs):
        out = m(idx)
        assert isinstance(out, DTensor) and out.placements == (Shard(2),), out
        with loss_parallel():
            loss = F.cross_entropy(out.flatten(0, 1), target.flatten())
            loss.backward()
        losses.append(loss.full_tensor())
    torch.testing.assert_close(losses[0], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses[1], expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, _local(q.grad, q), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sequence_dim", [None, 1], ids=["tp", "tp-sp-batch-first"])
def test_dtensor_logits_for_torch_loss_parallel_as_torch_computes_them(backend, sequence_dim):
    get_pool(2, "torchpar").run(_loss_parallel_like_torch, backend, sequence_dim)


def _dtensor_in_and_out(ctx):
    """A DTensor input is laid out as the layer takes it (here replicated, made Shard(-1)); with
    use_local_output=False the output is a DTensor placed as output_layouts; the gradient flows
    back through both to the caller's tensor."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dense = nn.Linear(4, 6)
    mesh = DeviceMesh.from_group(ctx.pg, "cpu")
    tp = parallelize_module(copy.deepcopy(dense), mesh, RowwiseParallel(use_local_output=False))
    x = torch.randn(3, 4, requires_grad=True)
    out = tp(DTensor.from_local(x, mesh, (Replicate(),), run_check=False))
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    expected_x = x.detach().clone().requires_grad_()
    expected = dense(expected_x)
    torch.testing.assert_close(out.to_local(), expected)
    out.to_local().pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, expected_x.grad)


def test_a_dtensor_input_and_a_dtensor_output_on_request():
    get_pool(2, "torchpar").run(_dtensor_in_and_out)


class _SwiGLU(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(hidden, 4 * hidden), nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    """torchtitan's shape: an MLP module whose input is gathered once (PrepareModuleInput) for
    its colwise layers, on [b, s, h] or [s, b, h]."""

    def __init__(self, vocab=16, hidden=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.mlp = _SwiGLU(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.mlp(self.norm(h))
        return self.out(h)


def _torchtitan_plan(d):
    seq = Shard(d)
    return {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "norm": SequenceParallel(sequence_dim=d),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=seq),
            "out": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}


def _torchtitan_like_torch(ctx, backend, d):
    torch.set_num_threads(1)
    ours, theirs = _Block(), _Block()
    parallelize_module(ours, DeviceMesh.from_group(group_for(ctx, backend), "cpu"), _torchtitan_plan(d))
    torch_parallelize_module(theirs, DeviceMesh.from_group(ctx.gloo, "cpu"), _torchtitan_plan(d))
    idx = torch.randint(0, 16, (6, 2), generator=torch.Generator().manual_seed(1))
    idx = idx.t().contiguous() if d == 1 else idx
    outs = [m(idx) for m in (ours, theirs)]
    torch.testing.assert_close(outs[0], _local(outs[1]), rtol=1e-5, atol=1e-6)
    for out in outs:
        _local(out).pow(2).mean().backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, _local(q.grad, q), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [0, 1], ids=["seq-first", "batch-first"])
def test_a_torchtitan_style_plan_with_prepare_module_input_computes_what_torch_computes(backend, d):
    get_pool(2, "torchpar").run(_torchtitan_like_torch, backend, d)


class _KeywordMLP(_Block):
    def forward(self, idx):
        h = self.emb(idx)
        return self.out(h + self.mlp(x=self.norm(h)))


def _keyword_input(ctx):
    torch.set_num_threads(1)
    model = parallelize_module(_KeywordMLP(), DeviceMesh.from_group(ctx.pg, "cpu"), _torchtitan_plan(1))
    with pytest.raises(ValueError, match="positional inputs only"):
        model(torch.randint(0, 16, (2, 6)))


def test_prepare_module_input_refuses_an_input_passed_by_keyword_on_every_rank():
    # It would go ungathered: the colwise layers would take a sequence shard for the whole (review finding).
    get_pool(2, "torchpar").run(_keyword_input)


REFUSED = {
    "sequence_dim 2": ({"ln": SequenceParallel(sequence_dim=2)}, "sequence on dimensions [2]"),
    "two sequence dims": ({"ln": SequenceParallel(sequence_dim=0), "ln_f": SequenceParallel()},
                          "sequence on dimensions [0, 1]"),
    "colwise embedding": ({"emb": ColwiseParallel()}, "embedding dimension"),
    "output on dim 0": ({"head": ColwiseParallel(output_layouts=Shard(0))}, "gathered whole (Replicate())"),
    "prepare output": ({"fc1": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))},
                       "PrepareModuleOutput is not supported"),
    "prepare input other": ({"fc1": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(0))},
                            "only a sequence shard"),
    "rowwise output on dim 2": ({"fc2": RowwiseParallel(output_layouts=Shard(2))}, "sequence on dimensions [2]"),
}


def _refused(ctx, case):
    plan, _ = REFUSED[case]
    model = _Net()
    before = copy.deepcopy(model.state_dict())
    try:
        parallelize_module(model, DeviceMesh.from_group(ctx.pg, "cpu"), plan)
    except NotImplementedError as e:
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing changed
        return str(e)
    return None


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_torchpar_layers_do_not_compute_is_refused_by_plan_entry(case):
    for err in get_pool(2, "torchpar").run(_refused, case):
        assert err and REFUSED[case][1] in err, err


def _bad_plan_after_broadcast_would_change(ctx, case):
    """Ranks that start apart keep their own weights when parallelize's own checks refuse the
    plan (the broadcast from src_data_rank comes after them; review finding)."""
    torch.manual_seed(ctx.rank)
    model = _Net()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(ctx.rank))
    if case == "tied":  # a weight shared by a planned module and an unplanned one
        model.head.weight = model.emb.weight
        plan = {"emb": RowwiseParallel(input_layouts=Replicate()), "fc1": ColwiseParallel()}
    else:  # a module the style does not take
        model.fc1 = nn.Conv1d(8, 32, 1)
        plan = {"fc1": ColwiseParallel(input_layouts=Shard(0)), "ln": SequenceParallel(sequence_dim=0)}
    before = copy.deepcopy(model.state_dict())
    with pytest.raises((ValueError, TypeError)):
        parallelize_module(model, DeviceMesh.from_group(ctx.pg, "cpu"), plan)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("case", ["tied", "wrong module"])
def test_a_plan_parallelize_refuses_changes_no_rank(case):
    get_pool(2, "torchpar").run(_bad_plan_after_broadcast_would_change, case)


def _whole_module(ctx):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dense = nn.Linear(4, 6)
    ref = copy.deepcopy(dense)
    tp = parallelize_module(dense, DeviceMesh.from_group(ctx.pg, "cpu"), ColwiseParallel())
    x = torch.randn(3, 4)
    torch.testing.assert_close(tp(x), ref(x).chunk(2, -1)[ctx.rank])


def test_a_style_for_the_module_itself_returns_its_parallel_form():
    get_pool(2, "torchpar").run(_whole_module)
