"""Dynamic loss scaling for float16 training (Micikevicius et al. 2018, arXiv:1710.03740).

float16 cannot hold the small gradients of late layers: they flush to zero. Multiplying the
loss by a large scale moves every gradient up into range; the optimizer divides it out again
(in the float32 master gradients, where dividing loses nothing). Too large a scale overflows:
such a step is skipped, and the scale halved. After ``growth_interval`` clean steps it is
doubled again, so it hovers near the largest scale that does not overflow.

Under ZeRO each rank sees only its shard's gradients, so an overflow one rank finds must skip
the step on all of them: ``unscale_and_check`` agrees by one all-reduce of a flag.
"""
import torch
import torch.distributed as dist


class DynamicLossScaler:
    """``scaler.scale(loss).backward()``, then hand the scaler to the optimizer
    (``ZeroRedundancyOptimizer(..., loss_scaler=scaler)`` or ``MixedPrecisionOptimizer``), whose
    ``step()`` unscales, checks, and skips or steps. ``last_step_skipped`` and
    ``skipped_steps`` tell what happened.

    The scale backs off only in ``step()``: call it every step, also when ``clip_grad_norm_``
    returned a non-finite norm (it then skips the update and halves the scale). A loop that
    skips ``step()`` on such a norm keeps the scale that overflowed, and overflows again."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, process_group=None):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1):
            raise ValueError(f"torchpar DynamicLossScaler: need growth_factor > 1, 0 < backoff_factor < 1 "
                             f"and growth_interval >= 1; got {growth_factor}, {backoff_factor}, {growth_interval}")
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.process_group = process_group
        self.good_steps = 0
        self.skipped_steps = 0
        self.last_step_skipped = False

    def scale(self, loss):
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_and_check(self, grads, group=None, device=None):
        """Divide ``grads`` (float32 master gradients) by the scale; True on every rank of
        ``group`` (default: the scaler's, else the world) if any rank's hold an inf or NaN.
        ``device``: where the flag is all-reduced (the group's device: a rank holding no
        gradient, e.g. owning no parameter under ZeRO, must not reduce on the CPU under NCCL);
        default the first gradient's, else the CPU."""
        found = self.unscale_(grads)
        if device is None and grads:
            device = grads[0].device
        return self.any_rank_found(found, group, device=device)

    @torch.no_grad()
    def unscale_(self, grads):
        """Divide ``grads`` by the scale, on this rank only; whether any holds an inf or NaN."""
        found = False
        for g in grads:
            g.mul_(1.0 / self.scale_value)
            if not found and not torch.isfinite(g).all():
                found = True
        return found

    def any_rank_found(self, found, group=None, device=None):
        """Whether ``found`` is true on any rank of ``group`` (default: the scaler's, else the
        world): one all-reduce, on ``device`` (default the CPU), which every rank must make."""
        group = group if group is not None else self.process_group
        if dist.is_initialized():
            flag = torch.tensor([1.0 if found else 0.0], device=device if device is not None else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            found = bool(flag.item() > 0.0)
        return bool(found)

    def update(self, found_inf):
        """After each step: back off on overflow, grow after growth_interval clean steps."""
        self.last_step_skipped = bool(found_inf)
        if found_inf:
            self.skipped_steps += 1
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale_value *= self.growth_factor
            self.good_steps = 0

    def state_dict(self):
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state):
        self.scale_value = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
