"""Which rank owns which parameter under ZeRO, and the bucketed all-gather of parameters.

ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054) gives each rank the optimizer state (ZeRO-1)
and the reduced gradients (ZeRO-2) of a shard of the parameters. Shards here are whole
parameters, so any torch optimizer can step them unchanged; they are balanced by size within
buckets, and each bucket's flat tensor is one equal segment per rank, rank r's parameters
back to back in segment r (``torchpar._C.zero_shard_buckets``, csrc/parallel/
bucket_assignment.h). The same layout serves both directions:

- DDP(shard_gradients=True) reduce-scatters each bucket: rank r receives segment r, the
  averaged gradients of exactly the parameters it owns;
- the optimizer all-gathers each bucket after its step: every rank contributes segment r,
  its updated parameters, and receives the whole bucket (one collective per bucket).

Who decides the layout: DDP, when it shards gradients. Its buckets follow backward's order
and must be fixed before the first backward, which may come before the optimizer exists; so
DDP computes the layout and records it against its parameters (``register``), and a
ZeroRedundancyOptimizer built on those parameters adopts it (``adopted``): nothing to pass by
hand, and DDP refuses to train until an optimizer has adopted its layout, since any other
optimizer would step gradients that are not there. Parameters no DDP shards get a layout of
the optimizer's own (ZeRO-1: their gradients are whole on every rank).

Under ``DDP.join()`` (uneven inputs) a joined rank shadows both halves of the others' step,
DDP's backward and the optimizer's: each finds the other through ``register_ddp`` and
``register_optimizer`` (ZeRO-1 and ZeRO-2 alike).
"""
import itertools
import weakref

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from torchpar import _C

# Parameter -> (the DDP layout it belongs to, its index there). Weak: a model freed with its
# DDP leaves nothing behind.
_DDP_SHARDED = WeakIdKeyDictionary()

# Parameter -> weak references to the torchpar DDP that reduces its gradient and to the latest
# ZeroRedundancyOptimizer built on it (an older one over the same parameter is taken as replaced).
_DDP_OF = WeakIdKeyDictionary()
_OPTIMIZER_OF = WeakIdKeyDictionary()
_SERIAL = itertools.count()  # construction order of optimizers: the order a joined rank steps them

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardLayout:
    """``buckets``: per bucket ``(params, owners, offsets, shard_numel)`` as
    ``_C.zero_shard_buckets`` returns them, the indices into ``params``."""

    def __init__(self, params, buckets, group, names=None):
        self.params = list(params)
        self.buckets = [tuple(b) for b in buckets]
        self.group = group
        self.names = names
        self.adopted = False  # DDP's layout: a ZeroRedundancyOptimizer has taken it
        self._flats = None    # per bucket, the flat tensor the parameters are views of (bind)

    @classmethod
    def compute(cls, params, group, cap_bytes):
        """Buckets of at most ``cap_bytes`` (one dtype and device each), split into shards."""
        buckets = _C.ddp_assign_buckets(params, cap_bytes, cap_bytes, None)
        return cls(params, _C.zero_shard_buckets(params, buckets, dist.get_world_size(group)), group)

    def owner(self):
        """Parameter index -> owning rank."""
        out = [None] * len(self.params)
        for indices, owners, _, _ in self.buckets:
            for i, r in zip(indices, owners):
                out[i] = r
        return out

    def shard_bytes(self, rank):
        """Bytes of the parameters ``rank`` owns."""
        return sum(self.params[i].numel() * self.params[i].element_size()
                   for i, r in enumerate(self.owner()) if r == rank)

    def name(self, i):
        return f"'{self.names[i]}'" if self.names else f"#{i} (shape {tuple(self.params[i].shape)})"

    @torch.no_grad()
    def bind(self):
        """Make the parameters views of their bucket's flat tensor (rank r's segment holds the
        parameters r owns; padding zero), as torch's ``parameters_as_bucket_view``: the
        all-gather then writes every parameter in place, no bucket allocated or copied per step.
        A parameter whose storage was replaced since (``.data =``, ``.to()``) is copied in and
        bound again."""
        world = dist.get_world_size(self.group)
        if self._flats is None:
            self._flats = [None] * len(self.buckets)
        for b, (indices, _, offsets, shard_numel) in enumerate(self.buckets):
            first = self.params[indices[0]]
            flat = self._flats[b]
            if flat is None or flat.dtype != first.dtype or flat.device != first.device:
                flat = self._flats[b] = torch.zeros(shard_numel * world, dtype=first.dtype, device=first.device)
            for i, off in zip(indices, offsets):
                p = self.params[i]
                slot = flat.narrow(0, off, p.numel())
                if p.data_ptr() != slot.data_ptr() or p.dtype != flat.dtype or p.device != flat.device:
                    slot.copy_(p.detach().reshape(-1))
                    p.data = slot.view_as(p)
        return self._flats

    @torch.no_grad()
    def all_gather(self):
        """Every rank's owned parameters everywhere: per bucket, one all-gather of this rank's
        segment (its stepped parameters, in place) into the whole bucket, whose other segments
        are the other ranks' parameters (``bind``). All are issued before the first is waited."""
        group = self.group
        rank = dist.get_rank(group)
        works = []
        for flat, (_, _, _, shard_numel) in zip(self.bind(), self.buckets):
            # In place: the input is the output's own segment (torchpar, gloo and nccl allow it).
            mine = flat.narrow(0, rank * shard_numel, shard_numel)
            works.append(_all_gather_single(flat, mine, group=group, async_op=True))
        for work in works:
            work.wait()


def register(params, names, layout_buckets, group):
    """DDP(shard_gradients=True): record the reducer's layout against its parameters."""
    layout = ShardLayout(params, layout_buckets, group, names)
    for i, p in enumerate(params):
        _DDP_SHARDED[p] = (layout, i)
    return layout


def adopted(params, cap_bytes, group):
    """The layouts for an optimizer's ``params``: DDP's, for those a DDP shards gradients of
    (it must be all of them), and one of the optimizer's own for the rest. Returns a list of
    ``(layout, optimizer index of each layout parameter)``."""
    ddp_layout, mine = None, []
    by_layout_index = {}
    for k, p in enumerate(params):
        entry = _DDP_SHARDED.get(p)
        if entry is None:
            mine.append(k)
            continue
        layout, i = entry
        if ddp_layout is not None and layout is not ddp_layout:
            raise ValueError("torchpar ZeRO: the parameters come from two DistributedDataParallel "
                             "modules with shard_gradients=True; build one optimizer per module")
        ddp_layout = layout
        by_layout_index[i] = k
    out = []
    if ddp_layout is not None:
        missing = [i for i in range(len(ddp_layout.params)) if i not in by_layout_index]
        if missing:
            raise ValueError(
                f"torchpar ZeRO: the optimizer has {len(by_layout_index)} of the "
                f"{len(ddp_layout.params)} parameters whose gradients DistributedDataParallel("
                f"shard_gradients=True) shards; missing {ddp_layout.name(missing[0])}. Build it on "
                f"all of ddp.parameters(), or the missing ones' gradient shards are never stepped.")
        if dist.get_world_size(ddp_layout.group) != dist.get_world_size(group):
            raise ValueError(
                f"torchpar ZeRO: the optimizer's group has {dist.get_world_size(group)} ranks, the "
                f"DDP that shards its gradients {dist.get_world_size(ddp_layout.group)}")
        ddp_layout.adopted = True
        out.append((ddp_layout, [by_layout_index[i] for i in range(len(ddp_layout.params))]))
    if mine:
        out.append((ShardLayout.compute([params[k] for k in mine], group, cap_bytes), mine))
    return out


def register_ddp(ddp, params):
    for p in params:
        _DDP_OF[p] = weakref.ref(ddp)


def register_optimizer(optimizer, params):
    optimizer._zero_serial = next(_SERIAL)
    for p in params:
        _OPTIMIZER_OF[p] = weakref.ref(optimizer)


def _live(registry, params):
    found = {}
    for p in params:
        ref = registry.get(p)
        obj = ref() if ref is not None else None
        if obj is not None:
            found[id(obj)] = obj
    return list(found.values())


def ddp_of(params):
    """The torchpar DDP that reduces the gradients of ``params``, or None."""
    found = _live(_DDP_OF, params)
    return found[0] if found else None


def optimizers_of(params):
    """The ZeroRedundancyOptimizers that step ``params`` (the latest built on each), in the order
    they were built."""
    return sorted(_live(_OPTIMIZER_OF, params), key=lambda o: o._zero_serial)


def joined_without_ddp_error():
    return RuntimeError(
        "torchpar ZeRO: the optimizer is in a Join without the torchpar DistributedDataParallel "
        "that reduces its gradients, so a joined rank could not shadow the backward; use "
        "ddp.join() or Join([ddp, optimizer])")
