"""Parallel modules: data parallel (``DistributedDataParallel``)."""
from torchpar.parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
