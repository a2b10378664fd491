"""Modules and functions over torchpar's fused kernels (``torch.ops.torchpar``)."""
from torchpar.nn import functional
from torchpar.nn.modules import BiasDropoutAdd, BiasGeLU, LayerNorm

__all__ = ["functional", "LayerNorm", "BiasGeLU", "BiasDropoutAdd"]
