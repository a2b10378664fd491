"""Modules over the fused ops in :mod:`torchpar.nn.functional`."""
import numbers
from typing import List, Union

import torch
from torch import Size, Tensor, nn

from torchpar.nn import functional as F

__all__ = ["LayerNorm", "BiasGeLU", "BiasDropoutAdd"]


class LayerNorm(nn.Module):
    """Drop-in for :class:`torch.nn.LayerNorm`: same arguments, same parameters and
    ``state_dict`` keys (``weight``, ``bias``), so checkpoints load either way; the same
    ``repr``; scriptable with TorchScript."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]

    def __init__(self, normalized_shape: Union[int, List[int], Size], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return F.layer_norm(input, list(self.normalized_shape), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}")


class BiasGeLU(nn.Module):
    """``gelu(x + bias)`` with a learned ``bias`` of shape ``[features]`` (initialised to
    zero), the bias a preceding ``nn.Linear(..., bias=False)`` leaves out."""

    def __init__(self, features: int, approximate: str = "none", device=None,
                 dtype=None) -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate
        self.bias = nn.Parameter(torch.zeros(features, device=device, dtype=dtype))

    def forward(self, input: Tensor) -> Tensor:
        return F.bias_gelu(input, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"{self.bias.shape[0]}, approximate={self.approximate!r}"


class BiasDropoutAdd(nn.Module):
    """``residual + dropout(x + bias)``, with a learned ``bias`` of shape ``[features]``;
    dropout is active in training mode only, as with :class:`torch.nn.Dropout`."""

    def __init__(self, features: int, p: float = 0.1, device=None, dtype=None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p must be in [0, 1], got {p}")
        self.p = p
        self.bias = nn.Parameter(torch.zeros(features, device=device, dtype=dtype))

    def forward(self, input: Tensor, residual: Tensor) -> Tensor:
        return F.bias_dropout_add(input, self.bias, residual, self.p, self.training)

    def extra_repr(self) -> str:
        return f"{self.bias.shape[0]}, p={self.p}"
