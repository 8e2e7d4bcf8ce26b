"""The checkpoint interval: config syntax, Young/Daly arithmetic, and the auto controller on a fake clock."""

from __future__ import annotations

import math
import pickle

import pytest

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.interval import (
    AutoSettings,
    IntervalController,
    IntervalMode,
    IntervalPolicy,
    IntervalStats,
    REEVALUATE_S,
    daly_interval,
    parse_interval,
    policy_from_config,
    young_interval,
)
from trainguard.checkpoint.state import TrainerState
from trainguard.contract.configbase import FieldError

pytestmark = pytest.mark.timeout(30)
AUTO = IntervalPolicy(IntervalMode.AUTO)


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("text, mode, steps, seconds", [
    ("auto", IntervalMode.AUTO, 0, 0.0),
    (" AUTO ", IntervalMode.AUTO, 0, 0.0),
    ("50", IntervalMode.FIXED, 50, 0.0),
    ("50 steps", IntervalMode.FIXED, 50, 0.0),
    ("1step", IntervalMode.FIXED, 1, 0.0),
    ("90s", IntervalMode.FIXED, 0, 90.0),
    ("5m", IntervalMode.FIXED, 0, 300.0),
    ("2 min", IntervalMode.FIXED, 0, 120.0),
    ("1.5h", IntervalMode.FIXED, 0, 5400.0),
    ("250ms", IntervalMode.FIXED, 0, 0.25),
    ("off", IntervalMode.OFF, 0, 0.0),
    ("0", IntervalMode.OFF, 0, 0.0),
    ("0s", IntervalMode.OFF, 0, 0.0),
])
def test_parse_interval(text, mode, steps, seconds) -> None:
    p = parse_interval(text)
    assert (p.mode, p.steps, p.seconds) == (mode, steps, pytest.approx(seconds))


@pytest.mark.parametrize("text", ["5x", "-3", "1.5", "auto-ish", "h", "s5"])
def test_parse_interval_rejects(text) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        parse_interval(text)


@pytest.mark.parametrize("interval, steps, secs, want, deprecated", [
    ("", 0, 0.0, IntervalPolicy(IntervalMode.AUTO), []),
    ("", 50, 0.0, IntervalPolicy(IntervalMode.FIXED, steps=50), ["interval_steps"]),
    ("", 0, 30.0, IntervalPolicy(IntervalMode.FIXED, seconds=30.0), ["interval_s"]),
    ("", 50, 30.0, IntervalPolicy(IntervalMode.FIXED, steps=50, seconds=30.0), ["interval_steps", "interval_s"]),
    ("off", 0, 0.0, IntervalPolicy(IntervalMode.OFF), []),
    ("20", 0, 0.0, IntervalPolicy(IntervalMode.FIXED, steps=20), []),
])
def test_policy_from_config_keeps_the_deprecated_keys_working(interval, steps, secs, want, deprecated) -> None:
    assert policy_from_config(interval, steps, secs) == (want, deprecated)
    assert CheckpointConfig(interval=interval, interval_steps=steps, interval_s=secs).interval_policy() == (want, deprecated)


@pytest.mark.parametrize("kwargs, field, text", [
    ({"interval": "5x"}, "interval", "cannot read '5x'"),
    ({"interval": "50", "interval_steps": 10}, "interval", "deprecated interval_steps"),
    ({"interval": "auto", "interval_s": 10.0}, "interval", "deprecated interval_s"),
    ({"interval_min_s": 0}, "interval_min_s", "must be > 0"),
    ({"interval_min_s": 60, "interval_max_s": 30}, "interval_max_s", "must be >= interval_min_s"),
    ({"interval_prior_mtbf_s": -1}, "interval_prior_mtbf_s", "must be > 0"),
    ({"interval_hysteresis": 1.0}, "interval_hysteresis", "must be in [0, 1)"),
])
def test_config_errors_name_the_field(kwargs, field, text) -> None:
    with pytest.raises(FieldError) as e:
        CheckpointConfig(**kwargs)
    assert e.value.field == field and text in str(e.value) and "Fix:" in str(e.value)


def test_young_and_daly_arithmetic() -> None:
    assert young_interval(2.0, 100.0) == pytest.approx(20.0)            # sqrt(2 * 2 * 100)
    assert young_interval(1.0, 3600.0) == pytest.approx(84.8528, abs=1e-4)
    # Daly: sqrt(7200) * (1 + sqrt(1/7200)/3 + (1/7200)/9) - 1 = 84.8528 * 1.0039439 - 1
    assert daly_interval(1.0, 3600.0) == pytest.approx(84.1875, abs=1e-3)
    # C = 2, M = 8: sqrt(32) = 5.65685, x = C/2M = 1/8: 5.65685 * (1 + 0.35355/3 + 0.125/9) - 2
    #   = 5.65685 * 1.13174 - 2
    assert daly_interval(2.0, 8.0) == pytest.approx(4.4021, abs=1e-3)
    assert daly_interval(10.0, 4.0) == 4.0                               # C >= 2M: T = M
    assert daly_interval(0.0, 100.0) == 0.0
    assert daly_interval(1.0, 0.0) == 0.0


def test_auto_bootstraps_at_the_floor_until_a_save_is_measured() -> None:
    clock = Clock()
    c = IntervalController(AUTO, AutoSettings(min_s=30, max_s=3600), clock=clock)
    assert not c.due(1)
    ch = c.update()
    assert ch is not None and ch.reason == "bootstrap" and ch.new_s == 30 and ch.bound == "min"
    clock.t = 29.9
    assert not c.due(10)
    clock.t = 30.0
    assert c.due(11)
    c.saved()
    assert not c.due(12)


def test_auto_picks_the_daly_optimum_from_measured_inputs() -> None:
    clock = Clock()
    c = IntervalController(AUTO, AutoSettings(min_s=1, max_s=10_000, prior_mtbf_s=3600, hysteresis=0.2),
                           world_size=4, clock=clock)
    c.update()
    c.observe_save(blocked_s=1.0)      # async: persist reported later
    c.observe_persist(2.0)             # no step ran meanwhile: no interference
    assert c.save_cost_s == pytest.approx(1.0)
    ch = c.update()
    assert ch.reason == "save_cost_measured"
    # No failure yet, no exposure: M is the prior.
    assert c.mtbf_s == pytest.approx(3600)
    assert ch.new_s == pytest.approx(daly_interval(1.0, 3600)) and ch.bound is None
    assert ch.inputs["save_cost_s"] == pytest.approx(1.0) and ch.inputs["persist_s"] == pytest.approx(2.0)
    # 1000 s of training at 4 ranks, then a restore from a periodic checkpoint: one unannounced failure.
    clock.t = 1000.0
    c.observe_restore(5.0, "periodic")
    ch = c.update()
    assert c.stats.exposure_rank_s == pytest.approx(4000)
    assert c.mtbf_s == pytest.approx((4000 / 4 + 3600) / 2)             # (E/W + M0) / (n + 1) = 2300
    assert ch.reason == "unannounced_failure"
    assert ch.new_s == pytest.approx(daly_interval(1.0, 2300))
    assert c.stats.restore_s == pytest.approx(5.0)
    # A planned re-formation (resize checkpoint) is no failure.
    c.observe_restore(3.0, "resize")
    assert c.stats.unannounced_failures == 1 and c.stats.announced_restores == 1


def test_mtbf_scales_with_the_world_size() -> None:
    clock = Clock()
    c = IntervalController(AUTO, AutoSettings(prior_mtbf_s=100), world_size=2, clock=clock)
    clock.t = 900.0
    c.tick()
    c.stats.unannounced_failures = 2
    assert c.mtbf_s == pytest.approx((1800 / 2 + 100) / 3)
    c.set_world_size(4)                 # twice the nodes: failures twice as often
    assert c.mtbf_s == pytest.approx((1800 / 4 + 100) / 3)


def test_hysteresis_keeps_the_interval_until_the_optimum_moves_enough() -> None:
    clock = Clock()
    c = IntervalController(AUTO, AutoSettings(min_s=1, max_s=10_000, prior_mtbf_s=10_000, hysteresis=0.2), clock=clock,
                           sync_saves=True)
    c.observe_save(1.0, 0.0)
    first = c.update()
    assert first is not None
    t0 = c.interval_s
    # A 10 % dearer save moves the optimum by ~5 %: inside the band, nothing changes.
    c.observe_save(1.1 / 0.3 - 1.0 * 0.7 / 0.3, 0.0)   # EWMA (alpha 0.3) lands at 1.1
    assert c.save_cost_s == pytest.approx(1.1)
    assert c.update() is None and c.interval_s == t0
    # Saves four times as dear: the optimum doubles, past the band.
    for _ in range(30):
        c.observe_save(4.0, 0.0)
    ch = c.update()
    assert ch is not None and ch.reason == "save_cost" and ch.old_s == t0
    assert ch.new_s == pytest.approx(daly_interval(c.save_cost_s, c.mtbf_s))
    assert ch.new_s > 1.9 * t0


def test_exposure_alone_is_reevaluated_once_a_second_other_inputs_at_once() -> None:
    # update() runs at every step: when only the exposure grew, the optimum is recomputed at most
    # every REEVALUATE_S; a measured save, a restore or a world-size change is taken at the next call.
    clock = Clock()
    c = IntervalController(AUTO, AutoSettings(min_s=1, max_s=10_000, prior_mtbf_s=10, hysteresis=0.2),
                           clock=clock, sync_saves=True)
    c.observe_save(1.0, 0.0)
    assert c.update() is not None
    t0 = c.interval_s
    clock.t = 0.5 * REEVALUATE_S  # the MTBF estimate (prior 10 s + exposure) grew 5 %: not re-evaluated
    calls = []
    real = c.optimum
    c.optimum = lambda: calls.append(clock.t) or real()  # type: ignore[method-assign]
    assert c.update() is None and not calls
    assert c.stats.exposure_rank_s == pytest.approx(0.5 * REEVALUATE_S)  # exposure is still counted
    clock.t = 10.0  # exposure doubled the MTBF: re-evaluated once the period passed, past the band
    ch = c.update()
    assert calls == [10.0] and ch is not None and ch.reason == "failure_rate" and ch.new_s > t0
    clock.t = 10.1
    c.observe_restore(2.0, "periodic")  # an input other than exposure: at once
    ch = c.update()
    assert calls == [10.0, 10.1] and ch is not None and ch.reason == "unannounced_failure"
    clock.t = 10.2
    c.set_world_size(4)
    c.update()
    assert calls[-1] == 10.2


def test_bounds_floor_at_persist_time_and_cap_at_max() -> None:
    clock = Clock()
    c = IntervalController(AUTO, AutoSettings(min_s=30, max_s=600, prior_mtbf_s=3600), clock=clock)
    c.observe_save(0.001)
    c.observe_persist(0.5)
    ch = c.update()                      # optimum ~2.7 s < 30: the floor
    assert ch.bound == "min" and ch.new_s == 30 and ch.optimum_s == pytest.approx(daly_interval(0.001, 3600))
    c.observe_save(0.001)
    for _ in range(30):
        c.observe_persist(50.0)          # persisting takes longer than the floor: at most one in flight
    ch = c.update()
    assert c.bounds()[0] == pytest.approx(50.0, rel=1e-3)
    assert ch.bound == "min" and ch.new_s == pytest.approx(c.stats.persist_s)
    c2 = IntervalController(AUTO, AutoSettings(min_s=30, max_s=600, prior_mtbf_s=1e7), clock=clock, sync_saves=True)
    c2.observe_save(10.0, 5.0)
    ch = c2.update()                     # sqrt(2 * 15 * 1e7) ~ 17 000 s > 600: the cap
    assert ch.bound == "max" and ch.new_s == 600


def test_interference_of_a_background_persist_is_part_of_the_save_cost() -> None:
    c = IntervalController(AUTO, AutoSettings(), clock=Clock())
    for _ in range(20):
        c.observe_step(1.0, persisting=False)
    c.observe_save(0.2)                   # async
    for _ in range(5):
        c.observe_step(1.2, persisting=True)  # 0.2 s slower each while it persists
    c.observe_persist(5.0)
    assert c.stats.interference_s == pytest.approx(1.0)
    assert c.save_cost_s == pytest.approx(0.2 + 1.0)
    # Synchronous saves: everything blocks, the cost is blocked + persist.
    s = IntervalController(AUTO, AutoSettings(), clock=Clock(), sync_saves=True)
    s.observe_save(0.2, 3.0)
    assert s.save_cost_s == pytest.approx(3.2)


@pytest.mark.parametrize("policy, due_steps", [
    (IntervalPolicy(IntervalMode.FIXED, steps=5), [5, 10, 15]),
    (IntervalPolicy(IntervalMode.OFF), []),
])
def test_fixed_steps_and_off(policy, due_steps) -> None:
    c = IntervalController(policy, clock=Clock())
    assert [s for s in range(1, 16) if c.due(s)] == due_steps
    assert c.update() is None


def test_fixed_duration_restarts_at_each_save() -> None:
    clock = Clock()
    c = IntervalController(IntervalPolicy(IntervalMode.FIXED, seconds=10.0), clock=clock)
    due = []
    for k in range(1, 40):
        clock.t = float(k)
        if c.due(k):
            due.append(k)
            clock.t += 0.5               # the save itself
            c.saved()
    assert due == [10, 21, 32]


def test_stats_survive_a_restart_through_the_trainer_state() -> None:
    clock = Clock()
    c = IntervalController(AUTO, AutoSettings(min_s=1, prior_mtbf_s=1000), world_size=2, clock=clock, sync_saves=True)
    c.observe_save(0.5, 1.5)
    c.update()
    clock.t = 100.0
    c.tick()
    trainer = TrainerState(seed=1, cursor={"epoch": 0, "consumed": 48})
    trainer.extras["interval"] = c.stats.to_dict()
    saved = trainer.state_dict()
    # The next process: restores the trainer state (as DCP would, in place) and continues.
    loaded = TrainerState()
    loaded.load_state_dict(saved)
    assert loaded.cursor == {"epoch": 0, "consumed": 48}
    stats = IntervalStats.from_dict(loaded.extras["interval"])
    assert stats.exposure_rank_s == pytest.approx(200) and stats.blocked_s == pytest.approx(0.5)
    c2 = IntervalController(AUTO, AutoSettings(min_s=1, prior_mtbf_s=1000), world_size=2, clock=clock, sync_saves=True)
    c2.load_stats(stats)
    assert c2.interval_s == pytest.approx(c.interval_s)   # the interval in effect carries over
    c2.observe_restore(2.0, "periodic")
    ch = c2.update()
    assert ch.reason == "unannounced_failure" and ch.old_s == pytest.approx(c.interval_s)
    assert IntervalStats.from_dict({"saves": 3, "from_the_future": 1}).saves == 3


def test_trainer_state_loads_checkpoints_written_before_extras_existed() -> None:
    old = TrainerState(seed=1, cursor={"epoch": 2}).state_dict()
    old["cursor"] = pickle.dumps({"epoch": 2})           # the format before extras
    t = TrainerState()
    t.load_state_dict(old)
    assert t.cursor == {"epoch": 2} and t.extras == {}


def test_expected_optimum_beats_neighbours_under_the_first_order_waste_model() -> None:
    """The chosen interval minimises C/T + T/(2M) (Young's model) better than 0.5x or 2x it."""
    cost, mtbf = 3.0, 5000.0

    def waste(t: float) -> float:
        return cost / t + t / (2 * mtbf)

    t = daly_interval(cost, mtbf)
    assert waste(t) < waste(0.5 * t) and waste(t) < waste(2 * t)
    assert abs(t - math.sqrt(2 * cost * mtbf)) / t < 0.05


@pytest.mark.parametrize("kind, repeats, failures", [
    ("periodic", 0, 1),     # the world that wrote it did not stop as planned
    ("periodic", 2, 3),     # ... and two worlds that restored it since died too
    ("emergency", 0, 0),    # a drain: planned
    ("resize", 0, 0),       # a scale-up: planned
    ("resize", 1, 1),       # a world restored this resize checkpoint before us and died
    ("final", 0, 0),
])
def test_restores_tell_failures_from_planned_reformations(kind, repeats, failures) -> None:
    c = IntervalController(AUTO, clock=Clock())
    assert c.observe_restore(2.0, kind, repeats) == failures
    assert c.stats.unannounced_failures == failures
    assert c.stats.announced_restores == (0 if failures else 1)


def test_manager_reports_the_restored_kind_and_earlier_restores_of_it(tmp_path) -> None:
    """A resize checkpoint restored by round 1 (which then dies without saving) and again by round 2:
    round 2 sees one repeat, i.e. one unannounced failure; the extras ride along in the trainer state."""
    import torch

    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.checkpoint.state import ModelOptimizerState

    cfg = CheckpointConfig(url=str(tmp_path / "ckpt"))
    model = torch.nn.Linear(4, 2)

    def state(extras: dict | None = None) -> dict:
        t = TrainerState(seed=1)
        t.extras.update(extras or {})
        return {"app": ModelOptimizerState(model), "trainer": t}

    with CheckpointManager(cfg, "run", rank=0, world_size=1, rdzv_round=0) as m0:
        m0.save(7, state({"interval": {"unannounced_failures": 4}}), kind="resize", block=True)
    seen = []
    for fence in (1, 2):
        with CheckpointManager(cfg, "run", rank=0, world_size=1, rdzv_round=fence) as m:
            st = state()
            assert m.restore(st) == 7
            seen.append((m.last_restored.kind, m.last_restored_repeats, st["trainer"].extras["interval"]))
    assert seen == [("resize", 0, {"unannounced_failures": 4}), ("resize", 1, {"unannounced_failures": 4})]


def test_a_world_that_died_before_any_checkpoint_leaves_no_record(tmp_path) -> None:
    """Epochs are claimed at a world's first restore or save: a world that found nothing and died
    before its first save leaves no epoch record, so the next one cannot count it (the controller
    still would, given a count)."""
    import torch

    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.checkpoint.state import ModelOptimizerState

    cfg = CheckpointConfig(url=str(tmp_path / "ckpt"))
    seen = []
    for fence in (0, 1):  # round 0 starts, finds nothing, dies; round 1 starts from nothing again
        with CheckpointManager(cfg, "run", rank=0, world_size=1, rdzv_round=fence) as m:
            assert m.restore({"app": ModelOptimizerState(torch.nn.Linear(2, 2)), "trainer": TrainerState()}) is None
            seen.append((m.last_restored, m.last_restored_repeats))
    assert seen == [(None, 0), (None, 0)]
    c = IntervalController(AUTO, clock=Clock())
    assert c.observe_restore(None, "none", 1) == 1 and c.stats.restore_s is None


def test_a_survivable_world_is_rolled_back_only_by_losses_that_take_the_state() -> None:
    """M = M_f / p with p = (L + 1) / (L + S + 1) over the losses seen: with none seen a survivable world
    is estimated like one that cannot survive a loss (p = 1); each loss it survives lowers p, each
    restart from storage raises it. A world that cannot survive a loss keeps M = (E / W + M0) / (n + 1)."""
    clock = Clock()
    c = IntervalController(AUTO, AutoSettings(prior_mtbf_s=1000), world_size=2, survivable=True, clock=clock)
    clock.t = 500.0
    c.tick()
    base = 500 + 1000                                              # E / W + M0
    assert c.rollback_probability == 1.0
    assert c.mtbf_s == pytest.approx(base)
    c.observe_survived_loss(unannounced=False)                     # a drain the survivors re-formed through
    c.observe_survived_loss(unannounced=False)
    c.observe_survived_loss(unannounced=True)                      # a node lost without notice, survived
    assert (c.stats.survived_losses, c.stats.survived_failures, c.stats.unannounced_failures) == (3, 1, 0)
    assert c.rollback_probability == pytest.approx(1 / 4)
    assert c.failure_mtbf_s == pytest.approx(base / 2)             # one unannounced failure seen
    assert c.mtbf_s == pytest.approx(base / 2 * 4)
    assert c.observe_restore(2.0, "periodic") == 1                 # the whole world died: a rollback
    assert (c.stats.lost_worlds, c.stats.unannounced_failures) == (1, 1)
    assert c.rollback_probability == pytest.approx(2 / 5)
    assert c.mtbf_s == pytest.approx(base / 3 * 5 / 2)
    c.set_world_size(2, survivable=False)                          # e.g. one node left: every loss takes it
    assert c.rollback_probability == 1.0
    assert c.mtbf_s == pytest.approx(base / 2)                     # survived losses do not count there


def test_losses_survived_move_the_interval_only_in_a_survivable_world() -> None:
    clock = Clock()
    c = IntervalController(AUTO, AutoSettings(min_s=1, max_s=10_000, prior_mtbf_s=3600), world_size=4, clock=clock)
    c.observe_save(0.1)
    c.observe_persist(0.5)
    c.update()
    assert c.interval_s == pytest.approx(daly_interval(0.1, 3600))
    for _ in range(3):
        c.observe_survived_loss(unannounced=False)
    assert c.update() is None                                       # not survivable: nothing changed
    c.set_world_size(4, survivable=True)
    ch = c.update()
    assert ch is not None and ch.reason == "world_size"
    assert ch.new_s == pytest.approx(daly_interval(0.1, 4 * 3600))  # p = 1 / 4
    assert ch.inputs["rollback_probability"] == pytest.approx(0.25) and ch.inputs["failure_mtbf_s"] == pytest.approx(3600)


@pytest.mark.parametrize("kind, in_place, from_memory, counts", [
    # counts: rollbacks (unannounced_failures), survived_losses, survived_failures, lost_worlds, announced_restores
    ("periodic", False, False, (1, 0, 0, 1, 0)),    # restarted from storage after a loss without notice
    ("periodic", False, True, (0, 1, 1, 0, 0)),     # from a snapshot in memory (tier 0 or a buddy): survived
    ("periodic", True, False, (1, 0, 0, 1, 0)),     # in place, sharded state, back to storage: a rollback
    ("emergency", False, False, (0, 0, 0, 1, 1)),   # every node drained: the state did not survive in memory
    ("emergency", True, False, (0, 1, 0, 0, 1)),    # in place, sharded: the checkpoint taken at the stop
    ("emergency", False, True, (0, 1, 1, 0, 1)),    # a snapshot in memory whose base is an emergency one
    ("resize", False, False, (0, 0, 0, 0, 1)),      # a scale-up by restart: no loss
    ("resize", True, False, (0, 0, 0, 0, 1)),       # a scale-up in place (sharded state): no loss
    ("none", False, False, (0, 0, 0, 0, 1)),        # a first start
])
def test_restores_count_as_rollbacks_or_as_survived_losses(kind, in_place, from_memory, counts) -> None:
    c = IntervalController(AUTO, clock=Clock())
    c.observe_restore(2.0, kind, in_place=in_place, from_memory=from_memory)
    s = c.stats
    assert (s.unannounced_failures, s.survived_losses, s.survived_failures, s.lost_worlds,
            s.announced_restores) == counts
    assert IntervalStats.from_dict(s.to_dict()) == s
