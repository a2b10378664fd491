"""Train a byte-level GPT with data, tensor and pipeline parallelism (issue 20):

    torchrun --standalone --nproc_per_node=8 examples/train_gpt.py --dp 2 --tp 2 --pp 2
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --dp 2 --tp 2 --fsdp --dtype bfloat16
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --dp 4 --fsdp --dp-replicate 2
    torchrun --nnodes=2 --nproc_per_node=4 ... examples/train_gpt.py --dp 8 --fsdp --reshard-after-forward 4
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --tp 2 --pp 2 --device cuda

The model is torchpar.models.GPT, made parallel by torchpar.models.ParallelGPT (parallelize plan,
pipeline cut, DDP or fully_shard). The data, unless --data names a file or folder, is the
Python standard library's own .py sources, present on every machine: read as bytes, the last
10 % held out for validation. Batches are drawn from a generator seeded by the step, so every
rank (and every layout) sees the same global batch at the same step. Rank 0 shows a progress
bar with loss, tokens/s and ETA, and writes a loss-curve PNG at the end. Gradients are clipped
to a global norm of 1.0 (--clip-grad) over the whole layout, as Megatron-LM does (under
--dtype bfloat16, the float32 master gradients the optimizer steps).

Without torchrun it runs as a single process (dp = tp = pp = 1).
"""
import argparse
import glob
import json
import math
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

import torchpar  # noqa: F401  (registers the "torchpar" backend)
from torchpar.models import GPT, GPTConfig
from torchpar.models.gpt import RECOMPUTE, num_parameters
from torchpar.models.parallel_gpt import DTYPES, SCHEDULES, Layout, ParallelGPT, check_layout

MODELS = {
    "default": GPTConfig(),  # 10.9M parameters
    "small": GPTConfig(seq_len=64, hidden=128, heads=4, layers=4),
    "tiny": GPTConfig.tiny(),
}


def _reshard_after_forward(value):
    """--reshard-after-forward: true, false or a number of ranks."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"true, false or a number of ranks, not {value!r}") from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, but not a None default (its help says what it means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    g = p.add_argument_group("layout (dp x tp x pp = world size)")
    g.add_argument("--dp", type=int, default=1)
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--fsdp", action="store_true", help="fully_shard over the dp group instead of DDP")
    g.add_argument("--dp-replicate", type=int, default=1,
                   help="with --fsdp: the dp ranks as this many replicas, each sharded over dp / dp-replicate "
                        "ranks (hybrid sharding, HSDP)")
    g.add_argument("--reshard-after-forward", type=_reshard_after_forward, default=True, metavar="{true,false,N}",
                   help="with --fsdp: free each block's gathered parameters after forward (true), keep them (false), "
                        "or keep 1/N of them among N ranks, e.g. one host's, whose backward all-gathers then stay "
                        "among those N")
    g.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b", help="pipeline schedule (pp > 1)")
    g.add_argument("--virtual-stages", type=int, default=None, help="stages per pipeline rank (interleaved: 2)")
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron's sequence parallelism (tp > 1)")
    g.add_argument("--dtype", choices=list(DTYPES), default="float32", help="bfloat16: O2 mixed precision")
    g.add_argument("--recompute", choices=RECOMPUTE, default="none")
    g.add_argument("--backend", choices=["torchpar", "gloo"], default="torchpar")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: each rank on cuda:LOCAL_RANK (torchpar carries CUDA tensors over NCCL)")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=list(MODELS), default="default")
    for name in ("seq-len", "hidden", "heads", "layers"):
        g.add_argument(f"--{name}", type=int, default=None, help="overrides the --model preset")
    g.add_argument("--dropout", type=float, default=0.0, help="probability, in [0, 1)")
    g.add_argument("--tie-embeddings", action="store_true", help="lm_head shares the token embedding's weight")
    g = p.add_argument_group("training")
    g.add_argument("--data", default=None, help="a text file or a folder of them (default: the stdlib's .py files)")
    g.add_argument("--steps", type=int, default=200, help="optimizer steps in all (a resumed run counts from 0)")
    g.add_argument("--batch-size", type=int, default=16, help="global batch, sequences")
    g.add_argument("--micro-batches", type=int, default=None, help="per step and dp rank (default: 2 x pp)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up, then cosine decay to lr/10")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    g.add_argument("--eval-every", type=int, default=50, help="steps between validation losses")
    g.add_argument("--eval-batches", type=int, default=4, help="batches per validation loss")
    g.add_argument("--seed", type=int, default=0, help="initial weights and dropout's streams")
    g.add_argument("--out", default="runs/gpt", help="folder for the loss curve")
    g.add_argument("--save", default=None,
                   help="folder for sharded checkpoints (torch.distributed.checkpoint): DIR/step_N, the newest named "
                        "in DIR/latest; written at the end and every --save-every steps")
    g.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    g.add_argument("--resume", default=None,
                   help="checkpoint to resume from (any layout): a --save folder (its latest) or a checkpoint folder")
    g.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.micro_batches is None:
        args.micro_batches = 2 * args.pp
    for name, least in (("steps", 1), ("save_every", 0), ("warmup", 0), ("batch_size", 1), ("eval_every", 1),
                        ("eval_batches", 1), ("seq_len", 1), ("hidden", 1), ("heads", 1), ("layers", 1)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.save_every and not args.save:
        p.error("--save-every needs --save DIR (where the checkpoints go)")
    return args


def model_config(args):
    over = {k: getattr(args, k) for k in ("seq_len", "hidden", "heads", "layers") if getattr(args, k) is not None}
    return GPTConfig(**{**MODELS[args.model].to_dict(), **over, "dropout": args.dropout,
                        "tie_embeddings": args.tie_embeddings})


# ---- data ----

def _is_text(data):
    # git's test for a binary file: a NUL byte in its first 8000 bytes.
    return b"\0" not in data[:8000]


def load_corpus(path=None):
    """Bytes of `path` (a file, or every text file under a folder, sorted: binary files, such as
    images or checkpoints kept beside the text, are skipped), or of the standard library's
    top-level .py files: the same bytes on every rank, no download."""
    if path is not None and not os.path.exists(path):
        raise ValueError(f"--data {path}: no such file or folder")
    folder = path is not None and os.path.isdir(path)
    if path is None:
        files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    elif folder:
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(f))
    else:
        files = [path]
    texts = [open(f, "rb").read() for f in files]
    kept = [t for t in texts if not folder or _is_text(t)]
    data = b"".join(kept)
    if len(data) < 1000:
        skipped = f" (from {len(kept)} text files; {len(texts) - len(kept)} binary files skipped)" if folder else ""
        raise ValueError(f"--data {path}: {len(data)} bytes{skipped}; need at least 1000")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Batches:
    """Random windows of the corpus; the last 10 % is the validation split."""

    def __init__(self, data, seq_len, batch_size, seed):
        cut = int(0.9 * len(data))
        self.train, self.val = data[:cut], data[cut:]
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        for split, part in (("training", self.train), ("validation", self.val)):
            if len(part) < seq_len + 2:  # (get draws starts below len - seq_len - 1)
                raise ValueError(f"the corpus's {split} split has {len(part)} bytes, fewer than a window of "
                                 f"--seq-len {seq_len} needs ({seq_len + 2}); the last 10 % of the corpus "
                                 f"({len(data)} bytes) is the validation split")

    def get(self, split, i):
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i + (0 if split == "train" else 10 ** 9))
        starts = torch.randint(0, len(data) - self.seq_len - 1, (self.batch_size,), generator=g)
        windows = torch.stack([data[s:s + self.seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]


# ---- checkpoint hooks (torchpar/models/checkpoint.py) ----

def checkpoint_functions(args):
    """(save_checkpoint, load_checkpoint) from torchpar.models.checkpoint when --save/--resume
    ask for them; a clear error on every rank before training when that module is missing.
    The interface: ``save_checkpoint(path, trainer, run)`` (trainer.step is the number of steps
    done; ``run``: this run's schedule arguments, kept with it) and ``load_checkpoint(path,
    trainer) -> step`` before the first step;
    training goes on from that step (the batches are drawn by step, so the data continue)."""
    if args.save is None and args.resume is None:
        return None, None
    try:
        from torchpar.models.checkpoint import load_checkpoint, save_checkpoint
    except ImportError as e:
        raise ValueError(f"--save/--resume need torchpar.models.checkpoint, which this build lacks ({e})")
    return save_checkpoint, load_checkpoint


def latest_checkpoint(path):
    """The checkpoint folder --resume PATH names: PATH/<the name in PATH/latest> for a --save
    folder, else PATH itself."""
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    return path


def save_step(save, path, trainer, rank, run):
    """Checkpoint ``trainer`` into PATH/step_N, then name it in PATH/latest (replaced in one
    rename: a run killed while saving leaves the previous checkpoint in place) and remove the
    older step folders."""
    name = f"step_{trainer.step}"
    save(os.path.join(path, name), trainer, run)
    dist.barrier()  # every rank's files written before the pointer moves
    if rank == 0:
        tmp = os.path.join(path, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(name + "\n")
        os.replace(tmp, os.path.join(path, "latest"))
        for old in glob.glob(os.path.join(path, "step_*")):
            if os.path.basename(old) != name:
                shutil.rmtree(old, ignore_errors=True)


def check_paths(args):
    """--out and --save must be folders (or absent), checked before training, not after. A --save
    folder holding another run's checkpoints is refused unless this run resumes from it (its
    older step folders are removed at each save, and one of the same step written over)."""
    for flag, path in (("--out", args.out), ("--save", args.save)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path}: exists and is not a folder")
    if args.save and args.data and os.path.isdir(args.data):
        data, save = os.path.realpath(args.data), os.path.realpath(args.save)
        if os.path.commonpath([data, save]) == data:
            raise ValueError(f"--save {args.save} is inside --data {args.data}: the checkpoints' files would be read "
                             "as training data by a resumed run (another corpus, other batches)")
    if args.save and os.path.isfile(os.path.join(args.save, "latest")) and (
            args.resume is None or os.path.realpath(args.resume) != os.path.realpath(args.save)):
        raise ValueError(f"--save {args.save} holds the checkpoints of another run; --resume {args.save} to go "
                         "on with it, or save elsewhere")


SCHEDULE_ARGS = ("steps", "warmup", "lr")


def check_schedule(meta, args, rank):
    """The learning rate follows --steps, --warmup and --lr: a resumed run goes on as if it had not
    stopped only when they are the run's that saved the checkpoint: another schedule is taken,
    with a note. A checkpoint at or past --steps is refused (nothing to train)."""
    start = meta["step"]
    if start >= args.steps:
        raise ValueError(f"--resume: the checkpoint is at step {start}, --steps {args.steps}: nothing to train "
                         f"(--steps counts from the start of training)")
    saved = meta.get("run") or {}
    diffs = [f"--{k} {getattr(args, k)} (the saved run's {saved[k]})" for k in SCHEDULE_ARGS
             if k in saved and saved[k] != getattr(args, k)]
    if diffs and rank == 0:
        now, then = lr_at(start, args), lr_at(start, argparse.Namespace(**{**vars(args), **saved}))
        rates = (f"from step {start} the rate is {now:.3g} where the saved run's would be {then:.3g}" if now != then
                 else f"the rate at step {start} is the saved run's ({now:.3g}); the two schedules part later")
        print(f"train_gpt.py: note: resuming with another learning-rate schedule: {', '.join(diffs)}; {rates}",
              file=sys.stderr)


def check_device(args):
    """A ValueError on every rank, before any collective, for a device this run cannot use."""
    if args.device == "cuda":
        if args.backend != "torchpar":
            raise ValueError(f"--device cuda needs --backend torchpar (its NCCL path), not {args.backend}")
        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device here")
        if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
            raise ValueError(f"--device cuda: {os.environ.get('LOCAL_WORLD_SIZE')} ranks on this machine but "
                             f"{torch.cuda.device_count()} GPU(s); one rank per GPU")


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def evaluate(trainer, batches, n):
    return sum(trainer.eval_step(*batches.get("val", i)) for i in range(n)) / n


def plot(history, path, title):
    """Draws the loss curve into ``path``; returns where it went, for the last lines printed."""
    try:
        import matplotlib
    except ImportError:  # e.g. the CUDA torch environment of a GPU host (make test-gpu)
        return "not drawn (matplotlib is not installed)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*history["train"]), label="train", lw=1)
    if history["val"]:
        ax.plot(*zip(*history["val"]), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return os.path.abspath(path)


def init_distributed(backend):
    if "RANK" not in os.environ:  # plain `python examples/train_gpt.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def main(argv=None):
    args = parse_args(argv)
    rank, world = init_distributed(args.backend)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    try:
        cfg = model_config(args)
        layout = Layout(args.dp, args.tp, args.pp, args.fsdp, args.schedule, args.virtual_stages,
                        args.sequence_parallel, args.dtype, args.recompute, args.micro_batches,
                        args.dp_replicate, args.reshard_after_forward)
        check_layout(cfg, layout, world, args.batch_size)  # every rank, before any collective
        if args.sequence_parallel and args.tp == 1 and rank == 0:
            print("train_gpt.py: note: --sequence-parallel does nothing at --tp 1 (it splits the sequence among "
                  "the tensor-parallel ranks)", file=sys.stderr)
        check_device(args)
        check_paths(args)
        save, load = checkpoint_functions(args)
        resume = latest_checkpoint(args.resume) if args.resume else None
        if resume:  # another model's checkpoint: refused here, before any collective
            from torchpar.models.checkpoint import check_checkpoint
            saved = check_checkpoint(resume, cfg)
            check_schedule(saved, args, rank)
        batches = Batches(load_corpus(args.data), cfg.seq_len, args.batch_size, args.seed)
    except ValueError as e:
        print(f"train_gpt.py (rank {rank}): error: {e}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    trainer = ParallelGPT(cfg, layout, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                          device=args.device, clip_grad=args.clip_grad)
    try:
        start = load(resume, trainer) if resume else 0
    except Exception as e:  # a damaged shard file: DCP raises it on every rank
        if rank == 0:
            print(f"train_gpt.py: error: --resume {resume}: {type(e).__name__}: {str(e).strip()[:500]}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    if resume and rank == 0 and cfg.dropout > 0:
        from torchpar.models.checkpoint import random_state_differences, restores_random_state
        if not restores_random_state(saved, trainer):
            why = (f"the checkpoint's were saved at another layout ({', '.join(random_state_differences(saved, trainer))})"
                   if "rng_streams" in saved else "the checkpoint holds none")
            print(f"train_gpt.py: note: dropout's random streams start afresh from --seed {args.seed}: {why}",
                  file=sys.stderr)
    run = {k: getattr(args, k) for k in SCHEDULE_ARGS}
    if rank == 0:
        with torch.device("meta"):  # counted without drawing from rank 0's generators (dropout's streams)
            count = num_parameters(GPT(cfg))
        print(f"GPT {count / 1e6:.1f}M "
              f"parameters {cfg}\nlayout {layout} on {world} ranks ({args.backend}, {args.device}); corpus "
              f"{len(batches.train) + len(batches.val)} bytes; global batch {args.batch_size} x {cfg.seq_len} tokens")
    history = {"train": [], "val": []}
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)
    tokens = args.batch_size * cfg.seq_len
    t_run = time.perf_counter()
    for step in range(start, args.steps):
        for g in trainer.optimizer.param_groups:
            g["lr"] = lr_at(step, args)
        t0 = time.perf_counter()
        loss = trainer.train_step(*batches.get("train", step))
        dt = time.perf_counter() - t0
        dt_avg = dt if step == start else 0.9 * dt_avg + 0.1 * dt  # smoothed for the bar
        history["train"].append((step + 1, loss))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            history["val"].append((step + 1, evaluate(trainer, batches, args.eval_batches)))
        if bar is not None:
            post = dict(loss=f"{loss:.3f}", tok_s=f"{tokens / dt_avg:,.0f}")
            if trainer.grad_norm is not None:
                post["gnorm"] = f"{trainer.grad_norm:.2f}"
            if history["val"]:
                post["val"] = f"{history['val'][-1][1]:.3f}"
            bar.set_postfix(post, refresh=False)
            bar.update(1)
        if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save_step(save, args.save, trainer, rank, run)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_run
    if args.save:
        save_step(save, args.save, trainer, rank, run)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        curve = "not drawn (no step run)"
        if history["train"]:
            curve = plot(history, os.path.join(args.out, "loss.png"),
                         f"GPT {cfg.layers}x{cfg.hidden}, {layout}, {args.backend}")
            with open(os.path.join(args.out, "loss.json"), "w") as f:  # the plotted values, [step, loss] pairs
                json.dump(history, f)
            curve += f" (values: {os.path.join(args.out, 'loss.json')})"
        steps = args.steps - start
        val = history["val"][-1][1] if history["val"] else float("nan")
        print(f"{steps} steps in {elapsed:.1f} s ({steps * tokens / max(elapsed, 1e-9):,.0f} tokens/s); "
              f"final train loss {history['train'][-1][1] if history['train'] else float('nan'):.3f}, "
              f"validation loss {val:.3f}")
        if trainer.grad_norm is not None:
            print(f"gradient norm at the last step: {trainer.grad_norm:.4f} (clipped to {args.clip_grad:g})")
        print(f"loss curve: {curve}")
        saved = os.path.abspath(latest_checkpoint(args.save)) if args.save else "not saved (pass --save DIR)"
        print(f"checkpoint: {saved}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
