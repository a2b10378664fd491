"""Cross-entropy over logits split along the vocabulary (Megatron-LM, arXiv:1909.08053,
section 3: "fuse the output of the parallel GEMM with the cross-entropy loss").

The full logits ``[..., V]`` are never gathered: each rank holds ``[..., V/tp]`` and the ranks
exchange only per-token scalars, two all-reduces in all (the max for a stable softmax, then
the sum of exponentials, the target's logit and, for label smoothing, the sum of logits, in
one stacked tensor). Memory per rank is ~V/tp per token.
"""
import torch
import torch.distributed as dist

from torchpar.parallel.tensor import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing, ignore_index):
        rank, tp = comm.group_rank_and_size(group)
        local_vocab = logits.size(-1)
        vocab = local_vocab * tp
        start = rank * local_vocab
        x = logits.float()
        max_logit = x.amax(-1)
        if tp > 1:
            dist.all_reduce(max_logit, dist.ReduceOp.MAX, group=group)
        x = x - max_logit.unsqueeze(-1)

        held = (target >= start) & (target < start + local_vocab)
        local_target = (target - start).masked_fill(~held, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~held, 0.0)
        exp = x.exp()
        # The last row counts the ranks holding each target: 0 for a target outside [0, V),
        # found in the same all-reduce, so every rank sees it and raises alike.
        stats = [exp.sum(-1), target_logit]
        if label_smoothing > 0:
            stats.append(x.sum(-1))
        stats.append(held.to(x.dtype))
        stats = torch.stack(stats)
        if tp > 1:
            dist.all_reduce(stats, group=group)
        valid = target != ignore_index
        unheld = valid & (stats[-1] == 0)
        if unheld.any():
            raise IndexError(f"vocab_parallel_cross_entropy: target {target[unheld][0].item()} is out of "
                             f"bounds for the vocabulary of {vocab} (and is not ignore_index {ignore_index})")
        log_z = stats[0].log()
        loss = log_z - stats[1]
        if label_smoothing > 0:
            # F.cross_entropy's smoothing: (1 - e) * nll + e * mean over the vocabulary of -log p.
            loss = (1 - label_smoothing) * loss + label_smoothing * (log_z - stats[2] / vocab)
        loss = loss.masked_fill(~valid, 0.0)

        softmax = exp.div_(stats[0].unsqueeze(-1))  # in place: the only [.., V/tp] buffer kept
        ctx.save_for_backward(softmax, local_target, held, valid)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, held, valid = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - smoothed one-hot target
        if ctx.label_smoothing > 0:
            grad = grad - ctx.label_smoothing / ctx.vocab
        hit = (held & valid).unsqueeze(-1).to(grad.dtype) * (1 - ctx.label_smoothing)
        grad = grad.scatter_add(-1, local_target.unsqueeze(-1), -hit)
        # where, not a product: with every target ignored the mean's grad_loss is inf (1/0), and
        # inf * 0 is nan; F.cross_entropy gives ignored tokens a zero gradient whatever grad_loss is.
        grad = grad * torch.where(valid, grad_loss, 0.0).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, target, group=None, label_smoothing=0.0, ignore_index=-100,
                                 *, reduction="mean"):
    """``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ...)`` from this rank's
    vocabulary slice ``logits [..., V/tp]`` (the output of a ColumnParallelLinear without
    gather_output); ``target [...]`` holds ids in ``[0, V)`` or ``ignore_index``.

    The loss is computed in float32. ``reduction`` is ``"mean"`` (over targets that are not
    ``ignore_index``, as F.cross_entropy), ``"sum"`` or ``"none"`` (per token, shaped like
    ``target``).
    """
    group = comm.resolve_group(group)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    # The shapes agree across ranks before any check that depends on them: a rank raising alone
    # would leave the others inside the next collective.
    comm.check_same_sizes(target, group, "vocab_parallel_cross_entropy target")
    comm.check_same_sizes(logits, group, "vocab_parallel_cross_entropy logits")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
                         f"{tuple(target.shape)} disagree (logits must be target's shape plus the vocabulary)")
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, float(label_smoothing), ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
