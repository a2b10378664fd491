"""Runs one rank's action list for one step: posts the receives and sends, waits only for a
compute's own inputs, calls the stage's forward / backward / weight-gradient, and times it.

Each send and receive is its own ``isend``/``irecv`` (see ``_post``), posted together just
before the next compute; sends are waited for at the end of the step, and those already
complete are dropped before each compute so their tensors can be freed.
"""
import time

import torch
import torch.distributed as dist

from torchpar.parallel.fsdp import FSDPModule
from torchpar.parallel.pipeline import _comm

_CACHE_KEYS = 16  # input shapes remembered (variable sequence length)


class Executor:
    """State of one step while the action list runs."""

    def __init__(self, sched, key, first_mbs, targets, train):
        self.s = sched
        self.key = key
        self.first_mbs = first_mbs
        self.targets = targets
        self.train = train
        split = sched.schedule.split_backward and train
        # The B/W split differentiates by the module's registered parameters; under fully_shard
        # those are the shards, not the gathered parameters the graph used, and W's gradients
        # would bypass the reduce-scatter. Such a stage runs its whole backward at B and W is
        # a no-op: exact, with 1F1B's bubble for that stage.
        self.split_stages = {i for i, st in sched._by_index.items()
                             if split and not any(isinstance(m, FSDPModule) for m in st.submod.modules())}
        self.scale = 1.0 / sched.n_microbatches if sched.scale_grads else 1.0
        self.tag_base = _comm.tag_base(sched._steps, sched.num_stages)
        self.recv_known = sched._recv_cache.get(key, {})
        self.send_known = sched._send_cache.get(key, {})
        self.recv_learned, self.send_learned, self.out_specs = {}, {}, {}
        self.pending_f, self.pending_b = {}, {}   # (mb, stage) -> pending receives
        self.deferred_b = {}  # stage -> micro-batches whose RECV_B came before the stage's first forward
        self.to_send_f, self.to_send_b = {}, {}
        self.sends, self.ops = [], []       # posted send works; ops not yet posted
        self.outputs, self.losses, self.events = [], [], []

    # -- communication --

    def _peer(self, stage):
        return stage % self.s.p

    def _isend(self, tensor, stage, tag):
        self.ops.append((dist.P2POp(dist.isend, tensor, group=self.s.group, group_peer=self._peer(stage),
                                     tag=self.tag_base + tag), None))

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

    def _empty(self, specs, stage):
        """Receive buffers for stage ``stage`` (of this rank), on its device. The headers stay
        on the CPU: a group of the torchpar backend carries CPU and CUDA tensors alike."""
        return _comm.empty(specs, self.s._by_index[stage].device)

    def _post_recv(self, tensors, stage, tag):
        pending = _Pending(tensors)
        for t in tensors:
            self.ops.append((dist.P2POp(dist.irecv, t, group=self.s.group, group_peer=self._peer(stage),
                                        tag=self.tag_base + tag), pending))
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
            data = self._post_recv(self._empty(self.recv_known[stage], stage), stage - 1, _comm.tag_activation(stage))
        self.pending_f[(mb, stage)] = (h, data)

    def send_f(self, mb, stage):
        outs = self.to_send_f.pop((mb, stage))
        got = _comm.specs(outs)
        known = self.send_known.get(stage)
        self._isend(_comm.encode(outs, stage), stage + 1, _comm.tag_header(stage + 1))
        if known is not None and known != got:
            # The next stage raises on reading this header; wait until it is delivered, or the
            # next stage may see this rank exit (connection reset) instead of the clear error.
            self._flush()
            self.sends[-1][0].wait()
            raise ValueError(f"pipeline stage {stage}: output of micro-batch {mb} is {_comm.describe(got)}, but "
                             f"stage {stage + 1} expects {_comm.describe(known)} (learned for the same input "
                             f"shapes); stage outputs must depend only on the input shapes")
        self.send_learned[stage] = got
        for t in outs:
            self._isend(t.detach().contiguous(), stage + 1, _comm.tag_activation(stage + 1))

    def recv_b(self, mb, stage):
        if stage not in self.out_specs:  # no forward of this stage yet in this step: shapes unknown
            self.deferred_b.setdefault(stage, []).append(mb)
            return
        self._recv_gradient(mb, stage)

    def _recv_gradient(self, mb, stage):
        self.pending_b[(mb, stage)] = self._post_recv(
            self._empty([sp for sp in self.out_specs[stage] if sp[2]], stage), stage + 1, _comm.tag_gradient(stage))

    def _post_deferred_b(self, stage):
        # Receives of one tag match the peer's sends in posting order, so the ones deferred
        # before the stage's first forward go out now, ahead of any RECV_B that follows.
        for mb in self.deferred_b.pop(stage, []):
            self._recv_gradient(mb, stage)

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
            data = self._post_recv(self._empty(got, stage), stage - 1, _comm.tag_activation(stage))
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
        outs = st.forward(mb, args, capture=stage in self.split_stages)
        if stage not in self.out_specs:
            self.out_specs[stage] = _comm.specs(outs)
            self._post_deferred_b(stage)
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
            pending.wait()
            grads = pending.tensors
        t_wait = time.perf_counter()
        backward = st.backward_input if stage in self.split_stages else st.backward
        in_grads = backward(mb, grads, self.scale)
        if not st.is_first:
            self.to_send_b[(mb, stage)] = _needed(in_grads, self.recv_learned[stage], st.device)
        return t_wait

    def do_w(self, mb, stage):
        t_wait = time.perf_counter()
        if stage in self.split_stages:
            self.s._by_index[stage].backward_weight(mb)
        return t_wait


def _post(op):
    """One isend/irecv with its own work. Not batch_isend_irecv: on a backend that coalesces
    (NCCL, torchpar) it returns one work for the whole batch, so waiting for a receive would
    also wait for every send posted with it (the stall of pytorch/pytorch#172668)."""
    kw = {"group_dst": op.group_peer} if op.op is dist.isend else {"group_src": op.group_peer}
    return op.op(op.tensor, group=op.group, tag=op.tag, **kw)


def _needed(in_grads, specs, device):
    """Gradients of the inputs that require one (zeros where autograd found none)."""
    out = []
    for g, (shape, dtype, rg) in zip(in_grads, specs):
        if rg:
            out.append(g if g is not None else torch.zeros(shape, dtype=dtype, device=device))
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
