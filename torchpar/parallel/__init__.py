"""Parallel modules: data parallel (``DistributedDataParallel``), the O2 mixed-precision
policy (``MixedPrecision``) the data-parallel wrappers share, and tensor parallelism
(``torchpar.parallel.tensor``, ``parallelize``)."""
from torchpar.parallel import tensor
from torchpar.parallel.ddp import DistributedDataParallel
from torchpar.parallel.mixed_precision import MixedPrecision
from torchpar.parallel.parallelize import parallelize

__all__ = ["DistributedDataParallel", "MixedPrecision", "tensor", "parallelize"]
