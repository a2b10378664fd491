"""Data parallelism: a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

Each rank holds a full replica and a slice of the batch; gradients are averaged over the
group during backward, so every replica takes the same optimizer step (Li et al.,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020,
arXiv:2006.15704, describes the bucketing and overlap this follows).

The engine is the C++ ``torchpar._C.Reducer`` (csrc/parallel/reducer.{h,cpp}): it owns the
buckets, the hooks on the gradient accumulators, the asynchronous all-reduces and the
write-back at the end of backward. This wrapper only checks and broadcasts the model at
construction, syncs buffers before forward and tells the reducer which forwards need a
synchronised backward. It uses the public torch.distributed API only, so it runs on any
backend (torchpar, gloo, nccl).
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from torchpar import _C
from torchpar.optim import shard_layout
from torchpar.parallel.mixed_precision import MixedPrecision, cast_floating

# The first bucket is small so its all-reduce starts early in backward (torch uses the
# same 1 MiB, pytorch/pytorch#73732).
FIRST_BUCKET_BYTES = 1 << 20

# Stable dtype codes for the cross-rank model check (hash(str) differs between processes).
_DTYPE_CODES = {dt: i for i, dt in enumerate([
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.bool])}


class DistributedDataParallel(nn.Module, Joinable):
    """Wraps ``module`` so that ``loss.backward()`` leaves gradients averaged over
    ``process_group`` (default: the world) in every parameter's ``.grad``.

    Arguments match torch's DDP (2.13), in its order, so that code written for it runs unchanged
    (docs/ddp.md lists the few it refuses):
    ``device_ids`` names the one device a CUDA module lives on (inputs are moved there, as
    torch does), and ``init_sync=False`` skips the model check and broadcast. With
    ``static_graph=True`` the first step records how many gradients each parameter gets
    (none for parameters unused in every step, several under reentrant checkpoints) and
    later steps reduce by that record, without ``find_unused_parameters``'s graph search.
    ``grad_reduce_dtype`` (e.g. ``torch.float32`` for bfloat16 parameters) is ours: the
    buckets hold and reduce gradients in that dtype and the result is cast back, because
    sums of many low-precision values lose precision.

    ``mixed_precision=MixedPrecision(param_dtype, reduce_dtype, master_dtype)`` (O2): the
    module's floating-point parameters and buffers are cast to ``param_dtype`` here, and
    floating-point inputs in forward; gradients are reduced in ``reduce_dtype``. The float32
    master weights are the optimizer's: ``torchpar.optim.MixedPrecisionOptimizer``, or
    ``ZeroRedundancyOptimizer(..., mixed_precision=...)``.

    ``shard_gradients=True`` (ZeRO-2, Rajbhandari et al. 2020) reduce-scatters each bucket
    instead of all-reducing it: after backward a rank holds ``.grad`` only for the parameters
    it owns, every other ``.grad`` is None (freed as soon as it is copied into its bucket).
    The buckets are split into whole-parameter shards (torchpar/optim/shard_layout.py says why
    DDP decides the layout) and a ``torchpar.optim.ZeroRedundancyOptimizer`` built on this
    module's parameters adopts it and steps exactly those shards; training without one raises.
    Backwards without ``zero_grad()`` between them add up as with torch's DDP (each one's
    average into ``.grad``), ``no_sync()`` or not, and a backward outside this module's forward
    (a penalty on the weights) adds its local gradient: the owner of a parameter, the only rank
    that still holds its average, keeps it aside and counts it once in the next reduction
    (csrc/parallel/reducer.h, ``before_accumulation``). Changing an owner's ``.grad`` in place
    between two such backwards other than zeroing it (clipping each micro-batch) is not followed.
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                 init_sync=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None, mixed_precision=None,
                 device_mesh=None, skip_all_reduce_unused_params=False, bucket_cap_mb_list=None,
                 batched_grad_copy=False, forward_sync_buffers=None, *, grad_reduce_dtype=None,
                 shard_gradients=False):
        super().__init__()
        Joinable.__init__(self)
        self.module = module
        for name, value in (("delay_all_reduce_named_params", delay_all_reduce_named_params),
                            ("param_to_hook_all_reduce", param_to_hook_all_reduce),
                            ("bucket_cap_mb_list", bucket_cap_mb_list)):
            if value is not None:
                raise NotImplementedError(f"torchpar DDP: {name} is not supported (buckets are sized by "
                                          "bucket_cap_mb and all reduced as backward fills them)")
        # skip_all_reduce_unused_params and batched_grad_copy are torch's speed settings: the
        # reducer already leaves out what no rank used (the .grad of those stays as it is) and
        # copies each gradient into its bucket once.
        if device_mesh is not None:
            if process_group is not None:
                raise ValueError("torchpar DDP: pass process_group or device_mesh, not both")
            if device_mesh.ndim != 1:
                raise ValueError(f"torchpar DDP: a 1-D device_mesh, got {device_mesh.ndim} dimensions")
            process_group = device_mesh.get_group(0)
        self.device_mesh = device_mesh
        # torch's reading: forward_sync_buffers (its new name) wins and buffers are synced at init
        # whatever it says; broadcast_buffers=False (the old name) skips the init sync too.
        init_sync_buffers = broadcast_buffers is not False or forward_sync_buffers is not None
        self.forward_sync_buffers = (broadcast_buffers is not False if forward_sync_buffers is None
                                     else forward_sync_buffers)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if self.process_group is None:
            raise RuntimeError("torchpar DDP: call torch.distributed.init_process_group first")
        self.mixed_precision = mixed_precision
        if mixed_precision is not None:
            grad_reduce_dtype = _apply_mixed_precision(module, mixed_precision, grad_reduce_dtype)
        self.shard_gradients = shard_gradients
        self.device, self.output_device = _single_device(module, device_ids, output_device)
        self.device_ids = None if self.device is None else [self.device.index]  # as torch's
        self.dim = dim
        self.static_graph = static_graph
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.grad_reduce_dtype = grad_reduce_dtype
        self.require_backward_grad_sync = True
        # torch's: buffers are broadcast at a forward when the previous one synchronised gradients
        # (or at the first), so an eval forward under no_grad after a training step sees rank 0's
        # buffers, and the first forward inside no_sync() still broadcasts.
        self.require_forward_param_sync = True

        # torch's ignore list (DistributedDataParallel._set_params_and_buffers_to_ignore_for_model):
        # those parameters and buffers are neither synced nor reduced, left to the caller.
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        self._synced_buffers = [b for n, b in module.named_buffers() if n not in self.parameters_to_ignore]
        if init_sync:
            _verify_same_model(named, self.process_group)
            with torch.no_grad():
                _broadcast_from_rank0([p for _, p in named] + (self._synced_buffers if init_sync_buffers else []),
                                      self.process_group)

        if bucket_cap_mb is None:
            bucket_cap_mb = 25  # torch's default
        trained = [(n, p) for n, p in named if p.requires_grad]
        params = [p for _, p in trained]
        cap = self.bucket_bytes_cap = int(bucket_cap_mb * 1024 * 1024)
        # Sharded buckets are split among the ranks by whole parameters: a small first bucket
        # (often one parameter) would leave most ranks only padding to send.
        first_cap = cap if shard_gradients else min(cap, FIRST_BUCKET_BYTES)
        # As torch's DDP decides it: an embedding made with sparse=True gives its weight sparse
        # gradients, which get a bucket of their own and are reduced sparse (the reducer).
        sparse_weights = {id(m.weight) for m in module.modules()
                          if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
        sparse = [id(p) in sparse_weights for p in params]
        on_torchpar = dist.get_backend(self.process_group) == "torchpar"
        if on_torchpar and any(s and p.is_cuda for p, s in zip(params, sparse)):
            # The backend reduces sparse tensors on the CPU; its CUDA path is NCCL's, dense only (as
            # torch's NCCL group, which refuses sparse all_reduce).
            raise ValueError("torchpar DDP: sparse gradients (nn.Embedding(sparse=True)) of CUDA parameters are not "
                             "reduced by the torchpar backend (sparse all_reduce is CPU only); use sparse=False, "
                             "or keep the table on the CPU")
        buckets = _C.ddp_assign_buckets(params, cap, first_cap, grad_reduce_dtype, sparse=sparse)
        # Not a Module or Parameter, so nn.Module stores it as a plain attribute: the
        # state_dict keys stay exactly torch DDP's ("module." + the module's keys).
        # The caps let the reducer rebuild the buckets in the order of the first backward.
        self.reducer = _C.Reducer(params, [n for n, _ in trained], buckets, self.process_group,
                                  gradient_as_bucket_view, find_unused_parameters, grad_reduce_dtype,
                                  cap, first_cap, static_graph,
                                  # torchpar's all_reduce_coalesced reduces tensors where they lie.
                                  on_torchpar, shard_gradients,
                                  sparse)
        self._params = params
        shard_layout.register_ddp(self, params)
        self._shard_layout = None
        if shard_gradients:
            self._shard_layout = shard_layout.register(params, [n for n, _ in trained],
                                                       self.reducer.shard_layout(), self.process_group)

    def forward(self, *inputs, **kwargs):
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        buffer_src = 0
        optimizers = [o for o in shard_layout.optimizers_of(self._params) if o._join_config.enable]
        if self._join_config.enable or optimizers:
            # Inside join(): count this rank as not joined (whichever of this module and its ZeRO
            # optimizers the Join lists first does), and let the joined ranks know whether this
            # step synchronises, so they shadow its collectives or not.
            for joinable in [self] + optimizers:
                Join.notify_join_context(joinable)
            if not self._join_config.enable:
                raise shard_layout.joined_without_ddp_error()
            sync, buffer_src = _join_vote(sync, True, self.process_group, self.join_device)
        if self.require_forward_param_sync and self.broadcast_buffers:
            with torch.no_grad():
                _broadcast_from_rank0(self._synced_buffers, self.process_group, buffer_src)
        self.require_forward_param_sync = sync
        if sync and self._shard_layout is not None and not self._shard_layout.adopted:
            raise RuntimeError(
                "torchpar DDP: shard_gradients=True leaves each rank only its shard of the "
                "gradients, but no torchpar.optim.ZeroRedundancyOptimizer was built on this "
                "module's parameters to step them (an optimizer built on other parameters, e.g. "
                "a copy of the model, or a plain optimizer, would miss the other ranks' shards)")
        if self.device is not None:  # device_ids given: inputs go to the module's device
            inputs, kwargs = tree_map(self._to_device, (inputs, kwargs))
        if self.mixed_precision is not None and self.mixed_precision.param_dtype is not None:
            inputs, kwargs = cast_floating((inputs, kwargs), self.mixed_precision.param_dtype)
        outputs = self.module(*inputs, **kwargs)
        if sync:
            tensors = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor)]
            self.reducer.prepare_for_backward(tensors if self.find_unused_parameters else [])
            if self.static_graph and self.reducer.records_static_graph():
                outputs = _queue_finalize_at_outputs(outputs, self.reducer)
        return outputs

    def register_comm_hook(self, state, hook):
        """Replace each bucket's all-reduce with ``hook(state, bucket)``, as torch's DDP does:
        ``bucket`` is a ``torch.distributed.GradBucket`` holding the bucket's gradients summed
        over this rank's backward but *not* averaged, and the hook returns a
        ``torch.futures.Future`` of the reduced flat tensor (the hooks in
        ``torch.distributed.algorithms.ddp_comm_hooks`` work as they are). Call it once,
        before the first backward."""
        if not callable(hook):
            raise TypeError(f"torchpar DDP: the comm hook must be callable, got {type(hook).__name__}")
        self.reducer.register_comm_hook(state, hook)

    def _to_device(self, x):
        return x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else x

    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """Training with uneven inputs, as torch's ``DDP.join()``: a rank whose inputs run out
        first keeps taking part in the other ranks' collectives, contributing zero gradients,
        until every rank is done; then all ranks take the model of one of the last to finish.
        Gradients stay divided by the whole group's size (``divide_by_initial_world_size``).
        A joined rank's ``.grad`` is that average (its own share zero); with a
        ``torchpar.optim.ZeroRedundancyOptimizer`` on this module's parameters (ZeRO-1 or 2) it
        steps its shard with it and enters the all-gather, once per synchronised step of the
        others, which must call ``step()`` after each synchronised backward."""
        if not divide_by_initial_world_size:
            raise NotImplementedError(
                "torchpar DDP: join(divide_by_initial_world_size=False) is not supported; "
                "gradients are always divided by the group's size")
        return Join([self], enable, throw_on_early_termination)

    def join_hook(self, **kwargs):
        return _JoinHook(self)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore):
        """torch's: names (as in ``module.named_parameters()`` / ``named_buffers()``) that a DDP
        made on ``module`` afterwards neither syncs nor reduces."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, p in module.named_parameters():
            if name in params_and_buffers_to_ignore:
                p._ddp_ignored = True

    @property
    def broadcast_buffers(self):
        """Whether rank 0's buffers are broadcast before each forward (torch's older name of
        ``forward_sync_buffers``)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value):
        self.forward_sync_buffers = value

    @property
    def join_device(self):
        return next(self.module.parameters()).device

    @property
    def join_process_group(self):
        return self.process_group

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally; the first synchronised
        backward after it averages the accumulated sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old


class _JoinHook(JoinHook):
    """What a joined rank does while others still train (see ``DistributedDataParallel.join``)."""

    def __init__(self, ddp):
        self.ddp = ddp

    def main_hook(self):
        # The collectives of one training step of the others, in their order: forward's
        # sync vote and buffer broadcast, then backward's (reducer.join_shadow_backward).
        ddp = self.ddp
        sync, buffer_src = _join_vote(False, False, ddp.process_group, ddp.join_device)
        if ddp.require_forward_param_sync and ddp.broadcast_buffers:
            with torch.no_grad():
                _broadcast_from_rank0(ddp._synced_buffers, ddp.process_group, buffer_src)
        ddp.require_forward_param_sync = sync
        if not sync:
            return
        ddp.reducer.join_shadow_backward()
        for optimizer in shard_layout.optimizers_of(ddp._params):
            optimizer._shadow_step()  # the others' clipping and step() after this backward

    def post_hook(self, is_last_joiner):
        # Joined ranks stopped stepping: everyone takes the model of the highest last joiner.
        ddp, group = self.ddp, self.ddp.process_group
        rank = dist.get_rank(group)
        src = torch.tensor([rank if is_last_joiner else -1], device=ddp.join_device)
        dist.all_reduce(src, op=dist.ReduceOp.MAX, group=group)
        with torch.no_grad():
            synced = [p for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
            _broadcast_from_rank0(synced + ddp._synced_buffers, group, group_src=int(src.item()))


class _QueueFinalize(torch.autograd.Function):
    """Identity on the forward's outputs, in the step that records a static graph. Its
    backward is the first node of the step's outermost backward, so it queues the reducer's
    end-of-backward callback there: that step reduces everything in that callback, which
    must not run at the end of a reentrant checkpoint's nested backward. The outputs are
    copies, not views, so that the caller may still modify them in place (once per run)."""

    @staticmethod
    def forward(ctx, reducer, *tensors):
        ctx.reducer = reducer
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.reducer.queue_finalize()
        return (None, *grads)


def _queue_finalize_at_outputs(outputs, reducer):
    leaves, spec = tree_flatten(outputs)
    idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return outputs
    for i, t in zip(idx, _QueueFinalize.apply(reducer, *(leaves[i] for i in idx))):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def _apply_mixed_precision(module, policy, grad_reduce_dtype):
    """Casts the module to the policy's parameter dtype; returns the dtype to reduce in."""
    if not isinstance(policy, MixedPrecision):
        raise TypeError(f"torchpar DDP: mixed_precision must be a torchpar.parallel.MixedPrecision, "
                        f"got {type(policy).__name__}")
    if policy.param_dtype is not None:
        module.to(policy.param_dtype)  # floating-point parameters and buffers only
    reduce = policy.reduce_dtype
    if grad_reduce_dtype is not None and grad_reduce_dtype != reduce:
        raise ValueError(f"torchpar DDP: grad_reduce_dtype={grad_reduce_dtype} contradicts "
                         f"mixed_precision.reduce_dtype={reduce}; give one")
    return reduce


def _single_device(module, device_ids, output_device):
    """The device ``device_ids`` names (None without it), checked as torch's DDP does: one
    device, the one a CUDA module's parameters are all on; CPU modules take none."""
    devices = {p.device for p in module.parameters()}
    if device_ids is None:
        if output_device is not None:
            raise ValueError("torchpar DDP: output_device needs device_ids")
        return None, None

    def as_device(d):  # an index means the module's device type
        return torch.device(next(iter(devices)).type, d) if isinstance(d, int) else torch.device(d)

    device = as_device(device_ids[0]) if len(device_ids) == 1 and devices else None
    if device is None or devices != {device} or device.type == "cpu":
        raise ValueError(
            f"torchpar DDP: device_ids must name the one accelerator device the module is on, "
            f"and be None for a CPU module; got device_ids {list(device_ids)} for a module on "
            f"{sorted(str(d) for d in devices)}")
    return device, device if output_device is None else as_device(output_device)


def _join_vote(sync, active, group, device):
    """One all-reduce per step inside join(): whether any rank synchronises this step, and
    the highest rank still training, whose buffers are the ones to broadcast (a joined
    rank's have stopped being updated)."""
    t = torch.tensor([int(sync), dist.get_rank(group) if active else -1], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t[0]), int(t[1])


def _broadcast_from_rank0(tensors, group, group_src=0):
    """Rank ``group_src``'s values everywhere (rank 0 of the group by default), one
    broadcast per (device, dtype) rather than per tensor."""
    src = dist.get_global_rank(group, group_src) if group is not dist.group.WORLD else group_src
    by_kind = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for same in by_kind.values():
        flat = _flatten_dense_tensors([t.detach() for t in same])
        dist.broadcast(flat, src, group=group)
        for t, value in zip(same, _unflatten_dense_tensors(flat, same)):
            t.copy_(value)


def _verify_same_model(named, group, who="torchpar DDP", what="model"):
    """Raise on every rank, naming the first parameter whose shape, dtype or requires_grad
    differs between ranks; different models would silently reduce unrelated gradients."""
    device = named[0][1].device if named else torch.device("cpu")
    world = dist.get_world_size(group)
    ndim = max((p.dim() for _, p in named), default=0)
    head = torch.tensor([len(named), ndim], dtype=torch.int64, device=device)
    heads = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(heads, head, group=group)
    counts = [int(h[0]) for h in heads]
    width = 2 + max(int(h[1]) for h in heads)
    rows = max(counts)
    # Row per parameter: dtype code, requires_grad, shape padded with -1; missing rows -2.
    sig = torch.full((rows, width), -2, dtype=torch.int64)
    for i, (_, p) in enumerate(named):
        sig[i, :] = -1
        sig[i, 0] = _DTYPE_CODES.get(p.dtype, 99)
        sig[i, 1] = int(p.requires_grad)
        sig[i, 2:2 + p.dim()] = torch.tensor(p.shape, dtype=torch.int64)
    sig = sig.to(device)
    sigs = [torch.empty_like(sig) for _ in range(world)]
    dist.all_gather(sigs, sig, group=group)
    sigs = [s.cpu() for s in sigs]
    for i in range(rows):
        for r in range(1, world):
            if not torch.equal(sigs[r][i], sigs[0][i]):
                name = named[i][0] if i < len(named) else f"#{i}"
                raise RuntimeError(
                    f"{who}: the {what} differs across ranks at parameter {i} ('{name}' "
                    f"on this rank, rank {dist.get_rank(group)}): rank 0 has {_describe(sigs[0][i])}, "
                    f"rank {r} has {_describe(sigs[r][i])}. Every rank must build the same {what}.")


def _describe(row):
    if int(row[0]) == -2:
        return "no such parameter"
    codes = {v: k for k, v in _DTYPE_CODES.items()}
    shape = tuple(int(d) for d in row[2:] if int(d) >= 0)
    grad = "requires_grad" if int(row[1]) else "frozen"
    return f"shape {shape}, {codes.get(int(row[0]), 'unknown dtype')}, {grad}"
