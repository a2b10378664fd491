"""One rank of a job spread over the test hosts of torchpar/bench/_hosts.py (run by tests/test_hosts.py,
under torchrun or started directly with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set).

    python tests/hosts_worker.py suite     # collectives against exact values, then DDP
    python tests/hosts_worker.py loop      # all-reduces until something fails (fault tests)
    python tests/hosts_worker.py restart   # under torchrun --max-restarts=1: the first attempt's
                                           # KILL_RANK dies mid-collective, the second finishes

Every line a test reads starts with "HOSTS "; a failure is an exception (exit status 1).
Settings: HOSTS_TIMEOUT (the group's timeout in seconds), KILL_RANK, KILL_AFTER_S, KILL_MARKER.
"""
import copy
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import torchpar  # noqa: F401  (registers the backend)
from torchpar.parallel import DistributedDataParallel


def say(*parts):
    # One write per line: the ranks of a host share torchrun's log, and print() writes its
    # arguments one by one when the stream is unbuffered, interleaving two ranks' words.
    sys.stdout.write(" ".join(["HOSTS", *map(str, parts)]) + "\n")
    sys.stdout.flush()


def my_address():
    """This host's address on the test bridge (eth0 in its namespace)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((os.environ["MASTER_ADDR"], 9))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]
    finally:
        s.close()


def tcp_peers(exclude_port):
    """Remote IPv4 addresses of this process's established TCP connections, leaving out those
    to `exclude_port` (the c10d store)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    peers = set()
    with open("/proc/self/net/tcp") as f:
        for row in f.readlines()[1:]:
            cols = row.split()
            remote, state, inode = cols[2], cols[3], cols[9]
            if state != "01" or inode not in inodes:  # 01: ESTABLISHED
                continue
            ip_hex, port_hex = remote.split(":")
            if int(port_hex, 16) == exclude_port:
                continue
            peers.add(socket.inet_ntoa(bytes.fromhex(ip_hex)[::-1]))
    return peers


def maps_shared_memory():
    """Whether this process maps a torchpar segment of /dev/shm (unlinked ones included)."""
    with open("/proc/self/maps") as f:
        return "/dev/shm/torchpar-" in f.read()


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def equal(got, want, what):
    check(torch.equal(got, want), f"{what}: got {got.tolist()[:8]}..., want {want.tolist()[:8]}...")


def collectives(W, r, n):
    """Every collective on the world group, each against its exact value."""
    base = torch.arange(n, dtype=torch.float64)
    t = base * (r + 1)
    dist.all_reduce(t)
    equal(t, base * (W * (W + 1) // 2), f"all_reduce sum of {n}")
    m = torch.full((n,), r, dtype=torch.int64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    equal(m, torch.full((n,), W - 1, dtype=torch.int64), "all_reduce max")

    b = torch.full((n,), float(r))
    dist.broadcast(b, src=W - 1)
    equal(b, torch.full((n,), float(W - 1)), "broadcast from the last rank")

    g = torch.empty(W * n, dtype=torch.int32)
    dist.all_gather_into_tensor(g, torch.full((n,), r, dtype=torch.int32))
    equal(g, torch.arange(W, dtype=torch.int32).repeat_interleave(n), "all_gather_into_tensor")
    parts = [torch.empty(3) for _ in range(W)]
    dist.all_gather(parts, torch.full((3,), r + 0.5))
    equal(torch.stack(parts), torch.arange(W).float().add(0.5)[:, None].expand(W, 3), "all_gather")

    rs_in = torch.arange(W * n, dtype=torch.float64) + r
    rs_out = torch.empty(n, dtype=torch.float64)
    dist.reduce_scatter_tensor(rs_out, rs_in)
    want = torch.arange(r * n, (r + 1) * n, dtype=torch.float64) * W + W * (W - 1) // 2
    equal(rs_out, want, "reduce_scatter_tensor")

    red = torch.full((n,), float(r + 1), dtype=torch.float64)
    dist.reduce(red, dst=W - 1)  # to a rank that is not its host's leader (3 hosts: alone on its host)
    equal(red, torch.full((n,), float(W * (W + 1) // 2 if r == W - 1 else r + 1), dtype=torch.float64),
          "reduce to the last rank")

    a2a_in = (100 * r + torch.arange(W)).repeat_interleave(n)
    a2a_out = torch.empty_like(a2a_in)
    dist.all_to_all_single(a2a_out, a2a_in)
    equal(a2a_out, (100 * torch.arange(W) + r).repeat_interleave(n), "all_to_all_single")

    # A ring of isend/irecv (every rank posts both before waiting), then a blocking pair
    # between the first and the last rank (on different hosts).
    nxt, prv = (r + 1) % W, (r - 1) % W
    out, inc = torch.full((n,), float(r)), torch.empty(n)
    works = [dist.isend(out, nxt), dist.irecv(inc, prv)]
    for w in works:
        w.wait()
    equal(inc, torch.full((n,), float(prv)), "irecv from the previous rank of the ring")
    if r == 0:
        dist.send(torch.arange(n, dtype=torch.float32), W - 1, tag=7)
    elif r == W - 1:
        got = torch.empty(n)
        dist.recv(got, 0, tag=7)
        equal(got, torch.arange(n, dtype=torch.float32), "recv from rank 0")
    dist.barrier()


def gather_scatter(W, r):
    """all_gather_into_tensor and reduce_scatter_tensor against exact values, in stages and
    pipelined (csrc/collectives/hierarchical_pipeline.h), for every dtype class at odd counts:
    on groups with 64 KiB arena slots (pipelined beyond 128 KiB in all) of every rank and of
    ranks 1 ... W-1 (2 hosts x 2: a host of 1 rank and one of 2, host 0's leader not rank 0;
    3 hosts: 1 rank on each), and on the world group (4 MiB slots) beyond 8 MiB."""
    os.environ["TORCHPAR_SHM_SLOT_BYTES"] = "64K"  # read when the group is made
    try:
        groups = [(list(range(W)), dist.new_group(list(range(W)))),
                  (list(range(1, W)), dist.new_group(list(range(1, W))))]
    finally:
        del os.environ["TORCHPAR_SHM_SLOT_BYTES"]
    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
              torch.int32, torch.int64, torch.bool)
    cases = [(ranks, g, dtype, n) for ranks, g in groups for dtype in dtypes
             for n in (1, 4099, (3 << 16) // dtype.itemsize + 7)]
    cases.append((list(range(W)), None, torch.float32, (9 << 20) // (4 * W) + 3))
    for ranks, g, dtype, n in cases:
        if r not in ranks:
            continue
        size, me = len(ranks), ranks.index(r)
        what = f"on ranks {ranks}, {dtype}, {n} per rank"

        def values(q, length, offset=0):  # small integers: exact in every dtype, every sum order
            v = (torch.arange(offset, offset + length) + 3 * q) % 5
            return v % 2 == 1 if dtype == torch.bool else v.to(dtype)

        out = torch.empty(size * n, dtype=dtype)
        dist.all_gather_into_tensor(out, values(me, n), group=g)
        equal(out, torch.cat([values(q, n) for q in range(size)]), f"all_gather_into_tensor {what}")
        inplace = torch.zeros(size * n, dtype=dtype)  # this rank's input is its block of the output
        inplace[me * n:(me + 1) * n] = values(me, n)
        dist.all_gather_into_tensor(inplace, inplace[me * n:(me + 1) * n], group=g)
        equal(inplace, out, f"all_gather_into_tensor in place {what}")
        if dtype == torch.bool:
            continue
        # float16 sums run flat (hierarchical.h, reduces_flat); its MAX runs hierarchically.
        # AVG where one division rounds alike in float64 and in the dtype (float32, float64).
        exact_avg = dtype in (torch.float32, torch.float64)
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX] + ([dist.ReduceOp.AVG] if exact_avg else [])
        for op in ops:
            got = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(got, values(me, size * n), op=op, group=g)
            parts = torch.stack([values(q, n, me * n).double() for q in range(size)])
            want = {dist.ReduceOp.SUM: parts.sum(0), dist.ReduceOp.MAX: parts.max(0).values,
                    dist.ReduceOp.AVG: parts.sum(0) / size}[op].to(dtype)
            equal(got, want, f"reduce_scatter_tensor {op} {what}")
    for ranks, g in groups:
        if r in ranks:
            dist.destroy_process_group(g)
    say("gather-scatter-ok", r)


def subgroups(W, r, host_of, n):
    """A group spanning hosts partly (ranks 1 ... W-2: part of host 0 and the next host), and
    one group per host; ranks of one host must share memory, ranks of two talk TCP."""
    span = list(range(1, W - 1))
    g = dist.new_group(span)
    if r in span:
        t = torch.full((n,), float(r))
        dist.all_reduce(t, group=g)
        equal(t, torch.full((n,), float(sum(span))), f"all_reduce on the sub-group {span}")
        b = torch.full((n,), float(r))
        dist.broadcast(b, src=span[-1], group=g)
        equal(b, torch.full((n,), float(span[-1])), f"broadcast on the sub-group {span}")
    hosts = sorted(set(host_of))
    per_host = {h: dist.new_group([q for q in range(W) if host_of[q] == h]) for h in hosts}
    mine = per_host[host_of[r]]
    members = [q for q in range(W) if host_of[q] == host_of[r]]
    t = torch.ones(n)
    dist.all_reduce(t, group=mine)
    equal(t, torch.full((n,), float(len(members))), "all_reduce on this host's group")
    if len(members) > 1:
        check(maps_shared_memory(), f"ranks {members} share a network namespace but their group "
                                    "does not use shared memory")


def transport_of(group=None):
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu")).transport


def mixed_world(W, r, host_of, port):
    """The world group spans hosts: ranks of one host reach each other through shared memory
    (the process maps a segment; no TCP connection to its own host), ranks of two over TCP."""
    check(transport_of() == "mixed", f"the world group's transport is {transport_of()}, not mixed")
    local = [q for q in range(W) if host_of[q] == host_of[r]]
    if len(local) > 1:
        check(maps_shared_memory(), f"ranks {local} share a host, but the world group maps no segment")
    own = {"127.0.0.1", host_of[r]}
    check(not (tcp_peers(port) & own), f"rank {r} talks TCP to its own host: {sorted(tcp_peers(port))}")
    say("mixed-ok", r, "local", len(local))


def same_results_other_ways(W, r, n):
    """A group of every rank with TORCHPAR_TRANSPORT=tcp (TCP between every pair, the
    baseline) and one with TORCHPAR_HIERARCHICAL=0 (the flat algorithms over the mixed
    transport) compute the same exact values as the hierarchical world group."""
    for name, value, transport in (("TORCHPAR_TRANSPORT", "tcp", "tcp"), ("TORCHPAR_HIERARCHICAL", "0", "mixed")):
        os.environ[name] = value
        try:
            g = dist.new_group(list(range(W)))
        finally:
            del os.environ[name]
        check(transport_of(g) == transport, f"{name}={value}: transport {transport_of(g)}")
        base = torch.arange(n, dtype=torch.int64)
        t = base * (r + 1)
        dist.all_reduce(t, group=g)
        equal(t, base * (W * (W + 1) // 2), f"{name}={value}: all_reduce sum")
        a = torch.full((n,), 2.0 * (r + 1))
        dist.all_reduce(a, op=dist.ReduceOp.AVG, group=g)
        equal(a, torch.full((n,), float(W + 1)), f"{name}={value}: all_reduce avg")
        b = torch.full((n,), float(r))
        dist.broadcast(b, src=1, group=g)
        equal(b, torch.full((n,), 1.0), f"{name}={value}: broadcast")
        dist.destroy_process_group(g)


def shm_refused_across_hosts(W, r, host_of):
    """TORCHPAR_TRANSPORT=shm on a group that spans namespaces: every member refuses it."""
    os.environ["TORCHPAR_TRANSPORT"] = "shm"
    ranks = [0, W - 1]  # on the first and the last host
    try:
        g = dist.new_group(ranks)
        if r in ranks:
            dist.all_reduce(torch.ones(1), group=g)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        check(r in ranks and "runs on another host" in str(e), f"unexpected error: {e}")
        say("shm-refused", r)
    else:
        check(r not in ranks, f"TORCHPAR_TRANSPORT=shm made a group of ranks {ranks} on two network "
                              "namespaces")
    finally:
        os.environ["TORCHPAR_TRANSPORT"] = "auto"


def ddp_like_one_process(W, r, steps=3):
    """torchpar's DDP on this rank's shard equals one process on the whole batch (float64:
    the two differ only in summation order)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 12), nn.LayerNorm(12), nn.Tanh(),
                          nn.Linear(12, 3)).double()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0005)  # several buckets
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (ddp, ref))
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(2 * W, 6, generator=gen).double(), torch.randn(2 * W, 3, generator=gen).double()
        opt.zero_grad()
        ((ddp(x.chunk(W)[r]) - y.chunk(W)[r]) ** 2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"rank {r}, step {step}, {name}: {m}")


def init():
    timeout = timedelta(seconds=float(os.environ.get("HOSTS_TIMEOUT", "30")))
    dist.init_process_group("torchpar", timeout=timeout)
    return dist.get_world_size(), dist.get_rank()


def suite():
    W, r = init()
    host_of = [None] * W
    dist.all_gather_object(host_of, my_address())
    say("rank", r, "of", W, "on", host_of[r], "pid", os.getpid())
    mixed_world(W, r, host_of, int(os.environ["MASTER_PORT"]))
    for n in (1, 1000, 70_000):  # 70k doubles cross every internal chunk and one-shot limit
        collectives(W, r, n)
    gather_scatter(W, r)
    same_results_other_ways(W, r, 70_000)
    # Ranks on different hosts talk TCP: the union over the ranks of (own host, peer host)
    # pairs must join every two hosts of the job (the TCP-only group above is gone by now).
    pairs = [None] * W
    dist.all_gather_object(pairs, sorted(tcp_peers(int(os.environ["MASTER_PORT"]))))
    linked = {frozenset((host_of[q], p)) for q in range(W) for p in pairs[q] if p != host_of[q]}
    hosts = sorted(set(host_of))
    for i, a in enumerate(hosts):
        for b in hosts[i + 1:]:
            check(frozenset((a, b)) in linked, f"no TCP connection between hosts {a} and {b}: {pairs}")
    subgroups(W, r, host_of, 1000)
    ddp_like_one_process(W, r)
    shm_refused_across_hosts(W, r, host_of)
    dist.barrier()
    say("suite-ok", r)
    dist.destroy_process_group()


def loop(before_kill=None):
    """All-reduces of 1 MiB until the group fails; KILL_RANK SIGKILLs itself KILL_AFTER_S
    seconds after the first one, in the middle of whichever all-reduce is running."""
    W, r = init()
    kill_rank = int(os.environ.get("KILL_RANK", "-1"))
    t = torch.ones(1 << 18)
    dist.all_reduce(t)
    say("ready", r, "pid", os.getpid())
    if r == kill_rank:
        def die():
            if before_kill:
                before_kill()
            say("killing", r, "at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(float(os.environ.get("KILL_AFTER_S", "0.5")), die).start()
    try:
        while True:
            dist.all_reduce(t)
            t.fill_(1)
    except Exception as e:  # noqa: BLE001 - reported for the test to read
        say("raised", r, "at", repr(time.time()), "error", " ".join(str(e).split()))
        sys.exit(1)


def restart():
    """Under torchrun --max-restarts=1: the first attempt loses KILL_RANK mid-collective (it
    creates the file KILL_MARKER as it dies); the next forms the group again and runs the
    suite's collectives to the end. The marker, not TORCHELASTIC_RESTART_COUNT, tells the
    attempts apart: an agent that restarts its workers because another host's agent came
    back to the rendezvous does not count that as a restart."""
    marker = os.environ["KILL_MARKER"]
    if not os.path.exists(marker):
        loop(before_kill=lambda: open(marker, "w").close())
        return
    W, r = init()
    collectives(W, r, 1000)
    say("restart-ok", r, "restart-count", os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)  # several ranks share two cores
    {"suite": suite, "loop": loop, "restart": restart}[sys.argv[1]]()
