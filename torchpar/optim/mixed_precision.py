"""O2 master weights without sharding, for DistributedDataParallel(mixed_precision=...).

The model's parameters are 16-bit; this optimizer keeps a float32 master copy of every one,
copies each (already averaged) 16-bit gradient into its master's float32 gradient, steps the
masters, and writes them back rounded to 16 bits (the NVIDIA recipe, Micikevicius et al. 2018,
arXiv:1710.03740). Small updates then accumulate in float32 instead of rounding away.

It is a ZeroRedundancyOptimizer whose every rank owns every parameter: the master, loss
scaler, clipping and state-dict machinery are the same, with no shards and no all-gather.
``clip_grad_norm_`` clips the float32 master gradients (after the loss scaler's division),
not the 16-bit ones, and sums over no group: every rank holds all of them.
"""
from torchpar.optim.zero import ZeroRedundancyOptimizer


class MixedPrecisionOptimizer(ZeroRedundancyOptimizer):
    """``MixedPrecisionOptimizer(ddp.parameters(), torch.optim.AdamW,
    mixed_precision=MixedPrecision(torch.bfloat16), lr=1e-3)``. ``process_group`` is the group
    whose ranks agree on skipping a step with ``loss_scaler`` (default: the world)."""

    def __init__(self, params, optimizer_class, mixed_precision=None, loss_scaler=None,
                 process_group=None, **defaults):
        if mixed_precision is None:
            from torchpar.parallel.mixed_precision import MixedPrecision
            mixed_precision = MixedPrecision()
        super().__init__(params, optimizer_class, process_group, mixed_precision=mixed_precision,
                         loss_scaler=loss_scaler, **defaults)

    # Every rank holds every master, with the same (DDP-averaged) gradients: summing over the
    # group would count each W times. clip_grad_norm_ sums over no group (or the caller's).
    _norm_over_group = False

    def _partition(self, start):
        return [], set(range(start, len(self._params())))  # every rank owns everything

    def _check_loadable_everywhere(self, state_dict, params):
        # No all-gather follows a load here, so no rank can be left waiting: check locally,
        # without a collective (a load on one rank alone stays possible).
        self._check_loadable(state_dict, params)

    def consolidate_state_dict(self, to=0):
        pass  # every rank holds the whole state

    def state_dict(self):
        return {"state": self._local_state(), "param_groups": self._groups_for_saving()}
