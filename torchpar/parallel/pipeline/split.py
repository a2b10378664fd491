"""Cutting a model into pipeline stages, so that users need not slice it by hand.

``split(model, num_stages, stage_index)`` takes

- an ``nn.Sequential``: stage ``stage_index`` is the ``nn.Sequential`` of its layers;
- a model whose layers are one ``nn.ModuleList``/``nn.Sequential`` attribute (``model.layers``,
  ``model.blocks``, ``model.h`` ...) with code around them (embeddings before, a head after): the
  model's ``forward`` is traced with ``torch.fx``, the blocks kept whole (leaves of the trace),
  and stage ``stage_index`` is a ``torch.fx.GraphModule`` running its blocks and the code
  between them; the first stage also runs what comes before the first block, the last what
  comes after the last block. A value one stage computes and a later one reads travels between
  them as a stage output (through the stages between, when it skips some), so the first stage
  takes the model's inputs and the last returns its output.

The stages hold the model's own module objects (parameters are shared, not copied) under their
names in the model, so a stage's ``state_dict`` keys are the whole model's. Without
``split_points`` the layers are divided as evenly as possible (earlier stages get the extra
layer); with ``split_points=["3", "6"]`` (names of the layers that *start* a new stage, as in
``model.named_children()``; for a model with a block list, ``"layers.3"`` or ``"3"``) the cut is
where the user says.

Tracing fixes the Python control flow of the code around the blocks at split time (the blocks
run their own ``forward``, branches included): ``self.training`` read there (write
``nn.Dropout`` modules, not ``F.dropout(x, p, self.training)``), and arguments compared with
``None`` (traced as given). Code that branches on tensor values cannot be traced, and such a
model is refused with the reason (build its stages by hand), as are blocks that forward runs
out of their list's order, twice, or not at all. A trained parameter used in two stages
(weights tied between the embedding and the head), or a module with state that two stages
call, is refused too: each stage's rank would keep its own copy;
``torchpar.models.ParallelGPT`` shows how to tie weights across stages. Buffers the code around
the blocks reads are copied into each stage that reads them (a rotary table handed to every
block), so they must not be written in forward.
"""
from collections import OrderedDict
from operator import attrgetter

import torch
from torch import fx, nn

_BLOCK_LISTS = ("layers", "blocks", "h", "layer")


def _layers(model):
    """(prefix, [(name, module)]) of the layers to cut."""
    if isinstance(model, nn.Sequential):
        return "", list(model.named_children())
    for attr in _BLOCK_LISTS:
        blocks = getattr(model, attr, None)
        if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            return attr + ".", list(blocks.named_children())
    lists = [n for n, m in model.named_children() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    if len(lists) == 1:
        return lists[0] + ".", list(getattr(model, lists[0]).named_children())
    raise TypeError(f"split: {type(model).__name__} is neither an nn.Sequential nor a model with one "
                    f"list of blocks (found lists: {lists or 'none'}); build the stages by hand")


def split_boundaries(names, num_stages, split_points=None, prefix=""):
    """Index of the first layer of each stage, plus len(names) at the end."""
    n = len(names)
    if num_stages < 1 or num_stages > n:
        raise ValueError(f"split: cannot cut {n} layers into {num_stages} stages")
    if split_points is None:
        base, extra = divmod(n, num_stages)
        starts = [s * base + min(s, extra) for s in range(num_stages)]
    else:
        if len(split_points) != num_stages - 1:
            raise ValueError(f"split: {num_stages} stages need {num_stages - 1} split points, "
                             f"got {len(split_points)}: {list(split_points)}")
        index = {name: i for i, name in enumerate(names)}
        index.update({prefix + name: i for i, name in enumerate(names)})
        starts = [0]
        for point in split_points:
            if point not in index:
                raise ValueError(f"split: split point '{point}' is not a layer name; layers are "
                                 f"{[prefix + nm for nm in names]}")
            if index[point] <= starts[-1]:
                raise ValueError(f"split: split points must name layers in increasing order, after the "
                                 f"first; '{point}' does not ({list(split_points)})")
            starts.append(index[point])
    return starts + [n]


def split(model, num_stages, stage_index, split_points=None):
    """Stage ``stage_index`` of ``model`` cut into ``num_stages`` consecutive pieces."""
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"split: stage_index {stage_index} out of range for {num_stages} stages")
    prefix, layers = _layers(model)
    bounds = split_boundaries([n for n, _ in layers], num_stages, split_points, prefix)
    if isinstance(model, nn.Sequential):
        piece = layers[bounds[stage_index]:bounds[stage_index + 1]]
        return nn.Sequential(OrderedDict(piece))  # the model's names: checkpoint keys do not collide
    stage_of_block = {prefix + name: s for s in range(num_stages) for name, _ in layers[bounds[s]:bounds[s + 1]]}
    return _traced_stage(model, stage_of_block, num_stages, stage_index)


class _BlocksAsLeaves(fx.Tracer):
    """Traces the model's own code, not into its blocks: a block may branch on its inputs or on
    flags (recomputation, training), which tracing would fix."""

    def __init__(self, block_names):
        super().__init__()
        self.block_names = block_names

    def is_leaf_module(self, m, qualname):
        return qualname in self.block_names or super().is_leaf_module(m, qualname)


def _traced_stage(model, stage_of_block, num_stages, stage_index):
    before = set(vars(model))
    tracer = _BlocksAsLeaves(set(stage_of_block))
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - torch.fx raises several kinds; all mean "cannot trace"
        raise TypeError(f"split: cannot trace {type(model).__name__}.forward with torch.fx around its blocks "
                        f"({type(e).__name__}: {e}); build the stages by hand (a PipelineStage takes any "
                        "module)") from e
    finally:
        # Tensor constants of the traced code (torch.tensor(...) in forward) are stored on the
        # traced module; they are the stage's, not the user's model's (review).
        constants = {name: model.__dict__.pop(name) for name in set(vars(model)) - before}
    stage = _assign_stages(graph, stage_of_block)
    _refuse_shared_state(model, constants, graph, stage)
    return _stage_module(model, constants, graph, stage, num_stages, stage_index)


def _assign_stages(graph, stage_of_block):
    """node -> stage. A block's call is its stage's; any other computing node goes with the last
    block before it (the first stage before any block); a parameter or buffer read
    (``get_attr``) goes with each stage that reads it (copied, see _stage_module). The blocks
    must run once each, in their list's order (``stage_of_block``'s): the cut follows that order."""
    position = {name: i for i, name in enumerate(stage_of_block)}
    stage, current, called, previous = {}, 0, set(), None
    for node in graph.nodes:
        if node.op == "call_module" and node.target in stage_of_block:
            if node.target in called:
                raise ValueError(f"split: block '{node.target}' runs twice in forward; the stages follow the "
                                 "blocks' order, each block once: build the stages by hand")
            if previous is not None and position[node.target] < position[previous]:
                raise ValueError(f"split: block '{node.target}' runs after '{previous}'; the stages follow the "
                                 "blocks' list order, and forward must run them in it")
            called.add(node.target)
            previous = node.target
            current = stage_of_block[node.target]
        if node.op == "placeholder":
            stage[node] = 0
        elif node.op != "get_attr":
            stage[node] = current
    missing = [b for b in stage_of_block if b not in called]
    if missing:
        raise ValueError(f"split: forward does not run the blocks {missing}; each stage must run its blocks "
                         "(cut only the blocks forward runs, or build the stages by hand)")
    return stage


def _stages_using(node, stage):
    return {stage[u] for u in node.users}


def _refuse_shared_state(model, constants, graph, stage):
    """A trained parameter two stages use would be two parameters trained apart, one per rank;
    a module two stages call would keep two states (a BatchNorm's running statistics). Buffers
    the code around the blocks reads (a rotary table handed to every block) are copied into each
    stage that reads them: they must not be written in forward."""
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = f"{names[id(p)]}' = '{n}" if id(p) in names else n
    where, modules = {}, {}  # id(parameter) -> (name, stages); module name -> stages
    for node in graph.nodes:
        if node.op == "call_module":
            module = model.get_submodule(node.target)
            params = list(module.parameters())
            used = {stage[node]}
            if params or any(True for _ in module.buffers()):
                modules.setdefault(node.target, set()).add(stage[node])
        elif node.op == "get_attr":
            value = constants[node.target] if node.target in constants else attrgetter(node.target)(model)
            params = [value] if isinstance(value, nn.Parameter) else []
            used = _stages_using(node, stage)
        else:
            continue
        for p in params:
            if p.requires_grad:
                where.setdefault(id(p), (names.get(id(p), node.target), set()))[1].update(used)
    for name, stages in modules.items():
        if len(stages) > 1:
            raise ValueError(f"split: module '{name}' runs in stages {sorted(stages)}; its parameters and buffers "
                             "would be kept apart on each stage's rank. Call it in one stage only")
    for name, stages in where.values():
        if len(stages) > 1:
            raise ValueError(f"split: parameter '{name}' is used by stages {sorted(stages)} (weights shared "
                             "across stages); each stage would train its own copy. Keep what uses it in one stage "
                             "(split_points), or give each stage its own copy and sum their gradients over the "
                             "stages that hold them, as torchpar.models.ParallelGPT does for tied embeddings")


def _check_tensors(values, names, stage_index):
    """Inserted before a stage's output: what crosses a stage boundary must be tensors."""
    for v, name in zip(values, names):
        if not isinstance(v, torch.Tensor):
            hint = (" If it is an argument of forward left at None, the code around the blocks was traced as "
                    "if it were given (torch.fx sees every argument): pass it." if v is None else "")
            raise TypeError(f"split: stage {stage_index} hands '{name}' to a later stage, but it is a "
                            f"{type(v).__name__}, not a tensor; pipeline stages exchange tensors only. "
                            "Compute it in the stage that reads it (or from a tensor there), or move the "
                            f"cut (split_points).{hint}")
    return values


def _describe(node):
    """``name = what(args)`` of a traced value, for messages."""
    what = getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        what = "." + what
    return f"{node.name} = {what}({', '.join(str(a) for a in node.args)})" if node.op != "placeholder" else node.name


def _stage_module(model, constants, graph, stage, num_stages, stage_index):
    """The GraphModule of one stage: its nodes, with placeholders for the values earlier stages
    computed and it (or a later stage) reads, and the values later stages read as its output,
    in the order of the model's graph (so every rank agrees on the positions)."""
    nodes = list(graph.nodes)

    def crossing(boundary):  # values made at or before stage `boundary`, read after it
        return [n for n in nodes if n.op != "get_attr" and n.op != "output" and stage[n] <= boundary
                and any(stage[u] > boundary for u in n.users)]

    out = fx.Graph()
    env = {}
    if stage_index == 0:
        for n in nodes:
            if n.op == "placeholder":
                env[n] = out.node_copy(n)
    else:
        for n in crossing(stage_index - 1):
            env[n] = out.placeholder(n.name)
    for n in nodes:
        if n.op in ("placeholder", "output") or n in env:
            continue
        if n.op == "get_attr":
            if stage_index in _stages_using(n, stage):
                env[n] = out.node_copy(n, lambda a: env[a])
            continue
        if stage[n] == stage_index:
            env[n] = out.node_copy(n, lambda a: env[a])
    if stage_index == num_stages - 1:
        result = next(n for n in nodes if n.op == "output")
        out.output(fx.map_arg(result.args[0], lambda a: env[a]))
    else:
        live = crossing(stage_index)
        values = out.call_function(_check_tensors, (tuple(env[n] for n in live), tuple(_describe(n) for n in live),
                                                    stage_index))
        out.output(values)
    targets = {n.target for n in out.nodes if n.op in ("get_attr", "call_module")}
    attrs = {t: constants[t] if t in constants else attrgetter(t)(model) for t in targets}
    module = fx.GraphModule(attrs, out, class_name=f"{type(model).__name__}Stage{stage_index}")
    for t, value in attrs.items():  # a buffer is in state_dict as in the model; constants are not
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not _persistent(model, t):
            owner, _, field = t.rpartition(".")
            module.get_submodule(owner)._non_persistent_buffers_set.add(field)
    module.training = model.training  # its submodules keep their own modes (a frozen BatchNorm)
    return module


def _persistent(model, target):
    owner, _, field = target.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return field in module._buffers and field not in module._non_persistent_buffers_set
