"""Cutting a model into pipeline stages, so that users need not slice it by hand.

``split(model, num_stages, stage_index)`` takes an ``nn.Sequential``, or a model whose layers
are one ``nn.ModuleList``/``nn.Sequential`` attribute (``model.layers``, ``model.blocks``,
``model.h`` ...), and returns the ``nn.Sequential`` of stage ``stage_index``'s layers (the same
module objects: parameters are shared, not copied). Without ``split_points`` the layers are
divided as evenly as possible (earlier stages get the extra layer); with
``split_points=["3", "6"]`` (names of the layers that *start* a new stage, as in
``model.named_children()``; for a model with a block list, ``"layers.3"`` or ``"3"``) the cut
is where the user says.
"""
from torch import nn

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
    piece = layers[bounds[stage_index]:bounds[stage_index + 1]]
    return nn.Sequential(*[m for _, m in piece])
