"""``parallelize_module(module, device_mesh, parallelize_plan)`` with torch's own plan: a script that
tensor-parallelises a model with ``torch.distributed.tensor.parallel``'s ``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel`` and ``PrepareModuleInput`` runs on torchpar's layers by
changing where ``parallelize_module`` is imported from. Each style is read, by its layouts, into the
``parallelize`` style (parallelize.py) and the sequence-parallel setting of that one layer that
compute the same local tensors: a colwise layer whose input is ``Shard(d)`` all-gathers the
sequence itself, one whose input is ``Replicate()`` takes it whole (a ``PrepareModuleInput`` above
it gathered it, as torchtitan's plans do), a rowwise one whose output is ``Shard(d)``
reduce-scatters. Parameters become this rank's plain shards, not DTensors. A layer's output is a
local tensor, or with ``use_local_output=False`` on a ``ColwiseParallel`` / ``RowwiseParallel``
entry a DTensor on the plan's mesh placed as its ``output_layouts`` say: torchtitan's head
``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` gives the vocabulary-sharded
logits that torch's ``loss_parallel()`` takes, without gathering them. A DTensor given to a planned
layer is laid out as the layer's input layout and its local part taken (torch's layers take DTensor
inputs too). ``SequenceParallel`` and ``PrepareModuleInput`` return local tensors whatever their
``use_local_output`` (torch's default there is DTensors; the values are the same). Like torch's, a
plan's layouts are trusted: they say what each local tensor is.

What torchpar's layers do not compute is refused, naming the plan entry, before anything changes:
``ColwiseParallel`` on an embedding (its embedding dimension split), a colwise output on another
layout than ``Shard(-1)`` or ``Replicate()``, ``PrepareModuleOutput``, a ``PrepareModuleInput``
other than sequence shards to whole (positional inputs only), and sequence parallelism on a
dimension other than 0 (``[s, b, h]``, Megatron's layout) or 1 (``[b, s, h]``, torch's default;
each collective then transposes), or on two in one plan.
"""
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from torchpar.parallel.parallelize import _matches, apply_plan, check_plan
from torchpar.parallel.tensor import comm


def _one(layouts):
    return layouts[0] if isinstance(layouts, tuple) and len(layouts) == 1 else layouts


def _is(layout, kind, dim=None):
    """``layout`` is exactly a ``kind`` (Shard, Replicate), on ``dim`` where given."""
    return type(layout) is kind and (dim is None or layout.dim == dim)


def _sequence_dims(plan):
    """The sequence dimensions the plan's layouts and SequenceParallel entries name."""
    dims = set()
    for style in plan.values():
        if isinstance(style, SequenceParallel):
            dims.add(_one(style.sequence_sharding).dim)
        for field in ("input_layouts", "output_layouts"):
            for layout in getattr(style, field, None) or ():
                if type(layout) is Shard and layout.dim != -1:
                    dims.add(layout.dim)
    return dims


def _style(name, module, style, sequence_dim):
    """(``parallelize`` style, whether this layer runs under sequence parallelism) computing what
    torch's ``style`` computes on ``module``; ``sequence_dim``: the plan's sequence dimension."""
    what = f"parallelize_module: plan entry for {name!r} ({type(style).__name__} on a {type(module).__name__})"
    if not isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel)):
        raise NotImplementedError(f"{what}: {type(style).__name__} is not supported; torchpar takes ColwiseParallel, "
                                  "RowwiseParallel, SequenceParallel and PrepareModuleInput")
    if isinstance(style, SequenceParallel):
        return "sequence", True
    if isinstance(style, ColwiseParallel):
        if isinstance(module, nn.Embedding):
            raise NotImplementedError(f"{what}: splitting the embedding dimension is not supported; "
                                      "RowwiseParallel splits the vocabulary")
        src, out = _one(style.input_layouts), _one(style.output_layouts)
        if not (_is(out, Shard, -1) or _is(out, Replicate)):
            raise NotImplementedError(f"{what}: output_layouts={out}; the output is sharded on its last "
                                      "dimension (Shard(-1)) or gathered whole (Replicate())")
        return ("colwise" if _is(out, Shard) else "colwise_gather"), _sequence_sharded(what, "input", src, sequence_dim)
    src, out = _one(style.input_layouts), _one(style.output_layouts)
    embedding = isinstance(module, nn.Embedding)
    if not (_is(src, Replicate) if embedding else _is(src, Shard, -1)):
        raise NotImplementedError(f"{what}: input_layouts={src}; torchpar's takes "
                                  f"{Replicate() if embedding else Shard(-1)}")
    return ("vocab" if embedding else "rowwise"), _sequence_sharded(what, "output", out, sequence_dim)


def _input_layout(style, sequence_dim):
    """The layout of the local tensor the converted layer takes (what a DTensor input is made)."""
    if isinstance(style, SequenceParallel):
        return Shard(sequence_dim)
    return _one(style.input_layouts)


def _placed(layout, ndim):
    """``layout`` with a negative shard dimension counted from the end of an ``ndim``-d tensor."""
    return Shard(layout.dim % ndim) if type(layout) is Shard else layout


def _local_of(dtensor, layout, mesh, what):
    """A DTensor input laid out as ``layout`` on ``mesh``, and its local part taken."""
    if dtensor.device_mesh != mesh:
        raise ValueError(f"{what}: a DTensor input on {dtensor.device_mesh}, the plan's mesh is {mesh}")
    return dtensor.redistribute(mesh, (_placed(layout, dtensor.dim()),)).to_local()


def _layer_hooks(module, style, sequence_dim, mesh, what):
    """A planned layer's hooks: DTensor inputs made local; with ``use_local_output=False``
    (ColwiseParallel, RowwiseParallel) the output made a DTensor placed as ``output_layouts``."""
    layout = _input_layout(style, sequence_dim)

    def take_local(m, args):
        if args and isinstance(args[0], DTensor):
            return (_local_of(args[0], layout, mesh, what),) + args[1:]
        return None
    module.register_forward_pre_hook(take_local)
    if isinstance(style, SequenceParallel) or style.use_local_output:
        return
    out_layout = _one(style.output_layouts)
    module.register_forward_hook(lambda m, args, out: DTensor.from_local(
        out, mesh, (_placed(out_layout, out.dim()),), run_check=False))


def _sequence_sharded(what, field, layout, sequence_dim):
    """Whether ``layout`` (a layer's input or output between the regions) is the sequence shard
    (sequence parallelism) rather than the whole tensor."""
    if _is(layout, Replicate):
        return False
    if _is(layout, Shard, sequence_dim):
        return True
    raise NotImplementedError(f"{what}: {field}_layouts={layout}; between the tensor-parallel regions an "
                              f"activation is whole (Replicate()) or a sequence shard (Shard({sequence_dim}))")


class _GatherSequence(torch.autograd.Function):
    """A sequence shard made whole (PrepareModuleInput, Shard(d) -> Replicate()): all-gather along
    ``d``; backward keeps this rank's part of the gradient, which the colwise layers below have
    all-reduced already (their input is whole, so they reduce its gradient, as torch's do)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        comm.check_same_sizes(x, group, "PrepareModuleInput input")  # before the all-gather, as the layers do
        return comm.gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        rank, tp = comm.group_rank_and_size(ctx.group)
        return grad.chunk(tp, ctx.dim)[rank].contiguous(), None, None


def _prepare_input(name, style, sequence_dim, mesh):
    """The forward pre-hook of a PrepareModuleInput entry: its positional inputs that are sequence
    shards and wanted whole are gathered; the others pass as they are."""
    what = f"parallelize_module: plan entry for {name!r} (PrepareModuleInput)"
    group = mesh.get_group(0)
    if style.input_kwarg_layouts or style.desired_input_kwarg_layouts:
        raise NotImplementedError(f"{what}: keyword input layouts are not supported")
    if style.input_layouts is None:
        return None  # nothing to prepare (torch's does nothing either)
    pairs = list(zip(style.input_layouts, style.desired_input_layouts))
    gather = []
    for i, (have, want) in enumerate(pairs):
        if have is None or want is None or (type(have) is type(want) and have == want):
            continue
        if not (_is(have, Shard, sequence_dim) and _is(want, Replicate)):
            raise NotImplementedError(f"{what}: input {i} from {have} to {want}; only a sequence shard "
                                      f"(Shard({sequence_dim})) made whole (Replicate()) is supported")
        gather.append(i)

    def hook(module, args):
        if len(args) != len(pairs):  # an input passed by keyword would go ungathered (review finding)
            raise ValueError(f"{what}: the module got {len(args)} positional inputs for {len(pairs)} input_layouts "
                             "(as torch's, PrepareModuleInput prepares positional inputs only)")
        return tuple(prepared(i, a) if i in gather else a for i, a in enumerate(args))

    def prepared(i, a):
        if isinstance(a, DTensor):  # made whole by DTensor's own redistribution
            return _local_of(a, Replicate(), mesh, what)
        return _GatherSequence.apply(a, sequence_dim, group)

    return hook


def parallelize_module(module, device_mesh=None, parallelize_plan=None, *, src_data_rank=0):
    """torch's ``parallelize_module`` on torchpar's layers (see the module's docstring): ``device_mesh``
    a 1-D mesh (its group is the tensor-parallel group); ``parallelize_plan`` one style for
    ``module`` itself or {glob over dotted module names: style}. ``src_data_rank=0`` (torch's
    default): the planned layers' parameters are first broadcast from the mesh's rank 0, so ranks
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
    dims = _sequence_dims(plan)
    if len(dims) > 1 or not dims <= {0, 1}:
        raise NotImplementedError(f"parallelize_module: the plan shards the sequence on dimensions {sorted(dims)}; "
                                  "torchpar takes one per plan, 0 ([s, b, h]) or 1 ([b, s, h])")
    sequence_dim = dims.pop() if dims else 0
    ours, sequence_parallel_of, hooks, styles = {}, {}, {}, {}
    for pattern, style in plan.items():
        hits = [n for n in named if n and _matches(pattern, n)] if pattern else [""]
        if "" in hits:
            raise NotImplementedError("parallelize_module: a style for the module itself inside a dict plan "
                                      "(key '') is not supported; pass the style alone")
        if not hits:  # torch warns and skips such an entry
            warnings.warn(f"parallelize_module: plan entry {pattern!r} matches no submodule; skipped", stacklevel=2)
        for n in hits:
            if isinstance(style, PrepareModuleInput):
                if (hook := _prepare_input(n, style, sequence_dim, device_mesh)) is not None:
                    hooks[n] = hook
            else:
                ours[n], sequence_parallel_of[n] = _style(n, named[n], style, sequence_dim)
                styles[n] = style
    checked = check_plan(holder, ours)  # parallelize's checks (module types, ties) before anything changes
    if src_data_rank is not None:
        src = dist.get_global_rank(group, src_data_rank)
        for n in ours:
            for t in list(named[n].parameters()) + list(named[n].buffers()):
                dist.broadcast(t.data, src, group=group)
    apply_plan(holder, checked, group, sequence_dim, sequence_parallel_of)
    for n, hook in hooks.items():
        holder.get_submodule(n).register_forward_pre_hook(hook)
    for n, style in styles.items():
        _layer_hooks(holder.get_submodule(n), style, sequence_dim, device_mesh,
                     f"parallelize_module: plan entry for {n!r}")
    return holder["m"] if root else holder
