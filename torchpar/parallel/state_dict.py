"""Checkpoints of torchpar's sharded models with ``torch.distributed.checkpoint`` (DCP),
optimizer state included, that load at any number of ranks: torch's ``get_state_dict`` /
``set_state_dict`` for ``fully_shard`` units and tensor-parallel layers.

Both keep plain local tensors, not DTensors, and torch's ``get_state_dict`` hands them to DCP as
they are; DCP takes a plain tensor for a whole tensor every rank holds alike, writes one rank's
and drops the others (on load: a size mismatch, or another rank's values where sizes agree).
Here each local tensor, and the optimizer state of its size, says where it lies in the full one:

- a ``fully_shard`` unit keeps, of each parameter, a contiguous run of its flattened elements:
  it becomes a ``ShardedTensor`` (torch's, the form FSDP1 checkpoints in) of the full shape
  whose local shards are the boxes the run covers (at most two partial rows at its ends and the
  whole rows between, per dimension), views of the run (the parameters' runs are copies, as
  ``sharded_state_dict()`` makes them);
- a tensor-parallel layer's shard (``ColumnParallelLinear`` rows, ``RowParallelLinear`` weight
  columns, ``VocabParallelEmbedding`` rows) is a ``DTensor`` over the layer's group, ``Shard(d)``,
  as torch's ``parallelize_module`` would leave it; with Megatron's ``stride`` (a slice of each
  fused block, e.g. q, k and v) a ShardedTensor of one box per block.

DCP writes every rank's part, checks that the parts tile each tensor, and on load reads the
overlapping parts of the saved ones into the parts the loading layout holds, at any world size.

    from torchpar.parallel import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    ...  # later, the same model sharded over any number of ranks
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

The optimizer half goes through torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
(parameter names as keys, the same layout as for an unsharded model); only the parts are converted.
A tensor-parallel layer inside a ``fully_shard`` unit (FSDP + TP, torchtitan's 2-D layout) holds a
run of its shard: the run's boxes, shifted to where the shard lies in the whole tensor, make the
ShardedTensor (the ranks of each position's unit group are learnt once, from the layer's group).
Names leave out torchpar DDP's
``module.`` level, as torch's functions leave out their own DDP's: a checkpoint loads with or
without the wrapper.

``StateDictOptions(full_state_dict=True)`` gives the whole tensors instead (every part
all-gathered over its group), the consolidated form for one-process use or export: on every rank,
or with ``cpu_offload=True`` on rank 0 only, in host memory (the others get empty dicts), as
torch's functions give them; ``set_state_dict`` takes that form back, each rank keeping its part.
Every rank of the default group calls it (the ranks first agree on what they gather).

``get_model_state_dict`` / ``get_optimizer_state_dict`` / ``set_model_state_dict`` /
``set_optimizer_state_dict`` are the two halves alone, torch's split functions (a model exported
whole on rank 0 without its optimizer: ``get_model_state_dict(model, options=StateDictOptions(
full_state_dict=True, cpu_offload=True))``).
"""
import dataclasses
import math
import pickle

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, _get_fqns
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as ShardPlacement

from torchpar.parallel.ddp import DistributedDataParallel
from torchpar.parallel.fsdp import FSDPModule, Shard, sharded_form
from torchpar.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


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
    ``runs[r] = (start, numel)`` of the flattened parameter of ``local_shape``. Under tensor
    parallelism (``tp``, a _Positions: the unit holds a tensor-parallel shard, torchtitan's
    FSDP + TP) that parameter is the shard of position t of the layer's group, which lies at
    ``t * local_shape[dim]`` along ``dim`` of the whole tensor of ``shape``: each box shifts by it."""
    __slots__ = ("local_shape", "shape", "runs", "boxes", "group", "rank", "grid", "tp", "pg")

    def __init__(self, flat, i, group, name, tp=None):
        self.local_shape, self.group, self.rank, self.tp = tuple(flat.shape(i)), group, flat.rank, tp
        if not self.local_shape:
            raise NotImplementedError(f"torchpar get_state_dict: '{name}' is a 0-dim parameter, which one rank holds "
                                      "and a ShardedTensor cannot leave empty on the others")
        self.shape = self.local_shape if tp is None else tp.whole_shape(self.local_shape)
        # ShardedTensor placements name global ranks (review: the group's own failed on a subgroup):
        # grid[t][r], rank r of the unit's group at tensor-parallel position t.
        self.grid = [[dist.get_global_rank(group, r) for r in range(flat.world_size)]] if tp is None else tp.grid
        self.pg = group if tp is None else None  # a ShardedTensor's group holds every placement: the world
        # The unit's parameters lie back to back in one flat vector, rank r holding elements
        # [r * shard_numel, (r + 1) * shard_numel) of it (fsdp_flat_param.h).
        begin, end = flat.offset(i), flat.offset(i) + math.prod(self.local_shape)
        self.runs = []
        for r in range(flat.world_size):
            lo, hi = max(begin, r * flat.shard_numel), min(end, (r + 1) * flat.shard_numel)
            self.runs.append((lo - begin, hi - lo) if hi > lo else (0, 0))
        assert self.runs[self.rank] == tuple(flat.shard_range(i)), (self.runs[self.rank], flat.shard_range(i))
        # Each (position, rank)'s boxes, once: the same runs at every position, shifted.
        self.boxes = [[self._boxes(t, start, numel) for start, numel in self.runs] for t in range(len(self.grid))]

    @property
    def start(self):
        return self.runs[self.rank][0]

    @property
    def numel(self):
        return self.runs[self.rank][1]

    @property
    def position(self):
        return 0 if self.tp is None else self.tp.rank

    @property
    def gather_ranks(self):
        """The global ranks a gather of the whole tensor involves (under tensor parallelism every
        position's unit group: the same set on all of them)."""
        return tuple(sorted(r for ranks in self.grid for r in ranks))

    def _boxes(self, t, start, numel):
        if numel == 0:
            # A rank holding none of the parameter still gives DCP a local shard, of no elements
            # (a ShardedTensor with none asks CUDA for its device on backends other than gloo),
            # placed past the whole tensor's last row: DCP keeps one write per offset, and one at a
            # real box's offset could stand in for that box.
            return [((self.shape[0], *[0] * (len(self.shape) - 1)), (0, *self.shape[1:]))]
        boxes = runs_to_boxes(self.local_shape, start, start + numel)
        return boxes if self.tp is None else self.tp.place(t, boxes, self.local_shape)

    def holds(self, value):
        """Whether an optimizer state value is per element of the piece (Adam's moments; not its
        step count)."""
        return torch.is_tensor(value) and value.dim() == 1 and value.numel() == self.numel

    def to_dcp(self, flat):
        """``flat`` (this rank's elements, any dtype) as a ShardedTensor of the full shape, its
        local shards views of ``flat``; the metadata lists every rank's boxes."""
        every = [(self.grid[t][r], boxes) for t, ranks in enumerate(self.boxes) for r, boxes in enumerate(ranks)]
        return _sharded_tensor(flat, self.boxes[self.position][self.rank], every, self.shape, self.pg)

    def gather_whole(self, local):
        """The whole tensor of the parameter's shape, every rank's run of it gathered (``local``,
        this rank's: its value or an optimizer state of its size), then under tensor parallelism
        every position's shard."""
        width = max(n for _, n in self.runs)
        mine = local.detach().reshape(-1).new_zeros(width)
        mine[:self.numel] = local.detach().reshape(-1)
        every = mine.new_empty(width * len(self.runs))
        dist.all_gather_single(every, mine, group=self.group)
        out = every.new_empty(math.prod(self.local_shape))
        for r, (start, numel) in enumerate(self.runs):  # the runs tile the parameter
            out[start:start + numel] = every[r * width:r * width + numel]
        out = out.view(self.local_shape)
        return out if self.tp is None else self.tp.gather(out)

    def from_whole(self, value):
        """This rank's run of a whole tensor of the parameter's shape."""
        local = value if self.tp is None else self.tp.mine(value, self.local_shape)
        return local.detach().reshape(-1)[self.start:self.start + self.numel].clone()

    def from_dcp(self, value, what):
        """This run's elements of ``value``: a ShardedTensor made by ``to_dcp`` at this layout."""
        return _flat_part(value, self.boxes[self.position][self.rank], self.shape, what,
                          f"elements [{self.start}, {self.start + self.numel}) of shape {list(self.local_shape)}")


def _sharded_tensor(flat, mine, every, shape, pg):
    """A ShardedTensor of ``shape`` whose local shards are views of ``flat`` (this rank's elements,
    box after box of ``mine``), the metadata every rank's boxes (``every``: [(global rank,
    boxes)])."""
    def meta(r, offsets, sizes):
        return ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes), placement=f"rank:{r}/{flat.device}")
    shards, at, me = [], 0, dist.get_rank()
    for offsets, sizes in mine:
        n = math.prod(sizes)
        shards.append(LocalShard(flat.detach().reshape(-1)[at:at + n].view(sizes), meta(me, offsets, sizes)))
        at += n
    props = TensorProperties(dtype=flat.dtype, layout=flat.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    md = ShardedTensorMetadata(shards_metadata=[meta(r, o, s) for r, boxes in every for o, s in boxes],
                               size=torch.Size(shape), tensor_properties=props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, md, process_group=pg)


def _flat_part(value, mine, shape, what, holding):
    """This rank's elements, flat, of a ShardedTensor made by ``_sharded_tensor`` with boxes ``mine``
    (``holding`` says what they are, for the error)."""
    if not isinstance(value, ShardedTensor):
        raise TypeError(f"torchpar set_state_dict: '{what}' is a {type(value).__name__}, not the "
                        "ShardedTensor get_state_dict gave (load the checkpoint into what get_state_dict returned)")
    local = sorted(value.local_shards(), key=lambda s: s.metadata.shard_offsets)
    got = [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in local]
    size = tuple(value.metadata().size)
    if size != shape or got != [(tuple(o), tuple(s)) for o, s in mine]:
        raise ValueError(f"torchpar set_state_dict: '{what}' holds boxes {got} of shape {list(size)}, but this rank "
                         f"holds {holding}: get its state_dict from this model, as wrapped now")
    return torch.cat([s.tensor.reshape(-1) for s in local])  # boxes in offset order are in flat order


class _Positions:
    """A tensor-parallel layer's split of one parameter: position ``rank`` of ``tp`` holds the
    equal slice ``rank`` along ``dim``; with Megatron's ``stride`` (ColumnParallelLinear's fused
    blocks, e.g. q, k and v: dim 0) slice ``rank`` of each of the ``stride`` equal blocks, side by
    side."""
    __slots__ = ("group", "tp", "rank", "dim", "stride", "grid")

    def __init__(self, module, dim):
        self.group, self.tp, self.dim = module.group, module.tp, dim
        self.rank = dist.get_rank(module.group)
        self.stride = getattr(module, "stride", 1)
        self.grid = None  # (in a fully_shard unit) the unit's group's global ranks at each position

    def whole_shape(self, local_shape):
        return tuple(n * self.tp if d == self.dim else n for d, n in enumerate(local_shape))

    def place(self, t, boxes, local_shape):
        """``boxes`` of position t's shard (its coordinates) in the whole tensor's: local index i
        along ``dim`` lies in block j = i // b (b, a block's slice) at j * tp * b + t * b + i % b, so
        a box is cut where blocks meet."""
        b = local_shape[self.dim] // self.stride
        placed = []
        for offsets, sizes in boxes:
            lo, hi = offsets[self.dim], offsets[self.dim] + sizes[self.dim]
            while lo < hi:
                j = lo // b
                end = min(hi, (j + 1) * b)
                at = lo + j * (self.tp - 1) * b + t * b
                placed.append((tuple(at if d == self.dim else o for d, o in enumerate(offsets)),
                               tuple(end - lo if d == self.dim else n for d, n in enumerate(sizes))))
                lo = end
        return placed

    def gather(self, local):
        """The whole tensor, every position's slice gathered over the layer's group."""
        every = local.detach().new_empty((self.tp, *local.shape))
        dist.all_gather_single(every, local.detach().contiguous(), group=self.group)
        if self.stride == 1:
            return torch.cat(every.unbind(0), dim=self.dim)
        # [position, block, slice, ...] -> [block, position, slice, ...] (dim 0)
        return every.unflatten(1, (self.stride, -1)).transpose(0, 1).flatten(0, 2)

    def mine(self, whole, local_shape):
        """This position's slice of a whole tensor."""
        if self.stride == 1:
            size = local_shape[self.dim]
            return whole.detach().narrow(self.dim, self.rank * size, size)
        return whole.detach().unflatten(0, (self.stride, self.tp, -1))[:, self.rank].flatten(0, 1)


class _TensorParallel:
    """A tensor-parallel layer's shard of a parameter: this rank's slice ``rank`` of ``tp`` equal
    slices along ``dim``, as a DTensor ``Shard(dim)`` over the layer's group; with ``stride`` > 1
    (a slice of each fused block, which no DTensor placement describes) a ShardedTensor of one
    box per block."""

    def __init__(self, positions, param):
        self.mesh = _mesh(positions.group, param.device.type)
        self.positions, self.group, self.dim = positions, positions.group, positions.dim
        self.local_shape = tuple(param.shape)
        self.shape = positions.whole_shape(self.local_shape)
        whole = [((0,) * len(self.local_shape), self.local_shape)]
        self.boxes = [positions.place(t, whole, self.local_shape) for t in range(positions.tp)]

    @property
    def gather_ranks(self):
        return tuple(dist.get_process_group_ranks(self.group))

    def holds(self, value):
        return torch.is_tensor(value) and tuple(value.shape) == self.local_shape

    def to_dcp(self, local):
        if self.positions.stride > 1:
            every = list(zip(self.gather_ranks, self.boxes))
            return _sharded_tensor(local.contiguous(), self.boxes[self.positions.rank], every, self.shape, self.group)
        stride = tuple(math.prod(self.shape[d + 1:]) for d in range(len(self.shape)))
        return DTensor.from_local(local.detach(), self.mesh, [ShardPlacement(self.dim)], run_check=False,
                                  shape=torch.Size(self.shape), stride=stride)

    def gather_whole(self, local):
        return self.positions.gather(local)

    def from_whole(self, value):
        return self.positions.mine(value, self.local_shape).clone()

    def from_dcp(self, value, what):
        if self.positions.stride > 1:
            return _flat_part(value, self.boxes[self.positions.rank], self.shape, what,
                              f"a shard {list(self.local_shape)} of {self.positions.stride} fused blocks").view(
                                  self.local_shape)
        if not isinstance(value, DTensor):
            raise TypeError(f"torchpar set_state_dict: '{what}' is a {type(value).__name__}, not the DTensor "
                            "get_state_dict gave (load the checkpoint into what get_state_dict returned)")
        if tuple(value.shape) != self.shape or tuple(value.to_local().shape) != self.local_shape:
            raise ValueError(f"torchpar set_state_dict: '{what}' is a DTensor of shape {list(value.shape)}, but this "
                             f"layer holds a shard {list(self.local_shape)} of {list(self.shape)}: get its state_dict "
                             "from this model, as sharded now")
        return value.to_local()


_MESHES = {}


def _mesh(group, device_type):
    """A 1-D DeviceMesh over a tensor-parallel layer's group (one per group and device type)."""
    key = (id(group), device_type)
    if key not in _MESHES or _MESHES[key][0] is not group:
        _MESHES[key] = (group, DeviceMesh.from_group(group, device_type=device_type))
    return _MESHES[key][1]


# Which parameter of a tensor-parallel layer is split along which dimension (the others, such as
# RowParallelLinear's bias, every rank holds whole).
_SPLIT = {ColumnParallelLinear: {"weight": 0, "bias": 0}, RowParallelLinear: {"weight": 1},
          VocabParallelEmbedding: {"weight": 0}}


def _holdings(model):
    """{parameter name: _Run or _TensorParallel} for each parameter of ``model`` that this rank
    holds a part of. Names are torch's state_dict functions' (no ``_orig_mod.`` of
    torch.compile, no activation checkpointing wrapper's prefix: review finding)."""
    held = {}

    def fqn(prefix, name):
        names = _get_fqns(model, f"{prefix}.{name}" if prefix else name)
        assert len(names) == 1, names
        return next(iter(names))

    split, units = {}, []
    for prefix, module in model.named_modules():
        # (fully_shard swaps a unit's class for a subclass of it)
        dims = next((d for cls, d in _SPLIT.items() if isinstance(module, cls)), {})
        if dims and module.tp > 1:
            for name, dim in dims.items():
                p = getattr(module, name, None)
                if p is not None:
                    split[fqn(prefix, name)] = (_Positions(module, dim), p)
        if isinstance(module, FSDPModule):
            units.append((prefix, module._fsdp))
    # (unit group's ranks, layer group's ranks): the grid, asked for once. Keyed by ranks, not
    # group objects: every rank then asks at the same parameters (review finding).
    grids = {}
    for prefix, unit in units:
        for _, _, i, name in unit.sites:
            key = fqn(prefix, name)
            positions = split.pop(key, (None,))[0]
            if positions is not None:  # a tensor-parallel shard in a unit (FSDP + TP)
                pair = (tuple(dist.get_process_group_ranks(unit.group)),
                        tuple(dist.get_process_group_ranks(positions.group)))
                if pair not in grids:
                    grids[pair] = _grid(unit.group, unit.flat.world_size, positions.group)
                positions.grid = grids[pair]
            held[key] = _Run(unit.flat, i, unit.group, key, positions)
    for key, (positions, p) in split.items():
        held[key] = _TensorParallel(positions, p)
    return held


def _grid(group, size, layer_group):
    """[t][r]: the global rank of rank r of the fully_shard group at position t of the
    tensor-parallel layer's group (each position has its own unit group, whose ranks this rank
    learns from its peers in the layer's group: one small all_gather_object)."""
    mine = [dist.get_global_rank(group, r) for r in range(size)]
    grid = [None] * dist.get_world_size(layer_group)
    dist.all_gather_object(grid, mine, group=layer_group)
    if any(len(ranks) != size for ranks in grid):
        raise ValueError(f"torchpar get_state_dict: the fully_shard groups at the tensor-parallel positions differ "
                         f"in size ({[len(r) for r in grid]}); each position's unit must shard alike")
    if len({r for ranks in grid for r in ranks}) != size * len(grid):
        raise ValueError(f"torchpar get_state_dict: a fully_shard unit's group shares ranks with the tensor-parallel "
                         f"group of its layers (unit groups by position: {grid}): fully_shard must shard over the "
                         "data-parallel ranks, each position apart")
    return grid


def _ddp_levels(model):
    """(with, without) name prefixes of the ``module.`` level each torchpar DDP in ``model`` adds,
    innermost first: torch's state_dict functions drop their own DDP's level only, and a
    checkpoint should load with or without the wrapper, as torch's does."""
    levels = [(f"{p}.module." if p else "module.", f"{p}." if p else "")
              for p, m in model.named_modules() if isinstance(m, DistributedDataParallel)]
    return sorted(levels, key=lambda level: -len(level[0]))


def _without_ddp(key, levels):
    for with_, without in levels:
        if key.startswith(with_):
            return without + key[len(with_):]
    return key


def _with_ddp(key, levels):
    for with_, without in levels:
        if key.startswith(without) and not key.startswith(with_):
            return with_ + key[len(without):]
    return key


def _renamed(model_sd, optim_sd, rename):
    """Both state dicts with every parameter name passed through ``rename``."""
    groups = [{**g, "params": [rename(n) for n in g["params"]]} for g in optim_sd.get("param_groups", [])]
    return ({rename(k): v for k, v in model_sd.items()},
            {**optim_sd, "state": {rename(k): v for k, v in optim_sd.get("state", {}).items()},
             "param_groups": groups})


def _check(options):
    """(the caller's options, the options torch's functions get): torch's never see
    full_state_dict or cpu_offload, which would gather or drop our plain parts as they are."""
    options = options or StateDictOptions()
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("torchpar get_state_dict/set_state_dict: broadcast_from_rank0 needs full_state_dict=True "
                         "(rank 0's whole state dicts), as torch's")
    # Nor flatten_optimizer_state_dict: the parts are found in the nested form, flattened after.
    local = dataclasses.replace(options, full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False,
                                flatten_optimizer_state_dict=False)
    return options, local


def _is_whole(h, value):
    """Whether ``value`` is a whole tensor of the parameter a _Run or _TensorParallel ``h`` holds
    a part of."""
    return torch.is_tensor(value) and tuple(value.shape) == h.shape


class _Part:
    """This rank's part of a whole tensor, cut as the tensor arrived from rank 0."""
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


def _from_rank0(model_sd, optim_sd, keep):
    """Rank 0's whole state dicts on every rank (``broadcast_from_rank0``; the other ranks' are
    ignored): the layout in one ``broadcast_object_list``, then each tensor in one broadcast from
    rank 0 of the default group, on the device type of rank 0's tensors, of which
    ``keep(key, value)`` returns what this rank keeps (its part: no rank holds more than one
    whole sharded tensor at a time). What rank 0 cannot send is found before anything is sent and
    raised on every rank, which would otherwise wait in a broadcast rank 0 never enters."""
    def spec(value):
        if not torch.is_tensor(value):
            return ("value", value)
        if isinstance(value, (DTensor, ShardedTensor)) or value.layout != torch.strided or value.is_meta:
            raise ValueError(f"a {type(value).__name__} ({value.layout}, on {value.device}), not a plain tensor")
        return ("tensor", tuple(value.shape), value.dtype)

    rank0 = dist.get_rank() == 0
    layout = [None]
    if rank0:
        try:
            values = [*model_sd.values(), *(v for state in optim_sd["state"].values() for v in state.values())]
            layout = [(next((v.device.type for v in values if torch.is_tensor(v)), "cpu"),
                       [(k, spec(v)) for k, v in model_sd.items()],
                       [(k, [(n, spec(v)) for n, v in state.items()]) for k, state in optim_sd["state"].items()],
                       {k: v for k, v in optim_sd.items() if k != "state"})]
            pickle.dumps(layout)
        except Exception as e:  # noqa: BLE001 (any: it is raised on every rank below)
            layout = [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(layout, src=0)
    if layout[0][0] == "error":
        raise ValueError(f"torchpar set_state_dict(broadcast_from_rank0=True): rank 0's state dicts cannot be sent "
                         f"({layout[0][1]}); rank 0 must pass whole plain tensors, model and optimizer")
    device_type, model_layout, state_layout, rest = layout[0]
    device = torch.device(device_type) if device_type == "cpu" else torch.device(
        device_type, torch.accelerator.current_device_index())

    def receive(key, kind, mine):
        if kind[0] == "value":
            return kind[1]
        value = mine.detach().to(device).contiguous() if rank0 else torch.empty(kind[1], dtype=kind[2], device=device)
        dist.broadcast(value, src=0)
        return keep(key, value)

    model = {k: receive(k, kind, model_sd[k] if rank0 else None) for k, kind in model_layout}
    state = {k: {n: receive(k, kind, optim_sd["state"][k][n] if rank0 else None) for n, kind in entries}
             for k, entries in state_layout}
    return model, {**rest, "state": state}


def _agree(plans):
    """Raises, on every rank alike (all see every plan), where two members of a group would
    gather different parts or in another order. ``plans[r]``: rank r's (group ranks, key, name,
    dtype) per part, in its order."""
    by_group = [{} for _ in plans]
    for rank, plan in enumerate(plans):
        for entry in plan:
            by_group[rank].setdefault(entry[0], []).append(entry[1:])
    # Every member of every group any rank names, against the group's first member: a member
    # with nothing to gather there must not leave the others waiting (review finding).
    for group in sorted({g for groups in by_group for g in groups}):
        first = group[0]
        theirs = by_group[first].get(group, [])
        for rank in group:
            mine = by_group[rank].get(group, [])
            if theirs != mine:
                diff = next((a, b) for a, b in zip(theirs + [None] * len(mine), mine + [None] * len(theirs))
                            if a != b)
                raise ValueError(f"torchpar get_state_dict(full_state_dict=True): ranks {first} and {rank} of group "
                                 f"{list(group)} hold different parts to gather (first difference: rank {first} "
                                 f"{diff[0]}, rank {rank} {diff[1]}): every rank must give the same model and "
                                 "optimizers, with state (a step taken) on all or none")


def _gathered(model_sd, optim_sd, held, cpu_offload):
    """Both state dicts with every part whole (see the module's docstring); None on a rank other
    than 0 with ``cpu_offload``. The ranks first compare, in one all_gather_object over the
    default group, the parts each group's members will gather, in order (``_agree``), so that a
    mismatch is an error on every rank rather than collectives that do not match. Then one
    tensor at a time, as torch gathers: with ``cpu_offload`` rank 0 moves each to host memory and
    the others drop it at once, so the device holds one gather's buffers at a time. The groups
    go in one order all ranks share (sorted by their ranks), so the lowest group with a gather
    left always has every member at it: a rank in several groups never waits in one while a peer
    waits in another for it. (A tensor-parallel shard in a unit is gathered over the unit's group,
    then over the layer's: its "group" is every rank either gather involves, the same set on all
    of them.)"""
    parts = [(key, None, value.local if isinstance(value, Shard) else value)
             for key, value in model_sd.items() if key in held]
    parts += [(key, name, v) for key, state in optim_sd["state"].items() if key in held
              for name, v in state.items() if held[key].holds(v)]
    plan = [(held[key].gather_ranks, key, name, str(v.dtype)) for key, name, v in parts]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, plan)
    _agree(everyone)
    group_order = {g: i for i, g in enumerate(sorted({e[0] for theirs in everyone for e in theirs}))}
    returns = dist.get_rank() == 0 or not cpu_offload  # torch's cpu_offload: on rank 0 only
    for i in sorted(range(len(parts)), key=lambda i: (group_order[plan[i][0]], i)):
        key, name, v = parts[i]
        value = held[key].gather_whole(v)
        if not returns:
            continue
        value = value.cpu() if cpu_offload else value
        if name is None:
            model_sd[key] = value
        else:
            optim_sd["state"][key] = {**optim_sd["state"][key], name: value}
    if not returns:
        return None
    if cpu_offload:  # the tensors every rank holds whole (not gathered) to host memory too
        to_cpu = lambda v: v.cpu() if torch.is_tensor(v) else v  # noqa: E731
        model_sd = {k: to_cpu(v) for k, v in model_sd.items()}
        optim_sd = {**optim_sd, "state": {k: {n: to_cpu(v) for n, v in state.items()}
                                          for k, state in optim_sd["state"].items()}}
    return model_sd, optim_sd


def _get(model, optimizers, options, *, with_model=True, with_optim=True):
    """get_state_dict's work, either half left out (as empty dicts) by the split functions."""
    options, local = _check(options)
    held = _holdings(model)
    model_sd, optim_sd = {}, {"state": {}, "param_groups": []}
    if with_model:
        with sharded_form(model):
            model_sd = torch_state_dict.get_model_state_dict(model, options=local)
    if with_optim:
        optim_sd = torch_state_dict.get_optimizer_state_dict(model, optimizers, options=local)
    if options.full_state_dict:
        gathered = _gathered(model_sd, optim_sd, held, options.cpu_offload)
        if gathered is None:  # cpu_offload: not rank 0
            return {}, {}
        model_sd, optim_sd = gathered
    else:
        for key, value in model_sd.items():
            if key in held:
                model_sd[key] = held[key].to_dcp(value.local if isinstance(value, Shard) else value)
        # (Its per-parameter dicts are the optimizer's own state dicts: replaced, not changed.)
        optim_sd["state"] = {
            key: state if key not in held else {name: held[key].to_dcp(v) if held[key].holds(v) else v
                                                for name, v in state.items()}
            for key, state in optim_sd["state"].items()}
    levels = _ddp_levels(model)
    model_sd, optim_sd = _renamed(model_sd, optim_sd, lambda k: _without_ddp(k, levels))
    if options.flatten_optimizer_state_dict and with_optim:
        optim_sd = torch_state_dict._flatten_optim_state_dict(optim_sd)
    return model_sd, optim_sd


def _unflattened(model, optimizers, flat):
    """torch's flattened optimizer state dict (``flatten_optimizer_state_dict``) in the nested form:
    ``state.<name>.<state name>`` under state[name], and each of the optimizers' param groups from
    the ``param_groups.<name>.<key>`` entries of its first parameter, as torch nests it."""
    levels = _ddp_levels(model)
    names = {id(p): _without_ddp(next(iter(_get_fqns(model, n))), levels) for n, p in model.named_parameters()}
    longest_first = sorted(set(names.values()), key=len, reverse=True)
    state = {}
    for key, value in flat.items():
        if not key.startswith("state."):
            continue
        rest = key[len("state."):]
        name = next((n for n in longest_first if rest.startswith(n + ".")), None)
        if name is None:
            raise ValueError(f"torchpar set_state_dict: flattened optimizer state '{key}' names no parameter of the model")
        *path, last = rest[len(name) + 1:].split(".")  # nested state (Shampoo's) as torch nests it
        at = state.setdefault(name, {})
        for part in path:
            at = at.setdefault(part, {})
        at[last] = value
    groups = []
    for optimizer in [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers:
        for group in optimizer.param_groups:
            params = [names[id(p)] for p in group["params"]]
            first = params[0]
            missing = [k for k in group if k != "params" and f"param_groups.{first}.{k}" not in flat]
            if missing:
                raise ValueError(f"torchpar set_state_dict: the flattened optimizer state dict has no "
                                 f"'param_groups.{first}.{missing[0]}'")
            groups.append({**{k: flat[f"param_groups.{first}.{k}"] for k in group if k != "params"},
                           "params": params})
    return {"state": state, "param_groups": groups}


def get_state_dict(model, optimizers, *, options=None):
    """(model state_dict, optimizer state_dict) of a model with ``fully_shard`` units or
    tensor-parallel layers, for DCP: each sharded parameter and its optimizer state of the same
    size as a ShardedTensor or DTensor of the full shape (no communication, but for fully_shard
    over tensor-parallel layers one exchange of the unit groups' ranks); keys and the rest as
    torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` give them.
    ``optimizers``: one optimizer or several, as torch's. With ``options.full_state_dict`` the
    parts are gathered into whole tensors instead (module docstring)."""
    return _get(model, optimizers, options)


def get_model_state_dict(model, *, options=None):
    """The model half of ``get_state_dict``, as torch's ``get_model_state_dict`` (e.g. the whole
    model on rank 0 for export: ``StateDictOptions(full_state_dict=True, cpu_offload=True)``)."""
    return _get(model, (), options, with_optim=False)[0]


def get_optimizer_state_dict(model, optimizers, *, options=None):
    """The optimizer half of ``get_state_dict``, as torch's ``get_optimizer_state_dict``."""
    return _get(model, optimizers, options, with_model=False)[1]


def _set(model, optimizers, model_state_dict, optim_state_dict, options):
    """set_state_dict's work; ``model_state_dict`` or ``optim_state_dict`` None: that half is not
    loaded (the split functions)."""
    options, local = _check(options)
    held = _holdings(model)
    levels = _ddp_levels(model)
    with_model, with_optim = model_state_dict is not None, optim_state_dict is not None
    model_state_dict = model_state_dict if with_model else {}
    optim_state_dict = optim_state_dict if with_optim else {"state": {}, "param_groups": []}
    if with_optim and options.flatten_optimizer_state_dict and (dist.get_rank() == 0
                                                                 or not options.broadcast_from_rank0):
        optim_state_dict = _unflattened(model, optimizers, optim_state_dict)
    if options.broadcast_from_rank0:
        def keep(key, value):
            h = held.get(_with_ddp(key, levels))
            return _Part(h.from_whole(value)) if h is not None and _is_whole(h, value) else value
        model_state_dict, optim_state_dict = _from_rank0(model_state_dict, optim_state_dict, keep)
    model_sd, optim_state_dict = _renamed(model_state_dict, optim_state_dict, lambda k: _with_ddp(k, levels))

    def part(h, value, what):
        """This rank's part of ``value``: a whole tensor (full_state_dict) or what get_state_dict gave."""
        if isinstance(value, _Part):
            return value.tensor
        if not options.full_state_dict:
            return h.from_dcp(value, what)
        if isinstance(value, (DTensor, ShardedTensor)):
            raise TypeError(f"torchpar set_state_dict(full_state_dict=True): '{what}' is a {type(value).__name__}; "
                            "the whole form takes plain whole tensors")
        if not _is_whole(h, value):
            raise ValueError(f"torchpar set_state_dict(full_state_dict=True): '{what}' is "
                             f"{list(value.shape) if torch.is_tensor(value) else type(value).__name__}, not a whole "
                             f"tensor of shape {list(h.shape)}")
        return h.from_whole(value)

    def sharded(h, v):
        """Whether an optimizer state value of a sharded parameter ``h`` is to be cut into this rank's
        part. Whole form: one per element of the parameter (as many elements), so that part()
        refuses one of another shape, on every rank given the same dict (a flattened moment loaded
        and then failed in opt.step() on the one rank holding none of the parameter); state not
        per element (a step count, Adafactor's row and column statistics) stays as it is."""
        if options.full_state_dict:
            return isinstance(v, _Part) or (torch.is_tensor(v) and v.dim() > 0 and v.numel() == math.prod(h.shape))
        return isinstance(v, (ShardedTensor, DTensor))

    # Both converted before either is loaded: a refused value leaves the model as it was.
    for key, value in model_sd.items():
        h = held.get(key)
        if isinstance(h, _Run):
            model_sd[key] = Shard(part(h, value, key), h.local_shape, h.start, len(h.runs), h.rank)
        elif h is not None:
            model_sd[key] = part(h, value, key)
    optim_sd = {**optim_state_dict, "state": {}}
    for key, state in optim_state_dict["state"].items():
        h = held.get(key)
        optim_sd["state"][key] = state if h is None else {
            name: part(h, v, f"{key}.{name}") if sharded(h, v) else v for name, v in state.items()}
    result = torch_state_dict.set_model_state_dict(model, model_sd, options=local) if with_model else None
    if with_optim:
        torch_state_dict.set_optimizer_state_dict(model, optimizers, optim_sd, options=local)
    return result


def set_state_dict(model, optimizers, *, model_state_dict, optim_state_dict, options=None):
    """Loads what ``get_state_dict`` gave (after ``dcp.load`` into it) into the model and the
    optimizers, converting the ShardedTensors and DTensors back into this rank's parts. Returns
    the model's ``load_state_dict`` result (missing and unexpected keys). With
    ``full_state_dict`` it takes whole tensors, and with ``broadcast_from_rank0`` too rank 0's
    (the other ranks may pass empty dicts), as torch's: every rank keeps its parts."""
    return _set(model, optimizers, model_state_dict, optim_state_dict, options)


def set_model_state_dict(model, model_state_dict, *, options=None):
    """The model half of ``set_state_dict``, as torch's ``set_model_state_dict``: returns the
    missing and unexpected keys."""
    return _set(model, (), model_state_dict, None, options)


def set_optimizer_state_dict(model, optimizers, optim_state_dict, *, options=None):
    """The optimizer half of ``set_state_dict``, as torch's ``set_optimizer_state_dict``."""
    _set(model, optimizers, None, optim_state_dict, options)
