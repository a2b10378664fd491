"""``pipeline(module, mb_args, split_spec=...)``: torch.distributed.pipelining's front end on torchpar's
``split``, so the tutorial form runs unchanged::

    pipe = pipeline(model, mb_args=(x_mb,), split_spec={"layers.4": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, device, group)

torch traces the model with ``torch.export`` on the example micro-batch; ``split`` traces it with
``torch.fx`` (split.py says what that allows), so ``mb_args`` and ``mb_kwargs`` are accepted and
not needed. A split point names a layer of the model's block list (or of an ``nn.Sequential``):
``BEGINNING`` starts a stage at it, ``END`` starts one after it (code between two layers goes with
the earlier stage). Unlike torch's, a cut before the first layer or after the last one (a stage of
only the code around the layers) is refused, and ``split_policy`` is refused.
"""
from torch.distributed.pipelining import SplitPoint

from torchpar.parallel.pipeline.split import _layers, split
from torchpar.parallel.pipeline.stage import PipelineStage


class Pipe:
    """The model and where it is cut; ``build_stage`` makes this rank's ``PipelineStage``."""

    def __init__(self, module, split_points):
        self.module = module
        self.split_points = split_points
        self.num_stages = len(split_points) + 1

    def get_stage_module(self, stage_index):
        """Stage ``stage_index``'s module (it holds the model's own modules and parameters)."""
        return split(self.module, self.num_stages, stage_index, self.split_points or None)

    def build_stage(self, stage_index, device, group=None):
        return PipelineStage(self.get_stage_module(stage_index), stage_index, self.num_stages, device, group=group)


def pipeline(module, mb_args=(), mb_kwargs=None, split_spec=None, split_policy=None):
    """torch's ``pipeline`` (see the module's docstring): one stage per split point, plus one."""
    if split_policy is not None:
        raise NotImplementedError("pipeline: split_policy is not supported; give split_spec "
                                  "({layer name: SplitPoint.BEGINNING or END})")
    prefix, layers = _layers(module)
    names = [prefix + n for n, _ in layers]
    points = []
    for name, where in (split_spec or {}).items():
        full = name if name.startswith(prefix) else prefix + name
        if full not in names:
            raise ValueError(f"pipeline: split point {name!r} is not a layer of {type(module).__name__}; its layers "
                             f"are {names}")
        if where == SplitPoint.END:
            i = names.index(full) + 1
            if i == len(names):
                raise ValueError(f"pipeline: SplitPoint.END at the last layer {name!r} leaves an empty stage")
            full = names[i]
        elif where != SplitPoint.BEGINNING:
            raise ValueError(f"pipeline: split point {name!r} is {where!r}, not a SplitPoint")
        if full == names[0]:  # torch would make a stage of the code before the first block alone
            raise ValueError(f"pipeline: a stage starting at the first layer {name!r} would leave only the code "
                             "before the layers to the stage before it; split cuts between layers")
        if full in points:
            raise ValueError(f"pipeline: two split points cut before {full!r}")
        points.append(full)
    points.sort(key=names.index)
    return Pipe(module, points)
