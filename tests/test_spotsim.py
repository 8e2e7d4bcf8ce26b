"""The spot-trace simulator: hand-computed timelines, trace handling, and auto vs fixed intervals."""

from __future__ import annotations

import random

import pytest

from trainguard.checkpoint.interval import AutoSettings, IntervalMode, IntervalPolicy
from bench.spotsim import (
    ChangeCosts,
    Dist,
    FailureKind,
    JobModel,
    Prices,
    StateLayout,
    Tier1,
    Trace,
    TraceError,
    TraceEvent,
    load_trace,
    pick_unannounced,
    scale,
    simulate,
    window,
)

pytestmark = pytest.mark.timeout(60)
OFF = IntervalPolicy(IntervalMode.OFF)
ZERO = Dist.of(0.0)


def trace(*events: tuple[float, str, str], duration: float) -> Trace:
    return Trace(tuple(TraceEvent(t, k, n) for t, k, n in events), duration)


def costs(**kw: float) -> ChangeCosts:
    # The optional per-kind costs stay None (they fall back to the general ones) unless given.
    base = {f: 0.0 for f in ChangeCosts.__slots__ if getattr(ChangeCosts(), f) is not None}
    base.update(kw)
    return ChangeCosts(**{k: Dist.of(v) for k, v in base.items()})


def check(r) -> None:
    assert r.productive_node_s + r.waste_total_node_s == pytest.approx(r.available_node_s, abs=1e-6)
    assert all(v >= -1e-9 for v in r.waste_node_s.values()), r.waste_node_s


def test_start_up_only() -> None:
    """2 nodes for 100 s: warm-up 1 s, rendezvous 2 s, start-up 3 s, then training."""
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), duration=100),
                 costs(warmup_s=1, reformation_s=2, startup_s=3), JobModel(node_s_per_step=2, samples_per_step=8), OFF)
    check(r)
    assert r.available_node_s == 200
    assert r.waste_node_s["warmup"] == pytest.approx(2)
    assert r.waste_node_s["reformation"] == pytest.approx(4)
    assert r.waste_node_s["restore"] == pytest.approx(6)
    assert r.productive_node_s == pytest.approx(188)
    assert r.ettr == pytest.approx(0.94)
    assert r.kept_steps == pytest.approx(94)          # 1 s per step at 2 nodes
    assert r.committed_samples == pytest.approx(94 * 8)


def test_announced_removal_drains_with_an_emergency_checkpoint() -> None:
    """3 nodes; c goes at 50 with a 10 s notice: detected at 41, emergency checkpoint 41..42, c waits
    for its reclaim 42..50, a and b re-form 42..44 and restore 44..49."""
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (50, "remove", "c"), duration=100),
                 costs(warmup_s=1, reformation_s=2, startup_s=3, restore_s=5, detect_notice_s=1, emergency_s=1),
                 JobModel(node_s_per_step=1), OFF, lead_s=10)
    check(r)
    assert r.available_node_s == 250
    assert r.waste_node_s["checkpoint"] == pytest.approx(3)
    assert r.waste_node_s["notice_lead"] == pytest.approx(8)
    assert r.waste_node_s["reformation"] == pytest.approx(6 + 4)
    assert r.waste_node_s["restore"] == pytest.approx(9 + 10)
    assert r.waste_node_s["recompute"] == 0 and r.waste_node_s["detection"] == 0
    assert r.productive_node_s == pytest.approx(3 * 35 + 2 * 51)
    assert [(c.why, c.size_before, c.size_after) for c in r.changes] == [("start", 0, 3), ("notice", 3, 2)]


def test_training_through_the_notice_idles_only_the_drain_lead() -> None:
    """As above with ``drain_lead_s`` 3 (preemption.train_through_notice): the notice is detected at 41,
    an out-of-cycle save pauses the world 0.5 s (41..41.5), training goes on until the drain at 47, the
    emergency checkpoint 47..48, c idles 48..50; a and b re-form 48..50 and restore 50..55."""
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (50, "remove", "c"), duration=100),
                 costs(warmup_s=1, reformation_s=2, startup_s=3, restore_s=5, detect_notice_s=1, emergency_s=1,
                       periodic_overhead_s=0.5, periodic_persist_s=1),
                 JobModel(node_s_per_step=1, drain_lead_s=3), OFF, lead_s=10)
    check(r)
    assert r.waste_node_s["periodic_checkpoint"] == pytest.approx(3 * 0.5)
    assert r.waste_node_s["checkpoint"] == pytest.approx(3)
    assert r.waste_node_s["notice_lead"] == pytest.approx(2)
    assert r.waste_node_s["reformation"] == pytest.approx(6 + 4)
    assert r.waste_node_s["restore"] == pytest.approx(9 + 10)
    assert r.productive_node_s == pytest.approx(3 * (41 - 6 + 47 - 41.5) + 2 * 45)
    assert r.periodic_saves == 1
    at_once = simulate(trace((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (50, "remove", "c"), duration=100),
                       costs(warmup_s=1, reformation_s=2, startup_s=3, restore_s=5, detect_notice_s=1, emergency_s=1,
                             periodic_overhead_s=0.5, periodic_persist_s=1),
                       JobModel(node_s_per_step=1), OFF, lead_s=10)
    assert r.ettr > at_once.ettr
    assert r.productive_node_s - at_once.productive_node_s == pytest.approx(3 * 5.5 - 2 * 6)


def test_unannounced_removal_rolls_back_to_the_last_periodic_checkpoint() -> None:
    """Rendezvous 0..1; saves every 10 s of training (0.5 s pause, committed 1 s later) at 11 and 21.5;
    b dies at 25 without notice: the 6 node-s trained since the save at 21.5 are recomputed;
    detection 25..27, re-formation 27..28, restore 28..31, a save at 41 (pause 0.5 s)."""
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), (25, "remove", "b"), duration=50),
                 costs(periodic_overhead_s=0.5, periodic_persist_s=1, detect_failure_s=2, reformation_s=1, restore_s=3),
                 JobModel(node_s_per_step=2), IntervalPolicy(IntervalMode.FIXED, seconds=10.0), unannounced=[0])
    check(r)
    assert r.available_node_s == 75
    assert r.waste_node_s["periodic_checkpoint"] == pytest.approx(1 + 1 + 0.5)
    assert r.waste_node_s["recompute"] == pytest.approx(6)
    assert r.waste_node_s["detection"] == pytest.approx(2)
    assert r.waste_node_s["reformation"] == pytest.approx(2 + 1)
    assert r.waste_node_s["restore"] == pytest.approx(3)
    assert r.productive_node_s == pytest.approx(20 + 20 + 10 + 8.5)
    assert r.recomputed_steps == pytest.approx(3)        # 1 s per step at 2 nodes
    assert r.kept_steps == pytest.approx(10 + 10 + 5 + 4.25)
    assert r.failures_seen == 1 and r.periodic_saves == 3


def test_a_save_not_yet_committed_does_not_protect() -> None:
    """The failure comes 0.8 s after a save started (persist 1 s): the previous commit stands."""
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), (10.8, "remove", "b"), duration=20),
                 costs(periodic_overhead_s=0.5, periodic_persist_s=1), JobModel(node_s_per_step=2),
                 IntervalPolicy(IntervalMode.FIXED, seconds=5.0), unannounced=[0])
    check(r)
    # saves at 5 (commits 6.5) and 10.5 (would commit 12): rolled back to the state at 5.
    assert r.waste_node_s["recompute"] == pytest.approx(2 * (10.5 - 5.5))


@pytest.mark.parametrize("resize_checkpoint, productive, recompute, warmup", [(True, 42, 0, 5), (False, 26, 18, 4)])
def test_join_takes_a_resize_checkpoint_or_rolls_back(resize_checkpoint, productive, recompute, warmup) -> None:
    """a warms up 0..2, re-forms 2..4, trains; b arrives at 20, ready at 22: a resize checkpoint 22..23
    (b still warming up meanwhile), re-formation 23..25, restore 25..28. Without the checkpoint the
    world rolls back to its start and re-forms at once."""
    r = simulate(trace((0, "add", "a"), (20, "add", "b"), duration=40),
                 costs(warmup_s=2, resize_checkpoint_s=1, reformation_s=2, restore_s=3),
                 JobModel(node_s_per_step=1, resize_checkpoint=resize_checkpoint), OFF)
    check(r)
    assert r.available_node_s == 60
    assert r.productive_node_s == pytest.approx(productive)
    assert r.waste_node_s["recompute"] == pytest.approx(recompute)
    assert r.waste_node_s["warmup"] == pytest.approx(warmup)


def test_notice_too_short_for_the_emergency_checkpoint_is_a_failure() -> None:
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), (30, "remove", "b"), duration=40),
                 costs(detect_notice_s=1, emergency_s=1, detect_failure_s=2, restore_s=1),
                 JobModel(node_s_per_step=1), OFF, lead_s=0.5)
    check(r)
    assert r.failures_seen == 1
    assert r.waste_node_s["recompute"] == pytest.approx(60)   # nothing committed since the start
    assert r.waste_node_s["checkpoint"] == 0


def test_without_notice_handling_every_removal_is_a_failure() -> None:
    t = trace((0, "add", "a"), (0, "add", "b"), (30, "remove", "b"), duration=40)
    c = costs(detect_notice_s=1, emergency_s=1, detect_failure_s=2, restore_s=1)
    planned = simulate(t, c, JobModel(node_s_per_step=1), OFF, lead_s=10)
    torchrun = simulate(t, c, JobModel(node_s_per_step=1, notices=False, resize_checkpoint=False), OFF, lead_s=10)
    assert planned.failures_seen == 0 and planned.waste_node_s["recompute"] == 0
    assert torchrun.failures_seen == 1 and torchrun.waste_node_s["recompute"] == pytest.approx(60)


def test_a_joiner_late_for_a_re_formation_triggers_the_next_one() -> None:
    """b is ready at 5, while the world restores (4..10): the world comes up at 10 and re-forms again."""
    r = simulate(trace((0, "add", "a"), (3, "add", "b"), duration=40),
                 costs(warmup_s=2, reformation_s=2, startup_s=6, restore_s=6, resize_checkpoint_s=1),
                 JobModel(node_s_per_step=1), OFF)
    check(r)
    assert [(c.why, c.size_before, c.size_after) for c in r.changes] == [("start", 0, 1), ("join", 1, 2)]
    assert r.changes[1].t_s == pytest.approx(10)
    assert r.productive_node_s == pytest.approx(2 * (40 - 19))


def test_in_place_a_loss_without_notice_costs_the_interrupted_step() -> None:
    """In place, b dies at 25.5 without notice, half-way through step 26: only that half step is lost
    (the survivor continues from memory); detection 25.5..27.5, re-formation 27.5..28.5, restore
    28.5..29.5 (the failure's own costs, not the general ones), then a trains alone (2 s a step)."""
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), (25.5, "remove", "b"), duration=50),
                 costs(detect_failure_s=2, start_reformation_s=0, reformation_s=100, restore_s=100,
                       failure_reformation_s=1, failure_restore_s=1),
                 JobModel(node_s_per_step=2, in_place=True), IntervalPolicy(IntervalMode.FIXED, seconds=10.0),
                 unannounced=[0])
    check(r)
    assert r.available_node_s == 75.5
    assert r.waste_node_s["recompute"] == pytest.approx(1)        # half a step at 2 nodes
    assert r.recomputed_steps == pytest.approx(0.5)
    assert r.waste_node_s["detection"] == pytest.approx(2)
    assert r.waste_node_s["reformation"] == pytest.approx(1)
    assert r.waste_node_s["restore"] == pytest.approx(1)
    assert r.productive_node_s == pytest.approx(50 + 20.5)
    assert r.kept_steps == pytest.approx(25 + 20.5 / 2)
    assert r.failures_seen == 0      # no restore from a checkpoint: the interval controller sees none


def test_in_place_a_loss_while_re_forming_is_survived_not_a_rollback() -> None:
    """In place, c is lost without notice while the world restores for d's join (21..23): the survivors
    still hold the state, so the interval controller sees no rollback; a lone node lost is one."""
    ev = [(0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (20, "add", "d"), (22, "remove", "c")]
    r = simulate(trace(*ev, duration=60), costs(join_reformation_s=1, join_restore_s=2, detect_failure_s=1),
                 JobModel(node_s_per_step=1, in_place=True), OFF, unannounced=[0])
    check(r)
    assert r.failures_seen == 0
    assert r.recomputed_steps == 0
    alone = simulate(trace((0, "add", "a"), (10, "remove", "a"), (11, "add", "b"), duration=30),
                     costs(detect_failure_s=1), JobModel(node_s_per_step=1, in_place=True), OFF, unannounced=[0])
    assert alone.failures_seen == 1


def test_in_place_a_world_that_loses_every_node_restarts_from_its_last_commit() -> None:
    """a, alone, dies without notice at 10 as c arrives: nothing survives to continue from memory, so the
    10 node-s trained since the start (no commit) are lost; c waits out the detection (1 s) and trains."""
    r = simulate(trace((0, "add", "a"), (10, "add", "c"), (10, "remove", "a"), duration=30),
                 costs(detect_failure_s=1), JobModel(node_s_per_step=1, in_place=True), OFF, unannounced=[0])
    check(r)
    assert r.waste_node_s["recompute"] == pytest.approx(10)
    assert r.waste_node_s["warmup"] == pytest.approx(1)
    assert r.productive_node_s == pytest.approx(19)


def test_in_place_join_and_the_start_use_their_own_costs() -> None:
    """a warms up 0..2, the first rendezvous 2..5 (start_reformation_s), start-up 5..9, trains; b arrives
    at 20, warm at 22: no checkpoint (the joiner takes the state from a peer), re-formation 22..23, restore
    23..23.5, then both train to 40."""
    r = simulate(trace((0, "add", "a"), (20, "add", "b"), duration=40),
                 costs(warmup_s=2, start_reformation_s=3, reformation_s=100, join_reformation_s=1, join_restore_s=0.5,
                       startup_s=4, restore_s=100, resize_checkpoint_s=100),
                 JobModel(node_s_per_step=1, in_place=True), OFF)
    check(r)
    assert r.waste_node_s["warmup"] == pytest.approx(4)
    assert r.waste_node_s["reformation"] == pytest.approx(3 + 2)
    assert r.waste_node_s["restore"] == pytest.approx(4 + 1)
    assert r.waste_node_s["checkpoint"] == 0
    assert r.productive_node_s == pytest.approx(13 + 33)
    assert [(c.why, c.size_before, c.size_after) for c in r.changes] == [("start", 0, 1), ("join", 1, 2)]


def test_the_first_world_warms_up_by_agent_start_s() -> None:
    """Nodes of the first world take agent_start_s (1 s) to reach the rendezvous; a node joining the
    running world later takes warmup_s (5 s: its workers start in standby)."""
    r = simulate(trace((0, "add", "a"), (20, "add", "b"), duration=40),
                 costs(agent_start_s=1, warmup_s=5), JobModel(node_s_per_step=1, in_place=True), OFF)
    check(r)
    assert r.waste_node_s["warmup"] == pytest.approx(1 + 5)
    assert r.productive_node_s == pytest.approx(39 + 15)


def test_time_between_steps_is_not_productive() -> None:
    """0.9 s steps with 0.1 s between them: 10 % of the training time is between_steps waste; the kept
    steps count the whole cycle."""
    r = simulate(trace((0, "add", "a"), duration=100), costs(), JobModel(node_s_per_step=0.9, step_overhead_s=0.1), OFF)
    check(r)
    assert r.productive_node_s == pytest.approx(90)
    assert r.waste_node_s["between_steps"] == pytest.approx(10)
    assert r.kept_steps == pytest.approx(100)


def test_costs_and_cost_per_sample() -> None:
    r = simulate(trace((0, "add", "a"), duration=3600), costs(), JobModel(node_s_per_step=2, samples_per_step=10), OFF,
                 prices=Prices(spot_per_hour=1.0, on_demand_per_hour=3.0))
    assert r.cost_total == pytest.approx(1.0)
    assert r.committed_samples == pytest.approx(18000)
    assert r.cost_per_sample == pytest.approx(1 / 18000)
    assert r.on_demand_cost_per_sample == pytest.approx(3.0 / 18000)


def test_distributions_are_drawn_with_the_seed() -> None:
    t = trace((0, "add", "a"), (0, "add", "b"), *[(100.0 * k, "remove" if k % 2 else "add", "b") for k in range(1, 20)],
              duration=2000)
    c = ChangeCosts(restore_s=Dist.of([1, 5, 9]), reformation_s=Dist.of([1, 2]))
    runs = [simulate(t, c, JobModel(node_s_per_step=1), OFF, seed=s).ettr for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    with pytest.raises(ValueError):
        Dist.of([])


def test_load_trace_and_its_errors(tmp_path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("0,add,n1\n0,add,n2\n60000,remove,n1\n120000,add,n3\n")
    t = load_trace(str(p))
    assert t.duration_s == 120 and [i[0] for i in t.instants()] == [0, 60, 120]
    assert t.sizes() == [(0.0, 2), (60.0, 1), (120.0, 2)]
    assert t.available_node_s() == 2 * 60 + 60
    for body, msg in (("0,add,n1\n0,add,n1\n", ":2: n1 is added while present"),
                      ("0,remove,n1\n", ":1: n1 is removed while absent"),
                      ("10,add,n1\n5,add,n2\n", ":2: time 5 ms goes back"),
                      ("0,join,n1\n", ":1: expected 'time_ms,add|remove,node'")):
        p.write_text(body)
        with pytest.raises(TraceError, match=msg):
            load_trace(str(p))


def test_window_and_scale() -> None:
    t = trace(*[(0, "add", f"n{i}") for i in range(8)], (100, "remove", "n0"), (100, "remove", "n1"),
              (200, "remove", "n2"), (200, "remove", "n3"), (300, "add", "n9"), (300, "add", "n8"), duration=400)
    w = window(t, 150, 200)
    assert w.sizes() == [(0.0, 6), (50.0, 4), (150.0, 6)] and w.duration_s == 200
    assert w.available_node_s() == 6 * 50 + 4 * 100 + 6 * 50
    s = scale(t, nodes_per_agent=2, max_agents=3, speed=10)
    # 8 nodes -> 3 agents (capped), 6 -> 3, 4 -> 2, 6 -> 3; times / 10
    assert s.sizes() == [(0.0, 3), (20.0, 2), (30.0, 3)] and s.duration_s == 40
    assert [e.node for e in s.removals()] == ["agent1"]   # the longest present goes first
    up = scale(t, nodes_per_agent=3, max_agents=3, rounding="up")
    assert up.sizes() == [(0.0, 3), (100.0, 2)]   # ceil: 8 -> 3, 6 -> 2, 4 -> 2, 6 -> 2


def test_pick_unannounced_is_seeded_and_near_the_share() -> None:
    t = trace(*[(float(k), "add", f"n{k}") for k in range(1000)], *[(2000.0 + k, "remove", f"n{k}") for k in range(1000)],
              duration=4000)
    a, b = pick_unannounced(t, 0.1, seed=3), pick_unannounced(t, 0.1, seed=3)
    assert a == b and 70 <= len(a) <= 130
    assert pick_unannounced(t, 0.0) == frozenset() and len(pick_unannounced(t, 1.0)) == 1000


def _churn(hours: float, every_s: float, nodes: int = 8, seed: int = 7) -> Trace:
    """``nodes`` nodes; one leaves at random times (``every_s`` apart on average) and a fresh one
    arrives a minute later."""
    rng = random.Random(seed)
    ev = [(0.0, "add", f"n{i}") for i in range(nodes)]
    alive = [f"n{i}" for i in range(nodes)]
    k, t = nodes, rng.expovariate(1 / every_s)
    while t < hours * 3600 - 60:
        ev.append((t, "remove", alive.pop(0)))
        alive.append(f"n{k}")
        ev.append((t + 60, "add", alive[-1]))
        k += 1
        t += 60 + rng.expovariate(1 / every_s)
    return trace(*ev, duration=hours * 3600)


@pytest.mark.parametrize("every_s, share", [(600.0, 1.0), (600.0, 0.1), (120.0, 1.0)])
def test_auto_is_within_5_percent_of_the_best_fixed_interval_in_hindsight(every_s, share) -> None:
    """Random churn (a node lost every ``every_s`` on average, a share of them without notice); the
    controller in the loop against a sweep of fixed intervals, total waste over three seeds."""
    t = _churn(12, every_s)
    c = ChangeCosts(detect_failure_s=Dist.of([6, 10, 14]), reformation_s=Dist.of([1, 3]), restore_s=Dist.of([4, 6]),
                    periodic_overhead_s=Dist.of([0.4, 0.6]), periodic_persist_s=Dist.of(2.0))
    job = JobModel(node_s_per_step=8 * 0.5)

    def waste(policy: IntervalPolicy) -> float:
        return sum(simulate(t, c, job, policy, settings=AutoSettings(min_s=5, max_s=7200, prior_mtbf_s=3600),
                            unannounced=pick_unannounced(t, share, seed), seed=seed).waste_total_node_s
                   for seed in (1, 2, 3))

    grid = [5 * 1.25 ** k for k in range(30)]  # 5 s .. ~3.2 h
    best = min(waste(IntervalPolicy(IntervalMode.FIXED, seconds=s)) for s in grid)
    auto = waste(IntervalPolicy(IntervalMode.AUTO))
    assert auto <= 1.05 * best, (auto, best)


def _pairs(hours: float, every_s: float, seed: int = 7) -> Trace:
    """Two nodes that go together (``every_s`` apart on average); a fresh pair arrives a minute later."""
    rng = random.Random(seed)
    ev, k, t = [(0.0, "add", "a0"), (0.0, "add", "b0")], 0, rng.expovariate(1 / every_s)
    while t < hours * 3600 - 60:
        ev += [(t, "remove", f"a{k}"), (t, "remove", f"b{k}")]
        k += 1
        ev += [(t + 60, "add", f"a{k}"), (t + 60, "add", f"b{k}")]
        t += 60 + rng.expovariate(1 / every_s)
    return trace(*ev, duration=hours * 3600)


@pytest.mark.parametrize("kind, share", [("churn", 0.1), ("pairs", 1.0), ("pairs", 0.5)])
def test_in_place_auto_is_within_5_percent_of_the_best_fixed_interval_in_hindsight(kind, share) -> None:
    """In place, a loss the survivors hold the state through rolls nothing back: the controller learns
    from the losses survived (churn: one node of 8 at a time; 1.057 with the estimate that ignored them)
    and from those that took the state (pairs: both nodes of the world go at once, every loss a rollback)."""
    t = _churn(12, 600.0) if kind == "churn" else _pairs(12, 1200.0)
    # pairs: the world restarts cold after every loss (cold_restore_s); the restore costs what the others do.
    c = ChangeCosts(detect_failure_s=Dist.of([6, 10, 14]), reformation_s=Dist.of([1, 3]), restore_s=Dist.of([4, 6]),
                    cold_restore_s=Dist.of([4, 6]), periodic_overhead_s=Dist.of([0.4, 0.6]), periodic_persist_s=Dist.of(2.0))
    job = JobModel(node_s_per_step=8 * 0.5, in_place=True)

    def waste(policy: IntervalPolicy) -> float:
        return sum(simulate(t, c, job, policy, settings=AutoSettings(min_s=5, max_s=7200, prior_mtbf_s=3600),
                            unannounced=pick_unannounced(t, share, seed), seed=seed).waste_total_node_s
                   for seed in (1, 2, 3))

    grid = [5 * 1.25 ** k for k in range(30)]
    best = min(waste(IntervalPolicy(IntervalMode.FIXED, seconds=s)) for s in grid)
    auto = waste(IntervalPolicy(IntervalMode.AUTO))
    assert auto <= 1.05 * best, (auto, best)


def test_torchrun_rounds_below_max_nodes_wait_out_the_last_call() -> None:
    """torch's c10d rendezvous (``JobModel.last_call_s``): 3 nodes of at most 3 start at once (a full
    round: no wait); c dies at 50: detected at 51, the survivors' round opens 51..53 and, 2 < 3, waits
    its 30 s last call until 83, restore 83..88. With a node d joining at 60 (ready at 61) the round
    fills to 3 and completes at once: restore 61..66."""
    job = JobModel(node_s_per_step=1, notices=False, resize_checkpoint=False, last_call_s=30, max_nodes=3)
    c = costs(warmup_s=1, reformation_s=2, startup_s=3, restore_s=5, detect_failure_s=1)
    base = [(0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (50, "remove", "c")]
    r = simulate(trace(*base, duration=100), c, job, OFF)
    check(r)
    assert r.world_time_s == pytest.approx({3: 44, 2: 12})
    assert r.waste_node_s["reformation"] == pytest.approx(3 * 2 + 2 * (2 + 30))
    filled = simulate(trace(*base, (60, "add", "d"), duration=100), c, job, OFF)
    check(filled)
    assert filled.world_time_s == pytest.approx({3: 44 + 34})
    # without the last call (trainguard's planned rounds): restore 53..58
    plain = simulate(trace(*base, duration=100), c, JobModel(node_s_per_step=1, notices=False, resize_checkpoint=False), OFF)
    assert plain.world_time_s == pytest.approx({3: 44, 2: 42})


def test_a_world_back_from_zero_nodes_starts_cold_not_as_a_join() -> None:
    """a, alone, dies without notice at 10; b arrives at 20 (warm at 21). No peer holds the state: b's
    world is a cold start (its first rendezvous 2 s, a restore from storage 30 s), not a join (0.5 + 0.5)."""
    c = costs(warmup_s=1, detect_failure_s=1, start_reformation_s=2, cold_restore_s=30, join_reformation_s=0.5,
              join_restore_s=0.5)
    r = simulate(trace((0, "add", "a"), (10, "remove", "a"), (20, "add", "b"), duration=100), c,
                 JobModel(node_s_per_step=1, in_place=True), OFF, unannounced=[0])
    check(r)
    assert [ch.why for ch in r.changes] == ["start", "failure", "join"]
    assert r.waste_node_s["reformation"] == pytest.approx(2 + 2)       # the first world's, then the cold one's
    assert r.waste_node_s["restore"] == pytest.approx(30)               # the start-up costs 0 here
    assert r.productive_node_s == pytest.approx(100 - 53)              # b trains from 53 (21 + 2 + 30)
    assert r.waste_node_s["recompute"] == pytest.approx(7)             # a trained 3..10: no commit


@pytest.mark.parametrize("kind, detection", [(FailureKind.KILL, 1), (FailureKind.FROZEN, 6), (FailureKind.HANG, 20)])
def test_detection_is_per_failure_kind(kind, detection) -> None:
    """b is lost without notice at 10: a killed process is seen at once (its sockets reset), a vanished
    machine after the missed heartbeats, a hung one after the progress timeout; a waits that long."""
    c = costs(detect_failure_s=1, detect_frozen_s=6, detect_hang_s=20)
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), (10, "remove", "b"), duration=60), c,
                 JobModel(node_s_per_step=1, in_place=True, unannounced_kind=kind), OFF, unannounced=[0])
    check(r)
    assert r.waste_node_s["detection"] == pytest.approx(detection)


W4 = ("n1", "n2", "n3", "n4")


@pytest.mark.parametrize("state, tier1, group, lost, survives", [
    (StateLayout.REPLICATED, Tier1.NONE, 4, {"n1", "n2", "n3"}, True),     # one copy left is enough
    (StateLayout.REPLICATED, Tier1.NONE, 4, set(W4), False),               # nothing left
    (StateLayout.SHARDED, Tier1.NONE, 4, {"n2"}, False),                   # n2's shard only in storage
    (StateLayout.SHARDED, Tier1.NONE, 4, {"x9"}, True),                    # not in the world: nothing lost
    (StateLayout.SHARDED, Tier1.COPIES, 4, {"n2"}, True),                  # its copy is on n3
    (StateLayout.SHARDED, Tier1.COPIES, 4, {"n1", "n3"}, True),            # copies on n2 and n4
    (StateLayout.SHARDED, Tier1.COPIES, 4, {"n2", "n3"}, False),           # n2 with its buddy n3
    (StateLayout.SHARDED, Tier1.COPIES, 4, {"n4", "n1"}, False),           # the ring closes: n4's copy is on n1
    (StateLayout.SHARDED, Tier1.PARITY, 2, {"n1", "n3"}, True),            # one per group {n1,n2} {n3,n4}
    (StateLayout.SHARDED, Tier1.PARITY, 2, {"n3", "n4"}, False),           # two in one group
    (StateLayout.SHARDED, Tier1.PARITY, 4, {"n1", "n4"}, False),
])
def test_what_a_loss_in_place_survives(state, tier1, group, lost, survives) -> None:
    job = JobModel(in_place=True, state=state, tier1=tier1, parity_group=group)
    assert job.survives(W4, lost) is survives
    assert JobModel(in_place=False, state=state, tier1=tier1).survives(W4, lost) is False


def test_a_parity_group_needs_two_nodes() -> None:
    with pytest.raises(ValueError, match="parity_group"):
        JobModel(parity_group=1)


@pytest.mark.parametrize("tier1, recompute, restore", [(Tier1.COPIES, 1, 1), (Tier1.NONE, 20 + 1, 9)])
def test_sharded_state_without_tier1_restores_from_storage(tier1, recompute, restore) -> None:
    """FSDP in place, b lost without notice at 10.5 (no commit since the start): with tier-1 copies the
    survivor rebuilds b's shard and loses the half step (1 node-s, restore 1 s on a); without them the
    world rolls back to the start (2 nodes x 10.5 s) and a restores from storage (9 s)."""
    c = costs(detect_failure_s=0, failure_restore_s=1, storage_restore_s=9)
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), (10.5, "remove", "b"), duration=60), c,
                 JobModel(node_s_per_step=2, in_place=True, state=StateLayout.SHARDED, tier1=tier1), OFF,
                 unannounced=[0])
    check(r)
    assert r.waste_node_s["recompute"] == pytest.approx(recompute)
    assert r.waste_node_s["restore"] == pytest.approx(restore)
    assert r.failures_seen == (0 if tier1 is Tier1.COPIES else 1)


def test_an_emergency_checkpoint_cut_off_by_the_reclaim_restarted_the_world_from_storage() -> None:
    """The runtime before 2026-11-29 (``abandon_in_place=False``). In place, b's notice comes 2 s before it
    goes (drain at 29 after 1 s of detection) and the emergency checkpoint needs 5 s: b is gone at 30 with
    it unfinished. The runtime abandoned the save at the drain deadline and every worker exited, so the
    survivor did not keep its memory: the world rolls back to the start (2 nodes x 29 s), a detects
    30..31, re-forms 31..32 and restores from storage 32..36 (storage_restore_s, not failure_restore_s),
    then trains alone to 60."""
    c = costs(detect_notice_s=1, emergency_s=5, detect_failure_s=1, failure_reformation_s=1, storage_restore_s=4,
              failure_restore_s=100, restore_s=100)
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), (30, "remove", "b"), duration=60), c,
                 JobModel(node_s_per_step=1, in_place=True, abandon_in_place=False), OFF, lead_s=2)
    check(r)
    assert r.waste_node_s["checkpoint"] == pytest.approx(2)        # the cut-off save, 29..30 on both
    assert r.waste_node_s["recompute"] == pytest.approx(58)
    assert r.waste_node_s["detection"] == pytest.approx(1)
    assert r.waste_node_s["reformation"] == pytest.approx(1)
    assert r.waste_node_s["restore"] == pytest.approx(4)
    assert r.productive_node_s == pytest.approx(24)
    assert r.failures_seen == 1


@pytest.mark.parametrize("state, tier1, survives", [
    (StateLayout.REPLICATED, Tier1.NONE, True),
    (StateLayout.SHARDED, Tier1.COPIES, True),
    (StateLayout.SHARDED, Tier1.NONE, False),
])
def test_an_emergency_checkpoint_cut_off_by_the_reclaim_leaves_the_survivors_their_memory(state, tier1, survives) -> None:
    """The runtime since 2026-11-29: the same cut-off save as above, but the survivor re-forms in place at
    the drain deadline (30, no detection: the leaver drained) from what it holds, where that covers the
    loss: re-forms 30..31 and restores from memory 31..31.5 (failure_restore_s), nothing rolled back. Sharded
    state without tier 1 still rolls back to the start and restores from storage 31..35."""
    c = costs(detect_notice_s=1, emergency_s=5, detect_failure_s=1, failure_reformation_s=1, storage_restore_s=4,
              failure_restore_s=0.5, restore_s=100)
    r = simulate(trace((0, "add", "a"), (0, "add", "b"), (30, "remove", "b"), duration=60), c,
                 JobModel(node_s_per_step=1, in_place=True, state=state, tier1=tier1), OFF, lead_s=2)
    check(r)
    assert r.waste_node_s["checkpoint"] == pytest.approx(2)        # the cut-off save, 29..30 on both
    assert r.waste_node_s["detection"] == 0
    assert r.waste_node_s["reformation"] == pytest.approx(1)
    if survives:
        assert r.waste_node_s["recompute"] == 0
        assert r.waste_node_s["restore"] == pytest.approx(0.5)
        assert r.productive_node_s == pytest.approx(58 + 28.5)
        assert r.failures_seen == 0
    else:
        assert r.waste_node_s["recompute"] == pytest.approx(58)
        assert r.waste_node_s["restore"] == pytest.approx(4)
        assert r.productive_node_s == pytest.approx(25)
        assert r.failures_seen == 1


def test_a_background_persist_slowing_the_steps_lengthens_the_auto_interval() -> None:
    """The interval controller counts the steps a background persist slows in the save cost, as the
    runtime's does: with 2 s of interference per save the auto interval is longer (fewer saves); the
    step times already hold the slowdown, so it is not charged as waste again."""
    t = trace((0, "add", "a"), (0, "add", "b"), duration=3000)
    auto = IntervalPolicy(IntervalMode.AUTO)
    settings = AutoSettings(min_s=1.0, max_s=600.0, prior_mtbf_s=300.0)
    quiet = simulate(t, costs(periodic_overhead_s=0.1, periodic_persist_s=0.5), JobModel(node_s_per_step=1), auto,
                     settings=settings)
    busy = simulate(t, costs(periodic_overhead_s=0.1, periodic_persist_s=0.5, periodic_interference_s=2.0),
                    JobModel(node_s_per_step=1), auto, settings=settings)
    check(busy)
    assert busy.periodic_saves < quiet.periodic_saves / 2
    assert busy.waste_node_s["periodic_checkpoint"] == pytest.approx(busy.periodic_saves * 0.1 * 2)


def test_a_rollback_counts_when_a_world_resumes_from_the_older_commit() -> None:
    """As the replay's ground truth (a step is lost when a later world re-trains it): b dies without
    notice at 30 (nothing committed since the start, 0..1 the first rendezvous), a detects it by 31,
    re-forms by 32 and restores by 36: the 58 node-s trained before are recompute. With the trace ending at 34, before that restore, no world
    has resumed from the older commit: the work is kept."""
    c = costs(detect_failure_s=1, reformation_s=1, restore_s=4)
    job = JobModel(node_s_per_step=1, in_place=False)
    resumed = simulate(trace((0, "add", "a"), (0, "add", "b"), (30, "remove", "b"), duration=60), c, job, OFF,
                       unannounced=[0])
    check(resumed)
    assert resumed.waste_node_s["recompute"] == pytest.approx(58)
    ended = simulate(trace((0, "add", "a"), (0, "add", "b"), (30, "remove", "b"), duration=34), c, job, OFF,
                     unannounced=[0])
    check(ended)
    assert ended.waste_node_s["recompute"] == 0
    assert ended.productive_node_s == pytest.approx(58)
    assert ended.kept_steps == pytest.approx(58)             # 0.5 s steps at 2 nodes
