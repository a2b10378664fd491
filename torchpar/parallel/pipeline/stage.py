"""One pipeline stage: a module, where it sits in the pipeline, and the state of the
micro-batches it has forwarded but not yet backwarded.

Stage ``s`` of ``num_stages`` lives on rank ``s % p`` of the pipeline ``group`` (p ranks; one
stage per rank, or several with the looped placement of interleaved 1F1B). The module may
itself run collectives on other groups (tensor-parallel layers, arXiv:1909.08053): the stage
only calls it, and every rank of a tensor-parallel group runs the same schedule.

Backward, two ways:

- ``backward(mb)``: one ``torch.autograd.backward`` from the stage's outputs; afterwards the
  stage inputs' ``.grad`` are the gradients to send back.
- ``backward_input(mb)`` then ``backward_weight(mb)`` (zero bubble, arXiv:2401.10241): B is
  ``torch.autograd.grad(outputs, inputs + ys, retain_graph=True)`` where ``ys`` are the outputs
  of every module that owns parameters directly (captured by forward hooks). That one pass
  computes the input gradients and, on the way, the gradient arriving at each such module.
  W then runs ``torch.autograd.backward(y, dy, inputs=that module's parameters)`` per module:
  only the last op of each module is differentiated again, so B + W cost about one backward.
  Parameters that path would miss or count twice (used outside their module, a module run
  twice, weights tied across modules, a module whose output is not a tensor; found by walking
  the graph, ``_single_path_params``) get theirs from one more backward from the stage
  outputs restricted to them.

Tensors from the caller's own graph (a keyword tensor, or the first stage's batch, that requires
grad) are among B's inputs too; W carries their gradients on into that graph, as the one
backward of the other schedules does.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves


def _as_tuple(x):
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise TypeError(f"pipeline stage outputs must be a tensor or a tuple of tensors, got {type(x).__name__}")


def _linear_weight_grads(module, calls, params):
    """W of a plain ``nn.Linear`` called once, as its matmuls: dW = dy^T x and db = sum(dy)
    over the flattened leading dimensions, the products autograd's backward of the Linear would
    compute, without a backward call (which first walks the whole graph below the output) per
    module: Megatron-LM's zero-bubble runs its deferred weight-gradient GEMMs this way. Returns
    False where autograd must do it: a module called more than once, an input written since
    forward (autograd would refuse it), other dtypes (autocast), parameters with hooks or of a
    tensor subclass."""
    if len(calls) != 1:
        return False
    y, dy, x, versions = calls[0]
    # The output as the Linear made it (not written in place since: a ReLU(inplace=True) after
    # it), its input as forward read it; real dtypes (a complex weight's gradient conjugates).
    if x is None or (x._version, y._version) != versions or x.dtype != dy.dtype or dy.is_complex():
        return False
    if any(type(p) is not nn.Parameter or p.dtype != dy.dtype or p._backward_hooks
           or getattr(p, "_post_accumulate_grad_hooks", None) for p in params):
        return False
    with torch.no_grad():
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        for p in params:
            weight = p is module.weight
            acc = p.grad
            if acc is not None and acc.is_contiguous() and acc.dtype == p.dtype and acc.shape == p.shape:
                # Accumulated into by the GEMM itself (Megatron's gradient-accumulation fusion).
                if weight:
                    acc.addmm_(dy2.t(), x2)
                else:
                    acc.add_(dy2.sum(0))
            else:
                g = dy2.t().mm(x2) if weight else dy2.sum(0)
                p.grad = g if acc is None else acc + g
    return True


def _plain_linear(module):
    """An ``nn.Linear`` whose output is ``F.linear(input, weight, bias)``: its own class's
    forward, no hook but the stage's capture (hooks run in registration order, so one before it
    could have replaced the output; a backward hook could rewrite the weight's gradient), no
    parameter besides weight and bias (review findings).
    Gradient-accumulator hooks on its parameters are not seen (docs/pipeline.md)."""
    m = nn.modules.module
    return (type(module) is nn.Linear and "forward" not in module.__dict__ and not module._forward_pre_hooks
            and len(module._forward_hooks) == 1 and set(module._parameters) <= {"weight", "bias"}
            and not (module._backward_hooks or module._backward_pre_hooks)
            and not (m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                     or m._global_backward_pre_hooks))


def _own_params(module):
    """``module.parameters(recurse=False)`` without the generator machinery (W asks every
    micro-batch)."""
    return [p for p in module._parameters.values() if p is not None]


def _param_ids(module):
    """The tensors the module holds as parameters now: during a ``torch.func.functional_call``
    those are the substitutes, not its registered parameters (review finding)."""
    return tuple(id(p) for p in module._parameters.values() if p is not None)


class _Call:
    """One forward of a parameter-owning module, captured for W: its output, its input where
    W may compute a plain Linear's gradients directly (with the versions both had), and the
    parameters it ran with."""
    __slots__ = ("module", "y", "x", "versions", "param_ids")

    def __init__(self, module, y, x, versions, param_ids):
        self.module, self.y, self.x, self.versions, self.param_ids = module, y, x, versions, param_ids


class _MicroBatch:
    __slots__ = ("inputs", "keywords", "outputs", "loss", "captured", "input_grads", "captured_grads", "upstream",
                 "whole")

    def __init__(self, inputs, keywords, outputs):
        self.inputs, self.keywords, self.outputs = inputs, keywords, outputs
        self.loss = None
        self.captured = []        # [_Call] for the B/W split
        self.input_grads = None
        self.captured_grads = None
        self.upstream = None      # (tensors of the caller's graph, their gradients) for W
        self.whole = False        # B ran the whole backward: W has nothing left to do


class PipelineStage:
    """``submodule`` as stage ``stage_index`` of ``num_stages`` on the pipeline ``group`` (default:
    the world), with torch's signature. Shapes and dtypes of the tensors between stages need not be
    given: the schedule learns them on the first step, and again whenever the first stage's input
    shape changes, so ``input_args`` and ``output_args`` (torch's static shapes) are accepted and
    not needed. ``device``: where the stage receives its inputs and output gradients (default: the
    device of the module's parameters, the CPU for a module without any). ``dw_builder`` (torch's
    custom weight-gradient closure) is refused: ``ScheduleZeroBubble`` splits backward itself."""

    def __init__(self, submodule, stage_index, num_stages, device=None, input_args=None, output_args=None,
                 group=None, dw_builder=None):
        if isinstance(device, dist.ProcessGroup):
            raise TypeError("PipelineStage: the fourth argument is the device, as in torch's PipelineStage; pass the "
                            "pipeline's process group as group=")
        if dw_builder is not None:
            raise NotImplementedError("PipelineStage: dw_builder is not supported; ScheduleZeroBubble splits each "
                                      "backward into its input and weight gradients itself")
        module = self.submod = submodule
        if device is None:
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self.device = torch.device(device)
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group if group is not None else dist.group.WORLD
        self.group_rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index {stage_index} out of range for {num_stages} stages")
        if num_stages % self.group_size != 0:
            raise ValueError(f"PipelineStage: {num_stages} stages do not spread evenly over the "
                             f"{self.group_size} ranks of the pipeline group")
        if stage_index % self.group_size != self.group_rank:
            raise ValueError(f"PipelineStage: stage {stage_index} of {num_stages} belongs on pipeline rank "
                             f"{stage_index % self.group_size} (looped placement), not on rank {self.group_rank}")
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.prev_rank = (stage_index - 1) % self.group_size  # group ranks of the neighbours
        self.next_rank = (stage_index + 1) % self.group_size
        self._mbs = {}
        self.live = 0          # micro-batches whose activations are held now
        self._owners = [m for m in module.modules() if _own_params(m)]
        self._whole_backward = False  # a reentrant checkpoint refused B's autograd.grad (backward_input)

    # ---- forward ----

    def forward(self, mb, args, capture=False, kwargs=None):
        """Runs the module on micro-batch ``mb``'s ``args`` (and ``kwargs``) and keeps what
        backward needs."""
        hooks, captured = [], []
        if capture and torch.is_grad_enabled():
            direct = not torch.is_autocast_enabled()

            def keep(module, inputs, output):
                if isinstance(output, torch.Tensor) and output.requires_grad:
                    # A plain Linear's input, for W to compute its weight gradient directly.
                    x = inputs[0] if direct and len(inputs) == 1 and _plain_linear(module) else None
                    captured.append(_Call(module, output, x, None if x is None else (x._version, output._version),
                                          _param_ids(module)))
            hooks = [m.register_forward_hook(keep) for m in self._owners]
        try:
            outputs = _as_tuple(self.submod(*args, **(kwargs or {})))
        finally:
            for h in hooks:
                h.remove()
        if torch.is_grad_enabled():
            keywords = [t for t in tree_leaves(kwargs or {}) if isinstance(t, torch.Tensor) and t.requires_grad]
            state = _MicroBatch(args, keywords, outputs)
            state.captured = captured
            self._mbs[mb] = state
            self.live += 1
        return outputs

    def set_loss(self, mb, loss):
        self._mbs[mb].loss = loss

    def outputs(self, mb):
        """Micro-batch ``mb``'s outputs (forwarded, not yet backwarded)."""
        return self._mbs[mb].outputs

    # ---- backward ----

    def _roots(self, mb, output_grads, scale):
        st = self._mbs[mb]
        if self.is_last:
            return [st.loss * scale], [None]
        # One gradient arrives per output that requires one, in the outputs' order: outputs that
        # need none (token ids passed on to a later stage) have no place in the list (review).
        outs = [o for o in st.outputs if o.requires_grad]
        grads = list(output_grads or [])
        if len(grads) != len(outs):
            raise RuntimeError(f"pipeline stage {self.stage_index}: {len(grads)} output gradients for "
                               f"{len(outs)} outputs that require one")
        return outs, grads

    def backward(self, mb, output_grads=None, scale=1.0):
        """Full backward of ``mb``; returns the gradients of the inputs that require one."""
        st = self._mbs[mb]
        roots, grads = self._roots(mb, output_grads, scale)
        if roots:
            torch.autograd.backward(roots, grads)
        out = self._input_grads(st)
        self._free(mb)
        return out

    def backward_input(self, mb, output_grads=None, scale=1.0):
        """B of the split: input gradients now, the weight gradients' inputs kept for W."""
        st = self._mbs[mb]
        roots, grads = self._roots(mb, output_grads, scale)
        ins = [x for x in st.inputs if x.requires_grad]
        wanted = ins + st.keywords + [c.y for c in st.captured]
        got = []
        if wanted and not self._whole_backward:
            try:
                got = torch.autograd.grad(roots, wanted, grads, retain_graph=True, allow_unused=True)
            except RuntimeError as e:
                # A reentrant torch.utils.checkpoint refuses autograd.grad (review finding): such a
                # stage runs its whole backward at B from now on, with 1F1B's bubble, as a
                # fully_shard stage does.
                if "use_reentrant=True" not in str(e):
                    raise
                self._whole_backward = True
        if self._whole_backward:
            if roots:
                torch.autograd.backward(roots, grads)
            st.whole = True
            return self._input_grads(st)
        n_in, n_ext = len(ins), len(ins) + len(st.keywords)
        st.input_grads = list(got[:n_in])
        st.captured_grads = list(got[n_ext:])
        # A received activation is a leaf whose gradient goes to the neighbour; an input with a
        # history, and every keyword tensor, belong to the caller's graph (W continues there).
        from_caller = [t.grad_fn is not None for t in ins] + [True] * len(st.keywords)
        st.upstream = [(t, g) for t, g, c in zip(ins + st.keywords, got[:n_ext], from_caller) if c and g is not None]
        st.outputs, st.loss = roots, grads  # W's fallback restarts from here
        it = iter(st.input_grads)
        return [(next(it) if x.requires_grad else None) for x in st.inputs]

    def backward_weight(self, mb):
        """W of the split: parameter gradients, then the micro-batch is freed."""
        st = self._mbs[mb]
        if st.whole:
            self._free(mb)
            return
        if st.upstream:
            torch.autograd.backward([t for t, _ in st.upstream], [g for _, g in st.upstream])
        covered = set()
        by_module = {}
        single, indirect = self._single_path_params(st)
        for c, g in zip(st.captured, st.captured_grads):
            if g is not None:
                by_module.setdefault(c.module, []).append((c.y, g, c.x, c.versions, c.param_ids))
        for module, calls in by_module.items():
            if any(ids != _param_ids(module) for *_, ids in calls):
                continue  # it ran with other tensors than its parameters: the fallback below
            params = [p for p in _own_params(module) if p.requires_grad and id(p) in single]
            if not params:
                continue
            calls = [call[:4] for call in calls]
            if module in indirect or not _linear_weight_grads(module, calls, params):
                torch.autograd.backward([c[0] for c in calls], [c[1] for c in calls], inputs=params,
                                        retain_graph=True)
            covered.update(id(p) for p in params)
        rest = [p for p in self.submod.parameters() if p.requires_grad and id(p) not in covered]
        roots, grads = st.outputs, st.loss
        if rest and roots:
            # Only those of `rest` the outputs depend on: autograd rejects unreachable inputs.
            reach = torch.autograd.grad(roots, rest, grads, retain_graph=True, allow_unused=True)
            for p, g in zip(rest, reach):
                if g is not None:
                    # autograd.grad may hand two parameters one tensor, or pass an incoming
                    # gradient through: a copy, as autograd's own accumulation would make.
                    p.grad = g.clone() if p.grad is None else p.grad + g
        self._free(mb)

    def _single_path_params(self, st):
        """Ids of the parameters whose per-module W is exact for this micro-batch, and the
        plain Linears whose W must go through autograd rather than the direct products.

        ``backward(y, dy, inputs=p)`` adds p's gradient along every path below y. Summed over
        the captured outputs of p's modules, that is p's gradient only if every path from the
        stage outputs to p crosses exactly one of them. It crosses none when p is also used
        outside its module, and two when its module runs twice or p is tied to a second
        module that feeds the first; such parameters take W's fallback (one backward from
        the stage outputs restricted to them), which counts every path once. A path crosses a
        captured output only through that output: one of several outputs of an autograd node
        (a split) is not the others (review finding). A plain Linear's direct products cover
        only the Linear's own op, so one whose parameters also reach its input (a tied
        autoencoder's decoder, review finding) is left to autograd.
        """
        owners = {}  # id(param) -> modules holding it directly
        for m in self._owners:
            for p in _own_params(m):
                owners.setdefault(id(p), set()).add(m)
        calls = {}
        boundary = {}  # (grad_fn, output_nr) of a captured output -> the modules that produced it
        for c in st.captured:
            calls[c.module] = calls.get(c.module, 0) + 1
            if c.y.grad_fn is not None:
                boundary.setdefault((c.y.grad_fn, c.y.output_nr), set()).add(c.module)

        def below(starts):
            """The leaves (parameters, inputs) reached from `starts` without crossing a captured output."""
            leaves, seen, stack = set(), set(), list(starts)
            while stack:
                node = stack.pop()
                if node in seen:
                    continue
                seen.add(node)
                var = getattr(node, "variable", None)  # AccumulateGrad of a leaf
                if var is not None:
                    leaves.add(id(var))
                    continue
                stack += [n for n, nr in node.next_functions if n is not None and (n, nr) not in boundary]
            return leaves

        bad = {pid for pid, ms in owners.items() if sum(calls.get(m, 0) for m in ms) > 1}
        # Each region of the graph: from the outputs, and from below each captured output, down
        # to the next captured outputs. A parameter reached in a region that is not its own
        # module's has a path whose last captured output (if any) is not one of its modules.
        # A stage output that is another output of a captured output's node (the gate a module
        # split off and the stage returns) starts a region of its own, as does each node: where
        # two modules' outputs share a node, neither owns the paths through the other's.
        by_node = {}
        for (node, _), modules in boundary.items():
            by_node.setdefault(node, []).append(modules)
        regions = [([o.grad_fn for o in st.outputs
                     if o.grad_fn is not None and (o.grad_fn, o.output_nr) not in boundary], set())]
        regions += [([node], sets[0] if len(sets) == 1 else set()) for node, sets in by_node.items()]
        for starts, modules in regions:
            bad.update(pid for pid in below(starts) if pid in owners and not owners[pid] & modules)
        indirect = set()
        for c in st.captured:
            if c.x is None or c.module in indirect:
                continue
            if c.x.grad_fn is None:
                reached = {id(c.x)}
            elif (c.x.grad_fn, c.x.output_nr) in boundary:
                reached = set()
            else:
                reached = below([c.x.grad_fn])
            if reached & {id(p) for p in _own_params(c.module)}:
                indirect.add(c.module)
        return {pid for pid in owners if pid not in bad}, indirect

    def _input_grads(self, st):
        return [(x.grad if x.requires_grad and x.is_leaf else None) for x in st.inputs]

    def _free(self, mb):
        del self._mbs[mb]
        self.live -= 1

    def reset(self):
        """Drops every micro-batch's state (after a step, or after a failed one)."""
        self._mbs.clear()
        self.live = 0
