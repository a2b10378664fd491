"""The O2 mixed-precision policy shared by DDP, ZeRO and FSDP.

O2 (the NVIDIA mixed-precision recipe; Micikevicius et al. 2018, arXiv:1710.03740): the model's
parameters and compute are in a 16-bit dtype, the optimizer steps float32 master copies, and
gradients are reduced across ranks in float32, because sums of many low-precision gradients lose
precision. One policy object describes it for all three wrappers.
"""
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: dtype of parameters during forward and backward (None: keep the
    module's). ``reduce_dtype``: dtype gradients are reduced in (None: ``param_dtype``'s).
    ``master_dtype``: dtype of the weights the optimizer steps."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = torch.float32
    master_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "master_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"MixedPrecision.{name} must be a floating-point torch.dtype, got {value!r}")


def cast_floating(tree, dtype):
    """``tree`` (inputs, outputs: tensors in lists, tuples, dicts) with its floating-point tensors
    in ``dtype``; ``None`` leaves it as it is."""
    if dtype is None:
        return tree
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)
