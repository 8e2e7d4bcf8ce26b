"""The spot-trace bench's lineage (pure part of ``bench/spot_trace.py``): which records of the sample
log end up in the final model. Regression: a rank 0 SIGKILLed mid-step never writes the step that a
surviving rank finished and handed to the re-formed world; that step is in the lineage all the same."""

from __future__ import annotations

import json
import os

import pytest

from tests.harness import REPO, bench_module


@pytest.fixture(scope="module")
def spot():
    with bench_module("spot_trace.py") as mod:
        yield mod


def ex(spot, agent, step, rank, world, rnd, t):
    return spot.Exec(agent, step, rank, world, t - 1.0, t, (step,), rnd)


def test_a_step_only_a_surviving_rank_logged_stays_in_the_lineage(spot):
    # Round 0: ranks 0 (a) and 1 (b) train steps 1-2; a dies during step 3, which b finished (its
    # all-reduce completed). Round 1: b alone is rank 0 and continues at step 4.
    execs = [ex(spot, "a", 1, 0, 2, 0, 1), ex(spot, "b", 1, 1, 2, 0, 1.01), ex(spot, "a", 2, 0, 2, 0, 2),
             ex(spot, "b", 2, 1, 2, 0, 2.01), ex(spot, "b", 3, 1, 2, 0, 3.01), ex(spot, "b", 4, 0, 1, 1, 5)]
    kept, final = spot.lineage(execs)
    assert final == 4
    assert sorted({e.step for e in kept}) == [1, 2, 3, 4]
    leads = spot.leads(execs)
    assert [(e.step, e.rank) for e in leads] == [(1, 0), (2, 0), (3, 1), (4, 0)]


def test_a_redone_step_keeps_its_last_attempt_only(spot):
    # Step 2 was trained in round 0, then the world restored step 1 and trained step 2 again (round 1).
    execs = [ex(spot, "a", 1, 0, 2, 0, 1), ex(spot, "b", 1, 1, 2, 0, 1), ex(spot, "a", 2, 0, 2, 0, 2),
             ex(spot, "b", 2, 1, 2, 0, 2), ex(spot, "a", 2, 0, 1, 1, 4)]
    kept, final = spot.lineage(execs)
    assert final == 2
    assert sorted((e.step, e.round, e.rank) for e in kept) == [(1, 0, 0), (1, 0, 1), (2, 1, 0)]


def test_costs_from_an_earlier_run_simulate_the_whole_trace_again_with_training_through_notices(spot, tmp_path):
    # The committed whole-trace run's measured costs, simulated again without agents: training through a
    # 120 s notice (the default; drain the lead before the reclaim) turns most of the idle notice lead into
    # training. The lead is sized as the agents size it: these sub-second steps and saves get the 10 s floor.
    # A synthetic 4-hour trace (8 nodes; every 10 min one leaves and comes back 5 min later).
    rows = ["time_ms,event,node"] + [f"0,add,n{i}" for i in range(8)]
    for k in range(1, 24):
        rows += [f"{k * 600_000},remove,n{k % 8}", f"{k * 600_000 + 300_000},add,n{k % 8}"]
    trace = tmp_path / "synthetic.csv"
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "resim.json"
    src = os.path.join(REPO, "docs", "results", "spot", "whole-trace-final.json")
    assert spot.main(["--costs-from", src, "--trace", str(trace), "--no-sweep", "--sim-seeds", "2",
                      "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    with open(src) as fh:
        before = json.load(fh)
    assert res["full_trace_costs_from"] == src
    assert res["ettr"] == before["ettr"] and res["runs"].keys() == before["runs"].keys()  # replay figures kept
    assert (res["full_trace"]["drain_lead_s"], res["full_trace"]["drain_lead_basis"]) == (10.0, "floor")
    block = res["full_trace"]["x1"]
    through, auto = block["trainguard-auto"], block["trainguard-auto-drain-at-notice"]
    assert through["waste_node_s"]["notice_lead"] < 0.2 * auto["waste_node_s"]["notice_lead"]
    assert through["ettr"] > auto["ettr"]
    fixed = tmp_path / "resim-20.json"  # a fixed lead, as given: twice the floor's idle notice lead
    assert spot.main(["--costs-from", src, "--trace", str(trace), "--no-sweep", "--sim-seeds", "2",
                      "--drain-lead-s", "20", "--json", str(fixed)]) == 0
    ft20 = json.loads(fixed.read_text())["full_trace"]
    assert (ft20["drain_lead_s"], ft20["drain_lead_basis"]) == (20.0, "fixed")
    assert ft20["x1"]["trainguard-auto"]["waste_node_s"]["notice_lead"] > through["waste_node_s"]["notice_lead"]
    # The same costs with every step 1 s long (a what-if, labelled so): the time between steps and the
    # step lost to a failure weigh 10x less, and the result says which step time it assumed.
    longer = tmp_path / "resim-1s.json"
    assert spot.main(["--costs-from", src, "--trace", str(trace), "--no-sweep", "--sim-seeds", "2",
                      "--sim-step-s", "1.0", "--json", str(longer)]) == 0
    ft = json.loads(longer.read_text())["full_trace"]
    assert ft["sim_step_s"] == 1.0 and "what-if" in ft["assumption"] and "sim_step_s" not in res["full_trace"]
    slow = ft["x1"]["trainguard-auto"]
    assert slow["waste_node_s"]["between_steps"] < 0.2 * through["waste_node_s"]["between_steps"]
    assert slow["ettr"] > through["ettr"]


def test_repeated_replays_are_compared_by_their_means(spot):
    # --runs baseline,baseline#2: the same schedule twice; the report compares the mean measured ETTR
    # with the mean prediction (a kind replayed once has no entry).
    runs = {"trainguard-auto": {"ettr": 0.9, "predicted": {"ettr": 0.91}},
            "baseline": {"ettr": 0.50, "predicted": {"ettr": 0.60}},
            "baseline#2": {"ettr": 0.70, "predicted": {"ettr": 0.62}}}
    assert [spot.run_kind(n) for n in runs] == ["trainguard-auto", "baseline", "baseline"]
    out = spot.repeats(runs)
    assert list(out) == ["baseline"]
    b = out["baseline"]
    assert b["runs"] == 2 and b["ettr"] == [0.5, 0.7] and b["ettr_mean"] == pytest.approx(0.6)
    assert b["predicted_mean"] == pytest.approx(0.61) and b["prediction_error_points"] == pytest.approx(1.0)


def test_torchrun_job_waits_out_torchs_last_call(spot):
    """The torchrun baseline is simulated with torch's own c10d last call (read from torch, 30 s by
    default) below its --nnodes maximum; trainguard's planned rounds do not wait it."""
    run = {"step_s_by_world_size": {"1": 0.1, "2": 0.1}, "step_overhead_s": 0.0}
    tr = spot.job_model(run, torchrun=True, max_nodes=3)
    assert (tr.last_call_s, tr.max_nodes) == (30.0, 3) and tr.notices is False
    tg = spot.job_model(run, torchrun=False, max_nodes=3)
    assert tg.last_call_s == 0.0 and tg.notices is True
