"""Pipeline schedules: the C++ generator (csrc/parallel/pipeline/) gives each rank its ordered
list of actions; ``_Executor.run`` walks it. Nothing here decides an order.

- ``RECV_*`` posts ``irecv``s (and returns at once); a compute waits only on the receives of its
  own inputs, so a rank never blocks on a receive it could have waited for later (the stall of
  pytorch/pytorch#172668).
- ``SEND_*`` posts ``isend``s; they are waited for at the end of the step, so communication
  overlaps the computes that follow.
- Gradients are scaled by 1/n_microbatches (the loss of each micro-batch is), as torch's
  schedules do; ``scale_grads=False`` keeps the sum.

A stage module wrapped in a ``DistributedDataParallel`` (ours or torch's) runs every micro-batch
under ``no_sync()``; its gradients are then averaged over its data-parallel group once, after
the last micro-batch, in one all-reduce.
"""
import contextlib
import json
import time
from collections import OrderedDict

import torch
import torch.distributed as dist

from torchpar import _C
from torchpar.parallel.pipeline import _comm
from torchpar.parallel.pipeline.stage import PipelineStage

_KIND_IDS = {"gpipe": 0, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 3, "custom": 4}
_CACHE_KEYS = 16  # input shapes remembered (variable sequence length)


def _split_batch(tensors, m, what):
    out = [[] for _ in range(m)]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} {i} is a {type(t).__name__}, not a tensor")
        if t.dim() == 0 or t.shape[0] % m != 0:
            raise ValueError(f"{what} {i} has batch size {t.shape[0] if t.dim() else 'none (0-d)'}, "
                             f"which does not split into {m} micro-batches")
        for j, piece in enumerate(t.chunk(m)):
            out[j].append(piece)
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
        self._recv_cache = OrderedDict()  # input key -> {stage: input specs}
        self._send_cache = OrderedDict()  # input key -> {stage: output specs}
        self.last_stats = None   # step_time, busy, bubble (idle over step time), peak_live
        self.last_events = None  # (action, microbatch, stage, start, end) of the last step

    def _make_schedule(self, p, m, v):
        return _C.pipeline_schedule(self.kind, p, m, v)

    # ---- public API ----

    def step(self, *args, target=None, losses=None, trace=None):
        """One training step over ``args`` (the whole batch, on the first stage's rank) and
        ``target`` (on the last stage's rank). Returns the last stage's output, else None."""
        return self._run(self._train_actions, args, target, losses, trace, train=True)

    def eval(self, *args, target=None, losses=None, trace=None):
        """Forward only (no gradients); losses are computed when a target is given."""
        with torch.no_grad():
            return self._run(self._eval_actions, args, target, losses, trace, train=False)

    # ---- one step ----

    def _agree(self, first_mbs, err, train):
        """All pipeline ranks exchange what they are about to run; any disagreement or local
        error is raised on every rank before a single activation moves."""
        key = _comm.key(first_mbs[0], train) if first_mbs else 0
        row = torch.tensor([self.num_stages, len(self.stages), _KIND_IDS[self.kind], self.n_microbatches,
                            key, int(err is not None), int(train)], dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in range(self.p)]
        dist.all_gather(rows, row, group=self.group)
        rows = [r.tolist() for r in rows]
        problems = []
        if any(r[5] for r in rows):
            msgs = [None] * self.p
            dist.all_gather_object(msgs, err, group=self.group)
            problems += [f"pipeline rank {i}: {m}" for i, m in enumerate(msgs) if m]
        names = ["number of stages", "stages per rank", "schedule kind", "number of micro-batches", None, None,
                 "step/eval"]
        for field, name in enumerate(names):
            if name and len({r[field] for r in rows}) > 1:
                problems.append(f"pipeline ranks disagree on the {name}: " +
                                ", ".join(f"rank {i} has {r[field]}" for i, r in enumerate(rows)))
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        return rows[0][4]  # rank 0 holds stage 0

    def _run(self, actions, args, target, losses, trace, train):
        m = self.n_microbatches
        first = self._by_index.get(0)
        last = self._by_index.get(self.num_stages - 1)
        err, first_mbs, targets = None, None, None
        try:
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
        key = self._agree(first_mbs, err, train)
        for s in self.stages:
            s.reset()
        ddp = [s.submod for s in self.stages if train and hasattr(s.submod, "no_sync")]
        try:
            with contextlib.ExitStack() as no_sync:
                for module in ddp:
                    no_sync.enter_context(module.no_sync())
                out = _Executor(self, key, first_mbs, targets, train).run(actions)
            for module in ddp:
                _average_gradients(module)
        finally:
            for s in self.stages:
                s._mbs.clear()
        outputs, step_losses, stats, events = out
        self.last_stats = stats
        self.last_events = events
        if losses is not None:
            losses.extend(step_losses)
        if trace:
            _write_trace(trace, events, self.rank, self.group)
        return outputs


class _Executor:
    """State of one step while the action list runs."""

    def __init__(self, sched, key, first_mbs, targets, train):
        self.s = sched
        self.key = key
        self.first_mbs = first_mbs
        self.targets = targets
        self.train = train
        self.split = sched.schedule.split_backward and train
        self.scale = 1.0 / sched.n_microbatches if sched.scale_grads else 1.0
        self.recv_known = sched._recv_cache.get(key, {})
        self.send_known = sched._send_cache.get(key, {})
        self.recv_learned, self.send_learned, self.out_specs = {}, {}, {}
        self.pending_f, self.pending_b = {}, {}   # (mb, stage) -> pending receives
        self.to_send_f, self.to_send_b = {}, {}
        self.sends, self.ops = [], []       # posted send works; ops not yet posted
        self.outputs, self.losses, self.events = [], [], []

    # -- communication --

    def _peer(self, stage):
        return stage % self.s.p

    def _isend(self, tensor, stage, tag):
        self.ops.append((dist.P2POp(dist.isend, tensor, group=self.s.group, group_peer=self._peer(stage), tag=tag),
                         None))

    def _flush(self):
        """Posts the queued sends and receives at once; returns their works in queue order."""
        if not self.ops:
            return
        ops, self.ops = self.ops, []
        # Sends that completed need not keep their tensors alive until the end of the step.
        # A work need not hold its tensor, so each send keeps its own until it completed.
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        for op, pending in ops:
            work = _post(op)
            if pending is None:
                self.sends.append((work, op.tensor))
            else:
                pending.works.append(work)

    def _post_recv(self, tensors, stage, tag):
        pending = _Pending(tensors)
        for t in tensors:
            self.ops.append((dist.P2POp(dist.irecv, t, group=self.s.group, group_peer=self._peer(stage), tag=tag),
                             pending))
        return pending

    # -- actions --

    def run(self, actions):
        t_start = time.perf_counter()
        busy = 0.0
        for name, mb, stage in actions:
            if name.startswith("RECV") or name.startswith("SEND"):
                getattr(self, name.lower())(mb, stage)
                continue
            self._flush()
            t0 = time.perf_counter()
            compute = getattr(self, "do_" + name.lower())
            t_wait = compute(mb, stage)  # returns when its inputs had arrived
            t1 = time.perf_counter()
            busy += t1 - t_wait
            if t_wait - t0 > 2e-5:
                self.events.append(("wait", mb, stage, t0 - t_start, t_wait - t_start))
            self.events.append((name, mb, stage, t_wait - t_start, t1 - t_start))
        self._flush()
        for w, _ in self.sends:
            w.wait()
        step_time = time.perf_counter() - t_start
        self._remember()
        stats = {"step_time": step_time, "busy": busy, "bubble": 1 - busy / step_time if step_time else 0.0,
                 "peak_live": max(s.peak_live for s in self.s.stages)}
        outputs = _merge(self.outputs) if self.outputs else None
        return outputs, self.losses, stats, self.events

    def _remember(self):
        for cache, learned in ((self.s._recv_cache, self.recv_learned), (self.s._send_cache, self.send_learned)):
            cache.setdefault(self.key, {}).update(learned)
            cache.move_to_end(self.key)
            while len(cache) > _CACHE_KEYS:
                cache.popitem(last=False)

    def recv_f(self, mb, stage):
        header = torch.empty(_comm.HEADER_LEN, dtype=torch.int64)
        h = self._post_recv([header], stage - 1, _comm.tag_header(stage))
        data = None
        if stage in self.recv_known:  # learned for these input shapes: post the data now
            data = self._post_recv(_comm.empty(self.recv_known[stage]), stage - 1, _comm.tag_activation(stage))
        self.pending_f[(mb, stage)] = (h, data)

    def send_f(self, mb, stage):
        outs = self.to_send_f.pop((mb, stage))
        got = _comm.specs(outs)
        known = self.send_known.get(stage)
        self._isend(_comm.encode(outs, stage), stage + 1, _comm.tag_header(stage + 1))
        if known is not None and known != got:
            self._flush()
            raise ValueError(f"pipeline stage {stage}: output of micro-batch {mb} is {_comm.describe(got)}, but "
                             f"stage {stage + 1} expects {_comm.describe(known)} (learned for the same input "
                             f"shapes); stage outputs must depend only on the input shapes")
        self.send_learned[stage] = got
        for t in outs:
            self._isend(t.detach().contiguous(), stage + 1, _comm.tag_activation(stage + 1))

    def recv_b(self, mb, stage):
        specs = self.out_specs.get(stage)
        if specs is None:  # forward of this stage not run yet in this step: post at use
            self.pending_b[(mb, stage)] = None
            return
        self.pending_b[(mb, stage)] = self._post_recv(
            _comm.empty([sp for sp in specs if sp[2]]), stage + 1, _comm.tag_gradient(stage))

    def send_b(self, mb, stage):
        for g in self.to_send_b.pop((mb, stage)):
            self._isend(g.contiguous(), stage - 1, _comm.tag_gradient(stage - 1))

    def _inputs(self, mb, stage):
        if stage == 0:
            return list(self.first_mbs[mb])
        h, data = self.pending_f.pop((mb, stage))
        h.wait()
        got = _comm.decode(h.tensors[0])
        if data is None:
            data = self._post_recv(_comm.empty(got), stage - 1, _comm.tag_activation(stage))
            self._flush()
        elif [sp[:2] for sp in got] != [sp[:2] for sp in self.recv_known[stage]]:
            raise ValueError(f"pipeline stage {stage}: micro-batch {mb} arrived as {_comm.describe(got)}, but "
                             f"{_comm.describe(self.recv_known[stage])} was expected (learned for the same input "
                             f"shapes); stage {stage - 1}'s output shape changed")
        data.wait()
        self.recv_learned[stage] = got
        ins = data.tensors
        for t, (_, _, rg) in zip(ins, got):
            if rg and self.train:
                t.requires_grad_(True)
        return ins

    def do_f(self, mb, stage):
        st = self.s._by_index[stage]
        args = self._inputs(mb, stage)
        t_wait = time.perf_counter()
        outs = st.forward(mb, args, capture=self.split)
        self.out_specs.setdefault(stage, _comm.specs(outs))
        if st.is_last:
            if self.s.loss_fn is not None and self.targets is not None:
                loss = self.s.loss_fn(outs[0] if len(outs) == 1 else outs, self.targets[mb][0])
                self.losses.append(loss.detach())
                if self.train:
                    st.set_loss(mb, loss)
            elif self.train:
                raise ValueError(f"pipeline stage {stage}: the last stage needs a loss_fn to train")
            self.outputs.append([o.detach() for o in outs])
        else:
            self.to_send_f[(mb, stage)] = outs
        return t_wait

    def do_b(self, mb, stage):
        st = self.s._by_index[stage]
        grads = None
        if not st.is_last:
            pending = self.pending_b.pop((mb, stage))
            if pending is None:
                pending = self._post_recv(_comm.empty([sp for sp in self.out_specs[stage] if sp[2]]),
                                          stage + 1, _comm.tag_gradient(stage))
                self._flush()
            pending.wait()
            grads = pending.tensors
        t_wait = time.perf_counter()
        backward = st.backward_input if self.split else st.backward
        in_grads = backward(mb, grads, self.scale)
        if not st.is_first:
            self.to_send_b[(mb, stage)] = [g for g in _needed(in_grads, self.recv_learned[stage])]
        return t_wait

    def do_w(self, mb, stage):
        t_wait = time.perf_counter()
        self.s._by_index[stage].backward_weight(mb)
        return t_wait


def _post(op):
    """One isend/irecv with its own work. Not batch_isend_irecv: on a backend that coalesces
    (NCCL, torchpar) it returns one work for the whole batch, so waiting for a receive would
    also wait for every send posted with it (the stall of pytorch/pytorch#172668)."""
    kw = {"group_dst": op.group_peer} if op.op is dist.isend else {"group_src": op.group_peer}
    return op.op(op.tensor, group=op.group, tag=op.tag, **kw)


def _needed(in_grads, specs):
    """Gradients of the inputs that require one (zeros where autograd found none)."""
    out = []
    for g, (shape, dtype, rg) in zip(in_grads, specs):
        if rg:
            out.append(g if g is not None else torch.zeros(shape, dtype=dtype))
    return out


class _Pending:
    """Receives of one message (one or several tensors)."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.works = []

    def wait(self):
        for w in self.works:
            w.wait()


def _merge(outputs):
    cols = list(zip(*outputs))
    merged = [torch.cat(c) for c in cols]
    return merged[0] if len(merged) == 1 else tuple(merged)


def _average_gradients(module):
    """Data-parallel average of a DDP-wrapped stage's gradients, once per step."""
    group = module.process_group
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _write_trace(path, events, rank, group):
    """Chrome trace (chrome://tracing, ui.perfetto.dev) of every pipeline rank's actions."""
    base = time.time()
    mine = [(name, mb, stage, t0, t1) for name, mb, stage, t0, t1 in events]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if rank != 0:
        return
    out = []
    for r, evs in enumerate(everyone):
        for name, mb, stage, t0, t1 in evs:
            out.append({"name": f"{name}{mb}" if name != "wait" else "wait", "cat": name, "ph": "X", "pid": r,
                        "tid": 0, "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6, "args": {"microbatch": mb, "stage": stage}})
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


class ScheduleInterleaved1F1B(_PipelineSchedule):
    """Interleaved 1F1B (arXiv:2104.04473 section 2.2): ``stages`` are this rank's v stages
    (stage indices r, r + p, ...); the bubble shrinks by v. n_microbatches must be a multiple of p."""
    kind = "interleaved_1f1b"

    def __init__(self, stages, n_microbatches, loss_fn=None, scale_grads=True):
        stages = sorted(stages, key=lambda s: s.stage_index)
        super().__init__(stages, n_microbatches, loss_fn, scale_grads, stages_per_rank=len(stages))


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
