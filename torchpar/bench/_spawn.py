"""Shared by the benchmark suites whose ranks run in processes of their own: start them, take
rank 0's result from a queue, and never wait past a timeout for a rank that hung or died."""
import os
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
        procs = [ctx.Process(target=target, args=(r, *before, init_file, *after, queue))
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
    if status != "ok":
        raise RuntimeError(f"{label}: {value}")
    return value
