"""The rank pool's own guard (tests/harness.py): a test that leaves its ranks out of step, or
the group failed, fails by name, and the next test gets a fresh pool instead of inheriting it
(a CI run once failed 116 tests on one pool whose group an earlier test had broken)."""
import pytest
import torch
import torch.distributed as dist

from harness import get_pool

pytestmark = pytest.mark.timeout(120)


def _one_rank_issues_an_all_reduce(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1), async_op=True, group=ctx.pg)  # never matched, never waited
    return True


def _sum_of_ranks(ctx):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t, group=ctx.pg)
    return t.item()


def test_a_test_leaving_its_ranks_out_of_step_fails_and_the_next_gets_a_fresh_pool():
    pool = get_pool(2)
    pids = [p.pid for p in pool.procs]
    with pytest.raises(AssertionError, match=r"left the ranks out of step: collectives issued per rank \[\d+, \d+\]"):
        pool.run(_one_rank_issues_an_all_reduce)
    fresh = get_pool(2)
    assert [p.pid for p in fresh.procs] != pids
    assert fresh.run(_sum_of_ranks) == [1.0, 1.0]
