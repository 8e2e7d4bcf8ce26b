"""Cost and goodput arithmetic on scripted timelines (no processes, no sleeps)."""

from __future__ import annotations

import json

import pytest

from trainguard.contract.configbase import ConfigError, FieldError
from trainguard.metrics.config import CostConfig, MetricsConfig
from trainguard.metrics.cost import cost_of, cost_snapshot, load_price_table, resolve_price
from trainguard.metrics.goodput import GoodputLedger, GoodputSnapshot

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float) -> float:
        self.t += dt
        return self.t


def check_partition(g: GoodputSnapshot) -> None:
    assert g.paid_s == pytest.approx(g.productive_s + g.wasted_total_s, abs=1e-9)
    assert all(v >= -1e-9 for v in g.wasted_s.values()), g.wasted_s


class Worker:
    """A node's workers as the agent's sampler sees them: the last step and the cumulative step time."""

    def __init__(self, ledger: GoodputLedger, clock: Clock) -> None:
        self.led, self.c = ledger, clock
        self.step, self.train_s = 0, 0.0

    def setup(self, after_s: float) -> None:
        """Process start, imports, model build: ``after_s`` seconds, then the series is declared."""
        self.c.tick(after_s)
        self.led.progress(None, train_s=self.train_s)

    def train(self, first: int, last: int, step_s: float, gap_s: float = 0.0) -> None:
        """Steps ``first..last`` of ``step_s`` each, ``gap_s`` between steps; one sample after each."""
        for s in range(first, last + 1):
            self.c.tick(step_s)
            self.step, self.train_s = s, self.train_s + step_s
            self.led.progress(s, train_s=self.train_s)
            if gap_s:
                self.c.tick(gap_s)


def test_worker_startup_is_not_productive() -> None:
    """The agent starts at 0, runs workers at 15; they import and build until 18, restore until 20,
    then train 100 steps of 1 s: only the steps are productive."""
    c = Clock(0)
    led = GoodputLedger(c)
    w = Worker(led, c)
    c.tick(10)
    led.set_state("rendezvous")
    c.tick(5)
    led.set_state("running")
    w.setup(3)
    c.tick(2)  # restore: no sample in between
    w.train(1, 100, 1.0)
    g = led.snapshot()
    check_partition(g)
    assert g.paid_s == pytest.approx(120)
    assert g.productive_s == pytest.approx(100)
    assert g.wasted_s["startup"] == pytest.approx(20)
    assert g.goodput == pytest.approx(100 / 120)


def test_time_between_steps_is_checkpoint_waste() -> None:
    c = Clock(0)
    led = GoodputLedger(c)
    w = Worker(led, c)
    led.set_state("running")
    w.setup(1)
    for chunk in range(5):  # a 0.5 s save after every 10th step
        w.train(chunk * 10 + 1, chunk * 10 + 10, 0.2)
        c.tick(0.5)
    led.stop()
    g = led.snapshot()
    check_partition(g)
    assert g.productive_s == pytest.approx(10)
    assert g.wasted_s["checkpoint"] == pytest.approx(2.5)
    assert g.wasted_s["startup"] == pytest.approx(1)


def test_drain_then_resize_is_drain_downtime_until_steps_flow_again() -> None:
    c = Clock(0)
    led = GoodputLedger(c)
    w = Worker(led, c)
    led.set_state("running")
    w.setup(0)
    w.train(1, 50, 1.0)
    led.set_cause("drain")        # notice arrives while running
    w.train(51, 52, 1.0)          # workers reach the agreed step
    led.set_state("draining")
    c.tick(6)                     # emergency checkpoint
    led.set_state("resizing")
    c.tick(4)                     # re-rendezvous at the smaller size
    led.set_state("running")
    w.setup(5)                    # new worker processes start, import, restore
    w.train(53, 62, 1.0)
    g = led.snapshot()
    check_partition(g)
    assert g.productive_s == pytest.approx(62)
    assert g.wasted_s["drain"] == pytest.approx(15)
    assert g.wasted_s["restart"] == 0 and g.wasted_s["recompute"] == 0 and g.wasted_s["resize"] == 0


def test_a_short_in_place_resize_is_resize_waste_though_step_reports_come_late() -> None:
    """Workers flush their step seconds every 8 steps (at agreement boundaries), so samples in
    between see no step and the flush overshoots its window. A peer's drain re-forms this node in
    place in 40 ms: that downtime is ``resize`` waste, not swallowed by the overshoot owed to the
    steady windows the late steps ran in; the steady windows pay it back and the totals stay exact."""
    c = Clock(0)
    led = GoodputLedger(c)
    led.set_state("running")
    led.progress(None, train_s=0.0)
    train, step, prev = 0.0, 0, {}
    for k in range(1, 41):  # 0.1 s steps, a sample every 0.25 s: a flush of 0.8 s of steps every 0.8 s
        c.t = k * 0.25
        while (step + 1) * 0.1 <= c.t + 1e-9:
            step += 1
        if step % 8 == 0 and step * 0.1 > train:
            train = step * 0.1
        led.progress(step, train_s=train)
        g = led.snapshot()
        assert all(g.wasted_s[r] >= prev.get(r, 0.0) - 1e-9 for r in g.wasted_s), (k, g.wasted_s, prev)
        prev = dict(g.wasted_s)
    # Steps 81..83 ran (0.3 s) and sit unflushed when the workers park: the carry is owed now.
    c.tick(0.3)
    led.progress(step, train_s=train)
    led.set_state("resizing")
    c.tick(0.01)
    led.set_state("rendezvous")
    c.tick(0.03)
    led.set_state("running")
    c.tick(0.05)  # the first step at the new size ends; the parked steps' seconds flush with it
    led.progress(step + 1, train_s=train + 0.3)
    g = led.snapshot()
    check_partition(g)
    assert g.wasted_s["resize"] >= 0.04 - 1e-9, g.wasted_s
    assert g.wasted_s["checkpoint"] >= prev["checkpoint"] - 1e-9
    led.stop()
    g = led.snapshot()
    check_partition(g)
    assert g.productive_s <= train + 0.3 + 1e-9


def test_step_time_that_reaches_a_draining_agent_late_is_productive() -> None:
    """Workers flush their step seconds every 5 steps (agreement boundaries); the agent samples every
    0.25 s. A notice comes mid-stride: the agent drains, the workers train to the agreed stop step (the
    stride's end), flush every step second as they exit, and the agent stops. The steps that ran before
    the notice reach the agent only in the drain, late; no steady window follows to pay them back, so
    the steady non-step time they were first taken for is held back (``LATE_S``) and reclaimed: at the
    end every reported step second is productive, exactly, and no waste counter ever went down."""
    c = Clock(0)
    led = GoodputLedger(c)
    led.set_state("running")
    c.tick(2.0)  # start-up: imports, model build
    led.progress(None, train_s=0.0)
    events: list[tuple[float, str, int]] = []  # (time, what, step)
    t = 2.0
    for step in range(1, 26):  # 0.1 s steps, 0.02 s of agreement between them
        t += 0.1
        events.append((t, "step", step))
        t += 0.02
    events += [(2.0 + 0.25 * k, "sample", 0) for k in range(1, 13)]
    notice = 2.0 + 23 * 0.12 + 0.05  # during step 24: steps 21..23 ran and sit unflushed
    events.append((notice, "notice", 0))
    events.sort()
    done = flushed = 0
    prev: dict[str, float] = {}
    for when, what, step in events:
        c.t = when
        if what == "step":
            done = step
            if step % 5 == 0:
                flushed = step
                if step == 25:  # the stop step: the workers flush and exit
                    break
        elif what == "sample":
            led.progress(done, train_s=flushed * 0.1)
        else:
            led.set_cause("drain")
            led.set_state("draining")
        g = led.snapshot()
        check_partition(g)
        assert all(g.wasted_s[r] >= prev.get(r, 0.0) - 1e-9 for r in g.wasted_s), (when, g.wasted_s, prev)
        prev = dict(g.wasted_s)
    assert done == 25 and c.t < 2.0 + 0.25 * 12
    led.progress(25, train_s=2.5)  # the exited workers' last flush (mark_worker_dead samples first)
    c.tick(0.05)
    led.set_state("stopped")
    g = led.snapshot()
    check_partition(g)
    assert all(g.wasted_s[r] >= prev.get(r, 0.0) - 1e-9 for r in g.wasted_s), (g.wasted_s, prev)
    assert g.productive_s == pytest.approx(2.5, abs=1e-9)
    # Waste is the rest: start-up (at least the 2 s before the workers declared; which window a late
    # step second is taken back from is the newest, so the split between causes is approximate), the
    # 0.02 s between steps and the 0.05 s from the workers' exit to the stop.
    assert g.wasted_total_s == pytest.approx(2.0 + 24 * 0.02 + 0.05, abs=1e-9)
    assert g.wasted_s["startup"] >= 2.0 - 1e-9 and g.wasted_s["drain"] >= 0.05 - 1e-9


def test_crash_restart_and_recompute() -> None:
    c = Clock(0)
    led = GoodputLedger(c)
    w = Worker(led, c)
    led.set_state("running")
    w.setup(0)
    w.train(1, 40, 1.0)
    led.committed(40)
    w.train(41, 55, 1.0)
    c.tick(0.5)                    # half of step 56, then a worker dies
    led.set_cause("restart")       # the supervisor says why ...
    led.set_state("restarting")    # ... then changes state
    c.tick(4)
    led.set_state("rendezvous")
    c.tick(1)
    led.set_state("running")
    c.tick(3)                      # new workers start and restore step 40
    seconds, steps = led.restored(40)
    w.setup(0)
    w.train(41, 60, 1.0)
    g = led.snapshot()
    check_partition(g)
    assert steps == 15
    assert seconds == pytest.approx(15)              # steps 41..55
    assert g.wasted_s["recompute"] == pytest.approx(15)
    assert g.wasted_s["restart"] == pytest.approx(0.5 + 4 + 1 + 3)  # the lost half step, downtime, start-up
    assert g.productive_s == pytest.approx(40 + 20)
    assert g.recomputed_steps == 15
    # A second rollback to the same checkpoint reclaims only what was trained since the first.
    led.set_state("restarting")
    seconds2, steps2 = led.restored(40)
    assert steps2 == 20 and seconds2 == pytest.approx(20)
    check_partition(led.snapshot())


def test_restore_between_sampled_marks_interpolates() -> None:
    c = Clock(0)
    led = GoodputLedger(c)
    led.set_state("running")
    led.progress(None, train_s=0.0)
    for s in (10, 20, 30):         # sampled every 10 s, 1 step/s
        c.tick(10)
        led.progress(s, train_s=float(s))
    led.set_state("rendezvous")
    seconds, steps = led.restored(25)
    assert steps == 5 and seconds == pytest.approx(5)


def test_samples_out_of_step_with_steps_keep_counters_monotonic_and_totals_exact() -> None:
    """Steps of 0.3 s, a 0.1 s gap, samples every second: a step straddles most sample instants."""
    c = Clock(0)
    led = GoodputLedger(c)
    led.set_state("running")
    led.progress(None, train_s=0.0)
    t, train, step, done = 0.0, 0.0, 0, []  # completion times of steps
    while t < 100:
        t += 0.3
        step += 1
        done.append((t, step, train + 0.3))
        train += 0.3
        t += 0.1
    prev: dict[str, float] = {}
    for k in range(1, 101):
        c.t = float(k)
        last = [d for d in done if d[0] <= k][-1]
        led.progress(last[1], train_s=last[2])
        g = led.snapshot()
        check_partition(g)
        assert all(g.wasted_s[r] >= prev.get(r, 0.0) - 1e-9 for r in g.wasted_s), (k, g.wasted_s, prev)
        prev = dict(g.wasted_s)
    led.stop()
    g = led.snapshot()
    last = [d for d in done if d[0] <= 100][-1]
    # The step in flight at the stop is lost; up to it, 0.3 of every 0.4 s trained.
    assert g.productive_s == pytest.approx(last[2], abs=1e-6)
    # Non-step time: the first sample's window is start-up (no step had completed when it opened).
    assert g.wasted_s["startup"] == pytest.approx(0.4, abs=1e-6)
    assert g.wasted_s["checkpoint"] == pytest.approx(100 - last[2] - 0.4, abs=1e-6)


def test_without_step_reports_running_time_is_productive() -> None:
    """Unmodified torchrun scripts report no step time: the state-only view."""
    c = Clock()
    led = GoodputLedger(c)
    c.tick(10)
    led.set_state("rendezvous")
    c.tick(5)
    led.set_state("running")
    for s in range(1, 101):
        c.tick(1)
        led.progress(None)
    g = led.snapshot()
    check_partition(g)
    assert g.paid_s == pytest.approx(115)
    assert g.productive_s == pytest.approx(100)
    assert g.wasted_s["startup"] == pytest.approx(15)
    assert not led.reporting


def test_lost_work_reported_by_caller() -> None:
    c = Clock()
    led = GoodputLedger(c)
    w = Worker(led, c)
    led.set_state("running")
    w.setup(0)
    w.train(1, 30, 1.0)
    moved = led.lost_work(12, steps=12, reason="recompute")
    assert moved == pytest.approx(12)
    w.train(31, 40, 1.0)
    g = led.snapshot()
    check_partition(g)
    assert g.productive_s == pytest.approx(28)
    assert g.wasted_s["recompute"] == pytest.approx(12)
    assert led.lost_work(1e9) == pytest.approx(28)  # capped at what is there
    check_partition(led.snapshot())


def test_stop_ends_the_paid_clock_and_unknown_reason_is_other() -> None:
    c = Clock()
    led = GoodputLedger(c)
    led.set_state("running")
    c.tick(10)
    led.set_state("weird_state")
    c.tick(2)
    led.set_cause("not-a-reason")
    c.tick(3)
    led.set_state("stopped")
    c.tick(100)
    g = led.snapshot()
    check_partition(g)
    assert g.paid_s == pytest.approx(15)
    assert g.wasted_s["other"] == pytest.approx(5)
    led.set_state("running")   # ignored after stop
    assert led.snapshot().paid_s == pytest.approx(15)


@pytest.mark.parametrize("terminal", ["succeeded", "failed", "stopped"])
def test_the_paid_clock_stops_when_the_job_ends_whatever_the_outcome(terminal) -> None:
    c = Clock()
    led = GoodputLedger(c)
    led.set_state("running")
    c.tick(10)
    led.set_state(terminal)
    c.tick(1000)
    assert led.snapshot().paid_s == pytest.approx(10)


def test_committed_prunes_without_changing_totals() -> None:
    c = Clock()
    led = GoodputLedger(c)
    w = Worker(led, c)
    led.set_state("running")
    w.setup(0)
    for chunk in range(5):
        w.train(chunk * 100 + 1, chunk * 100 + 100, 0.1)
        led.set_state("resizing")
        c.tick(1)
        led.set_state("running")
        led.committed(chunk * 100 + 100)
    before = led.snapshot()
    assert len(led._marks) <= 2  # noqa: SLF001 - bounded memory
    check_partition(before)
    assert before.productive_s == pytest.approx(50)
    assert before.wasted_s["resize"] == pytest.approx(5)


def test_cost_arithmetic() -> None:
    g = GoodputSnapshot(paid_s=7200, productive_s=5400,
                        wasted_s={"startup": 600, "drain": 600, "restart": 300, "recompute": 300})
    c = cost_snapshot(g, 3.0, tokens=2_000_000, samples=4_000)
    assert c.total == pytest.approx(6.0)
    assert c.wasted == pytest.approx({"startup": 0.5, "drain": 0.5, "restart": 0.25, "recompute": 0.25})
    assert c.per_million_tokens == pytest.approx(3.0)
    assert c.per_thousand_samples == pytest.approx(1.5)
    assert g.goodput == pytest.approx(0.75)
    none = cost_snapshot(g, 3.0)
    assert none.per_million_tokens is None and none.per_thousand_samples is None
    assert cost_of(1800, 2.0) == pytest.approx(1.0)


def test_price_resolution(tmp_path) -> None:
    assert resolve_price(CostConfig(spot_price_per_hour=1.5)).per_hour == 1.5
    od = resolve_price(CostConfig(capacity="on_demand", spot_price_per_hour=1.0, on_demand_price_per_hour=4.0))
    assert (od.per_hour, od.capacity, od.source) == (4.0, "on_demand", "config")
    assert resolve_price(CostConfig()).source == "unset"

    yml = tmp_path / "prices.yaml"
    yml.write_text("g5.xlarge: {spot: 0.4, on_demand: 1.006}\np4d.24xlarge: {on_demand: 32.77}\n")
    p = resolve_price(CostConfig(instance_type="g5.xlarge", price_table_file=str(yml)))
    assert p.per_hour == 0.4 and p.source.startswith("table:")
    js = tmp_path / "prices.json"
    js.write_text(json.dumps({"g5.xlarge": {"spot": 0.5}}))
    assert resolve_price(CostConfig(instance_type="g5.xlarge", price_table_file=str(js))).per_hour == 0.5

    with pytest.raises(ConfigError) as e:
        resolve_price(CostConfig(instance_type="nope", price_table_file=str(yml)))
    assert "cost.instance_type" in str(e.value) and "TRAINGUARD_COST_INSTANCE_TYPE" in str(e.value)
    with pytest.raises(ConfigError, match="no 'spot' price"):
        resolve_price(CostConfig(instance_type="p4d.24xlarge", price_table_file=str(yml)))
    with pytest.raises(ConfigError, match="TRAINGUARD_COST_PRICE_TABLE_FILE"):
        load_price_table(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("g5.xlarge: {spot: -1}\n")
    with pytest.raises(ConfigError, match="must be a number >= 0"):
        load_price_table(str(bad))


@pytest.mark.parametrize("kwargs, field", [
    ({"capacity": "reserved"}, "capacity"),
    ({"spot_price_per_hour": -1}, "spot_price_per_hour"),
    ({"price_table_file": "p.yaml"}, "instance_type"),
    ({"price_table_file": "p.csv", "instance_type": "x"}, "price_table_file"),
])
def test_cost_config_errors_name_the_field(kwargs, field) -> None:
    with pytest.raises(FieldError) as e:
        CostConfig(**kwargs)
    assert e.value.field == field and "Fix:" in str(e.value)


@pytest.mark.parametrize("kwargs, field", [
    ({"port": 70000}, "port"),
    ({"bind_address": " "}, "bind_address"),
    ({"sample_interval_s": 0}, "sample_interval_s"),
    ({"throughput_window_s": 1, "sample_interval_s": 1}, "throughput_window_s"),
])
def test_metrics_config_errors_name_the_field(kwargs, field) -> None:
    with pytest.raises(FieldError) as e:
        MetricsConfig(**kwargs)
    assert e.value.field == field


def test_a_node_drained_before_its_workers_reported_trained_nothing() -> None:
    """Its running time was pending (productive for now); the stop shows it was start-up."""
    c = Clock(0)
    led = GoodputLedger(c)
    c.tick(2)
    led.set_state("running")
    for _ in range(8):
        c.tick(1)
        led.progress(None)
        assert led.snapshot().productive_s > 0  # pending: tentatively productive
    led.set_cause("drain")
    led.set_state("draining")
    c.tick(1)
    led.set_state("stopped")
    g = led.snapshot()
    check_partition(g)
    assert g.productive_s == pytest.approx(0)
    assert g.wasted_s["startup"] == pytest.approx(2 + 8) and g.wasted_s["drain"] == pytest.approx(1)


def test_long_running_without_reports_is_a_tier1_script() -> None:
    from trainguard.metrics.goodput import TIER1_AFTER_S

    c = Clock(0)
    led = GoodputLedger(c)
    led.set_state("running")
    for _ in range(int(TIER1_AFTER_S) + 30):
        c.tick(1)
        led.progress(None)
    led.set_state("stopped")
    g = led.snapshot()
    check_partition(g)
    assert g.productive_s == pytest.approx(TIER1_AFTER_S + 30)
