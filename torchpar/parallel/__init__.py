"""Parallel modules: data parallel (``DistributedDataParallel``; ZeRO-2 with
``shard_gradients=True``), fully sharded data parallel (``fully_shard``), tensor parallelism
(``torchpar.parallel.tensor``, ``parallelize``), pipeline parallelism
(``torchpar.parallel.pipeline``), the O2 mixed-precision policy (``MixedPrecision``) the
data-parallel wrappers share, and gradient clipping by the global norm of a model spread over
ranks (``clip_grad_norm_``)."""
from torchpar.parallel import pipeline, tensor
from torchpar.parallel.clip_grad import clip_grad_norm_
from torchpar.parallel.ddp import DistributedDataParallel
from torchpar.parallel.fsdp import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from torchpar.parallel.state_dict import (get_model_state_dict, get_optimizer_state_dict, get_state_dict,
                                         set_model_state_dict, set_optimizer_state_dict, set_state_dict)
from torchpar.parallel.mixed_precision import MixedPrecision
from torchpar.parallel.parallelize import parallelize
from torchpar.parallel.torch_plan import parallelize_module

__all__ = ["DistributedDataParallel", "FSDPModule", "MixedPrecision", "clip_grad_norm_", "fully_shard", "UnshardHandle",
           "get_state_dict", "set_state_dict", "get_model_state_dict", "get_optimizer_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "parallelize", "parallelize_module", "register_fsdp_forward_method", "pipeline", "tensor"]
