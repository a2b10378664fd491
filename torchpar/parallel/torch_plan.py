"""``parallelize_module(module, device_mesh, parallelize_plan)`` with torch's own plan: a script that
tensor-parallelises a model with ``torch.distributed.tensor.parallel``'s ``ColwiseParallel``,
``RowwiseParallel`` and ``SequenceParallel`` runs on torchpar's layers by changing where
``parallelize_module`` is imported from. Each style is read into the ``parallelize`` style that
computes the same local tensors (parallelize.py); parameters become this rank's plain shards, not
DTensors, and outputs are local tensors (torch's ``use_local_output=True``).

What torchpar's layers do not compute is refused, naming the plan entry, before anything changes:
a style with ``use_local_output=False`` (DTensor outputs), ``ColwiseParallel`` on an embedding (its
embedding dimension split), a colwise output on another layout than ``Shard(-1)`` or
``Replicate()``, ``PrepareModuleInput``/``PrepareModuleOutput``,
and sequence parallelism on a dimension other than 0 (``[s, b, h]``, Megatron's layout) or 1
(``[b, s, h]``, torch's default; each collective then transposes), or on two in one plan.
"""
import warnings

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from torchpar.parallel.parallelize import _matches, apply_plan, check_plan


def _one(layouts):
    return layouts[0] if isinstance(layouts, tuple) and len(layouts) == 1 else layouts


def _is(layout, kind, dim=None):
    """``layout`` is exactly a ``kind`` (Shard, Replicate), on ``dim`` where given."""
    return type(layout) is kind and (dim is None or layout.dim == dim)


def _style(name, module, style, sequence_dim):
    """The ``parallelize`` style computing what torch's ``style`` computes on ``module`` (``sequence_dim``:
    the plan's SequenceParallel dimension, None without sequence parallelism)."""
    what = f"parallelize_module: plan entry for {name!r} ({type(style).__name__} on a {type(module).__name__})"
    if not isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel)):
        raise NotImplementedError(f"{what}: {type(style).__name__} is not supported; torchpar takes ColwiseParallel, "
                                  "RowwiseParallel and SequenceParallel (its layers move activations between "
                                  "the regions themselves)")
    if not style.use_local_output and not isinstance(style, SequenceParallel):
        raise NotImplementedError(f"{what}: use_local_output=False (DTensor outputs) is not supported; "
                                  "torchpar's layers return local tensors")
    # Between the tensor-parallel regions activations are sequence shards under SP, whole otherwise.
    between = Replicate() if sequence_dim is None else Shard(sequence_dim)
    if isinstance(style, SequenceParallel):
        return "sequence"
    if isinstance(style, ColwiseParallel):
        if isinstance(module, nn.Embedding):
            raise NotImplementedError(f"{what}: splitting the embedding dimension is not supported; "
                                      "RowwiseParallel splits the vocabulary")
        src, out = _one(style.input_layouts), _one(style.output_layouts)
        if not (_is(out, Shard, -1) or _is(out, Replicate)):
            raise NotImplementedError(f"{what}: output_layouts={out}; the output is sharded on its last "
                                      "dimension (Shard(-1)) or gathered whole (Replicate())")
        _check_boundary(what, "input_layouts", src, between)
        return "colwise" if _is(out, Shard) else "colwise_gather"
    if isinstance(style, RowwiseParallel):
        src, out = _one(style.input_layouts), _one(style.output_layouts)
        embedding = isinstance(module, nn.Embedding)
        expected_in = Replicate() if embedding else Shard(-1)
        if not (_is(src, Replicate) if embedding else _is(src, Shard, -1)):
            raise NotImplementedError(f"{what}: input_layouts={src}; torchpar's takes {expected_in}")
        _check_boundary(what, "output_layouts", out, between)
        return "vocab" if embedding else "rowwise"


def _check_boundary(what, field, layout, between):
    if not (type(layout) is type(between) and (type(layout) is Replicate or layout.dim == between.dim)):
        mode = "with" if type(between) is Shard else "without"
        raise NotImplementedError(f"{what}: {field}={layout}; {mode} SequenceParallel entries in the plan, the "
                                  f"activations between the tensor-parallel regions are {between}")


def parallelize_module(module, device_mesh=None, parallelize_plan=None, *, src_data_rank=0):
    """torch's ``parallelize_module`` on torchpar's layers (see the module's docstring): ``device_mesh``
    a 1-D mesh (its group is the tensor-parallel group); ``parallelize_plan`` one style for
    ``module`` itself or {glob over dotted module names: style}. ``src_data_rank=0`` (torch's
    default): the matched modules' parameters are first broadcast from the mesh's rank 0, so ranks
    that initialised differently agree; None: each rank's own copy is used (it must be the same).
    Returns the parallelised module."""
    if device_mesh is None or device_mesh.ndim != 1:
        raise ValueError("parallelize_module: a 1-D device_mesh is needed (slice a larger one: mesh['tp'])")
    group = device_mesh.get_group(0)
    if parallelize_plan is None:
        return module
    root = not isinstance(parallelize_plan, dict)
    holder = nn.ModuleDict({"m": module}) if root else module  # the root, as a child that can be replaced
    plan = {"m": parallelize_plan} if root else parallelize_plan
    named = dict(holder.named_modules())
    dims = {_one(s.sequence_sharding).dim for s in plan.values() if isinstance(s, SequenceParallel)}
    if len(dims) > 1 or not dims <= {0, 1}:
        raise NotImplementedError(f"parallelize_module: SequenceParallel with sequence_dim {sorted(dims)}; torchpar "
                                  "takes one sequence dimension per plan, 0 ([s, b, h]) or 1 ([b, s, h])")
    sequence_dim = dims.pop() if dims else None
    ours = {}
    for pattern, style in plan.items():
        hits = [n for n in named if n and _matches(pattern, n)] if pattern else [""]
        if "" in hits:
            raise NotImplementedError("parallelize_module: a style for the module itself inside a dict plan "
                                      "(key '') is not supported; pass the style alone")
        if not hits:  # torch warns and skips such an entry
            warnings.warn(f"parallelize_module: plan entry {pattern!r} matches no submodule; skipped", stacklevel=2)
        for n in hits:
            ours[n] = _style(n, named[n], style, sequence_dim)
    checked = check_plan(holder, ours)  # parallelize's checks (module types, ties) before anything changes
    if src_data_rank is not None:
        src = dist.get_global_rank(group, src_data_rank)
        for n in ours:
            for t in list(named[n].parameters()) + list(named[n].buffers()):
                dist.broadcast(t.data, src, group=group)
    apply_plan(holder, checked, group, sequence_dim or 0)
    return holder["m"] if root else holder
