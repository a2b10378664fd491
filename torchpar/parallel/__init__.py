"""Parallel modules: data parallel (``DistributedDataParallel``) and the O2 mixed-precision
policy (``MixedPrecision``) the data-parallel wrappers share."""
from torchpar.parallel.ddp import DistributedDataParallel
from torchpar.parallel.mixed_precision import MixedPrecision

__all__ = ["DistributedDataParallel", "MixedPrecision"]
