"""Parallel modules: data parallel (``DistributedDataParallel``; ZeRO-2 with
``shard_gradients=True``), fully sharded data parallel (``fully_shard``), tensor parallelism
(``torchpar.parallel.tensor``, ``parallelize``), pipeline parallelism
(``torchpar.parallel.pipeline``) and the O2 mixed-precision policy (``MixedPrecision``) the
data-parallel wrappers share."""
from torchpar.parallel import pipeline, tensor
from torchpar.parallel.ddp import DistributedDataParallel
from torchpar.parallel.fsdp import FSDPModule, fully_shard
from torchpar.parallel.mixed_precision import MixedPrecision
from torchpar.parallel.parallelize import parallelize

__all__ = ["DistributedDataParallel", "FSDPModule", "MixedPrecision", "fully_shard", "parallelize",
           "pipeline", "tensor"]
