"""Fused element-wise and normalisation ops (``torch.ops.torchpar.*``), as functions.

Each is one pass over memory in C++ (CPU) or CUDA, with its backward in C++; all three
trace under ``torch.compile`` without a graph break. See ``csrc/kernels/``.
"""
from typing import List, Optional

import torch
from torch import Tensor

import torchpar._C  # noqa: F401  (registers torch.ops.torchpar)

__all__ = ["layer_norm", "bias_gelu", "bias_dropout_add"]


def layer_norm(input: Tensor, normalized_shape: List[int],
               weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """Same contract as :func:`torch.nn.functional.layer_norm`: ``normalized_shape`` a list,
    tuple or ``torch.Size`` of ints (in eager mode an int too); statistics in float32
    (float64 for float64 input), saved for the backward. Scripts with TorchScript as torch's
    does, its annotation the same (``List[int]``, which takes tuples in scripted code)."""
    if isinstance(normalized_shape, int):
        shape = [normalized_shape]
    else:
        shape = list(normalized_shape)
    return torch.ops.torchpar.layer_norm(input, shape, weight, bias, float(eps))


def bias_gelu(input: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(input + bias)``; ``bias`` has shape ``[input.shape[-1]]``; ``approximate`` is
    ``"none"`` (erf) or ``"tanh"``, as in :func:`torch.nn.functional.gelu`."""
    return torch.ops.torchpar.bias_gelu(input, bias, approximate)


def bias_dropout_add(input: Tensor, bias: Tensor, residual: Tensor, p: float = 0.1,
                     training: bool = True) -> Tensor:
    """``residual + dropout(input + bias, p, training)``.

    The mask comes from Philox keyed by one draw from torch's default (CPU) generator, so
    ``torch.manual_seed`` fixes it, on CPU and CUDA alike; the backward regenerates it.
    Captured in a CUDA graph, the key comes from torch's CUDA generator at replay time, so
    every replay draws a new mask.
    """
    return torch.ops.torchpar.bias_dropout_add(input, bias, residual, float(p), bool(training))
