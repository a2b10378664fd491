"""torchpar: distributed training for PyTorch.

Importing the package registers the ``"torchpar"`` torch.distributed backend and the
``torch.ops.torchpar`` operators::

    import torch.distributed as dist
    import torchpar
    dist.init_process_group(backend="torchpar")
"""
import torch
import torch.distributed  # noqa: F401  (the C++ backend subclasses c10d classes bound there)

from torchpar import _C  # noqa: F401  (loads the C++ core and its TORCH_LIBRARY ops)
from torchpar._backend import monitored_barrier, register_backend
from torchpar import nn  # noqa: F401  (fused-kernel modules: torchpar.nn.LayerNorm ...)
from torchpar import parallel  # noqa: F401,E402  (torchpar.parallel.DistributedDataParallel)

__version__ = "0.1.0"

register_backend()

__all__ = ["monitored_barrier", "register_backend", "__version__"]
