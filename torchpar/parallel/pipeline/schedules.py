"""Pipeline schedules: the C++ generator (csrc/parallel/pipeline/) gives each rank its ordered
list of actions; ``Executor.run`` (executor.py) walks it. Nothing here decides an order.

- ``RECV_*`` posts ``irecv``s (and returns at once); a compute waits only on the receives of its
  own inputs, so a rank never blocks on a receive it could have waited for later (the stall of
  pytorch/pytorch#172668).
- ``SEND_*`` posts ``isend``s; they are waited for at the end of the step, so communication
  overlaps the computes that follow.
- Gradients are scaled by 1/n_microbatches (the loss of each micro-batch is), as torch's
  schedules do; ``scale_grads=False`` keeps the sum.

A stage module wrapped in a ``DistributedDataParallel`` runs every micro-batch's forward under
``no_sync()``. Ours, built with ``find_unused_parameters=True``, is armed just before the stage's
last backward (``prepare_for_backward``), so that backward's gradient hooks reduce the
accumulated gradients bucket by bucket while it still runs (as Megatron-LM syncs only in the
last micro-batch's backward). Without ``find_unused_parameters`` an armed backward would
refuse a parameter that only earlier micro-batches used, so such a stage, torch's DDP, ours
with ``static_graph``, ``join()`` or ``shard_gradients`` (``executor._armable``), and a stage whose
backward is split (zero bubble: the weight gradients come from several calls), are averaged
after the step in one all-reduce instead. A ``fully_shard`` stage accumulates its unsharded
gradients over the micro-batches and reduce-scatters their sum in its last backward (one
reduce-scatter per unit and step rather than one per micro-batch; torch's schedules and
Megatron-LM also reduce once a step), at the cost of a full-size gradient accumulator per unit
during the step.
"""
import contextlib
import json
import time
import zlib
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from torchpar import _C
from torchpar.parallel.pipeline import _comm
from torchpar.parallel.fsdp import FSDPModule
from torchpar.parallel.pipeline.executor import Executor, armed_stages
from torchpar.parallel.pipeline.failure import ShardedPeers, StepFailure, agree_on_outcome
from torchpar.parallel.pipeline.stage import PipelineStage

_KIND_IDS = {"gpipe": 0, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 3, "custom": 4, "interleaved_zb": 5,
             "looped_bfs": 6}


def _split_batch(tensors, m, what, names=None):
    out = [[] for _ in range(m)]
    for i, t in enumerate(tensors):
        label = f"{what} {names[i] if names else i}"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label} is a {type(t).__name__}, not a tensor")
        if t.dim() == 0 or t.shape[0] % m != 0:
            raise ValueError(f"{label} has batch size {t.shape[0] if t.dim() else 'none (0-d)'}, "
                             f"which does not split into {m} micro-batches")
        for j, piece in enumerate(t.chunk(m)):
            out[j].append(piece)
    return out


def _split_kwargs(kwargs, m):
    """The keyword arguments of each micro-batch, as torch's default chunk specs make them: every
    tensor (also inside lists, tuples and dicts) split along dimension 0 like the batch, anything
    else given whole to each."""
    pairs, spec = tree_flatten_with_path(kwargs)
    leaves = [v for _, v in pairs]
    at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    labels = [repr(pairs[i][0][0].key) + keystr(pairs[i][0][1:]) for i in at]  # 'mask', 'm'[0]
    pieces = _split_batch([leaves[i] for i in at], m, "keyword argument", labels)
    out = []
    for piece in pieces:
        mine = list(leaves)
        for i, t in zip(at, piece):
            mine[i] = t
        out.append(tree_unflatten(mine, spec))
    return out


class _PipelineSchedule:
    kind = None

    def __init__(self, stages, n_microbatches, loss_fn=None, scale_grads=True, stages_per_rank=1):
        self.stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not self.stages or not all(isinstance(s, PipelineStage) for s in self.stages):
            raise TypeError(f"{type(self).__name__}: expects PipelineStage objects")
        self.group = self.stages[0].group
        self.p = self.stages[0].group_size
        self.rank = self.stages[0].group_rank
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.num_stages = self.stages[0].num_stages
        v = len(self.stages)
        if v != stages_per_rank or any(s.num_stages != self.num_stages for s in self.stages):
            raise ValueError(f"{type(self).__name__}: this rank holds {v} stages, the schedule places "
                             f"{stages_per_rank} per rank")
        if self.num_stages != self.p * v:
            raise ValueError(f"{type(self).__name__}: {self.num_stages} stages on {self.p} pipeline ranks with "
                             f"{v} stage(s) each: needs {self.p * v} stages")
        self._by_index = {s.stage_index: s for s in self.stages}
        self.schedule = self._make_schedule(self.p, n_microbatches, v)  # ValueError on every rank alike
        self._train_actions = self.schedule.actions(self.rank)
        self._eval_actions = self.schedule.forward_only().actions(self.rank)
        # Every rank runs its own list from its own copy of the schedule; a custom one (a CSV
        # per rank) could differ, and lists that pair messages differently cross them silently.
        self._schedule_id = zlib.crc32(self.schedule.to_csv().encode())
        self._recv_cache = OrderedDict()  # input key -> {stage: input specs}
        self._send_cache = OrderedDict()  # input key -> {stage: output specs}
        self._steps = 0  # steps and evals begun, the same count on every rank: picks the tags
        self._failure = StepFailure(self.group)  # its store keys are agreed at the first step
        self.last_stats = None   # step_time, busy, bubble (idle over step time), peak_live
        self.last_events = None  # (action, microbatch, stage, start, end) of the last step

    def _make_schedule(self, p, m, v):
        return _C.pipeline_schedule(self.kind, p, m, v)

    # ---- public API ----

    def step(self, *args, target=None, losses=None, trace=None, return_outputs=True, **kwargs):
        """One training step over ``args`` (the whole batch, on the first stage's rank) and
        ``target`` (on the last stage's rank), as torch's. Returns the last stage's output (None
        elsewhere, or with ``return_outputs=False``). ``kwargs`` go to the forward of every
        stage of this rank, tensors split into micro-batches along dimension 0 (an attention
        mask), others whole; each rank passes its own."""
        return self._run(self._train_actions, args, target, losses, trace, kwargs, return_outputs, train=True)

    def eval(self, *args, target=None, losses=None, trace=None, return_outputs=True, **kwargs):
        """Forward only (no gradients); losses are computed when a target is given."""
        with torch.no_grad():
            return self._run(self._eval_actions, args, target, losses, trace, kwargs, return_outputs, train=False)

    def to_csv(self, path=None):
        """This schedule as ``rank,action,microbatch,stage`` lines, every rank's (the format
        ``ScheduleFromCSV`` reads; docs/pipeline.md), written to ``path`` when given."""
        text = self.schedule.to_csv()
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    # ---- one step ----

    def _agree(self, first_mbs, err, train):
        """All pipeline ranks exchange what they are about to run; any disagreement or local
        error is raised on every rank before a single activation moves."""
        key = _comm.key(first_mbs[0], train) if first_mbs else 0
        # Which parameters require grad decides which stage outputs do, so it is part of what the
        # learned shapes hold for (a stage frozen or unfrozen between steps: review finding).
        trainable = zlib.crc32(bytes(p.requires_grad for s in self.stages for p in s.submod.parameters()))
        row = torch.tensor([self.num_stages, len(self.stages), _KIND_IDS[self.kind], self.n_microbatches,
                            key, int(err is not None), int(train), self._schedule_id, self._failure.nonce,
                            trainable], dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in range(self.p)]
        dist.all_gather(rows, row, group=self.group)
        rows = [r.tolist() for r in rows]
        problems = []
        if any(r[5] for r in rows):
            msgs = [None] * self.p
            dist.all_gather_object(msgs, err, group=self.group)
            problems += [f"pipeline rank {i}: {m}" for i, m in enumerate(msgs) if m]
        names = ["number of stages", "stages per rank", "schedule kind", "number of micro-batches", None, None,
                 "step/eval", "schedule (checksum of the action lists)", None, None]
        for field, name in enumerate(names):
            if name and len({r[field] for r in rows}) > 1:
                problems.append(f"pipeline ranks disagree on the {name}: " +
                                ", ".join(f"rank {i} has {r[field]}" for i, r in enumerate(rows)))
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self._failure.agree(rows[0][8])
        # Rank 0 holds stage 0: its input shapes, with every rank's trainable parameters.
        return _comm.combine_keys([rows[0][4]] + [r[9] for r in rows])

    def _run(self, actions, args, target, losses, trace, kwargs, return_outputs, train):
        m = self.n_microbatches
        first = self._by_index.get(0)
        last = self._by_index.get(self.num_stages - 1)
        err, first_mbs, targets, kwarg_mbs = None, None, None, None
        try:
            kwarg_mbs = _split_kwargs(kwargs, m) if kwargs else None
            if first is not None:
                if not args:
                    raise ValueError("the first stage's rank must pass the batch to step()")
                first_mbs = _split_batch(args, m, "input")
            if last is not None and train and self.loss_fn is None:
                raise ValueError("the last stage needs a loss_fn to train")
            if last is not None and self.loss_fn is not None and (train or target is not None):
                if target is None:
                    raise ValueError("the last stage's rank must pass target= (there is a loss_fn)")
                targets = _split_batch([target], m, "target")
        except (ValueError, TypeError) as e:
            err = str(e)
        # DDP only (it has a process_group): a fully_shard module has no_sync too, but it
        # reduce-scatters in a backward, not in _average_gradients: its units are below.
        ddp = {s.stage_index: s.submod for s in self.stages
               if train and hasattr(s.submod, "no_sync") and hasattr(s.submod, "process_group")}
        armed = armed_stages(self, actions, ddp, train)
        after_step = {i: m for i, m in ddp.items() if i not in armed}
        # The data-parallel peers agree on the step's outcome, except where they may be waiting
        # where they could not answer: inside a fully_shard stage's collectives (a failed rank
        # cannot replay them: its groups are aborted instead, below), or inside an armed stage's
        # when the pipeline group cannot be aborted (gloo): there, a failed rank issuing what that
        # backward owes would wait on peers whose pipeline waits on its own (review: an
        # interleaved schedule on gloo then hung until the timeout).
        sharded = ShardedPeers(self, [m for s in self.stages for m in s.submod.modules()
                                      if isinstance(m, FSDPModule)])
        agree = not sharded.modules and (not armed or dist.get_backend(self.group) == "torchpar")
        # Armed stages whose backward has issued all its collectives (run, or given up on).
        settled = set() if agree else None
        with sharded.aborted_on_failure(), \
                _data_parallel_outcome(self, ddp if agree else {},
                                       lambda: _release_data_parallel_peers(ddp, armed, settled),
                                       lambda: _disarm(ddp, armed, settled)):
            out = self._run_actions(actions, first_mbs, targets, kwarg_mbs, err, train, ddp, settled, sharded)
        for module in after_step.values():
            _average_gradients(module)
        outputs, step_losses, stats, events = out
        self.last_stats = stats
        self.last_events = events
        if losses is not None:
            losses.extend(step_losses)
        if trace:
            _write_trace(trace, events, stats["start"], self.rank, self.group)
        return outputs if return_outputs else None

    def _run_actions(self, actions, first_mbs, targets, kwarg_mbs, err, train, ddp, settled, sharded):
        """Agrees on the step with the other pipeline ranks (and a fully_shard stage's
        data-parallel peers, ``sharded``) and runs this rank's actions."""
        try:
            try:
                key = self._agree(first_mbs, err, train)
            except RuntimeError as e:  # the group failed: on another rank, in this step or the last?
                failure = self._failure.failed_start(self, self._steps + 1)
                if failure is None:
                    raise
                raise failure from e
        except BaseException:
            with contextlib.suppress(Exception):  # a broken group: the peers' own errors come
                sharded.agree_to_start(failed=True)
            raise
        sharded.agree_to_start(failed=False)
        self._steps += 1
        for s in self.stages:
            s.reset()
        # fully_shard units that reduce: off until their stage's last backward, and back on after
        # the step, whatever happened.
        fsdp_modules = {s.stage_index: mods for s in self.stages if train and (mods := syncing_fsdp_modules(s.submod))}
        fsdp = {i: [m._fsdp.flat for m in mods] for i, mods in fsdp_modules.items()}
        try:
            with contextlib.ExitStack() as no_sync:
                for module in ddp.values():
                    no_sync.enter_context(module.no_sync())
                for modules in fsdp_modules.values():
                    no_sync.push(reduce_in_last_backward(modules))
                executor = Executor(self, key, first_mbs, targets, train, ddp, fsdp, settled, kwarg_mbs)
                try:
                    return executor.run(actions)
                except BaseException as e:  # KeyboardInterrupt too: the peers must not wait for the timeout
                    failure = self._failure.fail(self, self._steps, e, executor.action, executor.waiting)
                    if failure is e:
                        raise
                    raise failure from e
        finally:
            for s in self.stages:
                s._mbs.clear()


@contextlib.contextmanager
def _data_parallel_outcome(sched, ddp, release, disarm):
    """Around a step of DDP stages ``ddp``: the data-parallel peers learn whether each other's
    step ended (failure.agree_on_outcome), so that a failure in one pipeline raises in the other
    pipelines' replicas too instead of leaving them waiting in the average after the step, or in
    an armed stage's last backward: a failed rank first issues what that backward owes them
    (``release``; it returns the groups that broke doing so, where the peers' own errors come
    instead). A KeyboardInterrupt or SystemExit does not wait for the peers (its process usually
    ends, which releases them): it only disarms (``disarm``), as does one arriving meanwhile."""
    by_group = {}  # the flag goes where the group averages the gradients (an NCCL group: the GPU)
    for m in ddp.values():
        device = next((q.device for q in m.parameters()), torch.device("cpu"))
        by_group.setdefault(id(m.process_group), (m.process_group, device))
    if not by_group:
        yield
        return
    try:
        yield
    except Exception:
        try:
            broken = release()
            groups = [g for key, g in by_group.items() if key not in broken]
            with contextlib.suppress(Exception):  # a broken data-parallel group: its own error comes later
                agree_on_outcome(groups, failed=True)
        finally:
            disarm()
        raise
    except BaseException:
        disarm()
        raise
    groups = list(by_group.values())
    failed = agree_on_outcome(groups, failed=False)
    if failed:
        raise RuntimeError(f"{type(sched).__name__}: pipeline rank {sched.rank}: the step failed on its data-parallel "
                           f"peer(s) {', '.join(f'rank {r}' for r in failed)} (their error says why), so this rank's "
                           f"gradients are not the step's average; zero them before the next step")


def _release_data_parallel_peers(ddp, armed, settled):
    """After this rank's step failed (the pipeline group already aborted, so no neighbour waits
    on this): each armed stage whose last backward did not issue all its collectives issues the
    rest now, zeros, in the order of the stages' last backwards (its peers' order too), so that
    a peer in another pipeline, whose step went on into that backward, is not left waiting in
    its reduction (Reducer.abandon_backward). The peers then raise at the agreement. Returns the
    groups (ids) on which that failed (a comm hook raising on this rank alone, no memory for the
    zeros): those are aborted, so that the peers waiting for the rest fail now, and this rank's
    next collective there fails instead of completing theirs with its next step's buckets
    (review). That holds on torchpar; gloo's and NCCL's abort do not reach the peers, which
    wait for the timeout (docs/pipeline.md, "Missing / limits")."""
    broken = set()
    for stage in armed:
        group = ddp[stage].process_group
        if stage in settled:
            continue
        settled.add(stage)
        if id(group) in broken:
            ddp[stage].reducer.cancel_backward()
            continue
        try:
            ddp[stage].reducer.abandon_backward()
        except Exception:  # noqa: BLE001 - this rank's own error is the one it raises
            broken.add(id(group))
            with contextlib.suppress(Exception):
                group.abort()
    return broken


def _disarm(ddp, armed, settled):
    """Disarms the armed stages the error path did not get to (a Ctrl-C meanwhile): left armed, a
    reducer makes the next step's first no_sync backward reduce (review). Without an agreement
    (``settled`` None) the executor disarms a failed armed backward itself."""
    for stage in armed:
        if stage not in settled:
            settled.add(stage)
            ddp[stage].reducer.cancel_backward()


def syncing_fsdp_modules(module):
    """The fully_shard modules in ``module`` whose units reduce their gradients (a user's
    ``set_requires_gradient_sync(False)`` is kept: those are left out), for
    ``reduce_in_last_backward``."""
    return [m for m in module.modules() if isinstance(m, FSDPModule) and m._fsdp.flat.requires_grad_sync]


def reduce_in_last_backward(modules):
    """Turns the gradient sync of ``modules`` (fully_shard modules whose units reduce) off for
    the step and returns the exit callback that turns it on again. Until the stage's last
    backward, which syncs, each unit also stays gathered after a backward (as torch's schedules
    set ``set_reshard_after_backward(False)``): the next micro-batch's forward does not gather it
    again. A step that raised frees what is kept and puts back each unit's accumulator as the
    step found it (none, unless the user accumulates across steps): the partial sums of its
    micro-batches must not be reduced by the next step (review finding)."""
    units = [m._fsdp.flat for m in modules]
    found = [(u.reshard_after_backward, None if u.accumulator is None else u.accumulator.clone()) for u in units]
    for u in units:
        u.requires_grad_sync = False
        u.reshard_after_backward = False

    def exit_(exc_type, exc, tb):
        for m, u, (reshard, accumulator) in zip(modules, units, found):
            u.requires_grad_sync = True
            u.reshard_after_backward = reshard
            if exc_type is not None:
                u.accumulator = accumulator
                with contextlib.suppress(RuntimeError):  # a group the failure broke: the next step frees it
                    m.reshard()
        return False
    return exit_


def _average_gradients(module):
    """Data-parallel average of a DDP-wrapped stage's gradients, once per step, in the DDP's
    reduce dtype where it has one (O2: bfloat16 gradients summed in float32, as its reducer
    would; a bfloat16 sum of three or more ranks rounds at every step of the ring)."""
    group = module.process_group
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    for g in (g for g in grads if g.is_sparse):  # an nn.Embedding(sparse=True)'s, reduced alone
        dist.all_reduce(g, group=group)
        g.div_(dist.get_world_size(group))
    grads = [g for g in grads if not g.is_sparse]
    if not grads:
        return
    dtype = getattr(module, "grad_reduce_dtype", None)
    flat = torch.cat([g.reshape(-1) if dtype is None else g.reshape(-1).to(dtype) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _write_trace(path, events, start, rank, group):
    """Chrome trace (chrome://tracing, ui.perfetto.dev) of every pipeline rank's actions. Each
    rank's events are placed by its own start on the host's monotonic clock, so that a message's
    send and its receive line up (ranks on other hosts: as far as the clocks agree)."""
    base = time.time()
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (start, list(events)), group=group)
    if rank != 0:
        return
    out = []
    first = min(s for s, _ in everyone)
    for r, (start_r, evs) in enumerate(everyone):
        shift = start_r - first
        for name, mb, stage, t0, t1 in evs:
            out.append({"name": f"{name}{mb}" if name != "wait" else "wait", "cat": name, "ph": "X", "pid": r,
                        "tid": 0, "ts": (t0 + shift) * 1e6, "dur": (t1 - t0) * 1e6,
                        "args": {"microbatch": mb, "stage": stage}})
    with open(path, "w") as f:
        json.dump({"traceEvents": out, "otherData": {"written": base}}, f)


class ScheduleGPipe(_PipelineSchedule):
    """GPipe (Huang et al. 2019): all forwards, then all backwards; holds m micro-batches."""
    kind = "gpipe"


class Schedule1F1B(_PipelineSchedule):
    """1F1B (PipeDream-Flush, arXiv:2104.04473): GPipe's bubble with at most p micro-batches live."""
    kind = "1f1b"


class ScheduleZeroBubble(_PipelineSchedule):
    """ZB-H1 (arXiv:2401.10241): 1F1B with each backward split into input gradient (B) and
    weight gradient (W); 1F1B's peak memory, a third of its bubble when tF = tB = tW."""
    kind = "zb_h1"


class _LoopedSchedule(_PipelineSchedule):
    """Several stages per rank, looped placement: ``stages`` are this rank's v stages (stage
    indices r, r + p, ...)."""

    def __init__(self, stages, n_microbatches, loss_fn=None, scale_grads=True):
        stages = sorted(stages, key=lambda s: s.stage_index)
        super().__init__(stages, n_microbatches, loss_fn, scale_grads, stages_per_rank=len(stages))


class ScheduleInterleaved1F1B(_LoopedSchedule):
    """Interleaved 1F1B (arXiv:2104.04473 section 2.2): the bubble shrinks by v. n_microbatches
    must be a multiple of p."""
    kind = "interleaved_1f1b"


class ScheduleInterleavedZeroBubble(_LoopedSchedule):
    """Interleaved 1F1B with each backward split into B and W (arXiv:2401.10241), rank r holding
    back r W's to fill the cool-down, as ZB-H1 does for 1F1B: interleaved 1F1B's peak memory, a
    third of its bubble when tF = tB = tW. torch's ScheduleInterleavedZeroBubble's place (its
    ZB1P). n_microbatches must be a multiple of p. With one stage a rank, ScheduleZeroBubble
    leaves the same bubble with less memory (1F1B's shorter warm-up)."""
    kind = "interleaved_zb"


class ScheduleLoopedBFS(_LoopedSchedule):
    """Breadth-first (arXiv:2211.05953), looped placement as interleaved: every micro-batch
    through this rank's first stage, then its next, ...; backwards from its last stage, the
    micro-batches in reverse. GPipe's memory (v m micro-batch-stages), interleaved 1F1B's bubble
    when n_microbatches >= p, each stage's backwards together. As torch's ScheduleLoopedBFS."""
    kind = "looped_bfs"


class ScheduleFromCSV(_PipelineSchedule):
    """A custom schedule: ``csv`` is the text (or a path ending in .csv) of
    ``rank,action,microbatch,stage`` lines (see docs/pipeline.md)."""
    kind = "custom"

    def __init__(self, stages, n_microbatches, csv, loss_fn=None, scale_grads=True):
        self._csv = open(csv).read() if isinstance(csv, str) and csv.endswith(".csv") else csv
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        super().__init__(stages, n_microbatches, loss_fn, scale_grads, stages_per_rank=len(stages))

    def _make_schedule(self, p, m, v):
        return _C.pipeline_schedule_from_csv(self._csv, p, m, v)


_BY_NAME = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
            "ZeroBubble": ScheduleZeroBubble, "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
            "LoopedBFS": ScheduleLoopedBFS}
# torch's names of schedules torchpar does not generate (ZeroBubble is ZB-H1 without interleaving;
# the V-shaped ones place a rank's two stages at both ends of the pipeline).
_TORCH_ONLY = ("ZBVZeroBubble", "DualPipeV", "PipelineScheduleSingle", "PipelineScheduleMulti")


def get_schedule_class(schedule_name):
    """The schedule class of ``schedule_name``, case insensitive, as torch's function of that name
    (torchtitan picks its schedule so): GPipe, 1F1B, Interleaved1F1B, ZeroBubble (ZB-H1),
    InterleavedZeroBubble and LoopedBFS."""
    names = {k.lower(): k for k in _BY_NAME}
    key = str(schedule_name).lower()
    if key in names:
        return _BY_NAME[names[key]]
    if key in {n.lower() for n in _TORCH_ONLY}:
        raise NotImplementedError(f"get_schedule_class: torch's {schedule_name!r} schedule is not generated by "
                                  f"torchpar; it has {list(_BY_NAME)} (ScheduleFromCSV runs any other action list)")
    raise ValueError(f"get_schedule_class: unknown schedule name {schedule_name!r}; the valid options are "
                     f"{list(_BY_NAME)}")
