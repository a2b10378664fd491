"""torch FSDP2's ``fully_shard`` arguments, read for torchpar's ``fully_shard``, so that a script
written for ``torch.distributed.fsdp.fully_shard`` runs unchanged: ``mp_policy``
(``MixedPrecisionPolicy``), ``offload_policy``, ``shard_placement_fn`` and ``dp_mesh_dims``.
What torchpar cannot honour raises here, naming the argument, before anything is sharded.
"""
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from torchpar.parallel.mixed_precision import MixedPrecision


@dataclass(frozen=True)
class Precision:
    """What a unit computes, reduces and keeps its shards in, and what it casts."""
    param_dtype: Optional[torch.dtype] = None    # gathered parameters (None: the shards')
    reduce_dtype: Optional[torch.dtype] = None   # gradient reduction (None: param_dtype's)
    master_dtype: Optional[torch.dtype] = None   # the shards (None: the module's own dtype)
    cast_inputs: bool = True                      # floating inputs to param_dtype
    output_dtype: Optional[torch.dtype] = None   # floating outputs cast to it


def precision(mixed_precision, mp_policy):
    """One ``Precision`` from torchpar's ``mixed_precision`` (O2: float32 master shards) or torch's
    ``mp_policy`` (the shards keep the module's dtype, as in FSDP2)."""
    if mixed_precision is not None and mp_policy is not None:
        raise ValueError("torchpar fully_shard: pass mixed_precision (torchpar's MixedPrecision) or mp_policy "
                         "(torch's MixedPrecisionPolicy), not both")
    if mixed_precision is not None:
        if not isinstance(mixed_precision, MixedPrecision):
            raise TypeError("torchpar fully_shard: mixed_precision takes a torchpar.parallel.MixedPrecision, got "
                            f"{type(mixed_precision).__name__} (torch's MixedPrecisionPolicy goes to mp_policy)")
        p = mixed_precision
        return Precision(p.param_dtype, p.reduce_dtype or p.param_dtype, p.master_dtype, p.param_dtype is not None)
    if mp_policy is None:
        return Precision()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("torchpar fully_shard: mp_policy takes a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__} (torchpar's MixedPrecision goes to mixed_precision)")
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(mp_policy, name)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise TypeError(f"torchpar fully_shard: mp_policy.{name} must be a floating-point torch.dtype or None, "
                            f"got {value!r}")
    p = mp_policy
    return Precision(p.param_dtype, p.reduce_dtype or p.param_dtype, None,
                     bool(p.cast_forward_inputs) and p.param_dtype is not None, p.output_dtype)


def check_unsupported(params, offload_policy, shard_placement_fn, dp_mesh_dims):
    """Refuses what a torchpar unit cannot do, before anything is sharded. ``params``: the unit's
    (name, parameter) pairs."""
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError("torchpar fully_shard: offload_policy takes a torch.distributed.fsdp.OffloadPolicy, got "
                        f"{type(offload_policy).__name__}")
    if isinstance(offload_policy, CPUOffloadPolicy):
        # On CPU, torch's promise (shards, gradients and the optimizer step in host memory) holds as
        # it is; moving shards between a GPU and the host around each gather is not built.
        on_device = [name for name, p in params if p.device.type != "cpu"]
        if on_device:
            raise NotImplementedError(
                f"torchpar fully_shard: CPUOffloadPolicy is not supported for parameters on a device "
                f"('{on_device[0]}' is on {dict(params)[on_device[0]].device}); on CPU it needs nothing")
    if dp_mesh_dims is not None:
        raise NotImplementedError("torchpar fully_shard: dp_mesh_dims (parameters that are already DTensors on an "
                                  "SPMD mesh) is not supported: pass the data-parallel mesh (or group) itself")
    if shard_placement_fn is not None:
        from torch.distributed.tensor import Shard as DTensorShard
        for name, p in params:
            placement = shard_placement_fn(p)
            # A unit shards one flat parameter: every parameter is cut as if by Shard(0) of its
            # flattened elements. A placement on another dimension would need a layout of its own.
            if placement is not None and not (type(placement) is DTensorShard and placement.dim == 0):
                raise NotImplementedError(
                    f"torchpar fully_shard: shard_placement_fn gave {placement!r} for '{name}': a unit shards "
                    "one flat parameter over its group, so only Shard(0) (or None, the default) is supported")
