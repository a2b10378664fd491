"""Runs one rank's action list for one step: posts the receives and sends, waits only for a
compute's own inputs, calls the stage's forward / backward / weight-gradient, and times it.

Each send and receive is its own work (see ``_flush``), posted together just before the next
compute; sends are waited for at the end of the step, and those already complete are dropped
before each compute so their tensors can be freed.

Per step, only the first activation message of each stage boundary carries a header (the
shapes): every micro-batch of a step has the same input shapes, so the others go without, and
the sender checks each against the first.
"""
import time

import torch

from torchpar.parallel.ddp import DistributedDataParallel
from torchpar.parallel.fsdp import FSDPModule
from torchpar.parallel.pipeline import _comm

_CACHE_KEYS = 16  # input shapes remembered (variable sequence length)


class Executor:
    """State of one step while the action list runs."""

    def __init__(self, sched, key, first_mbs, targets, train, ddp=None, fsdp=None, settled=None, kwarg_mbs=None):
        self.s = sched
        self.group = sched.group
        self.key = key
        self.first_mbs = first_mbs
        self.kwarg_mbs = kwarg_mbs  # per micro-batch keyword arguments of this rank's stages, or None
        self.targets = targets
        self.train = train
        self.split_stages = split_stages(sched, train)
        self.scale = 1.0 / sched.n_microbatches if sched.scale_grads else 1.0
        self.tag_base = _comm.tag_base(sched._steps, sched.num_stages)
        self.recv_known = sched._recv_cache.get(key, {})
        self.send_known = sched._send_cache.get(key, {})
        self.recv_learned, self.send_learned, self.out_specs = {}, {}, {}
        self.headers = {}                    # stage -> this step's header receive, until read
        self.pending_f, self.pending_b = {}, {}   # (mb, stage) -> pending receives
        self.deferred_f = {}  # stage -> micro-batches whose data receive waits for the header
        self.deferred_b = {}  # stage -> micro-batches whose RECV_B came before the stage's first forward
        self.to_send_f, self.to_send_b = {}, {}
        self.sends, self.ops = [], []       # posted sends (work, tensor); ops not yet posted
        self.outputs, self.losses, self.events = [], [], []
        # Stage -> its module, when it is our DDP and its backward is not split: armed just
        # before the stage's last B, which then reduces as it runs (schedules.py says why).
        self.sync_in_last_backward = _synced_in_last_backward(ddp or {}, self.split_stages)
        self.last_b = {}
        # Armed stages whose last backward issued all its collectives; None (no agreement: a
        # fully_shard stage, a pipeline group other than torchpar's): a failed armed backward
        # disarms at once, as no error path will issue what it owes its peers.
        self.settled = settled
        # Stage -> its fully_shard units that reduce-scatter in the stage's last B only.
        self.fsdp = fsdp or {}
        self.fsdp_last_b = {}
        self.action = (None, None, None)  # the action running now, and whether it is posting
        self.waiting = False               # to or waiting for a peer (failure.py tells them apart)
        self._do = {"F": self.do_f, "B": self.do_b, "W": self.do_w, "RECV_F": self.recv_f,
                    "SEND_F": self.send_f, "RECV_B": self.recv_b, "SEND_B": self.send_b}

    # -- communication --

    def _send(self, tensor, stage, tag):
        self.ops.append((True, tensor, stage % self.s.p, self.tag_base + tag, None))

    def _post_recv(self, tensors, stage, tag):
        pending = _Pending(tensors)
        peer, tag = stage % self.s.p, self.tag_base + tag
        self.ops += [(False, t, peer, tag, pending) for t in tensors]
        return pending

    def _flush(self):
        """Posts the queued sends and receives, each its own work: not batch_isend_irecv, which
        on a backend that coalesces (NCCL, torchpar) returns one work for the whole batch, so
        waiting for a receive would also wait for every send posted with it (the stall of
        pytorch/pytorch#172668). ``ProcessGroup.send/recv`` take the group's own ranks and
        skip ``dist.isend``'s per-call checks, which cost more than the post itself."""
        if not self.ops:
            return
        ops, self.ops = self.ops, []
        # Sends that completed need not keep their tensors alive until the end of the step.
        # A work need not hold its tensor, so each send keeps its own until it completed.
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        group = self.group
        self.waiting = True  # a post may raise too, on a group a peer has broken (gloo)
        for is_send, tensor, peer, tag, pending in ops:
            if is_send:
                self.sends.append((group.send([tensor], peer, tag), tensor))
            else:
                pending.works.append(group.recv([tensor], peer, tag))
        self.waiting = False

    def _wait(self, works):
        self.waiting = True
        for w in works:
            w.wait()
        self.waiting = False

    def _empty(self, specs, stage):
        """Receive buffers for stage ``stage`` (of this rank), on its device. The headers stay
        on the CPU: a group of the torchpar backend carries CPU and CUDA tensors alike."""
        return _comm.empty(specs, self.s._by_index[stage].device)

    # -- actions --

    def run(self, actions):
        t_start = time.perf_counter()
        busy = 0.0
        events = self.events
        self.last_b = {stage: mb for name, mb, stage in actions
                       if name == "B" and stage in self.sync_in_last_backward}
        self.fsdp_last_b = {stage: mb for name, mb, stage in actions if name == "B" and stage in self.fsdp}
        peak_live = 0  # micro-batch-stages this rank holds at once, over all its stages
        for action in actions:
            self.action = name, mb, stage = action
            if name[0] in "RS":  # RECV_*, SEND_*: queued, posted before the next compute
                self._do[name](mb, stage)
                continue
            self._flush()
            t0 = time.perf_counter()
            t_wait = self._do[name](mb, stage)  # returns when its inputs had arrived
            t1 = time.perf_counter()
            busy += t1 - t_wait
            if name == "F":  # only a forward adds one
                peak_live = max(peak_live, sum(s.live for s in self.s.stages))
            if t_wait - t0 > 2e-5:
                events.append(("wait", mb, stage, t0 - t_start, t_wait - t_start))
            events.append((name, mb, stage, t_wait - t_start, t1 - t_start))
        self._flush()
        self.action = ("SEND", None, None)
        self._wait([w for w, _ in self.sends])
        step_time = time.perf_counter() - t_start
        self._remember()
        stats = {"step_time": step_time, "busy": busy, "bubble": 1 - busy / step_time if step_time else 0.0,
                 "peak_live": peak_live,
                 "start": t_start}  # time.perf_counter(): one clock for every process of a host
        outputs = _merge(self.outputs) if self.outputs else None
        return outputs, self.losses, stats, self.events

    def _remember(self):
        for cache, learned in ((self.s._recv_cache, self.recv_learned), (self.s._send_cache, self.send_learned)):
            cache.setdefault(self.key, {}).update(learned)
            cache.move_to_end(self.key)
            while len(cache) > _CACHE_KEYS:
                cache.popitem(last=False)

    def recv_f(self, mb, stage):
        if stage not in self.headers and stage not in self.recv_learned:  # the step's first
            header = torch.empty(_comm.HEADER_LEN, dtype=torch.int64)
            self.headers[stage] = self._post_recv([header], stage - 1, _comm.tag_header(stage))
        specs = self.recv_learned.get(stage, self.recv_known.get(stage))
        if specs is None:  # new input shapes: the data receive waits for the header
            self.deferred_f.setdefault(stage, []).append(mb)
            return
        self.pending_f[(mb, stage)] = self._post_recv(self._empty(specs, stage), stage - 1, _comm.tag_activation(stage))

    def send_f(self, mb, stage):
        outs = self.to_send_f.pop((mb, stage))
        got = _comm.specs(outs)
        first = self.send_learned.get(stage)
        if first is None:  # the step's first message to stage + 1: with a header
            known = self.send_known.get(stage)
            for part in _comm.encode(outs, stage):
                self._send(part, stage + 1, _comm.tag_header(stage + 1))
            if known is not None and known != got:
                # The next stage raises on reading this header; wait until it is delivered, or
                # the next stage may see this rank exit (connection reset) instead of the error.
                self._flush()
                self._wait([self.sends[-1][0]])
                raise _comm.ShapeMismatch(
                    f"pipeline stage {stage}: output of micro-batch {mb} is {_comm.describe(got)}, but stage "
                    f"{stage + 1} expects {_comm.describe(known)} (learned for the same input shapes); stage "
                    f"outputs must depend only on the input shapes")
            self.send_learned[stage] = got
        elif first != got:
            raise ValueError(f"pipeline stage {stage}: output of micro-batch {mb} is {_comm.describe(got)}, but "
                             f"the step's first was {_comm.describe(first)}; stage outputs must depend only on "
                             f"the input shapes")
        for t in outs:
            self._send(t.detach().contiguous(), stage + 1, _comm.tag_activation(stage + 1))

    def recv_b(self, mb, stage):
        if stage not in self.out_specs:  # no forward of this stage yet in this step: shapes unknown
            self.deferred_b.setdefault(stage, []).append(mb)
            return
        self._recv_gradient(mb, stage)

    def _recv_gradient(self, mb, stage):
        self.pending_b[(mb, stage)] = self._post_recv(
            self._empty([sp for sp in self.out_specs[stage] if sp[2]], stage), stage + 1, _comm.tag_gradient(stage))

    def send_b(self, mb, stage):
        for g in self.to_send_b.pop((mb, stage)):
            self._send(g.contiguous(), stage - 1, _comm.tag_gradient(stage - 1))

    def _read_header(self, mb, stage):
        """The step's header for ``stage``: checked against the shapes learned for these input
        shapes, or learned now (then the data receives that waited for it are posted, in the
        order of their RECV_F: receives of one tag match the peer's sends in posting order)."""
        header = self.headers.pop(stage)
        self._wait(header.works)
        header = header.tensors[0]
        if more := _comm.extension_len(header):  # many tensors: the rest follows with the same tag
            rest = self._post_recv([torch.empty(more, dtype=torch.int64)], stage - 1, _comm.tag_header(stage))
            self._flush()
            self._wait(rest.works)
            header = torch.cat([header, rest.tensors[0]])
        got = _comm.decode(header)
        known = self.recv_known.get(stage)
        if known is not None and [sp[:2] for sp in got] != [sp[:2] for sp in known]:
            raise _comm.ShapeMismatch(
                f"pipeline stage {stage}: micro-batch {mb} arrived as {_comm.describe(got)}, but "
                f"{_comm.describe(known)} was expected (learned for the same input shapes); stage {stage - 1}'s "
                f"output shape changed")
        self.recv_learned[stage] = got
        for later in self.deferred_f.pop(stage, []):
            self.pending_f[(later, stage)] = self._post_recv(self._empty(got, stage), stage - 1,
                                                             _comm.tag_activation(stage))
        self._flush()

    def _inputs(self, mb, stage):
        if stage == 0:
            return list(self.first_mbs[mb])
        if stage in self.headers:
            self._read_header(mb, stage)
        data = self.pending_f.pop((mb, stage))
        self._wait(data.works)
        ins = data.tensors
        if self.train:
            for t, (_, _, rg) in zip(ins, self.recv_learned[stage]):
                if rg:
                    t.requires_grad_(True)
        return ins

    def do_f(self, mb, stage):
        st = self.s._by_index[stage]
        args = self._inputs(mb, stage)
        t_wait = time.perf_counter()
        kwargs = self.kwarg_mbs[mb] if self.kwarg_mbs else {}
        outs = st.forward(mb, args, capture=stage in self.split_stages, kwargs=kwargs)
        if stage not in self.out_specs:
            self.out_specs[stage] = _comm.specs(outs)
            # Receives of one tag match the peer's sends in posting order, so the ones deferred
            # before the stage's first forward go out now, ahead of any RECV_B that follows.
            for m in self.deferred_b.pop(stage, []):
                self._recv_gradient(m, stage)
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
            self._wait(pending.works)
            grads = pending.tensors
        t_wait = time.perf_counter()
        backward = st.backward_input if stage in self.split_stages else st.backward
        sent = False
        if self.fsdp_last_b.get(stage) == mb:  # reduce-scatters the sum of every micro-batch's
            for unit in self.fsdp[stage]:
                unit.requires_grad_sync = True
        if self.last_b.get(stage) == mb:  # the stage's last backward reduces over data parallel
            in_grads, sent = self._armed_backward(backward, st, mb, grads)
        else:
            in_grads = backward(mb, grads, self.scale)
        if not st.is_first:
            self.to_send_b[(mb, stage)] = [] if sent else _needed(in_grads, self.recv_learned[stage], st.device)
        return t_wait

    def _armed_backward(self, backward, st, mb, grads):
        """The stage's last backward with its DDP armed, so that its gradient hooks reduce the
        accumulated gradients while it runs."""
        reducer = self.sync_in_last_backward[st.stage_index].reducer
        # The search for unused parameters starts where this backward does: the loss on the
        # last stage (an output the loss ignores must not count as used), else the outputs.
        roots = [st._mbs[mb].loss] if st.is_last else list(st.outputs(mb))
        hooks, sent = self._send_input_grads_when_ready(st, mb)
        completed = reducer.completed_backwards
        try:
            # (It raises when an earlier backward left the reducer armed with gradients missing:
            # what that one owes is then still counted, and the error path issues it.)
            reducer.prepare_for_backward(roots)
            in_grads = backward(mb, grads, self.scale)
            # A backward that reached none of the stage's parameters (a conditional stage) fired
            # no gradient hook: what the earlier micro-batches accumulated is reduced now (review).
            reducer.reduce_if_unreached()
        except BaseException as e:
            if reducer.completed_backwards > completed:
                self._settle(st)  # raised after its reduction ran through: nothing is owed
            elif self.settled is None or not isinstance(e, Exception):
                # Armed and left so, the next step's first (no_sync) backward would reduce (review).
                reducer.cancel_backward()
                self._settle(st)
            # Else left armed: once the pipeline group is aborted, the step's error path issues
            # what this backward still owes its data-parallel peers, then disarms
            # (schedules._release_data_parallel_peers).
            raise
        finally:
            for h in hooks:
                h.remove()
        self._settle(st)
        return in_grads, sent[0]

    def _settle(self, st):
        if self.settled is not None:
            self.settled.add(st.stage_index)

    def _send_input_grads_when_ready(self, st, mb):
        """An armed backward returns only after the reducer waited for its last buckets (its
        callback runs at the end of the graph task), but the input gradients are ready before:
        hooks post their send as soon as the last of them has accumulated, so the upstream stage
        does not wait for this stage's data-parallel reduction (Megatron-LM likewise waits for
        its reductions only after the schedule). Returns the hooks and a flag set once sent."""
        sent = [False]
        if st.is_first:
            return [], sent
        stage = st.stage_index
        inputs = [x for x, (_, _, rg) in zip(st._mbs[mb].inputs, self.recv_learned[stage]) if rg]
        if not inputs:
            return [], sent
        left = [len(inputs)]

        def arrived(_):
            left[0] -= 1
            if left[0] == 0:  # in the inputs' order, which the receiver's posted buffers follow
                for x in inputs:
                    self._send(x.grad.contiguous(), stage - 1, _comm.tag_gradient(stage - 1))
                self._flush()
                sent[0] = True
        return [x.register_post_accumulate_grad_hook(arrived) for x in inputs], sent

    def do_w(self, mb, stage):
        t_wait = time.perf_counter()
        if stage in self.split_stages:
            self.s._by_index[stage].backward_weight(mb)
        return t_wait


def split_stages(sched, train):
    """The stages whose backward runs as B then W. The B/W split differentiates by the module's
    registered parameters; under fully_shard those are the shards, not the gathered parameters
    the graph used, and W's gradients would bypass the reduce-scatter. Such a stage runs its
    whole backward at B and W is a no-op: exact, with 1F1B's bubble for that stage."""
    if not (sched.schedule.split_backward and train):
        return set()
    return {i for i, st in sched._by_index.items() if not any(isinstance(m, FSDPModule) for m in st.submod.modules())}


def _synced_in_last_backward(ddp, split):
    return {i: m for i, m in ddp.items() if _armable(m) and i not in split}


def armed_stages(sched, actions, ddp, train):
    """The DDP stages whose module the executor arms before their last backward, which then
    reduces their gradients, in the order of those last backwards (their collectives' order on
    every data-parallel peer); the other DDP stages are averaged after the step."""
    synced = _synced_in_last_backward(ddp, split_stages(sched, train))
    last = {stage: i for i, (name, _, stage) in enumerate(actions) if name == "B" and stage in synced}
    return sorted(last, key=last.get)


def _armable(module):
    """Our DDP, in its plain form, built with ``find_unused_parameters=True``: its reducer can
    be armed by hand. An armed backward expects a gradient for every parameter unless the
    reducer looks for unused ones, and a parameter that only earlier micro-batches used (a
    routed expert, a conditional layer) gets none in the last backward: without
    ``find_unused_parameters`` the stage is averaged after the step, as before arming existed.
    Not with a static graph (its recording step needs the forward's outputs wrapped),
    ``join()`` (every backward votes in the forward) or sharded gradients (a ZeRO optimizer
    must be checked in the forward); those are averaged after the step too."""
    return (isinstance(module, DistributedDataParallel) and module.find_unused_parameters
            and not module.static_graph and not module._join_config.enable and module._shard_layout is None)


def _needed(in_grads, specs, device):
    """Gradients of the inputs that require one (zeros where autograd found none)."""
    out = []
    for g, (shape, dtype, rg) in zip(in_grads, specs):
        if rg:
            out.append(g if g is not None else torch.zeros(shape, dtype=dtype, device=device))
    return out


class _Pending:
    """Receives of one message (one or several tensors)."""
    __slots__ = ("tensors", "works")

    def __init__(self, tensors):
        self.tensors = tensors
        self.works = []


def _merge(outputs):
    cols = list(zip(*outputs))
    merged = [torch.cat(c) for c in cols]
    return merged[0] if len(merged) == 1 else tuple(merged)
