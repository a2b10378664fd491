"""Gradient clipping by the global norm of a model whose parameters are spread over ranks
(Megatron-LM's ``clip_grad_norm_fp32``; Shoeybi et al. 2019, arXiv:1909.08053).

``torch.nn.utils.clip_grad_norm_`` needs every gradient in one process. When a model is split
by tensor and pipeline parallelism, and its gradients are sharded by fully_shard, each rank
holds some pieces of the gradient and copies of others. The global norm is then a sum over
unique pieces: each rank adds up ``|g|^p`` over the pieces it alone is responsible for
(``counted``), the partial sums are all-reduced over ``groups`` (max for the inf-norm), and
every rank scales all its gradients, copies included, by the same coefficient. The caller
decides what a rank counts (ParallelGPT: a tensor-parallel replica's LayerNorms on tp rank 0
only; a tied weight's second copy nowhere) and over which groups the pieces differ.

Under O2 the gradients to clip are the optimizer's float32 master gradients, not the 16-bit
ones backward leaves (Megatron's ``clip_grad_norm_fp32``): ``ZeroRedundancyOptimizer`` and
``MixedPrecisionOptimizer`` call this function on their masters (``clip_grad_norm_`` there).
"""
import math

import torch
import torch.distributed as dist


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, *, counted=None,
                    groups=(), device=None):
    """Scales the gradients of ``parameters`` in place so that the global ``norm_type``-norm
    (``inf`` too) is at most ``max_norm``, exactly as ``torch.nn.utils.clip_grad_norm_`` does
    on the whole model (coefficient ``max_norm / (norm + 1e-6)``, clamped to 1). Returns the
    global norm before clipping, a float32 scalar tensor, the same on every rank of
    ``groups``.

    ``counted``: the parameters whose gradients this rank adds to the norm (default: all of
    ``parameters``); ``groups``: the process groups over which the ranks' sums are combined,
    one after the other (a sum over each group in turn is the sum over their product). Every
    rank of those groups must call it, with or without gradients. ``device``: where the norm
    is reduced when this rank holds no parameter (default: the first parameter's, else the
    CPU). ``error_if_nonfinite``: raise (on every rank, before scaling anything) when the global
    norm is nan or inf, as torch's; ``foreach`` is accepted for torch's signature (the scaling is
    one in-place multiply per gradient either way). ``parameters`` and ``counted`` may be single
    tensors, as in torch."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if isinstance(counted, torch.Tensor):
        counted = [counted]
    counted = params if counted is None else list(counted)
    norm_type = float(norm_type)
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    grads = [p.grad for p in counted if p.grad is not None and p.grad.numel() > 0]
    if norm_type == math.inf:
        local = torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads else None
        op = dist.ReduceOp.MAX
    else:
        local = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) ** norm_type
                             for g in grads]).sum() if grads else None
        op = dist.ReduceOp.SUM
    total = local.to(device) if local is not None else torch.zeros((), dtype=torch.float32, device=device)
    if norm_type == math.inf and groups:
        # A NaN does not survive MAX everywhere (NCCL's fmaxf drops it; gloo keeps it or not
        # by the ranks' order): reduce [max, NaN seen] and put the NaN back, as torch's
        # function returns nan. (SUM carries NaN and inf through on its own.)
        nan = torch.isnan(total)
        pair = torch.stack([torch.where(nan, torch.zeros_like(total), total), nan.float()])
        for group in groups:
            dist.all_reduce(pair, op=op, group=group)
        total = torch.where(pair[1] > 0, torch.full_like(pair[0], math.nan), pair[0])
    else:
        for group in groups:
            dist.all_reduce(total, op=op, group=group)
    if norm_type != math.inf:
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):  # the same total on every rank: all raise
        raise RuntimeError(f"torchpar clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           f"{total.item()}, so they cannot be clipped; error_if_nonfinite=False clips anyway "
                           "(as torch.nn.utils.clip_grad_norm_)")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
