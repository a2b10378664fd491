"""The data-parallel systems the sharded-training benchmarks compare, each built the same way:
``make(model, group, lr) -> (wrapped_model, optimizer)`` around an already-constructed model,
called on every rank of ``group``, with AdamW.

- ``ddp``         torchpar DDP, full AdamW state on every rank
- ``zero1``       torchpar DDP (all-reduce) + torchpar ZeroRedundancyOptimizer (sharded state)
- ``zero2``       torchpar DDP(shard_gradients=True) (reduce-scatter) + ZeroRedundancyOptimizer
- ``torch-zero``  torch's DDP + torch's ZeroRedundancyOptimizer, the peer
"""
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeroRedundancyOptimizer

from torchpar.optim import ZeroRedundancyOptimizer
from torchpar.parallel import DistributedDataParallel


def _ddp(model, group, lr):
    ddp = DistributedDataParallel(model, process_group=group)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=lr)


def _zero(shard_gradients):
    def make(model, group, lr):
        ddp = DistributedDataParallel(model, process_group=group, shard_gradients=shard_gradients)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, group, lr=lr)
    return make


def _torch_zero(model, group, lr):
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    return ddp, TorchZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, group, lr=lr)


SYSTEMS = {"ddp": _ddp, "zero1": _zero(False), "zero2": _zero(True), "torch-zero": _torch_zero}


def optimizer_state_bytes(optimizer):
    """Bytes of the optimizer-state tensors this rank holds (and float32 masters under O2),
    whichever system built the optimizer."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.optimizer_state_bytes()
    inner = optimizer.optim if isinstance(optimizer, TorchZeroRedundancyOptimizer) else optimizer
    return sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values()
               if torch.is_tensor(v))
