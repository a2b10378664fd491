"""``split`` of a whole model with a block list (torch.fx around the blocks; issue 18): chained,
the stages compute the model; under every schedule on 2 ranks, the losses and gradients equal
one process's; bad models are refused with the reason."""
import copy

import pytest
import torch
from torch import nn

import torchpar
from harness import get_pool
from torchpar.models.gpt import GPT, GPTConfig
from torchpar.parallel.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                        ScheduleZeroBubble, pipeline, split)
from torchpar.parallel.pipeline.split import split_boundaries

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "zb_h1": ScheduleZeroBubble}


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)
        self.identity = False

    def forward(self, x):
        if self.identity and x.sum() > 0:  # a branch on a tensor: blocks are not traced
            return x
        return x + torch.tanh(self.fc(self.ln(x)))


class Tiny(nn.Module):
    """Embedding + a learned position table (a bare parameter), blocks, a head; ``skip``: the
    head also reads the embedding's output, a value that crosses every stage boundary."""

    def __init__(self, vocab=11, d=8, n=4, skip=False, ids_to_head=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(16, d))
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.skip = skip
        # The head also reads the token ids: a tensor without gradient crosses every boundary,
        # ahead of the activations in the stages' outputs (review: it took their gradient).
        self.ids_to_head = ids_to_head
        self.bias_table = nn.Parameter(torch.randn(vocab, vocab)) if ids_to_head else None

    def forward(self, idx):
        t = idx.shape[1]
        x = x0 = self.emb(idx) + self.pos[:t]
        for block in self.blocks:
            x = block(x)
        if self.skip:
            x = x + x0
        out = self.head(self.ln_f(x))
        if self.ids_to_head:
            out = out + self.bias_table[idx]
        return out


def _chain(stages, *inputs):
    out = inputs
    for st in stages:
        out = st(*out)
        out = out if isinstance(out, tuple) else (out,)
    return out[0] if len(out) == 1 else out


@pytest.mark.parametrize("skip", [False, True], ids=["chain", "skip"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_stages_chained_compute_the_model_and_partition_its_parameters(n, skip):
    model = Tiny(skip=skip)
    idx = torch.randint(11, (3, 5))
    stages = [split(model, n, s) for s in range(n)]
    torch.testing.assert_close(_chain(stages, idx), model(idx), rtol=0, atol=0)
    ids = [id(p) for st in stages for p in st.parameters()]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    # Names as in the model (checkpoints move by name); the first stage has the embeddings, the
    # last the head.
    keys = [k for st in stages for k in st.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())
    assert "emb.weight" in stages[0].state_dict() and "head.weight" in stages[-1].state_dict()
    # A value read two stages later passes through the stage between.
    if skip and n >= 3:
        assert len(_chain(stages[:2], idx)) == 2


def test_gradients_through_chained_stages_equal_the_model():
    model, ref = Tiny(skip=True), Tiny(skip=True)
    idx = torch.randint(11, (3, 5))
    _chain([split(model, 3, s) for s in range(3)], idx).square().mean().backward()
    ref(idx).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_split_points_name_the_first_block_of_each_stage():
    model = Tiny(n=5)
    for points in (["blocks.3"], ["3"]):
        first, second = split(model, 2, 0, split_points=points), split(model, 2, 1, split_points=points)
        assert {k.split(".")[1] for k in first.state_dict() if k.startswith("blocks.")} == {"0", "1", "2"}
        assert {k.split(".")[1] for k in second.state_dict() if k.startswith("blocks.")} == {"3", "4"}
    assert split_boundaries([str(i) for i in range(5)], 3) == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="'blocks.9' is not a layer name"):
        split(model, 2, 0, split_points=["blocks.9"])
    with pytest.raises(ValueError, match="increasing order"):
        split(model, 3, 0, split_points=["3", "2"])
    with pytest.raises(ValueError, match="need 1 split points"):
        split(model, 2, 0, split_points=["1", "2"])


def test_the_project_gpt_splits_and_its_tied_embeddings_are_refused():
    model = GPT(GPTConfig.tiny())
    idx = torch.randint(256, (16, 3))
    for n in (2, 4):
        torch.testing.assert_close(_chain([split(model, n, s) for s in range(n)], idx), model(idx), rtol=0, atol=0)
    tied = GPT(GPTConfig.tiny(tie_embeddings=True))
    with pytest.raises(ValueError, match="'tok_emb.weight' = 'lm_head.weight' is used by stages \\[0, 1\\]"):
        split(tied, 2, 1)
    split(tied, 1, 0)  # one stage holds both


class _Reversed(Tiny):
    def forward(self, idx):
        x = self.emb(idx)
        for block in reversed(self.blocks):
            x = block(x)
        return self.head(x)


class _Twice(Tiny):
    def forward(self, idx):
        x = self.emb(idx)
        for block in list(self.blocks) * 2:
            x = block(x)
        return self.head(x)


class _NotAll(Tiny):
    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks[:2]:
            x = block(x)
        return self.head(x)


class _NormAfterEveryBlock(Tiny):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(5, affine=False)  # state (running statistics), no parameter

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = self.norm(block(x))
        return self.head(x)


class _Constant(Tiny):
    def forward(self, idx):
        x = self.emb(idx) * torch.tensor([2.0]) + self.pos[:idx.shape[1]]  # a constant fx stores
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def test_what_split_leaves_of_the_model_and_its_stages():
    """The user's model is not modified (fx stores tensor constants on what it traces; a
    frozen BatchNorm stays in eval mode), and a stage's state_dict holds only the model's keys."""
    model = _Constant()
    model.ln_f.eval()
    attrs = set(vars(model))
    stages = [split(model, 2, s) for s in range(2)]
    assert set(vars(model)) == attrs and not model.ln_f.training
    merged = {k: v for st in stages for k, v in st.state_dict().items()}
    model.load_state_dict(merged)  # strict: no key the model lacks
    idx = torch.randint(11, (3, 5))
    torch.testing.assert_close(_chain(stages, idx), model(idx), rtol=0, atol=0)


class _LengthToTheHead(Tiny):
    def forward(self, idx):
        t = idx.shape[1]  # an int the head reads: it would have to cross the boundary
        x = self.emb(idx) + self.pos[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))[:, :t]


class _BranchOnData(Tiny):
    def forward(self, idx):
        x = self.emb(idx)
        if x.mean() > 0:
            x = -x
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_bad_models_are_refused_with_the_reason():
    idx = torch.randint(11, (3, 5))
    first = split(_LengthToTheHead(), 2, 0)
    with pytest.raises(TypeError, match=r"hands 'getitem = getitem\(getattr_1, 1\)' to a later stage, but it is a int"):
        first(idx)
    with pytest.raises(TypeError, match="cannot trace _BranchOnData.forward"):
        split(_BranchOnData(), 2, 0)
    with pytest.raises(TypeError, match="neither an nn.Sequential nor a model with one list"):
        split(nn.Linear(2, 2), 2, 0)
    with pytest.raises(ValueError, match="block 'blocks.2' runs after 'blocks.3'"):
        split(_Reversed(), 2, 0)
    with pytest.raises(ValueError, match="block 'blocks.0' runs twice"):
        split(_Twice(), 2, 0)
    with pytest.raises(ValueError, match=r"does not run the blocks \['blocks.2', 'blocks.3'\]"):
        split(_NotAll(), 2, 0)
    with pytest.raises(ValueError, match=r"module 'norm' runs in stages \[0, 1\]"):
        split(_NormAfterEveryBlock(), 2, 0)


# ---- under the schedules, 2 ranks ----

def _pipeline_equals_one_process(ctx, name, variant):
    torch.set_num_threads(1)
    v = 2 if name == "interleaved" else 1
    n = 2 * v
    model = Tiny(n=2 * n, skip=variant == "skip", ids_to_head=variant == "ids_to_head")
    ref = copy.deepcopy(model)
    stages = [PipelineStage(split(model, n, s), s, n) for s in range(ctx.rank, n, 2)]
    cls = SCHEDULES[name]

    def loss_fn(logits, target):
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    sched = cls(stages, 4, loss_fn=loss_fn) if v > 1 else cls(stages[0], 4, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(1)
    idx, target = torch.randint(11, (8, 6), generator=g), torch.randint(11, (8, 6), generator=g)
    losses = []
    sched.step(*((idx,) if stages[0].is_first else ()), target=target if stages[-1].is_last else None,
               losses=losses)
    want = [loss_fn(ref(i), t) for i, t in zip(idx.chunk(4), target.chunk(4))]
    sum(want).div(4).backward()
    if stages[-1].is_last:
        torch.testing.assert_close(torch.stack(losses), torch.stack(want).detach(), rtol=1e-6, atol=1e-6)
    for st in stages:
        for key, p in st.submod.named_parameters():
            q = ref.get_parameter(key)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("variant", ["chain", "skip", "ids_to_head"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_split_model_under_every_schedule_equals_one_process(name, variant):
    if not hasattr(torchpar._C, "ProcessGroupTorchpar"):
        pytest.skip("the torchpar backend is not built in this tree")
    get_pool(2, "torchpar").run(_pipeline_equals_one_process, name, variant)


# ---- torch's front end: pipeline(module, mb_args, split_spec).build_stage(...) ----

def _torch_front_end(ctx, where):
    from torch.distributed.pipelining import SplitPoint
    torch.set_num_threads(1)
    model = Tiny(n=4)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    idx, target = torch.randint(11, (8, 6), generator=g), torch.randint(11, (8, 6), generator=g)
    spec = {"blocks.1": SplitPoint.END} if where == "end" else {"blocks.2": SplitPoint.BEGINNING}
    pipe = pipeline(model, mb_args=(idx[:2],), split_spec=spec)
    assert pipe.num_stages == 2
    stage = pipe.build_stage(ctx.rank, torch.device("cpu"), ctx.pg)

    def loss_fn(logits, t):
        return nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten())
    Schedule1F1B(stage, 4, loss_fn=loss_fn).step(*((idx,) if ctx.rank == 0 else ()),
                                                 target=target if ctx.rank == 1 else None)
    sum(loss_fn(ref(i), t) for i, t in zip(idx.chunk(4), target.chunk(4))).div(4).backward()
    names = [key for key, _ in stage.submod.named_parameters()]
    assert any(f"blocks.{1 + ctx.rank}." in key for key in names)  # blocks 0-1 on rank 0, 2-3 on rank 1
    for key, p in stage.submod.named_parameters():
        torch.testing.assert_close(p.grad, ref.get_parameter(key).grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["beginning", "end"])
def test_torch_pipeline_front_end_builds_the_stages_split_would(where):
    if not hasattr(torchpar._C, "ProcessGroupTorchpar"):
        pytest.skip("the torchpar backend is not built in this tree")
    get_pool(2, "torchpar").run(_torch_front_end, where)


def test_torch_pipeline_front_end_refuses_what_it_cannot_cut():
    from torch.distributed.pipelining import SplitPoint
    with pytest.raises(ValueError, match="not a layer of Tiny"):
        pipeline(Tiny(), (), split_spec={"emb": SplitPoint.BEGINNING})
    with pytest.raises(ValueError, match="leaves an empty stage"):
        pipeline(Tiny(n=4), (), split_spec={"blocks.3": SplitPoint.END})
    with pytest.raises(ValueError, match="first layer"):
        pipeline(Tiny(n=4), (), split_spec={"blocks.0": SplitPoint.BEGINNING})
    with pytest.raises(ValueError, match="two split points cut before 'blocks.2'"):
        pipeline(Tiny(n=4), (), split_spec={"blocks.1": SplitPoint.END, "blocks.2": SplitPoint.BEGINNING})
    with pytest.raises(NotImplementedError, match="split_policy"):
        pipeline(Tiny(), (), split_policy=lambda gm: gm)


def test_a_sequential_stage_keeps_the_models_layer_names():
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    assert list(split(model, 2, 1).state_dict()) == ["2.weight", "2.bias", "3.weight", "3.bias"]
