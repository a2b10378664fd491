"""The pipeline schedule generator (csrc/parallel/pipeline/), pure: no process group.

For many (kind, p, m, v) the C++ simulator runs the action lists on a virtual clock and
checks every dependency (F before B before W), that each neighbour pair sends and receives
the same messages in the same order, and that no rank waits forever; here we also check the
bubble against the papers' formulas, the micro-batches in flight, and where receives sit.
"""
import pytest

from torchpar import _C

KINDS = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "interleaved_zb", "looped_bfs"]
INTERLEAVED = ("interleaved_1f1b", "interleaved_zb")


def _cases():
    for kind in KINDS:
        for p in range(1, 7):
            for m in range(1, 13):
                for v in ([1, 2, 3] if kind in INTERLEAVED + ("looped_bfs",) else [1]):
                    if kind in INTERLEAVED and (p < 2 or m % p) or p == 1 and v > 1:
                        continue
                    yield kind, p, m, v


CASES = list(_cases())
COMPUTE = {"F", "B", "W"}


@pytest.mark.parametrize("kind", KINDS)
def test_every_schedule_simulates_with_the_papers_bubble(kind):
    for k, p, m, v in CASES:
        if k != kind:
            continue
        s = _C.pipeline_schedule(kind, p, m, v)
        r = s.simulate()  # raises on any order, matching or deadlock problem
        theory = _C.pipeline_theoretical_bubble(kind, p, m, v)
        if kind == "zb_h1" and m < p:
            # The (p-1)(tF+tB-tW) bound needs m >= p W's to fill the tail; below it, no worse than 1F1B.
            assert max(r["bubble"]) <= _C.pipeline_theoretical_bubble("1f1b", p, m) * 1.0000001 + 1e-12
            continue
        if kind == "looped_bfs" and m < p:
            # Fewer micro-batches than ranks leave each chunk's rounds p - m apart: between
            # interleaving's bubble and GPipe's over all v p stages.
            assert all(theory - 1e-12 <= b <= (v * p - 1) / (v * m + v * p - 1) + 1e-12 for b in r["bubble"])
            continue
        for rank, b in enumerate(r["bubble"]):
            assert b == pytest.approx(theory, abs=1e-12), (kind, p, m, v, rank)


@pytest.mark.parametrize("p,m", [(2, 8), (3, 6), (4, 8)])
def test_simulation_at_given_costs_follows_the_papers_formulas(p, m):
    # Equal stages at F = 1, B = 1.2, W = 0.8: ZB-H1 leaves (p-1)(tF+tB-tW) (Qi et al. 2023);
    # 1F1B and GPipe at any (tF, tB) leave (p-1)/(m+p-1) of the step.
    f, b, w = 1.0, 1.2, 0.8
    zb = _C.pipeline_schedule("zb_h1", p, m).simulate([(f, b, w)] * p)
    idle = (p - 1) * (f + b - w)
    assert zb["bubble"] == pytest.approx([idle / (m * (f + b + w) + idle)] * p, abs=1e-12)
    for kind in ("1f1b", "gpipe"):
        r = _C.pipeline_schedule(kind, p, m).simulate([(1.0, 2.5, 0.0)] * p)
        assert r["bubble"] == pytest.approx([(p - 1) / (m + p - 1)] * p, abs=1e-12)
        assert r["makespan"] == pytest.approx((m + p - 1) * 3.5)
    # Unit costs given explicitly are the default's.
    unit = _C.pipeline_schedule("interleaved_1f1b", p, m, 2)
    assert unit.simulate([(1.0, 2.0, 0.0)] * (2 * p)) == unit.simulate()


def test_simulation_costs_are_checked():
    s = _C.pipeline_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match="costs for 1 stages; the schedule has 2"):
        s.simulate([(1.0, 2.0, 0.0)])
    with pytest.raises(ValueError, match="finite and >= 0, got -1"):
        s.simulate([(1.0, 2.0, 0.0), (1.0, -1.0, 0.0)])
    with pytest.raises(ValueError, match="finite and >= 0, got nan"):
        s.simulate([(1.0, 2.0, 0.0), (float("nan"), 1.0, 0.0)])


@pytest.mark.parametrize("kind", ["1f1b", "zb_h1", "gpipe", "interleaved_zb", "looped_bfs"])
def test_micro_batches_in_flight(kind):
    for k, p, m, v in CASES:
        if k != kind:
            continue
        peak = _C.pipeline_schedule(kind, p, m, v).simulate()["peak_in_flight"]
        if kind == "interleaved_zb":  # the held-back W's: no rank above interleaved 1F1B's busiest
            unsplit = _C.pipeline_schedule("interleaved_1f1b", p, m, v).simulate()["peak_in_flight"]
            assert max(peak) == max(unsplit) == unsplit[0], (p, m, v, peak, unsplit)
            continue
        for rank, n in enumerate(peak):
            if kind in ("gpipe", "looped_bfs"):
                assert n == m * v
            elif kind == "1f1b":
                assert n == min(p - rank, m), (p, m, rank)  # 1F1B: p - rank on rank `rank`
            else:
                assert n <= min(p, m), (p, m, rank)


def test_1f1b_warmup_is_p_minus_rank_minus_1():
    p, m = 4, 8
    s = _C.pipeline_schedule("1f1b", p, m)
    for rank in range(p):
        compute = [a for a in s.actions(rank) if a[0] in COMPUTE]
        first_b = next(i for i, a in enumerate(compute) if a[0] == "B")
        assert first_b == p - rank  # p - rank - 1 warm-up forwards, then the first steady F


def test_receives_are_posted_before_the_compute_that_precedes_their_use():
    for kind, p, m, v in CASES:
        if p < 2:
            continue
        s = _C.pipeline_schedule(kind, p, m, v)
        for rank in range(p):
            acts = s.actions(rank)
            for i, (name, mb, stage) in enumerate(acts):
                if not name.startswith("RECV"):
                    continue
                use = acts.index(("F" if name == "RECV_F" else "B", mb, stage))
                computes_between = [a for a in acts[i:use] if a[0] in COMPUTE]
                first_compute = next(j for j, a in enumerate(acts) if a[0] in COMPUTE)
                assert computes_between or i < first_compute, (kind, p, m, v, rank, name, mb, stage)


def test_several_stages_need_several_ranks():
    with pytest.raises(ValueError, match="looped BFS with 2 stages needs at least 2 pipeline ranks"):
        _C.pipeline_schedule("looped_bfs", 1, 4, 2)
    with pytest.raises(ValueError, match="2 stages on 1 pipeline rank"):
        _C.pipeline_schedule_from_csv("0,F,0,0\n0,F,0,1\n0,B,0,1\n0,B,0,0\n", 1, 1, 2)


@pytest.mark.parametrize("kind", INTERLEAVED)
def test_interleaved_needs_m_a_multiple_of_p(kind):
    with pytest.raises(ValueError, match=r"micro-batches \(6\) to be a multiple of the number of pipeline ranks \(4\)"):
        _C.pipeline_schedule(kind, 4, 6, 2)


def test_bad_sizes_and_kinds_are_value_errors():
    with pytest.raises(ValueError, match="micro-batches must be >= 1"):
        _C.pipeline_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match="unknown schedule kind 'pipedream'"):
        _C.pipeline_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="only the interleaved schedules and looped BFS place several stages"):
        _C.pipeline_schedule("1f1b", 2, 4, 2)


def test_csv_round_trip_and_compute_only_csv():
    s = _C.pipeline_schedule("zb_h1", 3, 5)
    again = _C.pipeline_schedule_from_csv(s.to_csv(), 3, 5)
    assert all(again.actions(r) == s.actions(r) for r in range(3))
    compute_only = "\n".join(line for line in s.to_csv().splitlines() if line.split(",")[1] in COMPUTE)
    added = _C.pipeline_schedule_from_csv("# compute only\n" + compute_only, 3, 5)
    assert all(added.actions(r) == s.actions(r) for r in range(3))


def test_simulator_rejects_broken_schedules():
    gp = _C.pipeline_schedule("gpipe", 2, 2).to_csv().splitlines()
    # B before its F on rank 0.
    swapped = [gp[0]] + [ln.replace(",F,", ",X,").replace(",B,", ",F,").replace(",X,", ",B,") for ln in gp[1:]]
    with pytest.raises(ValueError):
        _C.pipeline_schedule_from_csv("\n".join(swapped), 2, 2)
    # Both ranks run their backward first: each waits on the other (deadlock).
    dead = "0,B,0,0\n0,F,0,0\n1,B,0,1\n1,F,0,1\n"
    with pytest.raises(ValueError, match="runs before its forward|deadlock"):
        _C.pipeline_schedule_from_csv(dead, 2, 1)
    # Receives in another order than the peer sends.
    order = _C.pipeline_schedule("gpipe", 2, 2).to_csv()
    order = order.replace("1,RECV_F,0,1", "TMP").replace("1,RECV_F,1,1", "1,RECV_F,0,1").replace("TMP", "1,RECV_F,1,1")
    with pytest.raises(ValueError, match="disagree on message|before the receive"):
        _C.pipeline_schedule_from_csv(order, 2, 2)
    with pytest.raises(ValueError, match="line 1: expected rank,action,microbatch,stage"):
        _C.pipeline_schedule_from_csv("0,F,0\n", 2, 1)
    with pytest.raises(ValueError, match="unknown pipeline action 'FWD'"):
        _C.pipeline_schedule_from_csv("0,FWD,0,0\n", 2, 1)


@pytest.mark.parametrize("row", ["0,F,0,-4", "1,F,0,-2", "1,B,0,-1", "0,F,-1,0"])
def test_csv_stage_or_microbatch_out_of_range_is_a_clear_error(row):
    # Untrusted CSV: a negative stage once reached add_communication's rank arithmetic
    # (stage % p < 0) and indexed out of bounds (a segfault); it must be a ValueError naming the line.
    with pytest.raises(ValueError, match="line 1"):
        _C.pipeline_schedule_from_csv(row, 2, 1, 1)
