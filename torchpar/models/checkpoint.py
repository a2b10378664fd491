"""Sharded checkpoints of a ``ParallelGPT`` with ``torch.distributed.checkpoint`` (DCP) that
resume at any dp x tp x pp layout (issue 20).

The checkpoint speaks the dense model's language: every tensor is stored under the
single-process ``GPT``'s name (``model.blocks.3.attn.q_proj.weight``) and full shape, and the
optimizer state beside it (``optim.blocks.3.attn.q_proj.weight.exp_avg``), with a small record
of the model's config and the step. Each rank describes what it holds as boxes of those full
tensors (offsets and sizes) and writes them; DCP's planner drops the copies that replicas hold
(dp ranks under DDP, tp ranks for a LayerNorm) and checks that the boxes tile each tensor. On
load each rank asks for the boxes its own layout needs and DCP reads the overlapping parts of
whatever boxes were saved: that is the resharding.

What a rank holds of a parameter:

- tensor parallelism splits it evenly along one dim (found by comparing the local shape with
  the dense one): one box at ``tp_rank * local size`` along that dim;
- ``fully_shard`` keeps a contiguous run of the flattened (tp-local) parameter, which is a box
  only when it covers whole rows; a run is cut into at most two boxes per dimension (the partial
  rows at each end and the whole rows between);
- under O2 mixed precision with DDP the float32 master the optimizer steps is saved, not the
  16-bit copy, and loaded back into both;
- tied embeddings with pp > 1: the last stage's copy of the embedding (its ``lm_head.weight``)
  is the dense model's ``tok_emb.weight``, which the first stage saves; the copy is not saved
  again, and on load it reads ``tok_emb.weight`` (and that tensor's optimizer state).

The step counter is saved too; ``examples/train_gpt.py`` sets the learning rate from the step,
so the schedule resumes where it stopped. So is each rank's random state (dropout's streams: torch's
default generators and the model-parallel seeds of torchpar.parallel.tensor.random), restored when
every rank holds the place in the layout it held (dp, tp, pp, virtual stages) and forwards the same
micro-batches (the schedule, DDP or fully_shard, and recomputation may change), so that a resumed
run with dropout draws the masks the uninterrupted run would have drawn. Where the ranks' places
change, a rank's saved stream has no counterpart (each pipeline stage and tensor-parallel rank
draws its own), so they start afresh from the seed, as Megatron-LM ignores the RNG state when
the tensor or pipeline sizes change. A checkpoint of another model (any config field but
dropout differs) or another optimizer is refused by every rank before anything is read.
"""
import dataclasses
import json
import math
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from torchpar.models.gpt import GPT
from torchpar.optim.zero import ZeroRedundancyOptimizer
from torchpar.parallel.fsdp import FSDPModule
from torchpar.parallel.state_dict import runs_to_boxes
from torchpar.parallel.tensor.random import get_rng_tracker

META_KEY = "gpt_meta"
# Config fields that do not change the shape or meaning of any tensor: a checkpoint resumes
# with another value.
_FREE_CONFIG_FIELDS = {"dropout"}


# ---- what this rank holds, as boxes of the dense tensors ----

@dataclasses.dataclass
class _Held:
    """One tensor of the dense model as this rank holds it: ``tensor`` is the local values (a
    whole tp shard of shape ``local_shape``, or with ``flat_start`` the run of its flattening
    from there that fully_shard keeps), placed in the dense tensor at ``tp_offsets``."""
    tensor: torch.Tensor
    local_shape: tuple
    tp_offsets: tuple
    flat_start: int = None

    def boxes(self):
        """[(offsets in the dense tensor, view of the local values)]."""
        t = self.tensor
        if t.dim() == 0:  # a scalar of the optimizer state (Adam's step): held whole
            return [((), t)]
        if self.flat_start is None:
            return [(self.tp_offsets, t)]
        out, flat, pos = [], t.view(-1), 0
        for offsets, sizes in runs_to_boxes(self.local_shape, self.flat_start, self.flat_start + t.numel()):
            n = math.prod(sizes)
            out.append((tuple(a + b for a, b in zip(offsets, self.tp_offsets)), flat[pos:pos + n].view(sizes)))
            pos += n
        return out

    def like(self, tensor):
        """The same placement for a tensor of the optimizer state of the same shape."""
        return dataclasses.replace(self, tensor=tensor)


def _dense_shapes(config):
    with torch.device("meta"):
        model = GPT(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _tp_offsets(name, local_shape, dense_shape, tp_rank):
    if len(local_shape) != len(dense_shape):
        raise RuntimeError(f"checkpoint: '{name}' has local shape {list(local_shape)} but dense shape "
                           f"{list(dense_shape)}")
    split = [d for d, (a, b) in enumerate(zip(local_shape, dense_shape)) if a != b]
    if not split:
        return (0,) * len(dense_shape)
    d = split[0]
    if len(split) > 1 or dense_shape[d] % local_shape[d]:
        raise RuntimeError(f"checkpoint: '{name}' of local shape {list(local_shape)} is not an even split "
                           f"along one dim of its dense shape {list(dense_shape)}")
    return tuple(tp_rank * local_shape[d] if i == d else 0 for i in range(len(dense_shape)))


def _stepped(optimizer):
    """{id(parameter): the tensor the optimizer steps for it (its float32 master under O2, else
    itself)} for the parameters this rank's optimizer owns, and where their state lives."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return {id(p): m for p, m in optimizer.stepped_tensors()}, optimizer.optim.state
    return {id(p): p for g in optimizer.param_groups for p in g["params"]}, optimizer.state


def _held_parameters(trainer, with_copies=True):
    """[(dense name, parameter, the tensor the optimizer steps for it, _Held of that)] for this
    rank; ``with_copies=False`` leaves out the tied embedding's last-stage copy."""
    dense = _dense_shapes(trainer.config)
    stepped, _ = _stepped(trainer.optimizer)
    out = []
    for part in trainer.parts:
        shards = part.sharded_state_dict() if isinstance(part, FSDPModule) else None
        for local_name, p in part.named_parameters():
            copy = trainer.tied_copy and local_name == "lm_head.weight"  # the dense tok_emb.weight
            if copy and not with_copies:
                continue
            name = "tok_emb.weight" if copy else local_name
            if name not in dense:
                raise RuntimeError(f"checkpoint: the model holds '{name}', which the dense GPT has not")
            local_shape, start = tuple(p.shape), None
            if shards is not None:
                local_shape, start = tuple(shards[local_name].shape), shards[local_name].start
            offsets = _tp_offsets(name, local_shape, dense[name], trainer.tp_rank)
            s = stepped.get(id(p), p)
            out.append((name, p, s, _Held(s.detach(), local_shape, offsets, start)))
    return out


def _entries(trainer, with_optimizer, with_copies=True):
    """{checkpoint key: (dense shape, _Held)} for the model and, if asked, the optimizer state."""
    dense = _dense_shapes(trainer.config)
    _, state = _stepped(trainer.optimizer)
    out = {}
    for name, _, s, held in _held_parameters(trainer, with_copies):
        out[f"model.{name}"] = (dense[name], held)
        if not with_optimizer:
            continue
        for key, value in state.get(s, {}).items():
            if not torch.is_tensor(value):
                continue
            if value.dim() == 0:
                out[f"optim.{name}.{key}"] = ((), held.like(value))
            elif value.shape == held.tensor.shape:
                out[f"optim.{name}.{key}"] = (dense[name], held.like(value.detach()))
            else:
                raise NotImplementedError(f"checkpoint: optimizer state '{key}' of '{name}' has shape "
                                          f"{list(value.shape)}, neither a scalar nor the parameter's")
    return out


# ---- DCP planners over those boxes ----

def _box_table(entries):
    return {(key, tuple(offsets)): t for key, (_, held) in entries.items() for offsets, t in held.boxes()
            if t.numel() > 0}


class _SavePlanner(DefaultSavePlanner):
    """The default planner (it saves the meta record, drops duplicate boxes across ranks and
    checks the boxes tile each tensor) plus a write item per box this rank holds."""

    def __init__(self, entries):
        super().__init__()
        self.entries, self.table = entries, _box_table(entries)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for (key, offsets), t in self.table.items():
            size = torch.Size(self.entries[key][0])
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape)
            items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=chunk, size=size,
                                                               properties=TensorProperties.create_from_tensor(t))))
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def resolve_data(self, write_item):
        t = self.table.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        return super().resolve_data(write_item) if t is None else t


class _LoadPlanner(DefaultLoadPlanner):
    """Reads, for each box this rank needs, the overlapping parts of the saved boxes (DCP's
    resharding) straight into the model's and optimizer's tensors."""

    def __init__(self, entries):
        super().__init__()
        self.entries, self.table = entries, _box_table(entries)

    def create_local_plan(self):
        saved = self.metadata.state_dict_metadata
        chunks = {}
        for (key, offsets), t in self.table.items():
            chunks.setdefault(key, []).append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape))
        items = []
        for key, wanted in chunks.items():
            md = saved.get(key)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(self.entries[key][0]):
                raise ValueError(f"checkpoint: '{key}' is {_describe(md)} in the checkpoint, but this model "
                                 f"needs a tensor of shape {list(self.entries[key][0])}")
            items += create_read_items_for_chunk_list(key, md, wanted)
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.table[(index.fqn, tuple(index.offset or ()))]


def _describe(md):
    if md is None:
        return "missing"
    if isinstance(md, TensorStorageMetadata):
        return f"of shape {list(md.size)}"
    return "not a tensor"


# ---- random state: dropout's streams ----

def _rng_key(rank, what):
    return f"rng.rank{rank}.{what}"


def _rng_state(trainer):
    """{checkpoint key: tensor} of this rank's random state: what dropout draws from."""
    rank = dist.get_rank()
    out = {_rng_key(rank, "cpu"): torch.default_generator.get_state()}
    if trainer.device.type == "cuda" and torch.cuda.is_initialized():
        out[_rng_key(rank, "cuda")] = torch.cuda.get_rng_state(trainer.device)
    seeds = get_rng_tracker().get_states()
    if seeds:  # the model-parallel seeds differ by tensor-parallel rank and stage
        out[_rng_key(rank, "tracker")] = torch.tensor([seeds[k] for k in sorted(seeds)], dtype=torch.int64)
    return out


# The Layout fields that decide what each rank draws and in which order: its place in the mesh
# (dp, tp, pp, virtual stages), the micro-batches it forwards, which ops draw from the
# model-parallel stream (sequence parallelism), and the dtype of the tensors masks are drawn for.
# The others (schedule at the same stages: each stage forwards its micro-batches in order; DDP or
# fully_shard; recomputation, which torch.utils.checkpoint replays from saved generator states;
# resharding) change no draw: a resume may change them and keep the streams (review finding).
_RNG_LAYOUT_FIELDS = ("dp", "tp", "pp", "virtual_stages", "microbatches", "sequence_parallel", "dtype")


def _layout_record(trainer):
    return {**dataclasses.asdict(trainer.layout), "world_size": dist.get_world_size()}


def random_state_differences(meta, trainer):
    """The layout fields (and world size) that differ from those the checkpoint ``meta``
    describes was saved at and decide the ranks' random draws: ``["pp 2 -> 4", ...]``."""
    saved, now = meta.get("layout_record") or {}, _layout_record(trainer)
    return [f"{k} {saved.get(k)} -> {now[k]}" for k in (*_RNG_LAYOUT_FIELDS, "world_size") if saved.get(k) != now[k]]


def restores_random_state(meta, trainer):
    """Whether ``load_checkpoint`` puts back the random state saved in the checkpoint ``meta``
    describes: when every rank holds the place it held, forwarding the same micro-batches
    (``random_state_differences`` is empty)."""
    return "rng_streams" in meta and not random_state_differences(meta, trainer)


def _load_rng_state(path, trainer, meta):
    state = {k: torch.empty_like(v) for k, v in _rng_state(trainer).items()
             if not k.endswith(".cuda") or meta.get("rng_cuda")}
    dcp.load(state, checkpoint_id=path)
    rank = dist.get_rank()
    torch.default_generator.set_state(state[_rng_key(rank, "cpu")])
    if _rng_key(rank, "cuda") in state:
        torch.cuda.set_rng_state(state[_rng_key(rank, "cuda")], trainer.device)
    if meta["rng_streams"]:
        get_rng_tracker().set_states(dict(zip(meta["rng_streams"], state[_rng_key(rank, "tracker")].tolist())))


# ---- the interface of examples/train_gpt.py ----

def save_checkpoint(path, trainer, run=None):
    """Write ``trainer``'s (a ParallelGPT) model, optimizer state and step to the folder
    ``path``; every rank calls it and writes only what it holds. ``run``: a JSON-able record kept
    beside them (the example's learning-rate schedule), read back by ``read_meta``."""
    rng = _rng_state(trainer)
    meta = {"config": trainer.config.to_dict(), "step": trainer.step, "optimizer": _optimizer_name(trainer),
            "layout": str(trainer.layout), "run": run, "layout_record": _layout_record(trainer),
            "rng_streams": sorted(get_rng_tracker().get_states()), "rng_cuda": any(k.endswith(".cuda") for k in rng)}
    entries = _entries(trainer, with_optimizer=True, with_copies=False)
    meta["optimizer_state"] = any(k.startswith("optim.") for k in entries)
    dcp.save({META_KEY: json.dumps(meta), **rng}, checkpoint_id=path, planner=_SavePlanner(entries))


def read_meta(path):
    """The config, step and optimizer a checkpoint was saved with (no collective)."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"checkpoint {path}: not a torch.distributed.checkpoint folder (no .metadata there)")
    state = {META_KEY: ""}
    try:
        with warnings.catch_warnings():  # DCP's note that no_dist means a single process
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=path, no_dist=True)
        meta = json.loads(state[META_KEY])
        missing = {"config", "step", "optimizer", "optimizer_state"} - set(meta)
        if missing:
            raise ValueError(f"its record lacks {sorted(missing)}")
    except Exception as e:  # a DCP folder of something else, or a damaged one
        raise ValueError(f"checkpoint {path}: not a readable torchpar GPT checkpoint ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no message'})") from e
    return meta


def check_checkpoint(path, config, optimizer=None):
    """A ValueError naming every difference between the checkpoint at ``path`` and ``config``
    (and the optimizer's class name): raised alike by every rank, before any collective."""
    meta = read_meta(path)
    saved = meta["config"]
    diffs = [f"{k} = {saved.get(k)!r} in the checkpoint, {v!r} here" for k, v in config.to_dict().items()
             if k not in _FREE_CONFIG_FIELDS and saved.get(k) != v]
    diffs += [f"{k} = {saved[k]!r} in the checkpoint, absent here" for k in saved if k not in config.to_dict()]
    if optimizer is not None and meta["optimizer_state"] and meta["optimizer"] != optimizer:
        diffs.append(f"optimizer {meta['optimizer']} in the checkpoint, {optimizer} here")
    if diffs:
        raise ValueError(f"checkpoint {path} is of another model: " + "; ".join(diffs))
    return meta


def _optimizer_name(trainer):
    opt = trainer.optimizer
    return opt.optimizer_class.__name__ if isinstance(opt, ZeroRedundancyOptimizer) else type(opt).__name__


@torch.no_grad()
def _create_optimizer_state(trainer):
    """Make the optimizer create its state (zeros) by a step with zero gradients at learning rate
    0, which changes no parameter, so that the checkpoint's state can be read into it."""
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    lrs = [g["lr"] for g in trainer.optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in trainer.optimizer.param_groups:
        g["lr"] = 0.0
    trainer.optimizer.step()
    for g, lr in zip(trainer.optimizer.param_groups, lrs):
        g["lr"] = lr
    trainer.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def load_checkpoint(path, trainer):
    """Read the checkpoint at ``path`` (saved at any layout) into ``trainer``, a ParallelGPT of
    the same model; returns the step to go on from (also set as ``trainer.step``). The random
    state comes back too where every rank keeps its place (``restores_random_state``)."""
    meta = check_checkpoint(path, trainer.config, _optimizer_name(trainer))
    if meta["optimizer_state"]:
        _create_optimizer_state(trainer)
    entries = _entries(trainer, with_optimizer=meta["optimizer_state"])
    dcp.load({}, checkpoint_id=path, planner=_LoadPlanner(entries))
    for _, p, s, _ in _held_parameters(trainer):
        if s is not p:  # O2 under DDP: the master was loaded; the 16-bit copy follows
            p.copy_(s)
    if restores_random_state(meta, trainer):
        _load_rng_state(path, trainer, meta)
    trainer.step = meta["step"]
    return trainer.step
