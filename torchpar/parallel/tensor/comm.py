"""The tensor-parallel region operators (Megatron-LM's mappings), as Python functions.

Each is a C++ autograd function (csrc/parallel/tensor_parallel.cpp) whose backward is the
conjugate collective of its forward (Shoeybi et al. 2019, arXiv:1909.08053, section 3;
Korthikanti et al. 2022, arXiv:2205.05198, section 4.2):

================================== ================ ==================
operator                            forward          backward
================================== ================ ==================
copy_to_region                      identity         all-reduce
reduce_from_region                  all-reduce       identity
scatter_to_region (last dim)        keep own slice   all-gather
gather_from_region (last dim)       all-gather       keep own slice
scatter_to_sequence_region (dim 0)  keep own slice   all-gather
gather_from_sequence_region (dim 0) all-gather       reduce-scatter
reduce_scatter_to_sequence_region   reduce-scatter   all-gather
================================== ================ ==================

The sequence is dimension 0 (``[s, b, h]``, Megatron's layout): a rank's shard of a contiguous
tensor is one contiguous block, so the collectives need no packing copies.

``group`` is any ``torch.distributed`` process group (``None``: the default group); only the
public c10d API is called, so the operators run on torchpar, gloo and nccl alike.
"""
import torch.distributed as dist

from torchpar import _C

__all__ = [
    "copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region",
    "scatter_to_sequence_region", "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region", "linear_with_async_comm", "check_same_sizes",
    "resolve_group", "group_rank_and_size",
]


def resolve_group(group):
    """``group``, or the default group when it is ``None``."""
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise RuntimeError("torchpar tensor parallel: call torch.distributed.init_process_group first "
                               "(or pass group=)")
    return group


def group_rank_and_size(group):
    group = resolve_group(group)
    return dist.get_rank(group), dist.get_world_size(group)


def copy_to_region(input, group=None):
    return _C.tp_copy_to_region(input, resolve_group(group))


def reduce_from_region(input, group=None):
    return _C.tp_reduce_from_region(input, resolve_group(group))


def scatter_to_region(input, group=None):
    return _C.tp_scatter_to_region(input, resolve_group(group))


def gather_from_region(input, group=None):
    return _C.tp_gather_from_region(input, resolve_group(group))


def scatter_to_sequence_region(input, group=None):
    return _C.tp_scatter_to_sequence_region(input, resolve_group(group))


def gather_from_sequence_region(input, group=None):
    return _C.tp_gather_from_sequence_region(input, resolve_group(group))


def reduce_scatter_to_sequence_region(input, group=None):
    return _C.tp_reduce_scatter_to_sequence_region(input, resolve_group(group))


def reduce_scatter_along(input, dim, group=None):
    """``reduce_scatter_to_sequence_region`` with the sequence on ``dim`` (0 or 1): for a
    batch-first ``[b, s, h]`` the reduction runs on the transposed tensor (a copy each way)."""
    if dim == 0:
        return reduce_scatter_to_sequence_region(input, group)
    _, tp = group_rank_and_size(resolve_group(group))
    if input.dim() <= dim or input.size(dim) % tp:
        raise ValueError(f"torchpar tensor parallel: sequence parallelism on dim {dim} needs that dimension "
                         f"divisible by the tensor-parallel group size ({tp}); got shape {tuple(input.shape)}")
    return reduce_scatter_to_sequence_region(input.transpose(0, dim), group).transpose(0, dim)


def gather_along(input, dim, group=None):
    """``gather_from_sequence_region`` with the sequence on ``dim`` (0 or 1), transposing as
    ``reduce_scatter_along`` does."""
    if dim == 0:
        return gather_from_sequence_region(input, group)
    return gather_from_sequence_region(input.transpose(0, dim), group).transpose(0, dim)


def check_sequence_dim(dim):
    """The sequence dimension of a sequence-parallel layer: 0 (``[s, b, h]``, Megatron's layout,
    no copies) or 1 (``[b, s, h]``, torch's ``SequenceParallel`` default; each collective
    transposes)."""
    if dim not in (0, 1):
        raise ValueError(f"torchpar tensor parallel: sequence_dim is 0 ([s, b, h]) or 1 ([b, s, h]), got {dim!r}")
    return dim


def linear_with_async_comm(input, weight, bias=None, group=None, sequence_parallel=False, overlap=True):
    """``input @ weight.T + bias`` for a weight split by output features (Megatron-LM's
    LinearWithGradAccumulationAndAsyncCommunication). Backward launches the input gradient's
    all-reduce (reduce-scatter under sequence parallelism) asynchronously and computes the
    weight gradient while it runs."""
    return _C.tp_linear_with_async_comm(input, weight, bias, resolve_group(group), sequence_parallel, overlap)


def check_same_sizes(input, group, what):
    """ValueError on every rank of ``group`` unless ``input.shape`` is the same on all of them
    (one small fixed-size all-gather, so mismatched ranks cannot hang in the next collective)."""
    group = resolve_group(group)
    if dist.get_world_size(group) > 1:
        _C.tp_check_same_sizes(input, group, what)


def check_divisible(size, parts, what):
    """ValueError naming ``what`` unless ``size`` splits into ``parts`` equal shards."""
    if size % parts != 0:
        raise ValueError(f"torchpar tensor parallel: {what} ({size}) must be divisible by the "
                         f"tensor-parallel group size ({parts})")
