"""Optimizers for sharded data parallelism: ZeRO stages 1 and 2 (``ZeroRedundancyOptimizer``),
O2 float32 master weights without sharding (``MixedPrecisionOptimizer``), and the float16
``DynamicLossScaler`` both take."""
from torchpar.optim.loss_scaler import DynamicLossScaler
from torchpar.optim.zero import ZeroRedundancyOptimizer
from torchpar.optim.mixed_precision import MixedPrecisionOptimizer

__all__ = ["ZeroRedundancyOptimizer", "MixedPrecisionOptimizer", "DynamicLossScaler"]
