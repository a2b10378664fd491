"""Fully sharded data parallelism (ZeRO-3; Rajbhandari et al. 2020, arXiv:1910.02054; FSDP, Zhao
et al. 2023, arXiv:2304.11277; issue 19): ``fully_shard(module)``, applied bottom-up per block as
with torch's FSDP2, then once on the whole model.

Each ``fully_shard`` call makes one unit of the parameters of ``module`` that no sharded submodule
owns: a flat parameter, padded to a multiple of the group size, of which each rank keeps a 1/W
shard. The module's parameters are then that rank's pieces: plain ``nn.Parameter`` 1-D views of
the shard (possibly empty), not DTensors. A flat shard cuts through parameters, so a rank's piece
of one is a contiguous run of its flattened elements with no tensor shape of its own; a DTensor
would claim a placement (``Shard(0)``) that is not true of it. Optimizers that act element by
element (SGD, Adam, AdamW, ...) step these pieces exactly as they would the whole parameters;
anything that needs a whole parameter (norm clipping, per-matrix methods) needs a collective.

The engine is C++ (``torchpar._C.FsdpEngine`` and ``FlatParam``, csrc/parallel/fsdp_*): it
gathers and frees the units, prefetches the next unit's all-gather in the order the first forward
ran them (reversed in backward), packs gradients and reduce-scatters them while backward goes on.
This file installs the module hooks that call it and swaps the module's registered parameters
between the pieces (outside forward) and the gathered ones (inside). It uses the public c10d API
only (all-gather into a tensor, reduce-scatter of a tensor), so it runs on torchpar, gloo and nccl.
"""
import functools
import math
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchpar import _C
from torchpar.parallel.fsdp_policies import check_unsupported, precision
from torchpar.parallel.mixed_precision import cast_floating


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` wraps (as torch's FSDP2 does), so
    that the module keeps its type and gains these methods."""

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """With False, backward leaves each unit's gradients summed locally and unsharded (a full-
        size float accumulator per unit, in the reduce dtype): a rank cannot keep only its shard
        of a sum whose other terms are on other ranks without communicating. The first backward
        with True reduce-scatters that sum with its own gradients."""
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._fsdp.flat.requires_grad_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """Hybrid sharding: with False, backward reduce-scatters each unit's gradients within its
        shard group and keeps the sum sharded, without the all-reduce across the replicas (gradient
        accumulation that communicates within a replica only, as torch's FSDP2); the first
        backward with True adds the kept sum into its own and all-reduces both. ``.grad`` is only
        the step's mean after that backward. Set it alike on every rank; no effect without
        replicas."""
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._fsdp.flat.requires_all_reduce = bool(requires_all_reduce)

    def set_gradient_divide_factor(self, factor):
        """What this unit's summed gradients are divided by (not recursive, as torch's FSDP2):
        by default the number of data-parallel ranks (the mean); e.g. 1.0 keeps the sum, for a
        loss summed over tokens and normalised by the global token count by hand. ``None``
        restores the default. Set it alike on every rank."""
        if factor is not None and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"set_gradient_divide_factor: a positive finite number or None, got {factor!r}")
        self._fsdp.flat.gradient_divide_factor = None if factor is None else float(factor)

    def set_reduce_scatter_divide_factor(self, factor):
        """Deprecated name of ``set_gradient_divide_factor`` (as in torch's FSDP2)."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def reset_iter_state(self):
        """torch FSDP2's recovery after a forward or backward raised: call it on the root (the
        module the outermost ``fully_shard`` was applied to) on every rank that caught the error,
        then run the next iteration. It waits for what is in flight, drops the failed iteration's
        gradients, also what ``no_sync`` or ``set_requires_all_reduce(False)`` accumulated
        before it (restart the micro-batch sequence), frees every unit and forgets the step. No
        collective. Without it the next root forward settles the rest by itself, but keeps the
        accumulated gradients. As torch's, it leaves the ``.grad`` units already received in the
        failed backward: call the optimizer's ``zero_grad()`` before the next step."""
        unit = self._fsdp
        if unit.engine is None:
            return  # no forward ran: nothing to reset
        if unit.index != 0:
            raise RuntimeError("reset_iter_state: call it on the root FSDP module (the one the outermost "
                               "fully_shard was applied to, which ran forward first)")
        units = [m._fsdp for m in self.modules() if isinstance(m, FSDPModule) and m._fsdp.engine is unit.engine]
        try:
            unit.engine.reset_iter_state()
        finally:
            _register_pieces_again(engine=unit.engine)
            for u in units:
                u.unshard_handle = None
                u.register(u.sharded)

    def set_is_last_backward(self, is_last_backward):
        """torch FSDP2's: whether the next backward is a step's last, after which it waits for the
        pending reductions. Here every backward ends so (its reductions finished, its prefetch
        state cleared), so False changes nothing but is accepted (checked to be a bool)."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward takes a bool, got {is_last_backward!r}")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params, *, recurse=True):
        """torch FSDP2's: whether a rank's reduce-scatter includes zeros for parameters it got no
        gradient for (needed when ranks use different parameters). Here it always does, and a
        parameter no rank used keeps its .grad (docs/fsdp.md): either value is accepted."""
        if not isinstance(reduce_scatter_unused_params, bool):
            raise TypeError(f"set_reduce_scatter_unused_params takes a bool, got {reduce_scatter_unused_params!r}")

    def set_force_sum_reduction_for_comms(self, enable):
        """torch FSDP2's: reduce with SUM only and divide apart. The reduce-scatters and
        all-reduces here are always sums, divided after (gloo has no AVG): either value is
        accepted."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms takes a bool, got {enable!r}")

    def set_reshard_after_forward(self, reshard_after_forward, *, recurse=True):
        """Whether forward frees each unit's gathered parameters (backward then gathers them
        again) or keeps them until its backward (``fully_shard(reshard_after_forward=...)``).
        Set between steps. The root unit always keeps its own, as backward starts with it. A
        bool, as torch's: it also ends resharding to a smaller group (``fully_shard``'s int)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward takes a bool, got {reshard_after_forward!r} "
                             "(an int, the number of ranks to reshard to, goes to fully_shard)")
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._fsdp.flat.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        """With False, a backward that does not sync gradients (under ``no_sync`` or
        ``set_requires_gradient_sync(False)``: gradient accumulation, a pipeline stage's earlier
        micro-batches) leaves each unit gathered, so the next forward and backward skip its
        all-gathers, at the memory of the gathered unit in between. Unlike torch's FSDP2, a
        backward that syncs frees the units whatever this says: the optimizer step after it
        changes the shards, and a copy kept gathered would be stale. A unit is kept into a
        forward only where every rank has it gathered from shards not written since (the ranks
        agree with one small all-reduce at each forward while some unit asks for keeping;
        csrc/parallel/fsdp_engine.h, "Kept gathered"). Set it alike on every rank. ``reshard()``
        frees a kept unit at once."""
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._fsdp.flat.reshard_after_backward = bool(reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward):
        """torch FSDP2's: with False, this unit's parameters are not gathered for its backward
        (nor prefetched for it), for a unit whose backward does not read them, e.g. an
        embedding (its weight's gradient needs only the indices): one all-gather fewer per step.
        Its gradients are reduced as always. Not recursive (this unit's parameters only, as
        FSDP2's). A backward that does read them (a matmul, a recomputation) would read freed
        storage: torch raises there. Set it alike on every rank."""
        self._fsdp.flat.unshard_in_backward = bool(unshard_in_backward)

    def reshard(self):
        """Free this unit's gathered parameters now (not recursive, as torch's); the module's
        parameters are its pieces again. Every rank of the group must do the same before the next
        forward, whose all-gathers depend on it."""
        unit = self._fsdp
        if unit.engine is not None:
            unit.engine.reshard(unit.index)
        elif unit.flat.gathered():  # unshard() before the first forward
            if unit.flat.gather_in_flight():
                unit.flat.wait_gather()
            unit.flat.unshard_requested = False
            unit.flat.free_full()
        unit.unshard_handle = None
        unit.register(unit.sharded)

    def unshard(self, async_op=False):
        """All-gather this unit's parameters now (not recursive), as torch's FSDP2: the module's
        parameters are then the gathered ones, and the next forward finds them so (kept into its
        step, where no shard was written since) and does not gather them again. Call it alike on
        every rank of the group (the all-gather is a collective), e.g. ``model.unshard(async_op=
        True)`` before the forward, so that the root's all-gather overlaps loading the batch.
        With ``async_op`` returns an ``UnshardHandle``, whose ``wait()`` waits for it."""
        unit = self._fsdp
        if unit.engine is not None:
            unit.engine.unshard(unit.index)
        else:  # before the first forward made the engine: it keeps the unit at its first step
            unit.flat.unshard_requested = True
            if not unit.flat.gathered():
                unit.flat.start_gather()
        handle = unit.unshard_handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_modules_to_forward_prefetch(self, modules):
        """The fully_shard modules whose all-gathers this one's forward launches, instead of the
        next unit's (torch FSDP2's explicit prefetching): two or more overlap deeper, at the
        memory of the units gathered meanwhile. The forward all-gathers keep one order, so the
        units between this one and a listed one are launched too; a listed unit that runs before
        this one is not gathered again (fsdp_engine.h, "Explicit prefetching"). Units of the
        same model only; set it alike on every rank, as torch requires (other collectives on the
        group during forward, an ``unshard()`` among them, would pair with different
        all-gathers)."""
        self._fsdp.prefetch["forward"] = _prefetch_targets(self, modules, "set_modules_to_forward_prefetch")
        _apply_prefetch(self._fsdp)

    def set_modules_to_backward_prefetch(self, modules):
        """The same for backward: this unit's backward launches the all-gathers of the units from
        the next one in backward order to the furthest listed one. Set it alike on every rank:
        in backward the all-gathers interleave with the reduce-scatters."""
        self._fsdp.prefetch["backward"] = _prefetch_targets(self, modules, "set_modules_to_backward_prefetch")
        _apply_prefetch(self._fsdp)

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients without communication (see
        ``set_requires_gradient_sync``); the first backward after it reduces the sum."""
        units = [m._fsdp.flat for m in self.modules() if isinstance(m, FSDPModule)]
        old = [u.requires_grad_sync for u in units]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for u, flag in zip(units, old):
                u.requires_grad_sync = flag

    def sharded_state_dict(self):
        """``state_dict()`` with each sharded parameter as a ``Shard`` (this rank's piece, no
        communication) instead of the full tensor. It loads back with ``load_state_dict`` into a
        model wrapped the same way over the same number of ranks."""
        with sharded_form(self):
            return self.state_dict()

    @property
    def fsdp_engine(self):
        """The C++ engine of the model this unit belongs to (made at the root's first forward):
        ``trace()``, ``forward_order()``, ``memory()``, ``peak_memory()``."""
        return self._fsdp.engine


@contextmanager
def sharded_form(model):
    """Within it, ``model.state_dict()`` gives the parameters of every fully_shard unit in
    ``model`` as this rank's ``Shard``, whether or not ``model`` is a unit itself."""
    units = [m._fsdp for m in model.modules() if isinstance(m, FSDPModule)]
    for u in units:
        u.sharded_form = True
    try:
        yield
    finally:
        for u in units:
            u.sharded_form = False


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` waits for the all-gather
    and makes the module's parameters the gathered ones. As torch's, it acts once, and only
    until the unit's forward (which waits for the gather itself) or ``reshard()``: a later
    ``wait()`` does nothing (review: it registered gathered parameters after forward had put the
    pieces back, which the optimizer's ``zero_grad`` and clipping then missed)."""

    def __init__(self, unit):
        self._unit = unit

    def wait(self):
        unit = self._unit
        if unit.unshard_handle is not self:
            return
        unit.unshard_handle = None
        if unit.engine is not None:
            unit.engine.wait_unshard(unit.index)
        elif unit.flat.gather_in_flight():
            unit.flat.wait_gather()
        if unit.flat.gathered() and not unit.flat.gather_in_flight():
            unit.register(unit.unsharded)


def _prefetch_targets(module, modules, what):
    """The units of ``modules``, checked before anything is stored (review: a refused list was
    kept, and failed the next call or the first forward)."""
    modules = list(modules)
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise TypeError(f"torchpar fully_shard: {what} takes fully_shard modules, got a {type(m).__name__}")
    targets = [m._fsdp for m in modules]
    if module._fsdp.engine is not None:
        _check_prefetch(what, targets, lambda t: t.engine is module._fsdp.engine)
    return targets


def _check_prefetch(what, targets, same_model):
    if not all(same_model(t) for t in targets):
        raise ValueError(f"torchpar fully_shard: {what} lists a module of another model (units prefetch units of "
                         "the same model only)")


def _apply_prefetch(unit):
    """Hands a unit's prefetch lists to its engine (once it has one: the root's first forward)."""
    if unit.engine is None:
        return
    engine = unit.engine
    for kind, setter in (("forward", engine.set_forward_prefetch), ("backward", engine.set_backward_prefetch)):
        targets = unit.prefetch.get(kind)
        setter(unit.index, None if targets is None else [t.index for t in targets])


@dataclass
class Shard:
    """One rank's piece of a parameter in a ``sharded_state_dict``: elements
    [start, start + local.numel()) of the flattened parameter of shape ``shape``."""
    local: torch.Tensor
    shape: tuple
    start: int
    world_size: int
    rank: int


class _Unit:
    """Python-side state of one unit: where its parameters are registered, and its two sets of
    parameter objects (the pieces, the gathered)."""

    def __init__(self, flat, group, sites, sharded, unsharded, precision, replicate_group=None):
        self.flat = flat
        self.group = group            # the process group it shards over
        self.replicate_group = replicate_group  # hybrid sharding: the one it all-reduces over
        self.sites = sites            # (module, attribute, parameter index, name relative to the unit)
        self.sharded = sharded
        self.unsharded = unsharded
        self.precision = precision    # fsdp_policies.Precision: the dtypes it gathers, reduces, casts to
        self.engine = None
        self.index = None
        self.sharded_form = False
        self.prefetch = {}            # "forward"/"backward" -> [_Unit]: set_modules_to_*_prefetch
        self.unshard_handle = None    # the UnshardHandle of an unshard() its forward has not consumed
        for p in sharded:
            _UNIT_OF[id(p)] = self

    def register(self, params):
        for module, attr, i, _ in self.sites:
            module._parameters[attr] = params[i]


# Sharded parameter (by id) -> its unit, for the optimizer step hook below. A unit kept gathered
# (set_reshard_after_backward(False), reshard_after_forward=False) must not outlive a step of its
# shards; fused optimizers (fused=True) write them without bumping their version counters (review
# finding), so every torch.optim step counts itself on the units whose parameters it holds, and
# the engine keeps only units gathered since (fsdp_engine.h, "Kept gathered").
_UNIT_OF = weakref.WeakValueDictionary()


def _count_optimizer_step(optimizer, args, kwargs):
    units = {_UNIT_OF.get(id(p)) for group in optimizer.param_groups for p in group["params"]}
    for unit in units - {None}:
        unit.flat.optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)

_CLASSES = {}
# id of every original parameter a unit has flattened -> (weak reference, where it went). A unit
# copies its parameters into its flat shard, so one parameter tied into two units would become two
# parameters trained apart; fully_shard refuses it instead.
_TAKEN = {}


def fully_shard(module, group=None, reshard_after_forward=True, mixed_precision=None, *, mesh=None,
                replicate_group=None, mp_policy=None, offload_policy=None, ignored_params=None,
                shard_placement_fn=None, dp_mesh_dims=None):
    """Shard the parameters of ``module`` not owned by an already sharded submodule over
    ``group`` (default: the world), as torch's ``torch.distributed.fsdp.fully_shard``. Every rank
    must wrap the same model in the same order (checked: shapes, dtypes; collectives per call).
    ``mixed_precision``: a ``torchpar.parallel.MixedPrecision``; the shards stay in
    ``master_dtype``, forward and backward run on parameters gathered in ``param_dtype`` (floating
    inputs are cast to it), gradients are reduce-scattered in ``reduce_dtype``. Build the
    optimizer afterwards, on ``module.parameters()``. Returns ``module``.

    ``reshard_after_forward``: True frees the gathered parameters after forward (backward gathers
    them again), False keeps them until backward. An int N, as torch's FSDP2 (a divisor of the
    shard group's size W, e.g. the ranks of one host): forward leaves each rank 1/N of the
    gathered parameters, so that backward all-gathers among N ranks only (blocks of N consecutive
    ranks of the shard group), at W/N times the shard's size (in the compute dtype) held per unit
    from its forward to its backward.

    Hybrid sharding (HSDP, as torch's FSDP2 with a 2-D mesh; Zhang et al. 2022, "MiCS",
    arXiv:2205.00119): ``mesh``, a ``DeviceMesh`` of shape (replicate, shard), shards over its
    second dimension and replicates over its first; ``replicate_group`` says the same with groups
    (``group`` shards, ``replicate_group`` holds this rank's counterparts in the other replicas).
    Parameters are gathered within the shard group only; each reduced gradient shard is then
    all-reduced across the replicas. A 1-D ``mesh`` is the same as its group. Every unit of one
    model must use the same replicate group.

    torch FSDP2's arguments, as it reads them: ``mp_policy``, a ``MixedPrecisionPolicy``
    (``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``; the shards keep
    the module's dtype), instead of ``mixed_precision``; ``ignored_params``, parameters left as
    they are (not sharded, their gradients not reduced); ``offload_policy``: ``OffloadPolicy()``,
    or ``CPUOffloadPolicy`` for parameters on CPU (already where it would put them; refused on a
    device); ``shard_placement_fn`` may only give ``Shard(0)`` or None (a unit shards one flat
    parameter); ``dp_mesh_dims`` and a list of modules are refused."""
    if isinstance(module, (list, tuple)):
        raise NotImplementedError("torchpar fully_shard: a list of modules (one unit for several) is not supported: "
                                  "apply fully_shard to their common parent, or to each")
    exact = precision(mixed_precision, mp_policy)
    if mesh is not None:
        if group is not None or replicate_group is not None:
            raise ValueError("torchpar fully_shard: pass a mesh, or groups (group, replicate_group), not both")
        if mesh.ndim == 1:
            group = mesh.get_group(0)
        elif mesh.ndim == 2:
            replicate_group, group = mesh.get_group(0), mesh.get_group(1)
        else:
            raise ValueError(f"torchpar fully_shard: a mesh of 1 (shard) or 2 (replicate, shard) dimensions, "
                             f"got {mesh.ndim}: {tuple(mesh.shape)}")
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("torchpar fully_shard: call torch.distributed.init_process_group first")
    reshard_after_forward, post_forward_size = _reshard_after_forward(reshard_after_forward, group.size())
    if isinstance(module, FSDPModule):
        raise ValueError(f"torchpar fully_shard: {type(module).__name__} is already sharded")
    sites, params, index = [], [], {}
    ignored = {id(p) for p in ignored_params or ()}

    def walk(mod, prefix):
        for attr, p in mod._parameters.items():
            if p is not None and id(p) not in ignored:
                if id(p) not in index:
                    index[id(p)] = len(params)
                    params.append((prefix + attr, p))
                sites.append((mod, attr, index[id(p)], prefix + attr))
        for name, child in mod._modules.items():
            if child is not None and not isinstance(child, FSDPModule):
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    for name, p in params:
        taken = _TAKEN.get(id(p))
        if taken is not None and taken[0]() is p:
            raise ValueError(
                f"torchpar fully_shard: parameter '{name}' of {type(module).__name__} is already sharded "
                f"as {taken[1]} (a tied parameter); parameters shared by several modules must be in one "
                "unit: apply fully_shard to their common parent only")
    check_unsupported(params, offload_policy, shard_placement_fn, dp_mesh_dims)
    master = exact.master_dtype
    tensors = [p if master is None or p.dtype == master
               else p.detach().to(master).requires_grad_(p.requires_grad) for _, p in params]
    flat = _C.FlatParam(tensors, [n for n, _ in params], group, reshard_after_forward, exact.param_dtype,
                        exact.reduce_dtype, replicate_group)
    if post_forward_size:
        flat.post_forward_group = _post_forward_group(group, post_forward_size)
    sharded = [nn.Parameter(v, requires_grad=p.requires_grad) for v, (_, p) in zip(flat.shard_views(), params)]
    unsharded = [nn.Parameter(v, requires_grad=p.requires_grad) for v, (_, p) in zip(flat.unsharded_views(), params)]
    flat.bind(sharded, unsharded)
    _carry_over(params, sharded, unsharded)
    unit = _Unit(flat, group, sites, sharded, unsharded, exact, replicate_group)
    unit.register(sharded)
    for name, p in params:
        _TAKEN[id(p)] = (weakref.ref(p, lambda _, key=id(p): _TAKEN.pop(key, None)),
                         f"'{name}' of a {type(module).__name__}")

    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _CLASSES[cls]
    module._fsdp = unit
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward)
    module.register_forward_hook(_restore_pieces, always_call=True)
    module.register_state_dict_post_hook(_state_dict_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    return module


def register_fsdp_forward_method(module, method_name):
    """Run ``module.<method_name>`` as its forward is run (torch FSDP2's function of that name):
    the unit gathered before it, freed (and its gradients reduced in backward) after, for a method
    that uses the module's own parameters outside ``forward``, e.g. ``encode`` or a ``generate``
    that calls submodules directly. Not for methods that call ``self(...)``: that forward gathers
    the unit itself. A module that is not sharded is left as it is (as torch's: scripts call it
    whether or not they shard)."""
    if not isinstance(module, FSDPModule):
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)  # bound: the class's, or one registered before

    @functools.wraps(method)
    def run_as_forward(*args, **kwargs):
        args, kwargs = _pre_forward(module, args, kwargs)
        try:
            return _post_forward(module, args, method(*args, **kwargs))
        finally:
            _restore_pieces(module, args, None)
    setattr(module, method_name, run_as_forward)


def _reshard_after_forward(value, shard_size):
    """fully_shard's ``reshard_after_forward`` -> (bool, size of the post-forward groups or
    None), read as torch's FSDP2 reads it: an int must divide the shard group's size; 1 keeps the
    parameters gathered (False, with a warning: True was likely meant), the group's size is True."""
    if value is None:  # torch's default: True but for the root, which keeps its own here anyway
        return True, None
    if isinstance(value, bool):
        return value, None
    if not isinstance(value, int):
        raise ValueError("torchpar fully_shard: reshard_after_forward is a bool or an int (the number of ranks to "
                         f"reshard to after forward), got {value!r}")
    if value < 1 or shard_size % value:
        raise ValueError(f"torchpar fully_shard: reshard_after_forward={value} must divide the shard group's "
                         f"{shard_size} ranks")
    if value == 1:
        warnings.warn("torchpar fully_shard: reshard_after_forward=1 (an int) reshards to 1 rank: the parameters "
                      "stay gathered until backward, as with False; True frees them", stacklevel=3)
        return False, None
    return True, (value if value < shard_size else None)


# (backend, ranks) -> the post-forward group of those ranks, made once: every unit resharding to
# the same ranks shares it (new_group names such a group by its ranks, so a second one would clash).
_POST_FORWARD_GROUPS = {}


def _post_forward_group(group, size):
    """This rank's block of ``size`` consecutive ranks of ``group`` as a process group of its own,
    made by its members only (``use_local_synchronization``: the other blocks, and ranks outside
    ``group``, take no part, as where ``group`` is a pipeline stage's data-parallel group)."""
    ranks = dist.get_process_group_ranks(group)
    start = group.rank() // size * size
    block = tuple(ranks[start:start + size])
    key = (str(dist.get_backend(group)), block)
    # new_group names a locally synchronised group by its ranks and the number of groups this rank
    # has registered: ranks of one block that made different groups before (a group splitting the
    # block) would wait for each other under different names (a hang; review finding). Checked
    # over the whole group, so that every rank raises.
    counts = [None] * group.size()
    dist.all_gather_object(counts, len(dist.distributed_c10d._world.pg_names), group=group)
    split = [ranks[b:b + size] for b in range(0, len(ranks), size) if len(set(counts[b:b + size])) > 1]
    if split:
        raise ValueError(f"torchpar fully_shard: reshard_after_forward={size}: the ranks {split[0]} registered "
                         f"different numbers of process groups ({counts}), so torch cannot name their post-forward "
                         "group alike; make every group on all ranks of a block, or call fully_shard first")
    made = _POST_FORWARD_GROUPS.get(key)
    if made is not None:
        try:
            dist.get_process_group_ranks(made)  # raises once destroy_process_group() has run
            return made
        except (KeyError, RuntimeError, ValueError):
            pass
    made = dist.new_group(list(block), backend=key[0], use_local_synchronization=True)
    _POST_FORWARD_GROUPS[key] = made
    return made


def _carry_over(params, sharded, unsharded):
    """What was set on an original parameter, kept on the unit's two parameter objects: Megatron's
    ``sequence_parallel`` marker on both, and its gradient hooks on the gathered one, the
    parameter forward uses and backward reaches (sequence parallelism's hook all-reduces the
    gradient over the tensor-parallel group before the unit reduce-scatters it)."""
    for (_, p), piece, full in zip(params, sharded, unsharded):
        if getattr(p, "sequence_parallel", False):
            piece.sequence_parallel = full.sequence_parallel = True
        for hook in (p._backward_hooks or {}).values():
            full.register_hook(hook)


def _lazy_init(root):
    """At the first forward of a unit outside any other: it is a root; it and every unit below
    it without an engine share one (the root first, so the engine knows the order to record)."""
    units = [m._fsdp for m in root.modules() if isinstance(m, FSDPModule) and m._fsdp.engine is None]
    replicas = {id(u.replicate_group) if u.flat.replicas > 1 else None for u in units}
    if len(replicas) > 1:
        # The engine all-reduces each unit across the replicas in one agreed order; a unit left
        # out would leave its replicas' copies to drift apart.
        raise ValueError("torchpar fully_shard: the units of one model must all replicate over the same group "
                         "(hybrid sharding), or none of them: apply fully_shard with the same mesh or "
                         "replicate_group to every submodule and the root")
    members = {id(u) for u in units}
    for u in units:  # before anything is attached: a refused list leaves no half-made engine
        for kind, targets in u.prefetch.items():
            _check_prefetch(f"set_modules_to_{kind}_prefetch", targets, lambda t: id(t) in members)
    engine = _C.FsdpEngine([u.flat for u in units], 0)
    for i, u in enumerate(units):
        u.engine, u.index = engine, i
    for u in units:
        _apply_prefetch(u)


def _pre_forward(module, args, kwargs):
    unit = module._fsdp
    if unit.engine is None:
        _lazy_init(module)
    if unit.index == 0 and torch._C._current_graph_task_id() == -1:
        _register_pieces_again(engine=unit.engine)  # after a backward that raised
    grad = torch.is_grad_enabled()
    unit.unshard_handle = None  # the forward waits for an unshard() itself
    unit.engine.pre_forward(unit.index, grad)
    unit.register(unit.unsharded)
    if unit.precision.cast_inputs:
        args, kwargs = cast_floating((args, kwargs), unit.precision.param_dtype)
    if grad:
        args, kwargs = _register_post_backward(unit, args, kwargs)
    return args, kwargs


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs (FSDP2's RegisterPostBackwardFunction). Made before every node
    of the unit's forward, its backward runs after all of them: the unit's gradients are complete
    and it is reduced (fsdp_engine.h says why not from its parameters' gradient hooks)."""

    @staticmethod
    def forward(ctx, engine, index, *inputs):
        ctx.engine, ctx.index = engine, index
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.post_backward(ctx.index)
        return (None, None, *grads)


def _register_post_backward(unit, args, kwargs):
    leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    # Inputs that need no gradient (the root's token ids): the unit is reduced at the end of backward.
    if not at or not unit.engine.register_post_backward(unit.index):
        return args, kwargs
    for i, t in zip(at, _PostBackward.apply(unit.engine, unit.index, *(leaves[i] for i in at))):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def _post_forward(module, args, output):
    unit = module._fsdp
    grad = torch.is_grad_enabled()
    unit.engine.post_forward(unit.index, grad)  # (the pieces are registered back by _restore_pieces)
    output = cast_floating(output, unit.precision.output_dtype)
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if grad and tensors:
        # Runs when the first gradient reaches the unit's outputs, before its backward: gather
        # the unit again and prefetch the next one in backward order.
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: _pre_backward(unit), mode="any")
    return output


# Per autograd graph task (torch._C._current_graph_task_id()): the units whose gathered
# parameters _pre_backward registered for that backward, until it ends. Keyed so that a backward
# puts back only its own units: a nested one (reentrant checkpointing), another thread's, or
# another model's forward inside a recomputation must not take a running backward's (review).
_GATHERED_FOR_BACKWARD = {}


def _pre_backward(unit):
    unit.engine.pre_backward(unit.index)
    if not unit.flat.unshard_in_backward:  # nothing gathered to register
        return
    # Registered gathered until backward ends, as FSDP2's unshard does: activation checkpointing
    # inside the unit recomputes its forward in this backward and reads the module's attributes
    # (it read the pieces: a full-recompute block under fully_shard failed; audit finding). Not
    # at the unit's post-backward: a graph holding two forwards of it recomputes both. A backward
    # that raises runs no callback: the next forward of its root (outside any backward), or
    # reset_iter_state, puts them back.
    unit.register(unit.unsharded)
    task = torch._C._current_graph_task_id()
    if task not in _GATHERED_FOR_BACKWARD:
        _GATHERED_FOR_BACKWARD[task] = []
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _register_pieces_again(task=task))
    _GATHERED_FOR_BACKWARD[task].append(unit)


def _register_pieces_again(task=None, engine=None):
    """The pieces registered again on the units of backward ``task``, or of every finished
    backward of ``engine``'s units (after one that raised)."""
    tasks = [task] if task is not None else list(_GATHERED_FOR_BACKWARD)
    for t in tasks:
        units = _GATHERED_FOR_BACKWARD.get(t, [])
        for unit in [u for u in units if engine is None or u.engine is engine]:
            unit.register(unit.sharded)
            units.remove(unit)
        if not units:
            _GATHERED_FOR_BACKWARD.pop(t, None)


def _restore_pieces(module, args, output):
    """The pieces registered again after every forward (it runs right after ``_post_forward``),
    also one that raised (``always_call``): an error in the model, or non-reentrant
    checkpointing's recomputation, which stops by raising once it has recomputed what backward
    needs (before ``_post_forward``). Otherwise the module would keep the gathered parameter
    objects, and ``model.parameters()`` list those, without the ``.grad`` the optimizer and
    ``clip_grad_norm_`` read. The engine's own state after a raised forward is settled at the
    next root forward."""
    unit = module._fsdp
    unit.register(unit.sharded)


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    """Each of the unit's parameters under its usual key: the full tensor (gathered, a collective:
    every rank calls state_dict()), or this rank's ``Shard`` in ``sharded_state_dict()``."""
    unit = module._fsdp
    flat = unit.flat
    if unit.sharded_form:
        values = []
        for i, p in enumerate(unit.sharded):
            start, _ = flat.shard_range(i)
            values.append(Shard(p.detach().clone(), tuple(flat.shape(i)), start, flat.world_size, flat.rank))
    else:
        values = flat.gather_full_params()
    for _, _, i, name in unit.sites:
        if prefix + name in state_dict:
            state_dict[prefix + name] = values[i]


def _load_state_dict_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
    """Full tensors (from a model sharded over any number of ranks, or never sharded): each rank
    copies its piece, no communication. ``Shard``s: checked to be this rank's piece of this
    layout. Then the entry becomes the piece, which nn.Module's loader copies onto itself."""
    unit = module._fsdp
    flat = unit.flat
    unit.register(unit.sharded)  # after unshard() the gathered ones are registered (review): load into the pieces
    for _, _, i, name in unit.sites:
        key = prefix + name
        if key not in state_dict:
            continue  # reported as missing by nn.Module's loader
        value = state_dict[key]
        if isinstance(value, Shard):
            start, length = flat.shard_range(i)
            if value.world_size != flat.world_size or value.rank != flat.rank:
                raise ValueError(
                    f"torchpar fully_shard: '{key}' is a shard saved by rank {value.rank} of "
                    f"{value.world_size}, but this is rank {flat.rank} of {flat.world_size}; a sharded "
                    "state_dict loads only at the same world size (save state_dict(), the full form, "
                    "to move a checkpoint across world sizes)")
            if tuple(value.shape) != tuple(flat.shape(i)) or (value.start, value.local.numel()) != (start, length):
                raise ValueError(
                    f"torchpar fully_shard: '{key}' is elements [{value.start}, {value.start + value.local.numel()}) "
                    f"of shape {list(value.shape)}, but this rank holds [{start}, {start + length}) of shape "
                    f"{flat.shape(i)}: the model is wrapped differently from the one that saved it")
            value = value.local
        elif isinstance(value, torch.Tensor):
            if tuple(value.shape) != tuple(flat.shape(i)):
                raise ValueError(
                    f"torchpar fully_shard: the state_dict's '{key}' has shape {list(value.shape)}, but "
                    f"the model's parameter has shape {flat.shape(i)}")
            flat.load_full_param(i, value)
            value = unit.sharded[i].detach()
        state_dict[key] = value
