"""Test hosts on one machine: Linux network namespaces joined through a bridge (issue 21), for
``python -m torchpar.bench collectives --hosts N`` and tests/test_hosts.py.

``Hosts(n)`` makes ``n`` namespaces, each with loopback up and one veth whose other end sits
in a bridge in the root namespace, addressed 10.77.0.1 ... 10.77.0.n on one /24. The hosts
share this machine's kernel, /dev/shm and pid namespace, but reach each other only through
the bridge, as separate machines on one switch do. Everything is removed on exit, on error
and (for a run that crashed) by the next run: names carry the creating process's pid, and
``Hosts`` first removes what a dead pid left behind.

    with Hosts(2) as hosts:
        p = hosts[0].popen(["python", "-c", "..."])   # runs under `ip netns exec`
        hosts[1].link_down()                           # the host drops off the network

``Hosts.unavailable()`` says why namespaces cannot be made here (not root, no `ip`, a
kernel that refuses), or None; the tests skip with that reason. ``start_ranks`` starts the
ranks of one job over the hosts, with the environment of ``torch.distributed``'s env://;
``run_job`` runs a benchmark's ranks that way and returns rank 0's results.
"""
import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

STORE_PORT = 29500  # MASTER_PORT on host 0: each host is a namespace of its own, no other job shares it
PREFIX = "tpn"            # every name made here starts with it (netns, bridge, veth)
SUBNET = "10.77.0"        # hosts are SUBNET.1 ... SUBNET.n; each bridge is an L2 domain of
                          # its own with no address in the root namespace, so runs side by
                          # side may reuse it


def _ip(*args, check=True, netns=None):
    cmd = ["ip"] + (["-n", netns] if netns else []) + list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name):
    """The pid in a name made here ("tpn<pid in hex>x<count>..."), or None for any other name."""
    if not name.startswith(PREFIX):
        return None
    digits = name[len(PREFIX):].split("x", 1)[0]
    try:
        return int(digits, 16)
    except ValueError:
        return None


def sweep_stale():
    """Removes the namespaces and bridges whose creating process has died (a crashed run)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = _owner(name)
        if pid is not None and not _pid_alive(pid):
            _kill_netns_pids(name)
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        pid = _owner(name)
        if pid is not None and not _pid_alive(pid):
            _ip("link", "del", name, check=False)


def _kill_netns_pids(netns):
    """SIGKILLs what still runs in `netns` (processes this test started there)."""
    out = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in out:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Host:
    def __init__(self, index, netns, veth, address):
        self.index = index
        self.netns = netns      # the namespace's name, for `ip netns exec`
        self.veth = veth        # the root-namespace end of its link, in the bridge
        self.address = address  # its IPv4 address on the bridge's subnet
        self.procs = []

    def cmd(self, argv):
        return ["ip", "netns", "exec", self.netns] + list(argv)

    def popen(self, argv, **kwargs):
        """Starts `argv` in this host, in a session of its own (so that it and its children
        can be killed together)."""
        p = subprocess.Popen(self.cmd(argv), start_new_session=True, **kwargs)
        self.procs.append(p)
        return p

    def run(self, argv, timeout=30, check=True):
        out = subprocess.run(self.cmd(argv), capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{argv} in {self.netns} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def link_down(self):
        """Cuts this host off the bridge: its link goes down at the bridge's end, as when a
        cable is pulled. Nothing is told to the processes on either side."""
        _ip("link", "set", self.veth, "down")

    def link_up(self):
        _ip("link", "set", self.veth, "up")

    def shape(self, rate="1gbit", burst="256kb", latency="10ms"):
        """A token-bucket filter on both ends of this host's link (egress each way)."""
        _ip("link", "show", self.veth)  # a clear error if the link is gone
        for netns, dev in ((None, self.veth), (self.netns, "eth0")):
            cmd = (["ip", "netns", "exec", netns] if netns else []) + \
                ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                 "latency", latency]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip()}")

    def stop(self):
        """Kills the process sessions started here, then anything left in the namespace."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        _kill_netns_pids(self.netns)


class Hosts:
    _made = itertools.count()

    def __init__(self, n):
        assert 1 <= n <= 9
        # "tpn<pid>x<count>": unique among live processes, and the pid tells a later run whether
        # the owner is gone. Interface names have at most 15 bytes: "tpn" + pid in hex (pid_max
        # is at most 2^22, 6 hex digits) + "x" + count + "b" or "v<i>".
        self.tag = f"{PREFIX}{os.getpid():x}x{next(Hosts._made) % 256:x}"
        self.bridge = f"{self.tag}b"
        self.hosts = [Host(i, f"{self.tag}h{i}", f"{self.tag}v{i}", f"{SUBNET}.{i + 1}") for i in range(n)]
        assert len(self.bridge) <= 15 and all(len(h.veth) <= 15 for h in self.hosts), self.tag

    @staticmethod
    def unavailable():
        """Why namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "network namespaces need root (ip netns add); this runs as uid %d" % os.geteuid()
        for tool in ("ip",):
            if shutil.which(tool) is None:
                return f"`{tool}` (iproute2) is not installed"
        probe = f"{PREFIX}{os.getpid():x}xp"
        out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            return f"the kernel refused `ip netns add`: {out.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
        out = subprocess.run(["ip", "link", "add", probe, "type", "bridge"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode != 0:
            return f"the kernel refused a bridge (`ip link add ... type bridge`): {out.stderr.strip()}"
        subprocess.run(["ip", "link", "del", probe], capture_output=True, timeout=30)
        return None

    def __enter__(self):
        sweep_stale()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def __getitem__(self, i):
        return self.hosts[i]

    def __len__(self):
        return len(self.hosts)

    def __iter__(self):
        return iter(self.hosts)

    def _make(self):
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _ip("link", "set", h.veth, "master", self.bridge)
            _ip("link", "set", h.veth, "up")
            _ip("link", "set", "lo", "up", netns=h.netns)
            _ip("addr", "add", f"{h.address}/24", "dev", "eth0", netns=h.netns)
            _ip("link", "set", "eth0", "up", netns=h.netns)
        # The links come up asynchronously: wait until every bridge port forwards (state 3)
        # and every host's end reports UP, so that the first packets are not lost.
        deadline = time.monotonic() + 10
        for h in self.hosts:
            while not self._ready(h):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the link of {h.netns} ({h.veth}) did not come up in 10 s")
                time.sleep(0.05)

    def _ready(self, h):
        try:
            with open(f"/sys/class/net/{h.veth}/brport/state") as f:
                forwarding = f.read().strip() == "3"
        except OSError:
            return False
        return forwarding and "state UP" in _ip("-o", "link", "show", "eth0", netns=h.netns).stdout

    def close(self):
        for h in self.hosts:
            h.stop()
        for h in self.hosts:
            _ip("netns", "del", h.netns, check=False)  # takes its veth pair with it
            _ip("link", "del", h.veth, check=False)
        _ip("link", "del", self.bridge, check=False)


def package_root():
    """The directory holding this torchpar package, for PYTHONPATH in the hosts' processes."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_env(**extra):
    """The environment of a process on a test host: this one's, with this torchpar first on
    PYTHONPATH, one OpenMP thread (several ranks share the cores), the transport chosen per
    group (shared memory within a namespace, TCP between), and gloo on the hosts' links
    (by default it takes the hostname, which every namespace shares and resolves to loopback)."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": package_root() + os.pathsep + env.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
                "TORCHPAR_TRANSPORT": "auto", "GLOO_SOCKET_IFNAME": "eth0"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start_ranks(hosts, nprocs, argv, env, output=lambda rank: subprocess.DEVNULL):
    """Starts one job's ranks, each running ``argv``: hosts[i] runs nprocs[i] of them, ranks
    numbered host by host, with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
    (host 0's address) and MASTER_PORT set over ``env``. ``output(rank)`` is where the rank's
    stdout and stderr go (a file, or subprocess.PIPE). Returns the processes in rank order."""
    world = sum(nprocs)
    procs, rank = [], 0
    for h, nproc in zip(hosts, nprocs):
        for local in range(nproc):
            e = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(nproc),
                     MASTER_ADDR=hosts[0].address, MASTER_PORT=str(STORE_PORT))
            procs.append(h.popen(argv, stdout=output(rank), stderr=subprocess.STDOUT, text=True, env=e))
            rank += 1
    return procs


def rate_bits(rate):
    """tc's rate ("1gbit", "500mbit", "100kbit") in bits per second."""
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)bit", rate.strip().lower())
    if not m:
        raise SystemExit(f"--rate {rate!r}: give it in tc's bit units, e.g. 1gbit or 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]


def check_options(links, rate):
    """Before any job runs: SystemExit when test hosts cannot be made here, or a link or the
    rate is not understood. Returns the rate in bits per second."""
    why = Hosts.unavailable()
    if why:
        raise SystemExit(f"no test hosts: {why}")
    for link in links:
        if link not in ("unshaped", "shaped"):
            raise SystemExit(f"--links: unshaped or shaped, not {link!r}")
    return rate_bits(rate)


def add_arguments(parser, ranks_per_host, note=""):
    """A benchmark's options for running across test hosts: ``--hosts``, ``--ranks-per-host``,
    ``--rate``, ``--links``, and the hidden ``--worker-results`` of ``run_job``'s ranks.
    Returns the argument group, for the benchmark's own options."""
    group = parser.add_argument_group(f"across test hosts (network namespaces; needs root{note})")
    group.add_argument("--hosts", type=int, default=0, help="run over this many test hosts")
    group.add_argument("--ranks-per-host", type=int, default=ranks_per_host)
    group.add_argument("--rate", default="1gbit", help="the shaped link's tc tbf rate")
    group.add_argument("--links", default="unshaped,shaped", type=lambda s: s.split(","),
                       help="unshaped (the plain veth), shaped (tc tbf at --rate on both ends), or both")
    group.add_argument("--worker-results", help=argparse.SUPPRESS)  # a rank of a run_job job: rank 0 writes here
    return group


def run_job(n_hosts, ranks_per_host, link, rate, argv, timeout, on_line=None):
    """One benchmark job over fresh test hosts: ``n_hosts`` namespaces of ``ranks_per_host``
    ranks, the link plain (``link`` "unshaped") or shaped with tc tbf at ``rate``. Every rank
    runs ``argv + ["--worker-results", PATH]``; rank 0 writes its JSON results to PATH, which
    is returned parsed. ``on_line`` gets rank 0's output lines as they come; the other ranks'
    output is shown only if the job fails or runs past ``timeout`` seconds (SystemExit, with
    their tails; leaving the hosts kills what still runs)."""
    nprocs = [ranks_per_host] * n_hosts
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="torchpar-bench-hosts-"))
        hosts = stack.enter_context(Hosts(n_hosts))
        if link == "shaped":
            for h in hosts:
                h.shape(rate=rate)
        out = os.path.join(tmp, "results.json")
        # Rank 0's output is read as it comes (below); the others' goes to files, read on failure.
        logs = [None] + [stack.enter_context(open(os.path.join(tmp, f"rank{r}.log"), "w+"))
                         for r in range(1, sum(nprocs))]
        procs = start_ranks(hosts, nprocs, list(argv) + ["--worker-results", out], worker_env(),
                            output=lambda r: subprocess.PIPE if r == 0 else logs[r])
        deadline = time.monotonic() + timeout
        rank0 = []

        def relay():  # rank 0's progress as it comes, while the job is waited for below
            for line in procs[0].stdout:
                rank0.append(line)
                if on_line:
                    on_line(line.rstrip())
        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)  # Hosts' exit kills it
        reader.join(timeout=5)
        if None in codes:
            rank0.append(f"(the job did not finish within {timeout:.0f} s)\n")
        if codes != [0] * len(procs) or not os.path.exists(out):
            tails = [f"--- rank 0:\n{''.join(rank0)[-2000:]}"]
            for r, log in enumerate(logs[1:], start=1):
                log.seek(0)
                tails.append(f"--- rank {r}:\n{log.read()[-2000:]}")
            raise SystemExit(f"the {link} run failed (exit statuses {codes}):\n" + "\n".join(tails))
        with open(out) as f:
            return json.load(f)


def run_links(args, argv, relay=False):
    """A benchmark's ``--hosts`` run: per link of ``args.links``, one ``run_job`` of ``argv`` over
    fresh test hosts. Returns {"veth" or "tbf RATE": rank 0's results}; ``relay`` prints rank
    0's output lines as they come, prefixed with the link."""
    check_options(args.links, args.rate)
    results = {}
    for link in args.links:
        name = f"tbf {args.rate}" if link == "shaped" else "veth"
        print(f"running over {args.hosts} hosts x {args.ranks_per_host} ranks, {name} ...", file=sys.stderr, flush=True)
        on_line = (lambda line, name=name: print(f"[{name}] {line}", flush=True)) if relay else None
        results[name] = run_job(args.hosts, args.ranks_per_host, link, args.rate, argv, args.timeout, on_line=on_line)
    return results


def run_worker(measure, args):
    """One rank of a ``run_job`` job (env:// rendezvous, the torchpar backend): ``measure(rank,
    args)``; rank 0 writes what it returns to ``args.worker_results`` as JSON."""
    from datetime import timedelta

    import torch.distributed as dist

    import torchpar  # noqa: F401  (registers the backend)
    dist.init_process_group("torchpar", timeout=timedelta(seconds=600))
    results = measure(dist.get_rank(), args)
    if dist.get_rank() == 0:
        with open(args.worker_results, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    return 0
