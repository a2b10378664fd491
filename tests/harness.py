"""A pool of rank processes that run test functions under torch.distributed.

Starting a Python process that imports torch costs about a second, so the pool starts
``world_size`` ranks once and runs many test functions in them. Each rank holds a
``torchpar`` default group and a ``gloo`` group over the same ranks (the oracle).

A test function is a module-level function ``fn(ctx, *args)``; ``ctx`` has ``rank``,
``world_size``, ``pg`` (torchpar) and ``gloo``. ``pool.run(fn, *args)`` returns the
per-rank results or raises with the failing rank's traceback. A call that does not finish
within its timeout tears the pool down (the next call starts a fresh one).
"""
import collections
import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

DEFAULT_TIMEOUT = 60.0


@dataclass
class RankContext:
    rank: int
    world_size: int
    pg: object = None
    gloo: object = None


# Small internal buffers, so that modest test tensors already cross every chunk, slot and
# ring boundary, on either transport (the defaults are megabytes).
SMALL_BUFFERS = {
    "TORCHPAR_SHM_SLOT_BYTES": "64K",
    "TORCHPAR_SHM_RING_BYTES": "16K",
    "TORCHPAR_ONESHOT_MAX_BYTES": "16K",
    "TORCHPAR_P2P_CHUNK_BYTES": "8K",
}


# Every multi-process suite runs on both transports; "tcp" puts sockets between ranks of one
# host, as between hosts.
TRANSPORTS = ["shm", "tcp"]


def transport_env(transport, env=None):
    """``env`` plus the setting that picks ``transport``."""
    return {**(env or {}), "TORCHPAR_TRANSPORT": transport}


def _stack_file(init_file, rank):
    return f"{init_file}.stack-{rank}"


def _dump_stacks_on_request(stack_file):
    """A rank that does not answer in time is asked (SIGUSR1) for every thread's Python stack,
    so a rare hang in CI says where it hung (a failure that said only "no answer within 60s"
    could not be told from a slow machine). Crashes print their traceback too."""
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=True)


def _native_stacks(pids):
    """Per pid, one line per thread: its innermost native frames (a hang inside C++ shows no
    Python frame beyond the call that entered it), where gdb is installed; gdb attaches to all
    of them at once, within 30 s. Kept short, since CI shows only the tail of a failed run."""
    if shutil.which("gdb") is None:
        return {pid: "  (no gdb on this machine: native stacks not taken)" for pid in pids}
    gdbs = {pid: subprocess.Popen(["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 12"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for pid in pids}
    deadline, out = time.monotonic() + 30, {}
    for pid, gdb in gdbs.items():
        try:
            text = gdb.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            gdb.kill()
            gdb.communicate()
            out[pid] = "  (gdb did not finish within 30 s)"
            continue
        threads = []
        for line in text.splitlines():
            if line.startswith("Thread "):
                threads.append([line.split('"')[1] if '"' in line else line.split()[1]])
            elif line.startswith("#") and threads:
                words = line.split()
                name = words[3] if len(words) > 3 and words[2] == "in" else words[1]
                if not name.startswith(("_Py", "Py", "cfunction", "method_vectorcall", "__")):
                    threads[-1].append(name)
        out[pid] = "\n".join(f"  {t[0]}: " + " < ".join(t[1:9]) for t in threads)
    return out


def stacks_of(procs, ranks, init_file):
    """The Python and native stacks of ``ranks`` (still running), for a timeout's message.

    Never raises: its callers kill the late ranks after it, and a failure to take stacks must
    not leave them running."""
    try:
        return _stacks_of(procs, ranks, init_file)
    except Exception as e:  # noqa: BLE001
        return f"(stacks not taken: {e!r})"


def _stacks_of(procs, ranks, init_file):
    for rank in ranks:
        try:
            os.kill(procs[rank].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(2)
    native = _native_stacks([procs[rank].pid for rank in ranks])
    parts = []
    for rank in ranks:
        try:
            with open(_stack_file(init_file, rank)) as f:
                py = f.read() or "(no Python stack written)"
        except OSError:
            py = "(no Python stack file)"
        parts.append(f"--- rank {rank} (pid {procs[rank].pid}): Python stacks ---\n{py}"
                     f"--- rank {rank}: native stacks ---\n{native[procs[rank].pid]}")
    return "\n".join(parts)


def _worker(rank, world_size, init_file, backend, conn, pg_timeout, env):
    os.environ.update(env or {})
    _dump_stacks_on_request(_stack_file(init_file, rank))
    import torch.distributed as dist
    import torchpar  # noqa: F401

    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        ctx = RankContext(rank, world_size, dist.group.WORLD,
                          dist.new_group(backend="gloo", timeout=timedelta(seconds=pg_timeout)))
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            result = ("ok", fn(ctx, *args))
        except BaseException:  # noqa: BLE001
            result = ("err", traceback.format_exc())
        conn.send((*result, _issued(ctx.pg)))
    dist.destroy_process_group()
    # Leave without the interpreter's finalisation (the groups are destroyed already): dozens of
    # ranks tearing torch down at once at a session's end took 3-5 s each on two cores, 19 s of
    # every make test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _issued(pg):
    """How many collectives this rank has issued on the pool's torchpar group (c10d's sequence
    number; gloo's counts sends and receives too, which differ between ranks by design)."""
    import torch
    import torch.distributed as dist
    if dist.get_backend(pg) != "torchpar":
        return None
    return pg._get_backend(torch.device("cpu"))._get_sequence_number_for_group()


class RankPool:
    def __init__(self, world_size, backend="torchpar", pg_timeout=30.0, env=None):
        self.world_size = world_size
        self.env = dict(env or {})
        self.backend = backend
        self.pg_timeout = pg_timeout
        self.procs = []
        self.conns = []
        self._tmp = tempfile.TemporaryDirectory(prefix="torchpar-test-")
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        init_file = self.init_file = os.path.join(self._tmp.name, f"init-{os.getpid()}-{id(self)}")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world_size, init_file, self.backend,
                                                  child, self.pg_timeout, self.env), daemon=True)
            p.start()
            child.close()  # only the rank holds its end: its death then reads as EOF here
            self.procs.append(p)
            self.conns.append(parent)
        self._collect(DEFAULT_TIMEOUT * 2, "start-up")

    def _collect(self, timeout, what):
        results, errors, issued = [None] * self.world_size, [], [None] * self.world_size
        for rank, conn in enumerate(self.conns):
            if not conn.poll(timeout):
                late = [r for r in range(rank, self.world_size) if not self.conns[r].poll(0)]
                stacks = stacks_of(self.procs, late, self.init_file)
                self.close(kill=True)
                raise TimeoutError(f"rank {rank} did not finish {what} within {timeout:.0f}s\n{stacks}")
            try:
                status, value, *rest = conn.recv()
            except EOFError:
                self.close(kill=True)
                raise RuntimeError(f"rank {rank} died during {what}") from None
            issued[rank] = rest[0] if rest else None
            if status == "ok" or status == "ready":
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        broken = [e for e in errors if "[the group is no longer usable]" in e]
        if len(set(issued)) > 1 or broken:
            # A test that leaves its ranks out of step (one issued a collective the others did
            # not) or the group failed would make every later test of this pool fail, or
            # worse, pair one test's collective with another's of the same size. Fail here,
            # naming it, and start the next test on a fresh pool.
            self.close(kill=True)
            if not broken:
                errors.append(f"{what} left the ranks out of step: collectives issued per rank {issued}")
        if errors:
            raise AssertionError(f"{what} failed:\n" + "\n".join(errors))
        return results

    def run(self, fn, *args, timeout=DEFAULT_TIMEOUT):
        if not self.procs:  # closed (a failed test's guard): get_pool() starts a fresh one
            raise RuntimeError(f"{fn.__name__}: this rank pool was closed; call get_pool() again")
        for conn in self.conns:
            conn.send((fn, args))
        return self._collect(timeout, fn.__name__)

    @property
    def alive(self):
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def close(self, kill=False):
        self._ask_to_exit(kill)
        self._reap(time.monotonic() + (0 if kill else 10))

    def _ask_to_exit(self, kill=False):
        for conn in self.conns:
            try:
                if not kill:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass

    def _reap(self, deadline):
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self.procs, self.conns = [], []


_pools = collections.OrderedDict()  # least recently used first
# Rank processes kept alive at once. Each holds ~0.4 GB once it has run tests, and the session
# makes some 20 pools (world sizes x backends x environments): kept all, they reached 21 GB of
# the machine's 23 by 60 % of make test (a run was OOM-killed at 81 %). Beyond this many, the
# least recently used pools are closed; one asked for again is started afresh (a few seconds).
MAX_LIVE_RANKS = int(os.environ.get("TORCHPAR_TEST_MAX_RANKS", "24"))


def get_pool(world_size, backend="torchpar", env=None):
    """A pool shared by all tests of the session; restarted if a previous test broke it, or if it
    was closed to keep at most MAX_LIVE_RANKS rank processes. ``env`` (e.g. SMALL_BUFFERS) is set
    in the ranks before their groups are created."""
    key = (world_size, backend, tuple(sorted((env or {}).items())))
    pool = _pools.get(key)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close(kill=True)
            del _pools[key]
        _make_room(world_size)
        pool = _pools[key] = RankPool(world_size, backend, env=env)
    _pools.move_to_end(key)
    return pool


def _make_room(world_size):
    live = sum(len(p.procs) for p in _pools.values())
    while _pools and live + world_size > MAX_LIVE_RANKS:
        _, oldest = _pools.popitem(last=False)
        live -= len(oldest.procs)
        oldest.close()


def close_pools():
    """Every pool is asked to exit first, then reaped against one deadline: closing them one
    after the other cost up to 10 s each at the end of a session (90 s under load)."""
    for pool in _pools.values():
        pool._ask_to_exit()
    deadline = time.monotonic() + 10
    for pool in _pools.values():
        pool._reap(deadline)
    _pools.clear()


def spawn(fn, world_size, *args, timeout=DEFAULT_TIMEOUT, env=None):
    """Run ``fn(rank, world_size, init_file, *args)`` in fresh processes (no process group
    is created for it), for tests of initialisation, teardown and failures, with ``env``
    set in them. Returns each rank's result, or raises with the tracebacks of the ranks
    that failed."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="torchpar-spawn-") as tmp:
        init_file = os.path.join(tmp, "init")
        conns, procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_spawned, args=(fn, rank, world_size, init_file, args, child, env),
                            daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        results, errors, late = [None] * world_size, [], []
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                late.append(rank)
                errors.append(f"--- rank {rank} --- no answer within {timeout:.0f}s")
                continue
            try:
                status, value = conn.recv()
            except EOFError:
                results[rank] = "died"
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if late:
            errors.append(stacks_of(procs, late, init_file))
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if errors:
            raise AssertionError("\n".join(errors))
        return results


def _spawned(fn, rank, world_size, init_file, args, conn, env):
    os.environ.update(env or {})
    _dump_stacks_on_request(_stack_file(init_file, rank))
    try:
        conn.send(("ok", fn(rank, world_size, init_file, *args)))
    except BaseException:  # noqa: BLE001
        conn.send(("err", traceback.format_exc()))
