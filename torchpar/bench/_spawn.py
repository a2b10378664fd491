"""Shared by the benchmark suites whose ranks run in processes of their own: start them, take
rank 0's result from a queue, and never wait past a timeout for a rank that hung or died."""
import faulthandler
import os
import signal
import tempfile

import torch.multiprocessing as mp


def run_ranks(target, world_size, before, after, timeout, label):
    """Spawn ``world_size`` processes running ``target(rank, *before, init_file, *after, queue)``
    (``init_file`` a fresh ``file://`` rendezvous path) and return the value rank 0 put on the
    queue as ``("ok", value)``; raise naming ``label`` on ``("err", why)`` or after ``timeout``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="torchpar-bench-") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank_main, args=(target, r, *before, init_file, *after, queue))
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


def _rank_main(target, *args):
    # A rank that dies in native code leaves no Python traceback; with faulthandler it prints
    # where each thread was, and _exits names the signal.
    faulthandler.enable()
    target(*args)


def _exits(procs):
    """How each rank process ended, for the error: a rank killed by a signal says nothing else."""
    def how(code):
        if code is None:
            return "still running (killed)"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"
    return " [" + "; ".join(f"rank {r}: {how(p.exitcode)}" for r, p in enumerate(procs)) + "]"
