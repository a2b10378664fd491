"""Shared by the benchmark suites whose ranks run in processes of their own: start them, each
in the default group of a fresh rendezvous, take rank 0's result, and never wait past a timeout
for a rank that hung or died."""
import faulthandler
import os
import signal
import tempfile
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(measure, world_size, backend, args=(), *, timeout, label, env=None, pg_timeout=None):
    """Spawn ``world_size`` processes; each sets ``env``, joins a default group over ``backend``
    (a fresh ``file://`` rendezvous; ``pg_timeout`` seconds: the group's timeout), runs
    ``measure(rank, *args)`` and leaves the group. Returns what rank 0's ``measure`` returned;
    raises naming ``label`` when a rank raised, died, or rank 0 gave nothing within ``timeout``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="torchpar-bench-") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank_main,
                             args=(measure, r, world_size, backend, init_file, args, env, pg_timeout, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            status, value = queue.get(timeout=timeout)
        except Exception:  # noqa: BLE001 - queue.Empty: a rank hung or died
            status, value = "err", f"no result within {timeout}s"
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if status != "ok":
        raise RuntimeError(f"{label}: {value}{_exits(procs)}")
    return value


def _rank_main(measure, rank, world_size, backend, init_file, args, env, pg_timeout, queue):
    # A rank that dies in native code leaves no Python traceback; with faulthandler it prints
    # where each thread was, and _exits names the signal.
    faulthandler.enable()
    os.environ.update(env or {})
    import torchpar  # noqa: F401  (registers the torchpar backend)
    timeout = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            **timeout)
    try:
        value = measure(rank, *args)
        if rank == 0:
            queue.put(("ok", value))
    except BaseException as e:  # noqa: BLE001 - the parent prints it
        queue.put(("err", f"rank {rank}: {e!r}"))
        raise
    finally:
        dist.destroy_process_group()


def _exits(procs):
    """How each rank process ended, for the error: a rank killed by a signal says nothing else."""
    def how(code):
        if code is None:
            return "still running (killed)"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"
    return " [" + "; ".join(f"rank {r}: {how(p.exitcode)}" for r, p in enumerate(procs)) + "]"
