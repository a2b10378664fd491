"""Checkpoints of ``fully_shard`` models with ``torch.distributed.checkpoint`` (DCP), optimizer
state included, that load at any number of ranks: torch's ``get_state_dict`` /
``set_state_dict`` for torchpar's units.

A unit keeps, of each parameter, a contiguous run of its flattened elements (not a DTensor), and
the optimizer's state for it (Adam's moments) is a run of the same length. torch's
``get_state_dict`` hands those runs to DCP as plain tensors, which DCP takes for whole tensors
held alike by every rank: it writes one rank's and drops the others. Here each run becomes a
``ShardedTensor`` (torch's, the form FSDP1 checkpoints in) of the parameter's full shape whose
local shards are the boxes the run covers (at most two partial rows at its ends and the whole
rows between, per dimension), views of this rank's tensors: DCP writes every rank's boxes, checks
that they tile each tensor, and on load reads the overlapping parts of the saved boxes into the
boxes the loading layout holds, at any world size.

    from torchpar.parallel import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    ...  # later, the same model wrapped over any number of ranks
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

The optimizer half goes through torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
(parameter names as keys, the same layout as for an unsharded model); only the runs are converted.
"""
import math

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from torchpar.parallel.fsdp import FSDPModule, Shard, sharded_state_dict


def runs_to_boxes(shape, start, end):
    """Elements [start, end) of a row-major tensor of ``shape`` as boxes (offsets, sizes), in
    order: the flat run a ``fully_shard`` rank holds, cut where it leaves a row unfinished."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(end, inner)
    boxes = []

    def within_row(row, a, b):
        return [((row, *off), (1, *size)) for off, size in runs_to_boxes(shape[1:], a, b)]

    if r0 == r1:
        return within_row(r0, o0, o1)
    if o0:
        boxes += within_row(r0, o0, inner)
        r0 += 1
    if r1 > r0:
        boxes.append(((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if o1:
        boxes += within_row(r1, 0, o1)
    return boxes


class _Run:
    """Where each rank's piece of one parameter of a unit sits: for rank r of ``group``, elements
    ``runs[r] = (start, numel)`` of the flattened parameter of ``shape``."""
    __slots__ = ("shape", "runs", "group", "rank")

    def __init__(self, flat, i, group, name):
        self.shape, self.group, self.rank = tuple(flat.shape(i)), group, flat.rank
        if not self.shape:
            raise NotImplementedError(f"torchpar get_state_dict: '{name}' is a 0-dim parameter, which one rank holds "
                                      "and a ShardedTensor cannot leave empty on the others")
        # The unit's parameters lie back to back in one flat vector, rank r holding elements
        # [r * shard_numel, (r + 1) * shard_numel) of it (fsdp_flat_param.h).
        begin, end = flat.offset(i), flat.offset(i) + math.prod(self.shape)
        self.runs = []
        for r in range(flat.world_size):
            lo, hi = max(begin, r * flat.shard_numel), min(end, (r + 1) * flat.shard_numel)
            self.runs.append((lo - begin, hi - lo) if hi > lo else (0, 0))
        assert self.runs[self.rank] == tuple(flat.shard_range(i)), (self.runs[self.rank], flat.shard_range(i))

    @property
    def start(self):
        return self.runs[self.rank][0]

    @property
    def numel(self):
        return self.runs[self.rank][1]

    def _boxes(self, r):
        start, numel = self.runs[r]
        if numel == 0:
            # A rank holding none of the parameter still gives DCP a local shard, of no elements
            # (a ShardedTensor with none asks CUDA for its device on backends other than gloo),
            # placed past the last row: DCP keeps one write per offset, and one at a real box's
            # offset could stand in for that box.
            return [((self.shape[0], *[0] * (len(self.shape) - 1)), (0, *self.shape[1:]))]
        return runs_to_boxes(self.shape, start, start + numel)

    def sharded(self, flat):
        """``flat`` (this rank's elements, any dtype) as a ShardedTensor of the full shape, its
        local shards views of ``flat``; the metadata lists every rank's boxes."""
        def meta(r, offsets, sizes):
            return ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes),
                                 placement=f"rank:{r}/{flat.device}")
        shards, at = [], 0
        for offsets, sizes in self._boxes(self.rank):
            n = math.prod(sizes)
            shards.append(LocalShard(flat.detach()[at:at + n].view(sizes), meta(self.rank, offsets, sizes)))
            at += n
        props = TensorProperties(dtype=flat.dtype, layout=flat.layout, requires_grad=False,
                                 memory_format=torch.contiguous_format, pin_memory=False)
        every = [meta(r, o, s) for r in range(len(self.runs)) for o, s in self._boxes(r)]
        md = ShardedTensorMetadata(shards_metadata=every, size=torch.Size(self.shape), tensor_properties=props)
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, md, process_group=self.group)

    def flat(self, value, what):
        """This run's elements of ``value``: a ShardedTensor made by ``sharded`` at this layout."""
        if not isinstance(value, ShardedTensor):
            raise TypeError(f"torchpar set_state_dict: '{what}' is a {type(value).__name__}, not the "
                            "ShardedTensor get_state_dict gave (load the checkpoint into what get_state_dict returned)")
        local = sorted(value.local_shards(), key=lambda s: s.metadata.shard_offsets)
        want = self._boxes(self.rank)
        got = [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in local]
        size = tuple(value.metadata().size)
        if size != self.shape or got != [(tuple(o), tuple(s)) for o, s in want]:
            raise ValueError(f"torchpar set_state_dict: '{what}' holds boxes {got} of shape {list(size)}, "
                             f"but this rank holds elements [{self.start}, {self.start + self.numel}) of shape "
                             f"{list(self.shape)}: get its state_dict from this model, as wrapped now")
        if not local:
            return torch.empty(0, dtype=value.dtype)
        return torch.cat([s.tensor.reshape(-1) for s in local])


def _runs(model):
    """{parameter name: _Run} for each parameter a fully_shard unit of ``model`` holds."""
    runs = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        unit = module._fsdp
        flat = unit.flat
        for _, _, i, name in unit.sites:
            key = f"{prefix}.{name}" if prefix else name
            runs[key] = _Run(flat, i, unit.group, key)
    return runs


def _check(options):
    options = options or StateDictOptions()
    if options.full_state_dict or options.broadcast_from_rank0:
        raise NotImplementedError("torchpar get_state_dict/set_state_dict: full_state_dict and broadcast_from_rank0 "
                                  "are not built; model.state_dict() gives the full parameters on every rank")
    return options


def get_state_dict(model, optimizers, *, options=None):
    """(model state_dict, optimizer state_dict) of a model with ``fully_shard`` units, for DCP:
    each unit's parameter pieces and their optimizer state as ShardedTensors of the full shapes
    (views of this rank's tensors, no communication), the rest as torch's functions give it.
    ``optimizers``: one optimizer or several, as torch's."""
    options = _check(options)
    runs = _runs(model)
    model_sd = sharded_state_dict(model)
    for key, value in model_sd.items():
        if isinstance(value, Shard):
            model_sd[key] = runs[key].sharded(value.local)
    optim_sd = get_optimizer_state_dict(model, optimizers, options=options)
    # (Its per-parameter dicts are the optimizer's own state dicts: replaced, not changed.)
    optim_sd["state"] = {
        key: state if key not in runs else {name: runs[key].sharded(v) if _is_run(v, runs[key]) else v
                                            for name, v in state.items()}
        for key, state in optim_sd["state"].items()}
    return model_sd, optim_sd


def _is_run(value, run):
    """Whether an optimizer state value is per element of the piece (Adam's moments; not its
    step count)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == run.numel


def set_state_dict(model, optimizers, *, model_state_dict, optim_state_dict, options=None):
    """Loads what ``get_state_dict`` gave (after ``dcp.load`` into it) into the model and the
    optimizers, converting the ShardedTensors back into this rank's pieces. Returns the model's
    ``load_state_dict`` result (missing and unexpected keys)."""
    options = _check(options)
    runs = _runs(model)
    model_sd = dict(model_state_dict)
    for key, value in model_sd.items():
        run = runs.get(key)
        if run is not None:
            model_sd[key] = Shard(run.flat(value, key), run.shape, run.start, len(run.runs), run.rank)
    result = model.load_state_dict(model_sd, strict=options.strict)
    optim_sd = {**optim_state_dict, "state": {}}
    for key, state in optim_state_dict["state"].items():
        run = runs.get(key)
        optim_sd["state"][key] = state if run is None else {
            name: run.flat(v, f"{key}.{name}") if isinstance(v, ShardedTensor) else v for name, v in state.items()}
    set_optimizer_state_dict(model, optimizers, optim_sd, options=options)
    return result
