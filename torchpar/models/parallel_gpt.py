"""``ParallelGPT``: torchpar.models.GPT trained on a data x tensor x pipeline layout (Narayanan
et al. 2021, arXiv:2104.04473, "3D parallelism"), assembled from the project's public pieces
(issue 20):

1. groups from ``torch.distributed.device_mesh.init_device_mesh`` over dims ("pp", "dp", "tp")
   (under HSDP ("pp", "dp_replicate", "dp_shard", "tp"), item 4): tensor-parallel ranks are
   adjacent (they talk most), pipeline neighbours farthest apart;
2. the pipeline cut: ``num_stages = pp * virtual_stages`` stages of consecutive blocks
   (``split_boundaries``, the cut ``pipeline.split`` makes); the first stage also holds the
   embeddings, the last ``ln_f`` and ``lm_head``; a rank holds stages r, r + pp, ... (looped
   placement, for the schedules in ``LOOPED``);
3. tensor parallelism with ``parallelize`` and ``tensor_parallel_plan`` on each stage;
4. data parallelism: each stage in torchpar's ``DistributedDataParallel`` or, with ``fsdp``,
   ``fully_shard`` per block and per stage, over the dp group; with ``dp_replicate`` > 1 hybrid
   sharding (HSDP): the dp ranks as ``dp_replicate`` replicas, each sharded over
   ``dp / dp_replicate`` ranks (mesh dims "dp_replicate", "dp_shard"; torchtitan's
   ``data_parallel_replicate_degree``); O2 mixed precision by ``MixedPrecision``;
5. a pipeline schedule over the pp group whose last stage computes the vocabulary-parallel
   cross entropy;
6. after backward, Megatron's finishing steps: the tied embedding's two copies summed over the
   embedding group, then (``clip_grad``) clipping by the global gradient norm over the whole
   layout (``clip_grad_norm_``).

Tied embeddings with pp > 1 (Megatron's ``shared_embedding_or_output_weight``): the first stage
holds the input embedding, the last stage a copy of it as the output projection, both from the
same initial weights; after each backward the two gradients are all-reduced over the "embedding
group" (the first and last pipeline ranks of each data x tensor coordinate), so both copies
receive the same update and stay equal. Under tensor parallelism both are split by vocabulary
rows alike (tp rank r holds rows r V/tp onward in each); under fully_shard each copy is a unit of
its own, so dp rank d holds the same elements of both.

Every stage keeps the dense model's module names (its blocks are an ``nn.ModuleDict`` keyed by
the block's index in the whole model), so a stage's ``state_dict`` keys are the dense GPT's:
checkpoints can be resharded by name (``self.parts``).

Every rank builds the whole dense model from the same seed and keeps its part, so the parallel
model starts from exactly the weights of a single-process ``GPT(config)`` built after
``torch.manual_seed(seed)``. Dropout is then seeded as Megatron seeds it
(``model_parallel_seed``): each pipeline stage its own default stream (``seed + 100 * pp_rank``),
shared by its tensor-parallel ranks, and each tp rank of a stage its own model-parallel stream.
So after construction torch's default generators differ between pipeline stages: a training loop
drawing its batches from the default generator (``torch.randint`` without ``generator=``) would
give each stage other data. Draw batches from an explicit ``torch.Generator``, seeded alike on
every rank of a data-parallel replica (as examples/train_gpt.py does).
"""
import contextlib
import os
import re
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import functional as F

from torchpar.models.gpt import GPT, RECOMPUTE, GPTConfig, GPTParts
from torchpar.optim import MixedPrecisionOptimizer, ZeroRedundancyOptimizer
from torchpar.parallel import DistributedDataParallel, MixedPrecision, clip_grad_norm_, fully_shard, parallelize
from torchpar.parallel.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                        ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZeroBubble)
from torchpar.parallel.fsdp import FSDPModule
from torchpar.parallel.pipeline.failure import abort_with_reason, clip_reason, fully_shard_groups
from torchpar.parallel.pipeline.schedules import reduce_in_last_backward, syncing_fsdp_modules
from torchpar.parallel.pipeline.split import split_boundaries
from torchpar.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      model_parallel_seed, vocab_parallel_cross_entropy)

SCHEDULES = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B, "zero-bubble": ScheduleZeroBubble,
             "gpipe": ScheduleGPipe, "interleaved-zero-bubble": ScheduleInterleavedZeroBubble,
             "looped-bfs": ScheduleLoopedBFS}
LOOPED = ("interleaved", "interleaved-zero-bubble", "looped-bfs")  # several stages per rank
INTERLEAVED = ("interleaved", "interleaved-zero-bubble")  # m a multiple of pp
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Layout:
    """How the job is laid out: ``dp * tp * pp`` must be the world size. ``virtual_stages``:
    stages per pipeline rank (the v of the schedules in ``LOOPED``; default 2 for them, else 1).
    ``microbatches``: per step and data-parallel rank. ``dp_replicate`` (with ``fsdp``): the dp
    ranks as that many replicas of ``dp / dp_replicate`` shards each (hybrid sharding).
    ``reshard_after_forward`` (with ``fsdp``): fully_shard's, a bool or the number of ranks N (a
    divisor of the shard group's size; e.g. the ranks of one host) among which each unit stays
    sharded from its forward to its backward, whose all-gathers then stay among them."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: bool = False
    schedule: str = "1f1b"
    virtual_stages: Optional[int] = None
    sequence_parallel: bool = False
    dtype: str = "float32"
    recompute: str = "none"
    microbatches: int = 1
    dp_replicate: int = 1
    reshard_after_forward: Union[bool, int] = True

    def __post_init__(self):
        if self.virtual_stages is None:
            self.virtual_stages = 2 if self.schedule in LOOPED else 1

    @property
    def world_size(self):
        return self.dp * self.tp * self.pp

    def __str__(self):
        shard = f"hsdp {self.dp_replicate}x{self.dp // self.dp_replicate}" if self.dp_replicate > 1 else "fsdp"
        if self.reshard_after_forward is not True:
            shard += f" reshard_after_forward={self.reshard_after_forward}"
        extras = [n for n, on in ((shard, self.fsdp), ("sp", self.sequence_parallel),
                                  (f"recompute={self.recompute}", self.recompute != "none")) if on]
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} {self.schedule}"
                f"{f' v={self.virtual_stages}' if self.virtual_stages > 1 else ''} {self.dtype}"
                f"{''.join(' ' + e for e in extras)}")


def check_layout(cfg: GPTConfig, layout: Layout, world_size: int, batch_size: Optional[int] = None):
    """Every problem of running ``cfg`` at ``layout`` on ``world_size`` ranks, as one ValueError
    naming the sizes. Needs no collective: every rank raises the same error before training."""
    L, bad = layout, []
    if min(L.dp, L.tp, L.pp, L.microbatches, L.virtual_stages, L.dp_replicate) < 1:
        bad.append(f"dp, tp, pp, microbatches, virtual stages and dp_replicate must be >= 1 (got {L.dp}, {L.tp}, "
                   f"{L.pp}, {L.microbatches}, {L.virtual_stages}, {L.dp_replicate})")
        raise ValueError("GPT layout: " + "; ".join(bad))
    if L.world_size != world_size:
        bad.append(f"dp x tp x pp = {L.dp} x {L.tp} x {L.pp} = {L.world_size}, but the world size is {world_size}")
    if L.dp_replicate > 1 and not L.fsdp:
        bad.append(f"dp_replicate={L.dp_replicate} (hybrid sharding) needs fsdp; without it the dp ranks "
                   "are replicas already (DDP)")
    if L.dp % L.dp_replicate:
        bad.append(f"dp={L.dp} does not split into dp_replicate={L.dp_replicate} replicas")
    raf, shards = L.reshard_after_forward, L.dp // L.dp_replicate
    if raf is not True and not L.fsdp:
        bad.append(f"reshard_after_forward={raf} needs fsdp (it says when fully_shard frees the gathered parameters)")
    elif not isinstance(raf, bool) and (not isinstance(raf, int) or raf < 1 or shards % raf):
        bad.append(f"reshard_after_forward={raf!r} must be a bool or a divisor of the {shards} ranks each unit is "
                   "sharded over (dp / dp_replicate)")
    if L.schedule not in SCHEDULES:
        bad.append(f"schedule {L.schedule!r} is not one of {sorted(SCHEDULES)}")
    elif L.virtual_stages > 1 and L.schedule not in LOOPED:
        bad.append(f"{L.virtual_stages} virtual stages per rank need one of the schedules {list(LOOPED)}, "
                   f"not {L.schedule!r}")
    if L.schedule in LOOPED and L.pp < 2:
        bad.append(f"the {L.schedule} schedule needs at least 2 pipeline ranks (pp={L.pp})")
    elif L.schedule in INTERLEAVED and L.microbatches % L.pp:
        bad.append(f"the {L.schedule} schedule needs micro-batches ({L.microbatches}) a multiple of pp ({L.pp})")
    if L.recompute not in RECOMPUTE:
        bad.append(f"recompute {L.recompute!r} is not one of {RECOMPUTE}")
    if L.dtype not in DTYPES:
        bad.append(f"dtype {L.dtype!r} is not one of {sorted(DTYPES)}")
    if cfg.heads < 1 or cfg.hidden % cfg.heads:
        bad.append(f"hidden {cfg.hidden} is not a multiple of heads {cfg.heads}")
    for what, n in (("heads", cfg.heads), ("vocab_size", cfg.vocab_size)):
        if n % L.tp:
            bad.append(f"{what} {n} does not split over tp={L.tp}")
    if L.sequence_parallel and cfg.seq_len % L.tp:
        bad.append(f"seq_len {cfg.seq_len} does not split over tp={L.tp} (sequence parallelism)")
    stages = L.pp * L.virtual_stages
    if cfg.layers < stages:
        bad.append(f"{cfg.layers} layers cannot fill pp x virtual stages = {L.pp} x {L.virtual_stages} = "
                   f"{stages} pipeline stages")
    if cfg.tie_embeddings and L.pp == 1 and L.virtual_stages > 1:
        bad.append(f"tie_embeddings with pp = 1 and {L.virtual_stages} virtual stages: the embedding and lm_head "
                   "would be one parameter in two stages of one rank (with pp > 1 each stage has its copy)")
    if batch_size is not None and batch_size % (L.dp * L.microbatches):
        bad.append(f"batch size {batch_size} does not split into dp x micro-batches = {L.dp} x {L.microbatches}")
    if bad:
        raise ValueError("GPT layout: " + "; ".join(bad))


def tensor_parallel_plan(sequence_parallel=False, embeddings=True, head=True):
    """The ``parallelize`` plan of GPT (Megatron-LM's: q/k/v and fc1 column-parallel, out_proj
    and fc2 row-parallel, vocabulary-parallel embedding and logits); under sequence parallelism
    the LayerNorms, the embedding dropout and the position embedding run on sequence shards.
    Dropout on split activations (each rank's heads; under SP, every dropout of a block) draws
    from the model-parallel RNG stream. ``embeddings``/``head``: whether the (stage) module
    holds them."""
    plan = {"blocks.*.attn.[qkv]_proj": "colwise", "blocks.*.attn.out_proj": "rowwise",
            "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise", "blocks.*.attn": "model_parallel_rng"}
    if sequence_parallel:
        plan.update({"blocks.*.ln[12]": "sequence", "blocks.*": "model_parallel_rng"})
    if embeddings:
        plan["tok_emb"] = "vocab"
        if sequence_parallel:
            plan.update({"pos_emb": "sequence", "drop": "sequence"})
    if head:
        plan["lm_head"] = "colwise"
        if sequence_parallel:
            plan["ln_f"] = "sequence"
    return plan


class GPTStage(GPTParts, nn.Module):
    """Blocks [start, end) of ``model`` (the same module objects), with the embeddings when
    ``first`` and ``ln_f``/``lm_head`` when ``last``. Input: token ids [b, s] (batch first, the
    dim micro-batches split) on the first stage, else [s, b, hidden]."""

    def __init__(self, model: GPT, start: int, end: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, end)})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        if self.first:
            x = self.embed(x.t())
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.last else x


class ParallelGPT:
    """GPT(config) on ``layout`` over the default group (initialised first, world size =
    ``layout.world_size``). ``train_step(idx, target)`` / ``eval_step`` take the global batch
    (token ids [batch, seq], the same on every rank; each data-parallel rank takes its slice)
    and return the mean loss over it, on every rank.

    ``optimizer``: "adamw" (default) or "sgd" (momentum 0.9: the tests' choice, see
    tests/test_gpt_3d.py). ``clip_grad``: the global gradient 2-norm ``train_step`` clips to
    before each optimizer step (0, the default, does not clip; Megatron's default and
    examples/train_gpt.py's is 1.0); ``grad_norm`` is then the last step's norm before clipping.
    ``device``: "cpu", or "cuda" for this rank's GPU, ``cuda:LOCAL_RANK``: every rank builds the
    dense model on the CPU from the seed (the single-process weights), then moves its stages
    there; the torchpar backend carries the groups' CUDA tensors over NCCL.

    ``seed``: the initial weights (``torch.manual_seed(seed)`` on every rank), then dropout's
    streams (``model_parallel_seed``), which leave torch's default generators in another state on
    each pipeline stage. Do not draw batches from the default generator afterwards (each stage
    would see other data): use an explicit ``torch.Generator``, as examples/train_gpt.py does."""

    def __init__(self, config: GPTConfig, layout: Layout, lr=3e-4, weight_decay=0.0, optimizer="adamw", seed=0,
                 device="cpu", clip_grad=0.0):
        if not dist.is_initialized():
            raise RuntimeError("ParallelGPT: call torch.distributed.init_process_group first")
        check_layout(config, layout, dist.get_world_size())
        self.config, self.layout, L = config, layout, layout
        self.device = rank_device(device)
        self.mesh, self.shard_mesh, dp_mesh = self._meshes()
        self.pp_group, self.tp_group = self.mesh["pp"].get_group(), self.mesh["tp"].get_group()
        self.pp_rank, self.tp_rank = self.mesh.get_local_rank("pp"), self.mesh.get_local_rank("tp")
        self.dp_group, self.dp_rank = dp_mesh.get_group(), dp_mesh.get_local_rank()
        # The ranks holding distinct pieces of a sharded parameter (fully_shard's shard group):
        # the gradient norm sums over them; HSDP's replicas hold equal pieces.
        self.dp_shard_group = self.shard_mesh.get_group(self.shard_mesh.ndim - 1)

        torch.manual_seed(seed)  # the single-process model's initial weights, on every rank
        model = GPT(config).set_recompute(L.recompute)
        # Then the dropout streams (Megatron's): the default generators seed + 100 * pp_rank, alike
        # on the tp ranks of a stage; the model-parallel stream seed + 100 * pp_rank + 2718 + tp_rank.
        model_parallel_seed(seed, self.tp_group, pp_group=self.pp_group)
        # Tied embeddings on two pipeline ranks: the last stage's lm_head gets a copy of the weight.
        self.tied_copy = config.tie_embeddings and L.pp > 1
        if self.tied_copy:
            model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
        num_stages = L.pp * L.virtual_stages
        bounds = split_boundaries([str(i) for i in range(config.layers)], num_stages)
        indices = range(self.pp_rank, num_stages, L.pp)
        self.parts = [GPTStage(model, bounds[i], bounds[i + 1], i == 0, i == num_stages - 1) for i in indices]
        del model
        dtype = DTYPES[L.dtype]
        mp = MixedPrecision(dtype) if dtype != torch.float32 else None
        modules = [self._wrap(part, mp) for part in self.parts]
        self.modules = modules
        self.stages = [PipelineStage(m, i, num_stages, self.device, group=self.pp_group)
                       for m, i in zip(modules, indices)]
        self.has_first = any(p.first for p in self.parts)
        self.has_last = any(p.last for p in self.parts)
        cls = SCHEDULES[L.schedule]
        stages = self.stages if L.schedule in LOOPED else self.stages[0]
        self.schedule = cls(stages, L.microbatches, loss_fn=self._loss)
        # One stage (pp = 1, no virtual stages): nothing to pipeline, so train_step runs the
        # micro-batches itself (``_run_unpipelined``), as Megatron-LM's
        # forward_backward_no_pipelining does whatever the schedule.
        self.pipelined = num_stages > 1

        params = [p for m in modules for p in m.parameters()]
        # AdamW's fused implementation (on the CPU one kernel per parameter, on CUDA multi-tensor
        # kernels: the default loop's update, up to rounding, in a quarter of its time on this
        # model's 69 small tensors on the CPU), as Megatron-LM steps with a fused Adam.
        opt_cls, kw = ((torch.optim.AdamW, dict(lr=lr, weight_decay=weight_decay, fused=True))
                       if optimizer == "adamw" else (torch.optim.SGD, dict(lr=lr, momentum=0.9, weight_decay=weight_decay)))
        if mp is not None and not L.fsdp:  # DDP's O2: float32 masters live in the optimizer
            self.optimizer = MixedPrecisionOptimizer(params, opt_cls, mixed_precision=mp, process_group=self.dp_group,
                                                     **kw)
        else:
            self.optimizer = opt_cls(params, **kw)
        self.step = 0

        # This rank's copy of the tied embedding (after wrapping: fully_shard's piece of it), and
        # the group it is summed over; none between the first and last stage.
        self.embedding_group = self._embedding_group() if self.tied_copy else None
        self.embedding_weights = [part.tok_emb.weight if part.first else part.lm_head.weight
                                  for part in self.parts if self.tied_copy and (part.first or part.last)]
        self.clip_grad = clip_grad
        self.grad_norm = None
        self._params = params
        self._norm_params = self._counted_in_norm(params)
        self._norm_groups = [g for g, n in ((self.tp_group, L.tp), (self.pp_group, L.pp),
                                            (self.dp_shard_group, L.dp // L.dp_replicate if L.fsdp else 1)) if n > 1]

    def _meshes(self):
        """(the job's mesh, fully_shard's mesh, the dp mesh). Dims ("pp", "dp", "tp"), or with
        hybrid sharding ("pp", "dp_replicate", "dp_shard", "tp"): fully_shard gets the 2-D
        (replicate, shard) sub-mesh, and the batch splits over the two flattened ("dp")."""
        L, device = self.layout, self.device.type
        if L.dp_replicate == 1:
            mesh = init_device_mesh(device, (L.pp, L.dp, L.tp), mesh_dim_names=("pp", "dp", "tp"))
            return mesh, mesh["dp"], mesh["dp"]
        mesh = init_device_mesh(device, (L.pp, L.dp_replicate, L.dp // L.dp_replicate, L.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        shard_mesh = mesh["dp_replicate", "dp_shard"]
        return mesh, shard_mesh, shard_mesh._flatten("dp")

    def _wrap(self, part, mp):
        if self.layout.tp > 1:
            parallelize(part, tensor_parallel_plan(self.layout.sequence_parallel, part.first, part.last), self.tp_group)
            for block in part.blocks.values():  # their biases go to the fused kernels (gpt.py)
                for linear in (block.attn.out_proj, block.mlp.fc1, block.mlp.fc2):
                    linear.skip_bias_add = True
                # Each layer checks its input's shape across tp (an all-gather per call, so a
                # mismatch raises instead of hanging); within a block every input derives from
                # q_proj's, so one check a block is enough.
                for linear in (block.attn.k_proj, block.attn.v_proj, block.attn.out_proj, block.mlp.fc1,
                               block.mlp.fc2):
                    linear.check_input_sizes = False
            if part.last:  # its input derives from the stage's blocks' (checked)
                part.lm_head.check_input_sizes = False
        if self.device.type != "cpu":
            part.to(self.device)  # the same Parameter objects: parallelize's hooks and markers stay
        if self.layout.fsdp:
            raf = self.layout.reshard_after_forward
            if self.tied_copy:  # each copy a unit of its own: dp rank d holds the same elements of both
                for embedding in ([part.tok_emb] if part.first else []) + ([part.lm_head] if part.last else []):
                    fully_shard(embedding, mesh=self.shard_mesh, mixed_precision=mp, reshard_after_forward=raf)
            for block in part.blocks.values():
                fully_shard(block, mesh=self.shard_mesh, mixed_precision=mp, reshard_after_forward=raf)
            return fully_shard(part, mesh=self.shard_mesh, mixed_precision=mp, reshard_after_forward=raf)
        if self.layout.dp == 1 and mp is None:
            return part  # nothing to average: no reducer, no per-step all-reduce over one rank
        device_ids = [self.device.index] if self.device.type != "cpu" else None
        return DistributedDataParallel(part, device_ids=device_ids, process_group=self.dp_group, mixed_precision=mp)

    def _embedding_group(self):
        """The group of the first and the last pipeline rank of this rank's dp x tp coordinate
        (Megatron's embedding group), None on the ranks between. Every rank creates every such
        group, as ``new_group`` requires."""
        L = self.layout
        ends = self.mesh.mesh.reshape(L.pp, L.dp, L.tp)[[0, -1]]  # [2, dp, tp] global ranks
        mine = None
        for d in range(self.layout.dp):
            for t in range(self.layout.tp):
                ranks = ends[:, d, t].tolist()
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
        return mine

    def _counted_in_norm(self, params):
        """The parameters whose gradients this rank adds to the global norm, so that each
        element of the model's gradient counts once over the whole layout: a tensor-parallel
        shard on its tp rank; a parameter replicated over tp (LayerNorms, row-parallel biases,
        the position embedding) on tp rank 0 only; the tied embedding's last-stage copy nowhere
        (its first-stage twin counts). dp replicas (DDP) count alike and are not summed;
        fully_shard's pieces are each dp rank's own and are summed over dp (over the shard group
        under hybrid sharding: its replicas hold the same pieces)."""
        split = set()
        for part in self.parts:
            for m in part.modules():
                if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
                    split.update(id(p) for p in m.parameters(recurse=False))
                elif isinstance(m, RowParallelLinear):
                    split.add(id(m.weight))
        copies = {id(part.lm_head.weight) for part in self.parts if part.last} if self.tied_copy else set()
        return [p for p in params if id(p) not in copies and (id(p) in split or self.tp_rank == 0)]

    def _loss(self, logits, target):
        target = target.t()  # micro-batches split [b, s]; logits are [s, b, vocab (/ tp)]
        if self.layout.tp > 1:
            return vocab_parallel_cross_entropy(logits, target, self.tp_group)
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def check_batch(self, idx, target):
        """A ValueError (every rank alike: every rank holds the same global batch) for a batch
        this layout cannot run."""
        L, cfg = self.layout, self.config
        if idx.dim() != 2 or target.shape != idx.shape:
            raise ValueError(f"ParallelGPT: idx and target must be [batch, seq] alike, got {tuple(idx.shape)} "
                             f"and {tuple(target.shape)}")
        b, s = idx.shape
        if s > cfg.seq_len:
            raise ValueError(f"ParallelGPT: sequence length {s} exceeds the model's seq_len {cfg.seq_len}")
        if L.sequence_parallel and s % L.tp:
            raise ValueError(f"ParallelGPT: sequence length {s} does not split over tp={L.tp} (sequence parallelism)")
        if b % (L.dp * L.microbatches):
            raise ValueError(f"ParallelGPT: batch size {b} does not split into dp x micro-batches = "
                             f"{L.dp} x {L.microbatches}")

    def _run(self, run, idx, target, train):
        self.check_batch(idx, target)
        idx, target = (t.chunk(self.layout.dp)[self.dp_rank].to(self.device) for t in (idx, target))
        losses = []
        module = self.modules[0]
        ddp = train and not self.pipelined and isinstance(module, DistributedDataParallel)
        reducer = module.reducer if ddp else None
        completed = reducer.completed_backwards if reducer is not None else None
        try:
            if self.pipelined:
                run(*((idx,) if self.has_first else ()), target=target if self.has_last else None, losses=losses)
            else:
                self._run_unpipelined(idx, target, losses, train)
        except BaseException as e:
            self._fail(e, reducer, completed)
            raise
        loss, failed = self._mean_loss(losses)
        if failed:
            goes_on = not self.pipelined and self.layout.tp == 1 and not self.layout.fsdp
            what = ("the optimizer did not step and this rank's gradients are not the step's (the next step zeroes "
                    "them)" if train else "the loss is not the batch's")
            raise RuntimeError(
                f"ParallelGPT: rank {dist.get_rank()}: the {'step' if train else 'evaluation'} failed on rank(s) "
                f"{', '.join(map(str, failed))} (their error says why); {what}"
                + ("" if goes_on else f"; the failed ranks' tensor-parallel, pipeline and fully_shard groups are "
                   f"aborted: {_REBUILD}"))
        return loss

    def _fail(self, error, reducer, completed):
        """This rank's step raised ``error``: frees the peers that may be waiting on it, then,
        where every peer comes to it, joins the step's closing all-reduce (``_mean_loss``) with
        its failure flag up, so that each rank raises at once instead of waiting in a collective
        until the group's timeout (a rank raising alone at pp = 1 did that before; under tensor
        parallelism its tp peers did at any pp).
        - The tp group and, at pp = 1, the groups the fully_shard units shard and replicate over
          are aborted with the error as the reason (the peers' pending collectives in them fail
          at once; a failed rank cannot replay their order). At pp > 1 the schedule has aborted
          the pipeline group and those groups, or agreed with the DDP peers (failure.py).
        - At pp = 1 a DDP stage issues what its synchronised backward still owes the dp peers,
          zeros (``Reducer.abandon_backward``): their reduction completes, and the model and its
          groups go on with the next step.
        Only torchpar's abort reaches the peers, and on the CPU only (not a peer inside an NCCL
        kernel): with other groups the rank raises at once, as before. Nor does it wait for its
        peers where the error says one of them is stuck or gone (a timeout, an exited rank,
        ``_peer_lost``): the closing all-reduce would wait for that one too, a second timeout
        (review), so it only aborts. A KeyboardInterrupt or SystemExit aborts and disarms only
        (its process usually ends)."""
        L = self.layout
        reason = clip_reason(f"{type(error).__name__}: {error}") + (
            f" [the step of ParallelGPT's rank {dist.get_rank()} failed; the group is aborted: {_REBUILD}]")
        groups = {id(self.tp_group): self.tp_group} if L.tp > 1 else {}
        if not self.pipelined:
            sharded = [m for m in self.modules[0].modules() if isinstance(m, FSDPModule)]
            groups.update((key, g) for key, (g, _) in fully_shard_groups(sharded, post_forward=True).items())
        reached = all([abort_with_reason(g, reason) for g in groups.values()])
        reached = reached and (not groups or self.device.type == "cpu")
        settle = isinstance(error, Exception) and not _peer_lost(error)
        if reducer is not None:
            if not settle:
                reducer.cancel_backward()  # left armed, the next step's first no_sync backward would reduce
            elif reducer.completed_backwards == completed:
                try:
                    reducer.abandon_backward()
                except Exception:  # noqa: BLE001 - this rank's own error is the one to raise
                    reached = abort_with_reason(self.dp_group, reason) and reached
        pipeline_reached = not self.pipelined or (dist.get_backend() == "torchpar" and self.device.type == "cpu")
        if settle and reached and pipeline_reached:
            with contextlib.suppress(Exception):  # a group the failure broke: the peers' own errors come
                self._mean_loss([], failed=True)

    def _run_unpipelined(self, idx, target, losses, train):
        """The one stage's micro-batches in order, forward then backward each (1F1B's order on
        one stage; every schedule's arithmetic at pp = 1), each loss scaled by 1 / micro-batches
        as the schedules scale it. Under DDP every backward but the last runs in ``no_sync()``,
        so the last one averages the accumulated gradients bucket by bucket while it still runs
        (Megatron-LM's forward_backward_no_pipelining; the schedule instead averages a DDP stage
        in one all-reduce after the step, executor._armable says why). A fully_shard stage
        reduces once too, as under the schedule: its units accumulate unsharded and stay gathered
        until the last backward, which reduce-scatters (and under HSDP all-reduces across the
        replicas) the sum; reducing every micro-batch sent each unit's gradients over the
        replicas' links once per micro-batch (review finding)."""
        module, m = self.modules[0], self.layout.microbatches
        ddp = train and isinstance(module, DistributedDataParallel)
        fsdp = syncing_fsdp_modules(module) if train and m > 1 else []
        with contextlib.ExitStack() as sync:
            if fsdp:
                sync.push(reduce_in_last_backward(fsdp))
            for i, (x, y) in enumerate(zip(idx.chunk(m), target.chunk(m))):
                armed = ddp and i == m - 1
                if i == m - 1:
                    for mod in fsdp:
                        mod.set_requires_gradient_sync(True, recurse=False)
                with module.no_sync() if ddp and not armed else contextlib.nullcontext():
                    loss = self._loss(module(x), y)
                    losses.append(loss.detach())
                    if train:
                        (loss * (1.0 / m)).backward()

    def _mean_loss(self, losses, failed=False):
        """(the global batch's mean loss, the global ranks whose step failed). The last pipeline
        stage's ranks hold the micro-batch losses (its tp ranks the same value, each dp rank its
        own): one all-reduce over the whole job, each of them adding its mean / (dp x tp) and the
        other ranks zero, gives the mean on every rank, with one synchronisation per step instead
        of one over pp and one over dp. The same all-reduce carries a flag per rank, which a
        failed rank raises from its error path (``_fail``)."""
        L = self.layout
        loss = torch.stack(losses).double().mean().item() if losses else 0.0
        world = dist.get_world_size()
        if world == 1:
            return loss, []
        row = torch.zeros(1 + world, dtype=torch.float64)
        row[0], row[1 + dist.get_rank()] = loss / (L.dp * L.tp), float(failed)
        row = row.to(self.device)
        dist.all_reduce(row)
        total, *flags = row.tolist()
        return total, [r for r, f in enumerate(flags) if f]

    def forward_backward(self, idx, target):
        """Zeroes the gradients, runs forward and backward over the global batch (the pipeline
        schedule, DDP's or fully_shard's reduction over dp), then sums the tied embedding's two
        copies' gradients over the embedding group: afterwards each local parameter's ``.grad``
        is the one the optimizer steps on. Returns the batch's mean loss."""
        for m in self.modules:
            m.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._run(self.schedule.step, idx, target, train=True)
        for w in self.embedding_weights:  # Megatron's _allreduce_word_embedding_grads
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=self.embedding_group)
        return loss

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)`` of the
        single-process model, on this layout: the global norm counts each element of the
        gradient once (``_counted_in_norm``), summed over the tp and pp groups (and dp under
        fully_shard, the shard group under HSDP; max for ``inf``), and every rank scales all its gradients by the same
        coefficient. Call on every rank after ``forward_backward``. Returns the norm before
        clipping (a float32 scalar tensor, equal on every rank).

        Under O2 the gradients clipped are the float32 master gradients the optimizer steps
        (Megatron's ``clip_grad_norm_fp32`` on its main grads): with DDP those of
        ``MixedPrecisionOptimizer`` (the 16-bit ``.grad`` stay as backward left them), with
        fully_shard the float32 shards' own gradients."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return self.optimizer.clip_grad_norm_(max_norm, norm_type, counted=self._norm_params,
                                                  groups=self._norm_groups)
        return clip_grad_norm_(self._params, max_norm, norm_type, counted=self._norm_params, groups=self._norm_groups)

    def train_step(self, idx, target):
        """One optimizer step on the global batch (gradients clipped first when ``clip_grad``);
        returns its mean loss (before the step)."""
        loss = self.forward_backward(idx, target)
        if self.clip_grad > 0:
            self.grad_norm = self.clip_grad_norm_(self.clip_grad).item()
        self.optimizer.step()
        self.step += 1
        return loss

    @torch.no_grad()
    def eval_step(self, idx, target):
        """Mean loss on a batch, forward only (dropout off)."""
        for m in self.modules:
            m.eval()
        return self._run(self.schedule.eval, idx, target, train=False)


# What a user does after a failure aborted groups. DeviceMesh reuses the default group for a mesh
# dimension spanning the whole job (tp or fully_shard over every rank): then that one is aborted.
_REBUILD = ("build a new ParallelGPT (and, where the aborted group is the default one, destroy_process_group() "
            "and init_process_group() first)")


def _peer_lost(error):
    """Whether ``error``, its causes, or a reason passed along in them (an abort's, a published
    pipeline failure's) says that a peer is stuck or gone: a timeout, an exited rank."""
    seen, texts = set(), []
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    return re.search(r"timed out|has exited|closed the connection", " ".join(texts), re.IGNORECASE) is not None


def rank_device(device):
    """``torch.device(device)``; "cuda" without an index is this rank's GPU, cuda:LOCAL_RANK
    (torchrun sets it; else the global rank modulo the GPUs), made the current device."""
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"ParallelGPT: device {device} is neither cpu nor cuda")
    if not torch.cuda.is_available():
        raise ValueError("ParallelGPT: device cuda, but torch sees no CUDA device here")
    if device.index is None:
        local = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local) if local is not None else dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device
