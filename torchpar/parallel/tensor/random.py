"""Dropout under tensor parallelism: Megatron-LM's RNG tracker (megatron/core/tensor_parallel/
random.py; Shoeybi et al. 2019, arXiv:1909.08053, section 3).

A random op on an activation split across the tensor-parallel ranks (the attention
probabilities of each rank's heads; under sequence parallelism, anything on a sequence shard)
needs a mask of its own on each rank: the shards are different data, and a mask drawn the same
on every rank would repeat one pattern across them. A random op on a replicated activation
(outside the tensor-parallel region, without sequence parallelism) needs the same mask on every
rank, or the replicas drift apart. So, as Megatron, two generators:

- torch's default generator, seeded alike on every rank of the group: replicated activations;
- the "model-parallel" one, seeded ``seed + 2718 + rank``, entered with
  ``get_rng_tracker().fork()`` around random ops on split activations::

      model_parallel_seed(1234, group=tp_group, pp_group=pp_group)
      with get_rng_tracker().fork():
          o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)  # this rank's heads

``fork`` swaps the model-parallel state into torch's default CPU generator and, once CUDA is
initialised, into the current device's CUDA generator, so every random op inside draws from it:
``F.dropout``, ``scaled_dot_product_attention``, torchpar's fused bias+dropout+add (whose Philox
key is one draw from the default CPU generator, for CPU and CUDA tensors alike; kernels/dropout.h).

With pipeline parallelism both seeds are offset by ``100 * pipeline rank``, as Megatron does,
so that the stages' dropout masks differ (``model_parallel_seed``).

One difference from Megatron: the state a fork enters is not carried from the previous fork but
made afresh from the name's seed and one draw from the generator the fork was entered from.
The model-parallel streams are then a function of the default generator's state, which
``torch.utils.checkpoint`` saves before a checkpointed forward and restores for its
recomputation: recomputed dropout draws the same masks with torch's own checkpoint, reentrant
or not (Megatron needs its own ``checkpoint`` that saves and restores its tracker's states).
Nested forks stay reproducible for the same reason, wherever a recomputation starts.
"""
import contextlib

import torch
import torch.distributed as dist
from torch.nn import functional as F

from torchpar.nn import functional as TF
from torchpar.parallel.tensor import comm

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset between the default seed and the model-parallel ones.
MODEL_PARALLEL_SEED_OFFSET = 2718
# Megatron's step between the seeds of successive pipeline stages.
PIPELINE_SEED_STRIDE = 100
_MASK64 = (1 << 64) - 1

__all__ = ["RNGStatesTracker", "get_rng_tracker", "model_parallel_seed", "fork_if", "bias_dropout_add",
           "mark_model_parallel_rng", "MODEL_PARALLEL_RNG"]


def _mix(seed, draw):
    # SplitMix64's finaliser (Steele, Lea & Flood, OOPSLA'14), as dropout_graph_key in
    # csrc/kernels/dropout.h: nearby seeds (rank r and r + 1) give unrelated keys.
    z = (seed + (draw + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class RNGStatesTracker:
    """Named random streams, each from a seed (Megatron's CudaRNGStatesTracker, for CPU and CUDA)."""

    def __init__(self):
        self._seeds = {}

    def reset(self):
        self._seeds = {}

    def get_states(self):
        """{name: seed}: with the default generators' states, all a fork depends on."""
        return dict(self._seeds)

    def set_states(self, states):
        self._seeds = dict(states)

    def add(self, name, seed):
        """A stream ``name`` from ``seed``; a name or seed added twice is an error, as in Megatron
        (two names on one seed would draw the same masks)."""
        seed = int(seed)
        if name in self._seeds:
            raise ValueError(f"RNG tracker: stream {name!r} is already added")
        if seed in self._seeds.values():
            raise ValueError(f"RNG tracker: seed {seed} is already used by another stream")
        self._seeds[name] = seed

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG):
        """Random ops inside draw from stream ``name``; on exit the default generators are back
        where they were, one draw further on (the draw that keyed the fork, the same on every
        rank), whatever the ops inside drew."""
        if name not in self._seeds:
            raise RuntimeError(f"RNG tracker: stream {name!r} is not added; call "
                               "torchpar.parallel.tensor.random.model_parallel_seed(seed, group) first")
        # No CUDA tensor exists before CUDA is initialised, so there is no CUDA generator to
        # swap: this check keeps a CPU-only process (or one without a GPU) off torch.cuda.
        cuda = torch.cuda.is_initialized()
        if cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("RNG tracker: fork() while a CUDA graph is being captured is not "
                               "supported (a replay would not see the swapped generator state)")
        draw = int(torch.empty((), dtype=torch.int64).random_())
        key = _mix(self._seeds[name], draw)
        cpu = torch.default_generator
        cpu_state = cpu.get_state()
        gpu = torch.cuda.default_generators[torch.cuda.current_device()] if cuda else None
        gpu_state = gpu.get_state() if cuda else None
        cpu.manual_seed(key)
        if cuda:
            gpu.manual_seed(key)
        try:
            yield
        finally:
            cpu.set_state(cpu_state)
            if cuda:
                gpu.set_state(gpu_state)


_TRACKER = RNGStatesTracker()


def get_rng_tracker():
    """The process's tracker (Megatron's get_cuda_rng_tracker)."""
    return _TRACKER


def model_parallel_seed(seed, group=None, pp_group=None):
    """Megatron's seeding (``_set_random_seed`` in megatron/training/initialize.py, then
    ``model_parallel_cuda_manual_seed`` in megatron/core/tensor_parallel/random.py), for this
    rank's pipeline stage ``p`` (its rank in ``pp_group``; 0 without one) and tensor-parallel
    rank ``t`` (its rank in ``group``, the tensor-parallel group; default: the default group):

    - torch's default generators (CPU and every CUDA device) get ``seed + 100 * p``: the same on
      every tensor-parallel rank of a stage (replicated activations need the same masks), and
      another stream on each pipeline stage;
    - the tracker's model-parallel stream gets ``seed + 100 * p + 2718 + t``.

    Why the pipeline offset: without it every stage's generators start from the same states
    and each stage draws the same kinds of masks in the same order, micro-batch after
    micro-batch, so the stages' masks repeat one another (block k of stage 1 draws what block k
    of stage 0 drew, or a shifted copy of it, in both streams): dropout correlated across depth,
    which one process never draws. Megatron adds ``100 * pipeline rank`` for this reason
    ("Ensure that different pipeline MP stages get different seeds"). The data-parallel
    replicas keep the same seeds, as Megatron's default (they see different data).

    Call it with the same ``seed`` on every rank. It reseeds the default generators per stage,
    so build a model whose initial weights must not depend on the stage before it
    (ParallelGPT: ``torch.manual_seed(seed)``, the dense model, then this). For the same reason,
    after it the default CPU generator differs between pipeline stages: data drawn from it
    (``torch.randint`` or ``torch.randperm`` without ``generator=``) differs from stage to stage.
    Draw batches from an explicit ``torch.Generator`` seeded alike on every stage."""
    rank = dist.get_rank(comm.resolve_group(group))
    if rank < 0:
        raise ValueError("model_parallel_seed: this process is not a member of group")
    stage = 0
    if pp_group is not None:
        stage = dist.get_rank(pp_group)
        if stage < 0:
            raise ValueError("model_parallel_seed: this process is not a member of pp_group")
    seed = seed + PIPELINE_SEED_STRIDE * stage
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + rank)


def fork_if(split, name=MODEL_PARALLEL_RNG):
    """``get_rng_tracker().fork(name)`` when ``split`` (random ops on an activation split across
    the ranks), else nothing: replicated activations draw from the default generator."""
    return _TRACKER.fork(name) if split else contextlib.nullcontext()


def bias_dropout_add(out, bias, residual, p, training, split):
    """``residual + dropout(out + bias)`` (``bias``, ``residual``: None for none), torchpar's
    fused kernel when both are given; the mask comes from the model-parallel stream when
    ``split`` (``out`` is this rank's sequence shard), else from the default generator."""
    with fork_if(split and training and p > 0):
        if residual is not None and bias is not None:
            return TF.bias_dropout_add(out, bias, residual, p, training)
        if bias is not None:
            out = out + bias
        out = F.dropout(out, p, training)
        return out if residual is None else out + residual


def _enter_fork(module, args):
    fork = fork_if(module.training)
    fork.__enter__()
    module._torchpar_rng_forks.append(fork)


def _exit_fork(module, args, output):
    if module._torchpar_rng_forks:  # empty when _enter_fork itself raised
        module._torchpar_rng_forks.pop().__exit__(None, None, None)


def mark_model_parallel_rng(module, group=None):
    """Runs ``module``'s forward in training mode under ``get_rng_tracker().fork()``: for a module
    of a plain model whose random ops act on split activations (an attention block's dropout on
    its heads; under sequence parallelism, a block working on sequence shards). A forward hook
    pair, so the module keeps its class and ``state_dict``; nothing on a one-rank group.
    Returns ``module``."""
    group = comm.resolve_group(group)
    if dist.get_world_size(group) > 1 and not hasattr(module, "_torchpar_rng_forks"):
        module._torchpar_rng_forks = []  # a stack: a module may be re-entered (recursion)
        module.register_forward_pre_hook(_enter_fork, prepend=True)
        module.register_forward_hook(_exit_fork, always_call=True)
    return module
