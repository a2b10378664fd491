"""Sequence parallelism for the layers between tensor-parallel regions (Korthikanti et al.
2022, arXiv:2205.05198, section 4.2.2).

LayerNorm and dropout act on each token alone, so outside the tensor-parallel regions each
rank can run them on its shard of the sequence (``[s/tp, b, h]``) instead of repeating them
on the whole one: their activations' memory drops by tp. Their parameters stay replicated,
but each rank's gradient now covers only its tokens; the sum over the group is the full
gradient, so a hook all-reduces it during backward (Megatron-LM all-reduces the same
"sequence_parallel" parameters after backward).

Dropout on a sequence shard draws from the model-parallel stream of
``torchpar.parallel.tensor.random``: the shards are different tokens, and each needs a mask of
its own.

A learned position embedding (``nn.Embedding``) is the same case: each rank adds the rows of
its own positions to its sequence shard (the model looks them up, as torchpar.models.GPT does
from its token embedding's rank), so each rank's gradient holds only its rows, and the sum over
the group is the full gradient.
"""
from torch import nn

from torchpar.nn import LayerNorm as FusedLayerNorm
from torchpar.parallel.tensor import comm
from torchpar.parallel.tensor.random import mark_model_parallel_rng
from torchpar import _C

# Token-wise modules that may run on a sequence shard (style "sequence" of parallelize); an
# Embedding there is a position embedding looked up at the shard's positions.
SEQUENCE_PARALLEL_TYPES = (nn.LayerNorm, nn.RMSNorm, FusedLayerNorm, nn.Dropout, nn.Embedding)


def mark_sequence_parallel(module: nn.Module, group=None, name=None):
    """Lets ``module`` (a LayerNorm, RMSNorm, Dropout or position Embedding) run on a sequence shard: each of its
    parameters gets ``sequence_parallel = True`` (Megatron's marker) and a gradient hook that
    all-reduces the gradient over ``group``; a Dropout draws its masks from the model-parallel
    stream (``mark_model_parallel_rng``). Returns ``module`` itself (same class, same
    state_dict keys)."""
    if not isinstance(module, SEQUENCE_PARALLEL_TYPES):
        raise TypeError(f"sequence parallelism: module {name or ''!s} ({type(module).__name__}) cannot "
                        f"run on a sequence shard; only {', '.join(t.__name__ for t in SEQUENCE_PARALLEL_TYPES)} can")
    group = comm.resolve_group(group)
    _, tp = comm.group_rank_and_size(group)
    if isinstance(module, nn.Dropout):
        mark_model_parallel_rng(module, group)
    for p in module.parameters(recurse=False):
        if getattr(p, "sequence_parallel", False):
            continue
        p.sequence_parallel = True
        if tp > 1 and p.requires_grad:
            p.register_hook(lambda grad, group=group: _C.tp_reduce_from_region(grad, group))
    return module
