"""Parallel modules: data parallel (``DistributedDataParallel``), fully sharded data parallel
(``fully_shard``) and the O2 mixed-precision policy (``MixedPrecision``) the data-parallel
wrappers share."""
from torchpar.parallel.ddp import DistributedDataParallel
from torchpar.parallel.fsdp import FSDPModule, fully_shard
from torchpar.parallel.mixed_precision import MixedPrecision

__all__ = ["DistributedDataParallel", "FSDPModule", "MixedPrecision", "fully_shard"]
