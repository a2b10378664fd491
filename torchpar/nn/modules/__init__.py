from torchpar.nn.modules.fused import BiasDropoutAdd, BiasGeLU, LayerNorm

__all__ = ["LayerNorm", "BiasGeLU", "BiasDropoutAdd"]
