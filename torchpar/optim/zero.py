"""ZeRO stage 1 and 2: each rank keeps the optimizer state of its shard of the parameters only.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(2020, arXiv:1910.02054). Plain data parallelism keeps Adam's two moments for every parameter
on every rank; here rank r keeps them for the parameters it owns (whole parameters, balanced
by size, see shard_layout.py), steps those, and all-gathers the updated parameters bucket by
bucket, so optimizer-state memory per rank is 1/W of DDP's (plus at most one parameter's
worth of imbalance per bucket).

The contract is torch's ``torch.distributed.optim.ZeroRedundancyOptimizer``: ``step(closure)``,
``zero_grad``, ``consolidate_state_dict(to)`` on every rank then ``state_dict()`` on rank
``to`` (the ordinary single-process optimizer format, so it loads at any world size and into a
plain optimizer), ``load_state_dict`` on every rank, ``add_param_group``. With
``DistributedDataParallel(shard_gradients=True)`` (ZeRO-2) the optimizer adopts DDP's layout,
so the gradients DDP keeps are exactly the ones this rank steps.

O2 mixed precision (``mixed_precision=MixedPrecision(...)``): parameters in a 16-bit dtype,
float32 master copies of the owned shard held here and stepped, then copied back into the
parameters and all-gathered in the 16-bit dtype (half the bytes). ``loss_scaler`` (a
``DynamicLossScaler``) unscales the float32 master gradients and skips a step that
overflowed on any rank. With gradients sharded (ZeRO-2), torch's ``GradScaler`` sees only this
rank's and would skip the step on some ranks only (the ranks' collectives part: an error on
every rank at the next step's first one, a timeout after the last step): use ``loss_scaler`` or torch's
``ShardedGradScaler`` (docs/zero.md).

Gradient clipping (``clip_grad_norm_``, FairScale's ``OSS.clip_grad_norm``): between backward
and ``step()``, each rank adds up ``|g|^p`` over the gradients of the parameters it owns (each
parameter counted once, on its owner, whether DDP left the whole gradient everywhere (ZeRO-1) or
only the owner's shard (ZeRO-2)), the sums are all-reduced over the group (max for inf), and each
rank scales its shard's gradients. Under O2 those are the float32 master gradients, after the
loss scaler divided them: the ones ``step()`` then uses (it does not copy or unscale them again).

Uneven inputs: a ``Joinable`` as torch's is. Under the ``join()`` of the torchpar DDP that
reduces its gradients (or ``Join([ddp, optimizer])``, in either order), a rank whose batches
ran out steps its shard with the gradients the others averaged (its own share zero) and enters
the all-gather, once per synchronised step of the others: DDP's join hook runs this step after
shadowing the backward. Without a torchpar DDP (torch's, or none), ``Join([model, optimizer])``
with the model first, and the optimizer's own hook steps, as with torch's optimizer.
"""
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from torchpar.optim import shard_layout

_BUCKET_CAP_MB = 25  # as DDP's


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """``ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=1e-3)`` on every rank of
    ``process_group`` (default: the world), with the same ``params`` on each. ``optim`` is the
    local ``optimizer_class`` instance over this rank's shard (its masters under O2).

    torch's ``parameters_as_bucket_view`` is accepted and changes nothing here: the parameters are
    always views into flat buckets (what torch does with ``True``; the all-gather after the step
    writes them in place), so a parameter's storage is its whole bucket (``torch.save`` of one
    parameter alone writes the bucket: save ``.clone()`` or the ``state_dict``);
    ``overlap_with_ddp=True`` (the step run inside DDP's comm hook) is refused."""

    def __init__(self, params, optimizer_class, process_group=None, parameters_as_bucket_view=False,
                 overlap_with_ddp=False, *, bucket_cap_mb=_BUCKET_CAP_MB, mixed_precision=None, loss_scaler=None,
                 **defaults):
        if overlap_with_ddp:
            raise NotImplementedError("torchpar ZeRO: overlap_with_ddp is not supported; the step all-gathers the "
                                      "updated shards after it (torchpar's DDP(shard_gradients=True) gives ZeRO-2)")
        self._ready = False  # Optimizer.__init__ calls add_param_group before we can shard
        super().__init__(params, defaults)
        Joinable.__init__(self)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if self.process_group is None:
            raise RuntimeError("torchpar ZeRO: call torch.distributed.init_process_group first")
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self.optimizer_class = optimizer_class
        self.mixed_precision = mixed_precision
        self.loss_scaler = loss_scaler
        self._cap_bytes = int(bucket_cap_mb * 2 ** 20)
        self._layouts = []    # (ShardLayout, optimizer index of each of its parameters)
        self._local = []      # optimizer indices this rank steps, in the local optimizer's order
        self._masters = {}    # optimizer index -> the tensor the local optimizer steps
        self._consolidated = None
        self.optim = None
        # This step's master gradients, once prepared (copied, unscaled, checked): whether this
        # rank's overflowed, else None. clip_grad_norm_ prepares them before step() does.
        self._prepared = None
        # What the gradients were when prepared (and after clipping them): a later change
        # (model.zero_grad(), p.grad = None, another backward) makes the preparation stale.
        self._prepared_grads = None
        # Under join(): whether this step's clip descriptor was all-reduced already.
        self._described = False
        # The counted and groups of this rank's last clip_grad_norm_, which a joined rank uses.
        self._clip_counted, self._clip_groups = None, ()
        self._shard(0)
        self._ready = True
        shard_layout.register_optimizer(self, self._params())

    # ---- sharding ----

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _partition(self, start):
        """Layouts for parameters ``start:``, and which of them this rank owns."""
        params = self._params()
        new = params[start:]
        _verify_same_params(new, start, self.process_group)
        layouts = [(layout, [start + k for k in index])
                   for layout, index in shard_layout.adopted(new, self._cap_bytes, self.process_group)]
        owned = set()
        for layout, index in layouts:
            owned.update(index[i] for i, r in enumerate(layout.owner()) if r == self.rank)
        return layouts, owned

    def _shard(self, start):
        """Shard parameters ``start:`` (all at construction, a new group's after): their
        layouts, masters, and the local optimizer's groups."""
        layouts, owned = self._partition(start)
        self._layouts += layouts
        for layout, _ in layouts:
            layout.bind()  # parameters become views of the buckets the all-gather fills
        master_dtype = self.mixed_precision.master_dtype if self.mixed_precision else None
        base = 0
        first_new_group = len(self.optim.param_groups) if self.optim is not None else 0
        for gi, g in enumerate(self.param_groups):
            local = []
            for k, p in enumerate(g["params"], start=base):
                if k >= start and k in owned:
                    if master_dtype is not None and p.dtype != master_dtype:
                        self._masters[k] = p.detach().to(master_dtype).requires_grad_(p.requires_grad)
                    else:
                        self._masters[k] = p  # stepped in place, as without O2
                    self._local.append(k)
                    local.append(self._masters[k])
            if gi >= first_new_group:  # a group being sharded now
                local_group = {**_options(g), "params": local}
                if self.optim is None:
                    self.optim = self.optimizer_class([local_group], **self.defaults)
                else:
                    self.optim.add_param_group(local_group)
            base += len(g["params"])
        # The local optimizer fills in its defaults; show them in the groups users see.
        for g, lg in zip(self.param_groups, self.optim.param_groups):
            g.update(_options(lg))

    def add_param_group(self, param_group):
        """On every rank, with the same parameters: they are sharded as a layout of their own,
        so the shards and state of the existing parameters stay where they are."""
        if not self._ready:
            return super().add_param_group(param_group)
        start = len(self._params())
        super().add_param_group(param_group)
        self._shard(start)
        shard_layout.register_optimizer(self, self._params()[start:])

    # ---- stepping ----

    def step(self, closure=None, **kwargs):
        """As torch's: ``kwargs`` go to the local optimizer's ``step``."""
        if shard_layout.ddp_of(self._params()) is None:
            Join.notify_join_context(self)  # as torch's; a torchpar DDP notifies in its forward
        return self._step(closure, **kwargs)

    def _step(self, closure=None, **kwargs):
        """The step, and on a joined rank the shadow of the others' (its gradients are the
        average of theirs, left by DDP's shadow backward)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, lg in zip(self.param_groups, self.optim.param_groups):
            lg.update(_options(g))  # an LR scheduler changes the groups users see
        if not self._described and self._join_active():
            self._describe_clip(None)  # no clipping this step: the joined ranks must not clip either
        self._described = False
        pairs = self._pairs()
        self._prepare_grads(pairs)
        found_inf = self._prepared
        self._prepared = None
        self._prepared_grads = None
        if self.loss_scaler is not None:
            # Every rank, every step, whatever it owns (nothing: 2 parameters on 4 ranks), on
            # the group's device (NCCL reduces no CPU tensor).
            found_inf = self.loss_scaler.any_rank_found(found_inf, self.process_group, device=self.join_device)
            self.loss_scaler.update(found_inf)
            if found_inf:  # every rank skips: parameters stay as they are everywhere
                self._release_master_grads(pairs)
                return loss
        self.optim.step(**kwargs)
        with torch.no_grad():
            for p, m in pairs:
                if m is not p:
                    p.copy_(m)
            self._release_master_grads(pairs)
            self._gather()
        return loss

    def _shadow_step(self):
        """A joined rank's share of the others' step: the clip descriptor they all-reduce
        (``_describe_clip``), their clipping if they clip (with their ``max_norm`` and
        ``norm_type``), then the step."""
        told = self._describe_clip(None, shadow=True)
        if told is not None:
            self._clip(*told, counted=self._clip_counted, groups=self._clip_groups)
        self._step()

    def _join_active(self):
        """Whether this optimizer, or the torchpar DDP over its parameters, is under a
        ``Join`` (which every rank of the group enters: the answer is the same everywhere)."""
        if self._join_config.enable:
            return True
        ddp = shard_layout.ddp_of(self._params())
        return ddp is not None and ddp._join_config.enable

    def _describe_clip(self, args, shadow=False):
        """Under ``join()``, once a step on every rank: all-reduce (max) of what this step's
        clipping is. ``args``: this rank's ``(max_norm, norm_type)``, or None (a joined rank, or
        a rank stepping without clipping; ``shadow``: a joined rank). Returns the clipping
        ranks' ``(max_norm, norm_type)``, or None if no rank clips. Raises on every rank if the ranks still training disagree."""
        self._described = True
        inf = float("inf")
        if args is None:
            mine = [0.0, -inf, -inf, -inf, -inf, 0.0 if shadow else 1.0]
        else:
            max_norm, norm_type = float(args[0]), float(args[1])
            mine = [1.0, max_norm, norm_type, -max_norm, -norm_type, 0.0]
        d = torch.tensor(mine, dtype=torch.float64, device=self.join_device)
        dist.all_reduce(d, op=dist.ReduceOp.MAX, group=self.process_group)
        clip, hi_norm, hi_type, lo_norm, lo_type, declined = d.tolist()
        if not clip:
            return None
        if declined or hi_norm != -lo_norm or hi_type != -lo_type:
            raise RuntimeError(
                "torchpar ZeRO: under join() the ranks still training must all call clip_grad_norm_ "
                "in the same steps, with the same max_norm and norm_type; this step some did not "
                f"(max_norm {-lo_norm}..{hi_norm}, norm_type {-lo_type}..{hi_type}, some not clipping: "
                f"{bool(declined)})")
        return hi_norm, hi_type

    def _pairs(self):
        params = self._params()
        return [(params[k], self._masters[k]) for k in self._local]

    @staticmethod
    def _grad_tensors(pairs):
        return [t.grad for p, m in pairs for t in ((p, m) if m is not p else (p,))]

    def _grads_now(self, pairs):
        """What the gradients the step reads are now: each ``.grad`` (weakly: a new tensor
        after ``p.grad = None`` cannot pass for the old one, as a reused ``id`` could) and its
        version (an in-place change: ``zero_grad(set_to_none=False)``, accumulation)."""
        return [(None, -1) if g is None else (weakref.ref(g), g._version) for g in self._grad_tensors(pairs)]

    def _still_prepared(self, pairs):
        """Whether the prepared gradients are still the ones the step would read."""
        if self._prepared is None or self._prepared_grads is None:
            return False
        now = self._grad_tensors(pairs)
        return len(now) == len(self._prepared_grads) and all(
            (r is None) if g is None else (r is not None and r() is g and g._version == v)
            for (r, v), g in zip(self._prepared_grads, now))

    @torch.no_grad()
    def _prepare_grads(self, pairs):
        """The gradients the local optimizer steps on (float32 copies of the parameters' under
        O2), divided by the loss scaler's scale; sets ``_prepared`` to whether this rank's hold
        an inf or NaN. Local only (``step()`` then all-reduces that flag, once, on every rank),
        and done again if the gradients changed since (``clip_grad_norm_``, a step skipped,
        ``model.zero_grad()`` or ``p.grad = None``, another backward): whether a rank redoes it
        need not be the same everywhere."""
        if self._still_prepared(pairs):
            return
        for p, m in pairs:
            if m is not p:
                m.grad = None if p.grad is None else p.grad.detach().to(m.dtype)
        found_inf = False
        if self.loss_scaler is not None:
            found_inf = self.loss_scaler.unscale_([m.grad for _, m in pairs if m.grad is not None])
        self._prepared = found_inf
        self._prepared_grads = self._grads_now(pairs)

    # ---- gradient clipping ----

    _norm_over_group = True  # ranks own different parameters: their sums add up over the group

    def clip_grad_norm_(self, max_norm, norm_type=2.0, *, counted=None, groups=()):
        """``torch.nn.utils.clip_grad_norm_`` of the parameters this optimizer steps, on every
        rank of its group, after backward and before ``step()`` (with a ``closure``: inside
        it). Each rank adds up its own shard's gradients; the sums are all-reduced over the
        group (max for ``norm_type=inf``), and each rank scales its shard's gradients by
        ``max_norm / (norm + 1e-6)`` when that is below 1. Returns the total norm before
        clipping, a float32 scalar tensor, the same on every rank.

        Only the gradients this rank steps are scaled. Under ZeRO-1 the gradients of the
        parameters other ranks own, which DDP also left here, keep their values (``step()``
        does not read them); under ZeRO-2 this rank has no others. Under O2 the float32 master
        gradients are clipped, after the loss scaler divided them (the 16-bit ``.grad`` of the
        parameters stay as backward left them); a step that overflowed returns a non-finite
        norm and ``step()`` skips it.

        For a model also split by tensor or pipeline parallelism (``torchpar.parallel.
        clip_grad_norm_``): ``counted``, the parameters whose gradients count on this rank
        (default all; a replica's other copies must not count twice) and ``groups``, the further
        groups the sums are all-reduced over.

        Call ``step()`` after it every step, also when the norm is not finite (an overflow
        under a loss scaler): ``step()`` then skips the update and the scaler backs off. If a
        step is skipped anyway and the gradients are reset (``zero_grad``, ``model.zero_grad()``
        or ``p.grad = None``) and computed again, the next call clips the new ones.

        Under ``join()``: call it at most once a step, with the same ``max_norm`` and
        ``norm_type`` on every rank still training (else every rank raises). The ranks still
        training first all-reduce a small descriptor of the step's clipping (in this call, or in
        ``step()`` when they do not clip), which a joined rank always takes part in; it then
        joins the norm's all-reduce with their ``max_norm`` and ``norm_type`` (and the
        ``counted`` and ``groups`` of its own last call, by default all it owns and none)."""
        args = (float(max_norm), float(norm_type))
        self._clip_counted, self._clip_groups = counted, tuple(groups)
        if self._join_active():
            if self._described:  # the joined ranks would not shadow a second norm all-reduce
                raise RuntimeError("torchpar ZeRO: under join() call clip_grad_norm_ at most once "
                                   "between two step()s")
            # Tell the joined ranks (who shadow this in _shadow_step) that this step clips, and how.
            self._describe_clip(args)
        return self._clip(*args, counted=counted, groups=groups)

    def _clip(self, max_norm, norm_type, counted=None, groups=()):
        from torchpar.parallel.clip_grad import clip_grad_norm_

        pairs = self._pairs()
        self._prepare_grads(pairs)
        masters = [m for _, m in pairs]
        if counted is not None:
            counted_ids = {id(p) for p in counted}
            counted_masters = [m for p, m in pairs if id(p) in counted_ids]
        else:
            counted_masters = masters
        norm_groups = list(groups)
        if self._norm_over_group and self.world_size > 1:
            norm_groups.insert(0, self.process_group)
        norm = clip_grad_norm_(masters, max_norm, norm_type, counted=counted_masters, groups=norm_groups,
                               device=self.join_device)
        self._prepared_grads = self._grads_now(pairs)  # the clipped gradients are the prepared ones
        return norm

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        pairs = self._pairs()
        self._release_master_grads(pairs)
        self._prepared = None

    # ---- uneven inputs (Join) ----

    def join_hook(self, **kwargs):
        return _JoinHook(self)

    @property
    def join_device(self):
        params = self._params()
        return params[0].device if params else torch.device("cpu")

    @property
    def join_process_group(self):
        return self.process_group

    def stepped_tensors(self):
        """[(parameter, the tensor this rank's local optimizer steps for it)] for the parameters
        this rank owns: the float32 master under O2, else the parameter itself. Its state is
        ``self.optim.state[tensor]`` (for checkpoints that address state by parameter); between
        ``clip_grad_norm_`` and ``step()`` a master's ``.grad`` is the clipped gradient."""
        return self._pairs()

    def _gather(self):
        for layout, _ in self._layouts:
            layout.all_gather()

    @staticmethod
    def _release_master_grads(pairs):
        for p, m in pairs:
            if m is not p:
                m.grad = None

    def optimizer_state_bytes(self, masters=True):
        """Bytes of this rank's optimizer state tensors (and of its float32 masters under O2)."""
        total = sum(v.numel() * v.element_size() for s in self.optim.state.values()
                    for v in s.values() if torch.is_tensor(v))
        if masters:
            params = self._params()
            total += sum(m.numel() * m.element_size() for k, m in self._masters.items() if m is not params[k])
        return total

    # ---- state dicts ----

    def _local_state(self):
        """This rank's shard of the state, keyed by optimizer (global) index."""
        local = self.optim.state_dict()["state"]
        params = self._params()
        out = {}
        for i, k in enumerate(self._local):
            entry = dict(local.get(i, {}))
            if self._masters[k] is not params[k]:
                entry["master_param"] = self._masters[k].detach().clone()
            if entry:
                out[k] = entry
        return out

    def _groups_for_saving(self):
        groups, base = [], 0
        for g in self.param_groups:
            groups.append({**_options(g), "params": list(range(base, base + len(g["params"])))})
            base += len(g["params"])
        return groups

    def consolidate_state_dict(self, to=0):
        """Gather every rank's shard of the state on rank ``to``; call on every rank."""
        group = self.process_group
        dst = dist.get_global_rank(group, to) if group is not dist.group.WORLD else to
        pieces = [None] * self.world_size if self.rank == to else None
        dist.gather_object(self._local_state(), pieces, dst=dst, group=group)
        self._consolidated = None
        if self.rank == to:
            merged = {}
            for piece in pieces:
                merged.update(piece)
            self._consolidated = dict(sorted(merged.items()))

    def state_dict(self):
        """The whole state in the plain optimizer format, on the rank consolidated to."""
        if self._consolidated is None:
            raise RuntimeError(
                f"torchpar ZeRO: the optimizer state is not consolidated on rank {self.rank}; call "
                f"consolidate_state_dict(to={self.rank}) on every rank first (or sharded_state_dict())")
        return {"state": self._consolidated, "param_groups": self._groups_for_saving()}

    def sharded_state_dict(self):
        """This rank's shard only (no communication); loads back only at the same world size."""
        return {"state": self._local_state(), "param_groups": self._groups_for_saving(),
                "zero": {"world_size": self.world_size, "rank": self.rank, "owned": list(self._local)}}

    def load_state_dict(self, state_dict):
        """On every rank, the same consolidated state_dict (or a plain optimizer's): each rank
        keeps its shard of it. A ``sharded_state_dict`` loads only at its own world size and rank."""
        params = self._params()
        self._check_loadable_everywhere(state_dict, params)
        state = state_dict["state"]
        local_state, local_groups, i = {}, [], 0
        position = {k: i for i, k in enumerate(self._local)}  # in the local optimizer's numbering
        base = 0
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update(_options(saved))
            for k in range(base, base + len(g["params"])):
                if k in position:
                    pos = position[k]
                    # Copies: the caller's state_dict must not change as this optimizer steps.
                    entry = {name: v.clone() if torch.is_tensor(v) else v
                             for name, v in state.get(k, state.get(str(k), {})).items()}
                    master = entry.pop("master_param", None)
                    with torch.no_grad():
                        if self._masters[k] is not params[k]:
                            self._masters[k].copy_(master if master is not None else params[k])
                        elif master is not None:
                            params[k].copy_(master)
                    if entry:
                        local_state[pos] = entry
            base += len(g["params"])
        for lg, g in zip(self.optim.param_groups, self.param_groups):
            n = len(lg["params"])
            local_groups.append({**_options(g), "params": list(range(i, i + n))})
            i += n
        # The local optimizer numbers its parameters in self._local's order, group by group.
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        with torch.no_grad():  # parameters follow the loaded masters everywhere
            for k in self._local:
                if self._masters[k] is not params[k]:
                    params[k].copy_(self._masters[k])
        # On every rank, whatever it owns: a rank owning no master (or no parameter at all)
        # that skipped this all-gather would leave the others waiting in it.
        self._gather()

    def _check_loadable_everywhere(self, state_dict, params):
        """``_check_loadable`` on every rank, then raise on all of them if it failed on any:
        each rank may load a different (sharded) state_dict, and a rank raising alone would
        leave the others waiting in the all-gather at the end of ``load_state_dict``."""
        error = None
        try:
            self._check_loadable(state_dict, params)
        except Exception as e:  # noqa: BLE001 (a malformed dict: KeyError, IndexError too)
            error = e
        device = params[0].device if params else torch.device("cpu")
        failed = torch.tensor([self.rank if error is not None else -1], device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.process_group)
        if error is not None:
            raise error
        if failed.item() >= 0:
            raise ValueError(f"torchpar ZeRO: load_state_dict failed on rank {int(failed.item())} "
                             f"(see its error); every rank must load a state_dict it accepts")

    def _check_loadable(self, state_dict, params):
        meta = state_dict.get("zero")
        if meta is not None and (meta["world_size"] != self.world_size or meta["rank"] != self.rank):
            raise ValueError(
                f"torchpar ZeRO: this state_dict is rank {meta['rank']}'s shard of a group of "
                f"{meta['world_size']} ranks; this is rank {self.rank} of {self.world_size}. Save "
                f"with consolidate_state_dict() and state_dict() to load at another world size.")
        # The same world size may still shard differently (another bucket_cap_mb, ZeRO-1 vs
        # DDP's ZeRO-2 layout): the parameters this rank owns now would silently get no state.
        if meta is not None and "owned" in meta and sorted(meta["owned"]) != sorted(self._local):
            raise ValueError(
                f"torchpar ZeRO: this sharded state_dict holds the state of the parameters rank "
                f"{self.rank} owned when it was saved ({len(meta['owned'])} of them); this optimizer "
                f"shards differently and this rank owns parameters {sorted(self._local)[:8]}... Load "
                f"with the same layout (bucket_cap_mb, DDP shard_gradients), or save the "
                f"consolidated state_dict.")
        saved = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in saved] != sizes:
            raise ValueError(
                f"torchpar ZeRO: the state_dict has parameter groups of sizes "
                f"{[len(g['params']) for g in saved]}; this optimizer's are {sizes}")
        for k, entry in state_dict["state"].items():
            k = int(k)
            for name, value in entry.items():
                if torch.is_tensor(value) and value.numel() > 1 and value.shape != params[k].shape:
                    raise ValueError(
                        f"torchpar ZeRO: state '{name}' of parameter #{k} has shape "
                        f"{tuple(value.shape)}; the parameter has shape {tuple(params[k].shape)}")


class _JoinHook(JoinHook):
    """A joined rank's share of one step of the others: this optimizer's step, unless the torchpar
    DDP over its parameters is joined too, whose hook runs it after the shadow backward."""

    def __init__(self, zero):
        self.zero = zero

    def main_hook(self):
        ddp = shard_layout.ddp_of(self.zero._params())
        if ddp is None:
            self.zero._shadow_step()
        elif not ddp._join_config.enable:
            # The ranks still training raise in DDP's forward, after the same notification.
            raise shard_layout.joined_without_ddp_error()


def _options(group):
    return {key: v for key, v in group.items() if key != "params"}


def _verify_same_params(params, start, group):
    """Every rank must pass the same parameters (same count, shapes, dtypes), or the shards
    and the all-gather would mix up unrelated tensors: a clear error on every rank."""
    from torchpar.parallel.ddp import _verify_same_model  # the check DDP makes of its model
    _verify_same_model([(f"#{start + k}", p) for k, p in enumerate(params)], group,
                       who="torchpar ZeRO", what="parameter list")
