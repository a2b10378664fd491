"""A step that fails on one pipeline rank fails on every one, promptly, naming the stage.

A rank whose stage raises mid-step owes its neighbours messages it will never send: they
would wait for them, and ranks further along would wait on those, until the group's timeout.
So the first rank to fail publishes why in the group's store (one key per step), then aborts
the pipeline group (``ProcessGroup.abort``). A rank whose wait then fails reads the reason and
raises it; the rank whose own work raised re-raises its own exception; a rank that had
finished the step raises the reason at the start of the next one. A KeyboardInterrupt (Ctrl-C)
or SystemExit mid-step counts as the rank's own failure: published, the group aborted, and
re-raised as it is (review: the peers waited for the timeout).

The keys carry a random number that pipeline rank 0 drew for the schedule, learned by every
rank in the first step's agreement; a count of the schedules made over the group (as before)
differs between ranks that made different numbers of them, and the reason was lost (review).

- torchpar: the abort fails every pending and later operation of the group on every rank
  within ~50 ms (the progress threads watch the group's shared abort flag, or the TCP
  connections), whichever rank they wait on.
- gloo has no abort (``ProcessGroupGloo`` keeps ``Backend.abort()``'s no-op), so a peer's
  pending receive fails only when the failed rank's process exits (its connections close) or
  at the group's timeout; then it raises the published reason. Ranks that exit on the error
  (an uncaught exception) pass it on one stage at a time.

The group is unusable afterwards: make a new one. The one exception is a shape mismatch
between the two ranks of a two-rank pipeline: both raise by themselves (the header carries
the shapes), nobody is left waiting, and the group goes on (the groups of fully_shard stages
are aborted all the same: ``ShardedPeers``).

Under pipeline x data parallelism the failure reaches the same stage's replicas in the other
pipelines too: a stage whose DDP averages after the step first tells its data-parallel peers
whether its step ended (``agree_on_outcome``: one all-reduce of flags over the DP group, which
the failed rank joins from its error path), and every peer of a failed rank raises instead of
waiting in the average for a rank that will not come, until that rank's process exits or the
group's timeout. Nothing is aborted, so the DDP modules and their groups go on with the next
step. A stage armed to reduce inside its last backward (our DDP with find_unused_parameters)
agrees too: the failed rank first issues the buckets that backward still owes its peers
(``schedules._release_data_parallel_peers``; a data-parallel group on which that fails is
aborted). Not covered (no agreement for any DDP stage of the rank): a rank with a fully_shard
stage, whose peers may wait in its units' collectives (``ShardedPeers``: an agreement before the
actions, an abort of its torchpar groups with the reason after), and armed stages on a pipeline group other than
torchpar's, which cannot be aborted first (docs/pipeline.md).
"""
import contextlib
import secrets
from datetime import timedelta

import torch
import torch.distributed as dist

from torchpar import _C
from torchpar.parallel.pipeline import _comm

# How long a rank that learned of a failure waits for the failed rank to write its reason
# (it counts itself in first, then writes: two store calls apart).
_REASON_WAIT = timedelta(seconds=5)
_ACTIONS = {"F": "the forward", "B": "the backward", "W": "the weight gradient", "SEND": "the last sends"}


class StepFailure:
    """Where one schedule publishes why a step failed: the group's store, a key per step."""

    def __init__(self, group):
        self.group = group
        self.nonce = secrets.randbits(62)  # this rank's draw; rank 0's is the one used
        self.prefix = None  # until the first step's agreement: nothing can fail mid-step before

    def agree(self, nonce):
        """Takes pipeline rank 0's number (every rank gets the same from the step's agreement)."""
        self.prefix = f"torchpar/pipeline/{nonce:x}/"

    def fail(self, sched, step, exc, action, waiting):
        """Called with the exception that ended this rank's step number ``step`` while it ran
        ``action`` (name, micro-batch, stage); ``waiting``: in a wait for a peer. Returns the
        exception to raise: ``exc`` when this rank's own work raised, else one naming the
        stage that failed first and why."""
        name, mb, stage = action
        me = f"pipeline stage {stage} (pipeline rank {sched.rank})" if stage is not None else \
            f"pipeline rank {sched.rank}"
        # A KeyboardInterrupt or SystemExit is this rank's own, wherever it struck: published
        # (unless a peer's reason came first) and re-raised as it is.
        own = not isinstance(exc, Exception)
        reason = self.published(step) if waiting else None
        if reason is None:
            what = _ACTIONS.get(name, name or "the step")
            if mb is not None:
                what += f" of micro-batch {mb}"
            self._publish(step, f"{me} failed in {what}: {type(exc).__name__}: {exc}")
        if not (sched.p == 2 and isinstance(exc, _comm.ShapeMismatch)):
            try:
                self.group.abort()
            except Exception:  # noqa: BLE001 - a backend without abort: its peers time out
                pass
        if reason is None or own:
            return exc
        return _stopped_waiting(sched, me, reason)

    def failed_start(self, sched, step):
        """The error for a rank whose agreement to start step number ``step`` failed, naming
        the reason a peer published, or None when none did. A peer whose agreement had
        completed may have run ahead, failed and aborted the group while this rank still
        completed it (seen in a full test run): its reason is under ``step``; one that failed
        at the end of the previous step left it under ``step - 1``."""
        reason = self.published(step)
        if reason is not None:
            return _stopped_waiting(sched, f"pipeline rank {sched.rank}", reason)
        reason = self.published(step - 1)
        if reason is not None:
            return RuntimeError(f"{type(sched).__name__}: pipeline rank {sched.rank} cannot start a step: in the "
                                f"previous one, {reason}")
        return None

    def published(self, step):
        """The reason the first rank to fail in step ``step`` published, or None. A rank that
        has counted itself in but not yet written its reason is waited for, briefly."""
        if self.prefix is None:
            return None
        try:
            store = self._store()
            key = f"{self.prefix}{step}"
            if store.check([key]):
                return store.get(key).decode()
            if store.add(key + "/count", 0) == 0:
                return None
            store.wait([key], _REASON_WAIT)
            return store.get(key).decode()
        except Exception:  # noqa: BLE001 - the store itself gone: the caller reports its own error
            return None

    def _publish(self, step, reason):
        if self.prefix is None:
            return
        try:
            store = self._store()
            key = f"{self.prefix}{step}"
            if store.add(key + "/count", 1) == 1:  # the first to fail tells the others
                store.set(key, reason)
        except Exception:  # noqa: BLE001 - no store: the peers still fail, without the reason
            pass

    def _store(self):
        return dist.distributed_c10d._get_process_group_store(self.group)


def _stopped_waiting(sched, me, reason):
    return RuntimeError(f"{type(sched).__name__}: {me} stopped waiting for its peers because {reason}")


class ShardedPeers:
    """A rank's ``fully_shard`` stages (``modules``) and their data-parallel peers, the same
    stages in the other pipelines, across a failed step.

    A failure before the step's actions start (bad input, the pipeline's agreement) is agreed on
    with those peers (``agree_to_start``: one all-reduce of flags over each group the units
    shard or replicate over, every step, at the same point on every rank), so every peer raises and nothing
    is left waiting: the groups go on. Once the actions run, a peer may be waiting in a unit's
    all-gather or reduce-scatter for this rank, which cannot issue the rest of its step's
    collectives in their order. So a failure from there on aborts those groups, with the
    failure as the reason (``aborted_on_failure``): each of the peers' pending and later
    collectives there fails at once with "the group was aborted by rank R: <the failure>" (their
    pipelines then fail as this one did), instead of waiting until the group's timeout or
    pairing with this rank's next step's collectives. The groups are unusable afterwards, as the
    pipeline group is. Only a torchpar group's abort reaches the peers (and, on GPU, not those in
    an NCCL kernel): other backends' groups are left as they are (docs/pipeline.md, "Missing /
    limits")."""

    def __init__(self, sched, modules):
        self.sched = sched
        self.modules = modules
        self.groups = fully_shard_groups(modules)
        # Aborted on failure: those, and the groups the units' backward gathers their post-forward
        # slices in (reshard_after_forward=N). Those are subsets of the shard groups, whose
        # agreement already reaches all their members: they take no part in agree_to_start.
        self.aborted = fully_shard_groups(modules, post_forward=True)
        self.started = False

    def agree_to_start(self, failed):
        """Called once a step by every rank with fully_shard stages, after the pipeline's
        agreement (``failed``: this rank's step fails before its actions). Raises when a peer's
        did; from here on a failure aborts the groups."""
        if not self.groups:
            return
        self.started = True  # a failure inside the agreement itself may leave peers in it
        peers = agree_on_outcome(list(self.groups.values()), failed)
        self.started = not failed and not peers
        if peers and not failed:
            raise RuntimeError(f"{type(self.sched).__name__}: pipeline rank {self.sched.rank}: the step failed to "
                               f"start on its data-parallel peer(s) {', '.join(f'rank {r}' for r in peers)} (their "
                               f"error says why); nothing ran")

    @contextlib.contextmanager
    def aborted_on_failure(self):
        try:
            yield
        except BaseException as e:  # Ctrl-C too: the peers must not wait
            if self.started:
                self.started = False
                reason = clip_reason(f"{type(e).__name__}: {e}") + (
                    f" [the step of {type(self.sched).__name__}'s pipeline rank {self.sched.rank} (global rank "
                    f"{dist.get_rank()}) failed; the groups its fully_shard stages shard over are aborted: make new ones]")
                for group, _ in self.aborted.values():
                    abort_with_reason(group, reason)
            raise


def fully_shard_groups(modules, post_forward=False):
    """{id: (group, device of a flag sent over it)}: the groups of more than one rank that the
    fully_shard ``modules`` shard over and, under hybrid sharding, replicate over; with
    ``post_forward``, also those their backward gathers in (reshard_after_forward=N), which a
    failed rank aborts with the others."""
    groups = {}
    for m in modules:
        device = m._fsdp.sharded[0].device if m._fsdp.sharded else torch.device("cpu")
        extra = (m._fsdp.flat.post_forward_group,) if post_forward else ()
        for group in (m._fsdp.group, m._fsdp.replicate_group) + extra:
            if group is not None and dist.get_world_size(group) > 1:
                groups.setdefault(id(group), (group, device))
    return groups


def clip_reason(text, limit=700):
    """``text``, its middle cut out past ``limit`` characters: an abort's reason travels in 1 KiB,
    and a chained failure's first cause (the start) and its innermost (the end) both matter."""
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


def abort_with_reason(group, reason):
    """Aborts ``group`` where that reaches its other ranks (torchpar): their pending and later
    operations fail with "the group was aborted by rank R: ``reason``". Other backends' groups
    are left alone (their abort does not reach the peers). Returns whether the group is
    torchpar's (its peers are reached). Never raises: the caller is on an error path, whose own
    error is the one to raise."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - no CPU backend (an NCCL-only group)
        return False
    if not isinstance(backend, getattr(_C, "ProcessGroupTorchpar", ())):
        return False
    try:
        backend.abort(reason)
    except Exception:  # noqa: BLE001 - already shut down: its peers learn of it otherwise
        pass
    return True


def agree_on_outcome(groups, failed):
    """Tells the data-parallel peers in ``groups`` ((group, device) pairs: the flags go on the
    device the group reduces the stage's gradients on, which an NCCL group needs) whether this
    rank's step failed, and learns whether theirs did: the global ranks that failed. Every rank
    of each group calls it once per step of its DDP stages, from the error path or after the
    schedule ran, with the groups in the same order.

    One all-reduce (max) per group of a flag per global rank, each carrying what the groups before
    it told: through a hybrid-sharded stage's shard group and then its replicate group, a failure
    reaches the ranks that share neither group with the failed one (review finding: one exchange
    per group left them starting their actions)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
    if failed:
        flags[dist.get_rank()] = 1
    for group, device in groups:
        flags = flags.to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [r for r, f in enumerate(flags.cpu().tolist()) if f]
