"""``parallelize(model, plan, group)``: tensor parallelism from a plan of module names, shaped
like torch's ``parallelize_module`` (issue 17), so a model written with plain ``nn.Linear``,
``nn.Embedding`` and ``nn.LayerNorm`` becomes tensor-parallel without rewriting it.

Styles:

- ``"colwise"``: an ``nn.Linear`` becomes a ColumnParallelLinear (output features split);
- ``"colwise:N"``: the same for an ``nn.Linear`` whose output is N fused blocks side by side
  (``"colwise:3"`` for a q/k/v projection ``nn.Linear(h, 3 * h)``, ``"colwise:2"`` for a fused
  gate/up projection): each block is split, so each rank gets its heads' q, k and v
  (ColumnParallelLinear's ``stride``);
- ``"colwise_gather"``: the same with its output gathered whole (``gather_output``; an output
  layer whose logits the loss wants whole, as torch's ``ColwiseParallel(output_layouts=Replicate())``);
- ``"rowwise"``: an ``nn.Linear`` becomes a RowParallelLinear (input features split, output
  all-reduced);
- ``"vocab"``: an ``nn.Embedding`` becomes a VocabParallelEmbedding;
- ``"sequence"``: a LayerNorm / RMSNorm / Dropout / position Embedding runs on the rank's sequence shard (its
  parameters' gradients are all-reduced over the group; a Dropout's masks differ per rank);
- ``"model_parallel_rng"``: any module whose random ops act on split activations runs its
  forward under the model-parallel RNG stream (``torchpar.parallel.tensor.random``), so its
  dropout masks differ across ranks: an attention block (its heads are split) and, under
  sequence parallelism, a transformer block (its dropouts act on sequence shards). Dropout
  outside these draws from the default generator, the same on every rank, as replicated
  activations need; ``model_parallel_seed(seed, group)`` seeds both.

Any ``"sequence"`` entry turns on sequence parallelism for the whole plan: activations
between the tensor-parallel regions are then ``[s/tp, b, h]`` shards (dim 0 the sequence),
the colwise layers all-gather them and the rowwise and vocab layers reduce-scatter into them.

The model's own code must work on local shards: an attention block reads the number of heads
from its projections' output (``view(s, b, -1, head_dim)``), and a loss over colwise logits is
``vocab_parallel_cross_entropy``.
"""
from fnmatch import fnmatchcase

from torch import nn

from torchpar.parallel.tensor import comm
from torchpar.parallel.tensor.embedding import VocabParallelEmbedding
from torchpar.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from torchpar.parallel.tensor.random import mark_model_parallel_rng
from torchpar.parallel.tensor.sequence import SEQUENCE_PARALLEL_TYPES, mark_sequence_parallel

STYLES = ("colwise", "colwise:N", "colwise_gather", "rowwise", "vocab", "sequence", "model_parallel_rng")
# What each style converts: a type the module must be exactly, or a tuple it must be an instance of.
_NEEDS = {"colwise": nn.Linear, "colwise_gather": nn.Linear, "rowwise": nn.Linear, "vocab": nn.Embedding,
          "sequence": SEQUENCE_PARALLEL_TYPES, "model_parallel_rng": (nn.Module,)}


def _parse(style):
    """(kind, fused blocks) of a plan style: "colwise:3" -> ("colwise", 3); None if unknown."""
    if not isinstance(style, str):
        return None
    kind, colon, blocks = style.partition(":")
    if not colon:
        return (kind, 1) if kind in _NEEDS else None
    if kind == "colwise" and blocks.isdigit() and int(blocks) >= 1:
        return kind, int(blocks)
    return None


def _matches(pattern, name):
    # Atom by atom, as torch's parallelize_module: "blocks.*.mlp.fc1" never crosses a dot.
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatchcase(p, a) for a, p in zip(atoms, parts))


def _convert(name, module, style, group, sequence_parallel, sequence_dim):
    kind, blocks = _parse(style)
    sp = {"sequence_parallel": sequence_parallel, "sequence_dim": sequence_dim}
    if kind in ("colwise", "colwise_gather"):
        return ColumnParallelLinear.from_dense(module, group, stride=blocks, gather_output=kind == "colwise_gather",
                                               **sp)
    if kind == "rowwise":
        return RowParallelLinear.from_dense(module, group, **sp)
    if kind == "vocab":
        return VocabParallelEmbedding.from_dense(module, group, **sp)
    if kind == "model_parallel_rng":
        return mark_model_parallel_rng(module, group)
    return mark_sequence_parallel(module, group, name)


def _sharding(style, param_name):
    # How the converted module holds its part of a parameter: modules that share (tie) a
    # parameter, as GPT-2's lm_head and token embedding do, can keep sharing it only when
    # every one of them holds the same part.
    kind, blocks = _parse(style) or (None, 1)
    if kind == "colwise" and blocks > 1:
        return f"split along dim 0 in {blocks} blocks"
    if kind in ("colwise", "colwise_gather", "vocab"):
        return "split along dim 0"
    if kind == "rowwise":
        return "split along dim 1" if param_name == "weight" else "replicated"
    return "unchanged"


def _shared_parameters(named, style_of):
    """[(holders, sharding)] for each parameter held by several modules, holders being
    [(module name, parameter name)]; a ValueError naming them unless all shard it alike."""
    holders = {}
    for name, module in named.items():
        for pname, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((name, pname))
    shared = []
    for hs in holders.values():
        if len(hs) < 2:
            continue
        kinds = {_sharding(style_of.get(n), pn) for n, pn in hs}
        if len(kinds) > 1:
            where = ", ".join(f"{n!r}.{pn} ({style_of.get(n, 'not in the plan')})" for n, pn in hs)
            raise ValueError(f"parallelize: a parameter shared by {where} would be sharded differently "
                             f"in each ({', '.join(sorted(kinds))}); modules sharing a parameter need "
                             f"the same style")
        shared.append((hs, kinds.pop()))
    return shared


def parallelize(model: nn.Module, plan: dict, group=None, *, sequence_dim=0) -> nn.Module:
    """Replaces, in place, each module of ``model`` whose name matches a key of ``plan`` (glob
    patterns over dotted names, e.g. ``"blocks.*.attn.q_proj"``) by its tensor-parallel form
    for the style the key maps to, sharded over ``group`` (default: the default group).
    Returns ``model``.

    Every rank must call it with the same model (same seed or checkpoint) and plan. An entry
    matching no module, an unknown style or a module that cannot take its style is a
    ValueError/TypeError naming it, raised on every rank before any collective. Tied
    parameters (an ``lm_head`` sharing the token embedding's weight) stay tied when every module
    holding them shards them alike ("vocab" and "colwise" both split the vocabulary rows);
    otherwise it is a ValueError naming the modules.

    ``sequence_dim``: where the sequence is under sequence parallelism, 0 (``[s, b, h]``,
    Megatron's layout; the collectives run on the tensors themselves) or 1 (``[b, s, h]``, as
    torch's ``SequenceParallel`` default; each collective transposes, a copy each way).
    """
    group = comm.resolve_group(group)
    comm.check_sequence_dim(sequence_dim)
    return apply_plan(model, check_plan(model, plan), group, sequence_dim)


def check_plan(model, plan):
    """Every check of ``parallelize`` (nothing changed, no collective): the [(module name, style)]
    to convert, the tied parameters [(holders, sharding)] and whether sequence parallelism is on."""
    for pattern, style in plan.items():
        if _parse(style) is None:
            raise ValueError(f"parallelize: plan entry {pattern!r} has style {style!r}; styles are {STYLES} "
                             f"(N >= 1)")
    named = dict(model.named_modules())
    todo, entry_of = [], {}
    for pattern, style in plan.items():
        hits = [n for n in named if n and _matches(pattern, n)]
        if not hits:
            raise ValueError(f"parallelize: plan entry {pattern!r} ({style}) matches no module of "
                             f"{type(model).__name__}")
        for n in hits:
            if n in entry_of:  # converted once only; two styles for one module is ambiguous
                first, first_style = entry_of[n]
                if _parse(first_style) != _parse(style):
                    raise ValueError(f"parallelize: module {n!r} is matched by plan entries {first!r} "
                                     f"({first_style}) and {pattern!r} ({style})")
                continue
            entry_of[n] = (pattern, style)
            todo.append((n, style))
    for name, style in todo:
        module = named[name]
        need = _NEEDS[_parse(style)[0]]
        if not (isinstance(module, need) if isinstance(need, tuple) else type(module) is need):
            names = ", ".join(t.__name__ for t in need) if isinstance(need, tuple) else need.__name__
            raise TypeError(f"parallelize: module {name!r} is a {type(module).__name__}; style {style!r} "
                            f"needs an {names}")
    return todo, _shared_parameters(named, dict(todo)), "sequence" in plan.values()


def apply_plan(model, checked, group, sequence_dim=0, sequence_parallel_of=None):
    """Converts what ``check_plan`` returned, in place; returns ``model``. ``sequence_parallel_of``:
    {module name: whether that layer runs under sequence parallelism}, instead of the plan's
    one setting (torch's plans say it per layer, by their layouts)."""
    todo, shared, sequence_parallel = checked
    named = dict(model.named_modules())
    for name, style in todo:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        sp = (sequence_parallel_of or {}).get(name, sequence_parallel)
        setattr(parent, attr, _convert(name, named[name], style, group, sp, sequence_dim))
    for holders, sharding in shared:  # each converted module made its own copy: tie them again
        if sharding != "unchanged":
            (first, first_param), *rest = holders
            param = getattr(model.get_submodule(first), first_param)
            for name, pname in rest:
                setattr(model.get_submodule(name), pname, param)
    return model
