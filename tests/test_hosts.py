"""torchpar across hosts (issue 21): jobs over network namespaces joined by a bridge
(torchpar/bench/_hosts.py), launched by torchrun with the c10d rendezvous as on real machines, and
the faults a multi-host job meets: a rank killed mid-collective, a restart after it, a host
whose link goes down. The ranks run tests/hosts_worker.py; the hosts are those of
torchpar/bench/_hosts.py (as for ``python -m torchpar.bench collectives --hosts N``). Needs
root; skips saying why otherwise. docs/hosts.md describes the set-up.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from harness import SMALL_BUFFERS
from torchpar.bench._hosts import Hosts, start_ranks, worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "hosts_worker.py")
RDZV_PORT = 29400   # each host is a namespace of its own: no other job shares its ports


@pytest.fixture(scope="module")
def can_make_hosts():
    why = Hosts.unavailable()
    if why:
        pytest.skip(f"no test hosts: {why}")


def _env(**extra):
    # Small chunks and slots: modest tensors cross every boundary.
    return worker_env(**SMALL_BUFFERS, **{"HOSTS_TIMEOUT": "30", **extra})


def _torchrun(hosts, nprocs, mode, tmp_path, max_restarts=0, argv=None, **env):
    """One torchrun per host (hosts[i] runs nprocs[i] ranks), c10d rendezvous on host 0, each
    rank running the worker in ``mode`` (or ``argv``: a script and its arguments)."""
    procs = []
    for h, nproc in zip(hosts, nprocs):
        # is_host: torchrun guesses whether it should host the rendezvous store from its
        # hostname's addresses, which the namespaces' eth0 addresses are not.
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nprocs)}",
               f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={hosts[0].address}:{RDZV_PORT}", f"--rdzv-id=hosts-{os.getpid()}",
               f"--rdzv-conf=is_host={int(h is hosts[0])}",
               f"--local-addr={h.address}", f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
               *(argv or [WORKER, mode])]
        log = open(tmp_path / f"{h.netns}.log", "w+")
        procs.append((h.popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(**env)), log))
    return procs


def _start_ranks(hosts, nprocs, mode, tmp_path, **env):
    """The ranks started directly (no torchrun agent to kill the survivors of a fault)."""
    logs = [open(tmp_path / f"rank{rank}.log", "w+") for rank in range(sum(nprocs))]
    procs = start_ranks(hosts, nprocs, [sys.executable, WORKER, mode], _env(**env), output=lambda rank: logs[rank])
    return list(zip(procs, logs))


def _wait(procs, timeout):
    """Waits for every process; returns (exit statuses, everything they printed)."""
    deadline = time.monotonic() + timeout
    codes = []
    for p, _ in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)  # still running: the fixture kills it
    text = ""
    for _, log in procs:
        log.seek(0)
        text += log.read()
    return codes, text


def _lines(text, word):
    return [line.split() for line in text.splitlines() if line.startswith(f"HOSTS {word} ")]


def _wait_for(procs, word, count, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = ""
        for _, log in procs:
            log.seek(0)
            text += log.read()
        if len(_lines(text, word)) >= count:
            return text
        if all(p.poll() is not None for p, _ in procs):
            break
        time.sleep(0.2)
    raise AssertionError(f"fewer than {count} '{word}' lines:\n{text[-4000:]}")


def _leftover_segments(pids):
    """torchpar's /dev/shm segments made by any of `pids` (names: /torchpar-<pid>-...)."""
    return [f for f in os.listdir("/dev/shm") if any(f.startswith(f"torchpar-{pid}-") for pid in pids)]


def _run_suite(nprocs, tmp_path, timeout):
    with Hosts(len(nprocs)) as hosts:
        codes, text = _wait(_torchrun(hosts, nprocs, "suite", tmp_path), timeout)
    assert codes == [0] * len(nprocs), f"torchrun exit statuses {codes}:\n{text[-6000:]}"
    assert sorted(int(w[2]) for w in _lines(text, "suite-ok")) == list(range(sum(nprocs))), text[-6000:]
    # all_gather_into_tensor and reduce_scatter_tensor, in stages and pipelined, every dtype.
    assert sorted(int(w[2]) for w in _lines(text, "gather-scatter-ok")) == list(range(sum(nprocs))), text[-6000:]
    refused = sorted(int(w[2]) for w in _lines(text, "shm-refused"))
    assert refused == [0, sum(nprocs) - 1], text[-6000:]
    # Every rank checked that its host's peers use shared memory inside the world group.
    local = sorted((int(w[2]), int(w[4])) for w in _lines(text, "mixed-ok"))
    assert [r for r, _ in local] == list(range(sum(nprocs))), text[-6000:]
    assert sorted(n for _, n in local) == sorted(n for n in nprocs for _ in range(n)), text[-6000:]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_torchrun_two_hosts_two_ranks_each(can_make_hosts, tmp_path):
    """torchrun --nnodes=2 --nproc-per-node=2, c10d rendezvous: every collective against its
    exact value, a sub-group over part of each host, per-host groups on shared memory, TCP
    between the hosts, TORCHPAR_TRANSPORT=shm refused across them, DDP equal to one process."""
    _run_suite([2, 2], tmp_path, timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_torchrun_three_hosts_uneven_ranks(can_make_hosts, tmp_path):
    """Three hosts with 2, 1 and 1 ranks (each torchrun its own --nproc-per-node)."""
    _run_suite([2, 1, 1], tmp_path, timeout=300)


def _final_losses(text):
    m = re.search(r"final train loss ([0-9.]+), validation loss ([0-9.]+)", text)
    assert m, text[-6000:]
    return float(m.group(1)), float(m.group(2))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gpt_example_across_two_hosts_saves_a_checkpoint_one_process_resumes(can_make_hosts, tmp_path):
    """examples/train_gpt.py under torchrun --nnodes=2 --nproc-per-node=2 at dp 2 x tp 2 (tensor
    parallelism inside each host, the data-parallel average between them, as Megatron places
    them), 4 steps then a checkpoint written by the ranks of both hosts; one process resumes it
    for 2 more steps: the final losses of 6 steps in one process."""
    script = os.path.join(ROOT, "examples", "train_gpt.py")
    ckpt = str(tmp_path / "ckpt")
    # Inside the warm-up throughout: the learning rate of a step does not depend on --steps.
    common = ["--model", "tiny", "--batch-size", "8", "--warmup", "10", "--eval-every", "100", "--no-progress",
              "--out", str(tmp_path / "out")]
    argv = [script, "--dp", "2", "--tp", "2", *common, "--steps", "4", "--save", ckpt]
    with Hosts(2) as hosts:
        codes, text = _wait(_torchrun(hosts, [2, 2], None, tmp_path, argv=argv), 300)
    assert codes == [0, 0], f"torchrun exit statuses {codes}:\n{text[-6000:]}"
    assert "4 steps in" in text and open(os.path.join(ckpt, "latest")).read().strip() == "step_4", text[-6000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = lambda *extra: subprocess.run([sys.executable, script, *common, *extra], capture_output=True, text=True,
                                        timeout=120, env=env)
    resumed, whole = run("--steps", "6", "--resume", ckpt), run("--steps", "6")
    assert resumed.returncode == 0 and "2 steps in" in resumed.stdout, resumed.stdout + resumed.stderr
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert _final_losses(resumed.stdout) == pytest.approx(_final_losses(whole.stdout), rel=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rank_killed_mid_collective_fails_every_host(can_make_hosts, tmp_path):
    """SIGKILL of rank 3 (host 1) inside an all-reduce: ranks 0 and 1 (host 0) and rank 2
    (host 1) raise within the group timeout naming rank 3 (host 0's ranks: and its host),
    and /dev/shm keeps nothing."""
    timeout = 20
    with Hosts(2) as hosts:
        procs = _start_ranks(hosts, [2, 2], "loop", tmp_path, HOSTS_TIMEOUT=timeout, KILL_RANK=3,
                             KILL_AFTER_S=0.5)
        codes, text = _wait(procs, timeout=90)
        pids = [int(w[4]) for w in _lines(text, "ready")]
    assert None not in codes, f"ranks still running 90 s after the kill (exit statuses {codes}):\n{text[-6000:]}"
    assert codes[3] == -9, text[-6000:]
    killed_at = float(_lines(text, "killing")[0][4])
    raised = {int(w[2]): (float(w[4]), " ".join(w[6:])) for w in _lines(text, "raised")}
    assert sorted(raised) == [0, 1, 2], f"ranks that raised: {sorted(raised)}\n{text[-6000:]}"
    for rank, (at, message) in raised.items():
        assert at - killed_at < timeout, f"rank {rank} raised {at - killed_at:.1f} s after the kill"
        assert re.search(r"\brank 3\b", message), f"rank {rank}'s error does not name rank 3: {message}"
        if rank in (0, 1):  # host 0: the dead rank's host is named too
            assert re.search(r"\branks? [0-9, ]*\b3\b[0-9, ]* on host 1 \(ranks 2, 3\)", message), \
                f"rank {rank}'s error does not say rank 3 is on host 1: {message}"
    assert len(pids) == 4 and _leftover_segments(pids) == []


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_torchrun_restart_after_a_kill_finishes_the_job(can_make_hosts, tmp_path):
    """torchrun --max-restarts=1: the first attempt loses rank 3 mid-collective, the agents
    form the group again and the second attempt finishes on every rank."""
    with Hosts(2) as hosts:
        codes, text = _wait(_torchrun(hosts, [2, 2], "restart", tmp_path, max_restarts=1, HOSTS_TIMEOUT=20,
                                      KILL_RANK=3, KILL_AFTER_S=0.5, KILL_MARKER=tmp_path / "killed"),
                            timeout=420)
    assert codes == [0, 0], f"torchrun exit statuses {codes}:\n{text[-6000:]}"
    assert len(_lines(text, "killing")) == 1, text[-6000:]
    done = _lines(text, "restart-ok")
    assert sorted(int(w[2]) for w in done) == [0, 1, 2, 3], text[-6000:]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_host_whose_link_goes_down_fails_the_others_within_the_timeout(can_make_hosts, tmp_path):
    """Host 1's link goes down (no FIN, no RST: its packets just stop) while ranks all-reduce:
    the ranks on host 0 raise within the group timeout, not after TCP keep-alive's hours."""
    timeout = 15
    with Hosts(2) as hosts:
        procs = _start_ranks(hosts, [2, 2], "loop", tmp_path, HOSTS_TIMEOUT=timeout)
        _wait_for(procs, "ready", 4, timeout=90)
        time.sleep(0.5)
        down_at = time.time()
        hosts[1].link_down()
        codes, text = _wait(procs[:2], timeout=timeout + 30)
        raised = {int(w[2]): (float(w[4]), " ".join(w[6:])) for w in _lines(text, "raised")}
        assert None not in codes and sorted(raised) == [0, 1], \
            f"host 0's ranks (exit statuses {codes}) did not all raise:\n{text[-6000:]}"
        for rank, (at, message) in raised.items():
            assert at - down_at < timeout + 5, f"rank {rank} raised {at - down_at:.1f} s after the link went down"
            # Every survivor names the host that went silent, through the rank of it that host
            # 0 waited on over TCP (rank 2 from the leaders, rank 2 or 3 from the rails: the
            # first rail to time out aborts host 0's arena), not only the host-local rank it
            # was waiting for.
            assert re.search(r"\brank [23] on host 1 \(ranks 2, 3\)", message), \
                f"rank {rank}'s error does not name host 1: {raised}"
        # Host 1's ranks are cut off from the store and from host 0: they must end too.
        codes, text = _wait(procs[2:], timeout=timeout + 30)
        assert None not in codes, f"host 1's ranks still running (exit statuses {codes}):\n{text[-6000:]}"
