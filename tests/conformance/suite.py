"""One configuration of PyTorch's distributed_test.py, run in this process (issue 23).

Run by run.py, one process per (mode, world size, transport); reads its configuration from
the environment the way PyTorch's own runner hands it over (BACKEND, WORLD_SIZE, TEMP_DIR,
INIT_METHOD) plus CONFORMANCE_MODE:

- ``plugin``: BACKEND=torchpar, as PyTorch runs an out-of-tree backend. torchpar is added to
  ``DistTestCases.backend_feature`` for what it implements, so the cases gated on those
  features run; cases gated on ``BACKEND == "gloo"`` do not.
- ``gloo-as-torchpar``: BACKEND=gloo, but every group asked for as "gloo" is created as
  "torchpar" (init_process_group / new_group patched), so gloo's own cases run on torchpar.
- ``gloo``: plain gloo, the oracle the two above are compared with.

Ranks are forked from this process, not spawned: a spawned rank re-imports torch and the
11 000-line test module for every case (seconds each on a loaded 2-core machine), which
would make the suite take hours. Everything else (the test class, its set-up, barriers,
timeouts, skip codes) is PyTorch's, unchanged.

Writes {case: {"outcome", "message", "seconds"}} as JSON to the path in argv[1].
"""
import json
import os
import sys
import time
import traceback
import unittest

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

MODE = os.environ["CONFORMANCE_MODE"]
if MODE != "gloo":
    import torchpar  # noqa: F401  (registers the backend)


def _as_torchpar(backend):
    """"gloo" (in any spelling torch accepts) -> "torchpar"; anything else unchanged."""
    if backend is None:
        return None
    text = str(backend)
    if text.lower() == "gloo":
        return "torchpar"
    if ":" in text:  # "cpu:gloo,cuda:nccl"
        return ",".join(
            f"{dev}:{'torchpar' if b.lower() == 'gloo' else b}"
            for dev, b in (part.split(":") for part in text.split(","))
        )
    return backend


def _patch_gloo_to_torchpar():
    for name in ("init_process_group", "new_group"):
        original = getattr(c10d, name)

        def patched(*args, _original=original, _name=name, **kwargs):
            if "backend" in kwargs:
                kwargs["backend"] = _as_torchpar(kwargs["backend"])
            elif _name == "init_process_group" and args:
                args = (_as_torchpar(args[0]),) + args[1:]
            elif _name == "new_group" and len(args) >= 3:
                args = args[:2] + (_as_torchpar(args[2]),) + args[3:]
            return _original(*args, **kwargs)

        patched.__wrapped__ = original
        # Both: the tests call dist.new_group, c10d's helpers (new_subgroups ...) the module's.
        setattr(c10d, name, patched)
        setattr(dist, name, patched)
    # torch's dist.monitored_barrier refuses any group whose backend is not named "gloo";
    # torchpar.monitored_barrier reaches the same c10d call on a torchpar group. (The tests
    # that call group.monitored_barrier reach torchpar's C++ monitoredBarrier unpatched.)
    if hasattr(torchpar, "monitored_barrier"):  # absent before issue 23 (before/after runs)
        dist.monitored_barrier = torchpar.monitored_barrier


if MODE == "gloo-as-torchpar":
    _patch_gloo_to_torchpar()

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if MODE == "plugin":
    # What torchpar implements, as an out-of-tree backend declares it (CPU only here).
    for feature in ("plugin", "subgroup", "ddp"):
        DistTestCases.backend_feature[feature].add("torchpar")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithFork(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


class _Recorder(unittest.TestResult):
    def __init__(self, out, log):
        super().__init__()
        self.out, self.log, self._t0 = out, log, 0.0

    def startTest(self, test):
        super().startTest(test)
        self._t0 = time.monotonic()

    def _put(self, test, outcome, message=""):
        name = test.id().split(".")[-1]
        secs = round(time.monotonic() - self._t0, 2)
        self.out[name] = {"outcome": outcome, "message": message, "seconds": secs}
        print(f"{outcome:5s} {secs:6.1f}s {name}", file=self.log, flush=True)

    def addSuccess(self, test):
        self._put(test, "pass")

    def addSkip(self, test, reason):
        self._put(test, "skip", str(reason)[:300])

    def addFailure(self, test, err):
        self._put(test, "fail", _last_lines(err))

    def addError(self, test, err):
        self._put(test, "fail", _last_lines(err))

    def addExpectedFailure(self, test, err):
        self._put(test, "pass")

    def addUnexpectedSuccess(self, test):
        self._put(test, "fail", "unexpected success")


def _last_lines(err):
    text = "".join(traceback.format_exception(*err)).strip().splitlines()
    # The child's exception sits at the end of the parent's report.
    wanted = [line for line in text if "Error" in line or "Exception" in line or "Timed" in line]
    return " | ".join((wanted or text)[-3:])[:600]


def main(argv):
    out_path = argv[1]
    only = set(argv[2].split(",")) if len(argv) > 2 and argv[2] else None
    names = unittest.TestLoader().getTestCaseNames(TestDistBackendWithFork)
    if only is not None:
        names = [n for n in names if n in only]
    suite = unittest.TestSuite(TestDistBackendWithFork(n) for n in names)
    results = {}
    suite.run(_Recorder(results, sys.stdout))
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv)
