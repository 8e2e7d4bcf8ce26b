"""Straggler detection (issue 38): the pure rules as tables, the agent's monitor and the spare's admission
against a fake store and fake clocks (no timing in any assertion)."""

from __future__ import annotations

import json

import pytest

from trainguard.agent.config import TrainguardConfig
from trainguard.agent.configload import load_config
from trainguard.agent.straggler import (AdmissionAct, Eviction, KeepReason, PaceRecord, PaceWindow, StragglerConfig,
                                        Verdict, decide_admission, decide_straggler, projected_gain, scores)
from trainguard.agent.stragglermon import StragglerMonitor, read_evictions, wait_as_spare
from trainguard.contract import protocol as proto
from trainguard.contract.configbase import ConfigError, FieldError


class FakeStore:
    """The slice of a TCPStore the straggler code uses."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d for k in keys)

    def get(self, key: str) -> bytes:
        return self.d[key]

    def set(self, key: str, value: bytes) -> None:
        self.d[key] = value

    def append(self, key: str, value: bytes) -> None:
        self.d[key] = self.d.get(key, b"") + value


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_scores_are_relative_to_the_other_nodes_median():
    s = scores({"a": 1.0, "b": 1.0, "c": 2.0})
    assert s == {"a": pytest.approx(1 / 1.5), "b": pytest.approx(1 / 1.5), "c": pytest.approx(2.0)}
    assert scores({"a": 1.0}) == {}
    assert scores({"a": 3.0, "b": 1.0}) == {"a": 3.0, "b": pytest.approx(1 / 3)}


@pytest.mark.parametrize("t_slow,t_rest,n,gain", [
    (2.0, 1.0, 3, 2.0 / 1.5),   # half speed on 3 nodes: 2 nodes at 1.5 beat 3 at 2
    (1.1, 1.0, 3, 1.1 / 1.5),   # 10 % slow: the job is faster with it
    (3.0, 1.0, 2, 1.5),         # 2 nodes: the rest alone takes twice as long
    (1.0, 1.0, 1, 0.0),         # nothing to compare
])
def test_projected_gain(t_slow, t_rest, n, gain):
    assert projected_gain(t_slow, t_rest, n) == pytest.approx(gain)


CFG = StragglerConfig(action="evict", threshold=1.3, sustain_s=20, margin=0.05, max_evictions_per_hour=2)
HALF = {"a": 1.0, "b": 1.02, "c": 2.0}
TEN = {"a": 1.0, "b": 1.0, "c": 1.1}
SLOW30 = {"a": 1.0, "b": 1.0, "c": 1.4}


@pytest.mark.parametrize("name,values,since,evictions,nodes,min_nodes,cfg,verdict,node,reason", [
    ("healthy", {"a": 1.0, "b": 1.05, "c": 0.98}, {}, [], 3, 1, CFG, Verdict.NONE, None, ""),
    ("first_seen_is_suspect", HALF, {}, [], 3, 1, CFG, Verdict.SUSPECT, "c", ""),
    ("not_yet_sustained", HALF, {"c": 990.0}, [], 3, 1, CFG, Verdict.SUSPECT, "c", ""),
    ("half_speed_evicted", HALF, {"c": 900.0}, [], 3, 1, CFG, Verdict.EVICT, "c", "faster_without"),
    ("ten_percent_below_threshold", TEN, {"c": 900.0}, [], 3, 1, CFG, Verdict.NONE, None, ""),
    ("ten_percent_low_threshold_kept", TEN, {"c": 900.0}, [], 3, 1,
     StragglerConfig(action="evict", threshold=1.05, sustain_s=20), Verdict.KEEP, "c", KeepReason.NOT_FASTER.value),
    ("slow_but_not_worth_it", SLOW30, {"c": 900.0}, [], 3, 1, StragglerConfig(action="evict", threshold=1.2, sustain_s=20),
     Verdict.KEEP, "c", KeepReason.NOT_FASTER.value),
    ("min_nodes", HALF, {"c": 900.0}, [], 3, 3, CFG, Verdict.KEEP, "c", KeepReason.MIN_NODES.value),
    ("rate_limited", HALF, {"c": 900.0}, [500.0, 900.0], 3, 1, CFG, Verdict.KEEP, "c", KeepReason.RATE_LIMITED.value),
    ("old_evictions_do_not_count", HALF, {"c": 900.0}, [-5000.0, -4000.0], 3, 1, CFG, Verdict.EVICT, "c", "faster_without"),
    ("action_report", HALF, {"c": 900.0}, [], 3, 1, StragglerConfig(action="report", sustain_s=20), Verdict.KEEP, "c",
     KeepReason.ACTION_REPORT.value),
    ("margin_blocks_a_small_gain", {"a": 1.0, "b": 1.0, "c": 1.55}, {"c": 900.0}, [], 3, 1,
     StragglerConfig(action="evict", sustain_s=20, margin=0.1), Verdict.KEEP, "c", KeepReason.NOT_FASTER.value),
    ("two_nodes_needs_twice", {"a": 1.0, "c": 2.5}, {"c": 900.0}, [], 2, 1, CFG, Verdict.EVICT, "c", "faster_without"),
    ("worst_of_two_slow", {"a": 1.0, "b": 1.0, "c": 2.0, "d": 3.0}, {"c": 900.0, "d": 900.0}, [], 4, 1, CFG,
     Verdict.EVICT, "d", "faster_without"),
    ("one_node", {"a": 5.0}, {}, [], 1, 1, CFG, Verdict.NONE, None, ""),
])
def test_decide_straggler(name, values, since, evictions, nodes, min_nodes, cfg, verdict, node, reason):
    d = decide_straggler(values, now=1000.0, above_since=since, evictions=evictions, nodes=nodes, min_nodes=min_nodes, cfg=cfg)
    assert (d.verdict, d.node, d.reason) == (verdict, node, reason), name
    if verdict is not Verdict.NONE:
        assert d.above_since[node] == since.get(node, 1000.0)  # the first time above is kept, never reset
    else:
        assert dict(d.above_since) == {}


def test_a_node_that_recovers_loses_its_sustain_time():
    d = decide_straggler(HALF, now=1000.0, above_since={}, evictions=[], nodes=3, min_nodes=1, cfg=CFG)
    d = decide_straggler({"a": 1.0, "b": 1.0, "c": 1.0}, now=1010.0, above_since=d.above_since, evictions=[], nodes=3,
                         min_nodes=1, cfg=CFG)
    d = decide_straggler(HALF, now=1025.0, above_since=d.above_since, evictions=[], nodes=3, min_nodes=1, cfg=CFG)
    assert d.verdict is Verdict.SUSPECT  # above again since 1025, not since 1000


@pytest.mark.parametrize("evicted_at,selftest,ref,failed_at,act,reason", [
    ([], None, None, None, AdmissionAct.ADMIT, "never_evicted"),
    ([950.0], None, None, None, AdmissionAct.WAIT, "cooldown"),
    ([800.0], None, None, None, AdmissionAct.SELFTEST, "cooldown_over"),
    ([800.0], 1.0, 0.9, None, AdmissionAct.ADMIT, "selftest_passed"),
    ([800.0], 2.0, 1.0, None, AdmissionAct.WAIT, "selftest_failed"),
    ([800.0], 1.25, 1.0, None, AdmissionAct.ADMIT, "selftest_passed"),  # readmit_ratio, not the straggler threshold
    ([800.0], 2.0, None, None, AdmissionAct.ADMIT, "selftest_passed"),  # no reference: nothing to compare to
    ([800.0], None, 1.0, 950.0, AdmissionAct.WAIT, "selftest_failed"),  # a failed test restarts the cool-down
    ([100.0, 500.0, 800.0], 1.0, 1.0, None, AdmissionAct.QUARANTINE, "evicted 3 times within 86400 s"),
])
def test_decide_admission(evicted_at, selftest, ref, failed_at, act, reason):
    cfg = StragglerConfig(cooldown_s=120.0, threshold=1.05, readmit_ratio=1.3, quarantine_after=3)
    a = decide_admission(now=1000.0, evicted_at=evicted_at, selftest_s=selftest, reference_s=ref, failed_at=failed_at, cfg=cfg)
    assert (a.act, a.reason) == (act, reason)


def test_pace_window_median_per_rank_and_expiry():
    clock = Clock(0.0)
    w = PaceWindow(10.0, clock)
    w.add(proto.Pace(rank=0, local_rank=0, step=3, compute_s=(1.0, 1.0, 9.0)))
    w.add(proto.Pace(rank=1, local_rank=1, step=3, compute_s=(2.0, 2.0, 2.0)))
    assert w.node_value(3) == (2.0, 3)  # the slowest rank's median; an outlier does not move it
    assert w.node_value(4) is None
    clock.t = 11.0
    w.add(proto.Pace(rank=0, local_rank=0, step=4, compute_s=(0.5,)))
    assert w.node_value(1) is None  # rank 1's samples expired
    w.add(proto.Pace(rank=1, local_rank=1, step=4, compute_s=(0.7,)))
    assert w.node_value(1) == (0.7, 1)


def test_records_round_trip():
    r = PaceRecord("n1", 0.25, 7, 3, 1234.5)
    assert PaceRecord.from_json(r.to_json()) == r
    assert PaceRecord.from_json(b"{bad") is None
    log = Eviction("n1", 10.0, "straggler", 2.0).to_line() + b"garbage\n" + Eviction("n2", 11.0).to_line()
    assert [e.node for e in Eviction.parse_log(log)] == ["n1", "n2"]


def _nodes(store, clock, wall, cfg, names=("a", "b", "c"), min_nodes=1):
    drained: dict[str, list[str]] = {n: [] for n in names}
    mons = {n: StragglerMonitor(cfg, job_id="j", node=n, min_nodes=min_nodes, interval_s=1.0,
                                request_drain=lambda why, n=n: drained[n].append(why), clock=clock, wall=wall)
            for n in names}
    return mons, drained


def _feed(mons, paces, step):
    for n, v in paces.items():
        mons[n].observe(proto.Pace(rank=0, local_rank=0, step=step, compute_s=(v,) * 5))


def _run(mons, store, clock, wall, paces, seconds, *, decider="a"):
    out = []
    for i in range(seconds):
        clock.t += 1.0
        wall.t += 1.0
        _feed(mons, paces, i)
        for n, m in mons.items():
            d = m.tick(store, round_=1, nodes=len(mons), decides=n == decider)
            if n == decider:
                out.append(d)
    return out


def test_monitor_evicts_a_half_speed_node_through_its_own_agent():
    store, clock, wall = FakeStore(), Clock(0.0), Clock(5000.0)
    cfg = StragglerConfig(action="evict", sustain_s=5.0, window_s=30.0, min_samples=5)
    mons, drained = _nodes(store, clock, wall, cfg)
    decisions = _run(mons, store, clock, wall, {"a": 0.10, "b": 0.11, "c": 0.21}, 10)
    verdicts = [d.verdict for d in decisions if d is not None]
    assert Verdict.SUSPECT in verdicts and verdicts[-1] in (Verdict.EVICT,)
    evictions = read_evictions(store, "j")
    assert [e.node for e in evictions] == ["c"]  # once, however many ticks follow
    assert drained == {"a": [], "b": [], "c": [drained["c"][0]]} and "straggler" in drained["c"][0]


def test_monitor_keeps_a_ten_percent_node_and_a_healthy_job_evicts_nobody():
    store, clock, wall = FakeStore(), Clock(0.0), Clock(5000.0)
    cfg = StragglerConfig(action="evict", threshold=1.05, sustain_s=5.0, min_samples=5)
    mons, drained = _nodes(store, clock, wall, cfg)
    decisions = _run(mons, store, clock, wall, {"a": 0.10, "b": 0.10, "c": 0.11}, 15)
    assert decisions[-1].verdict is Verdict.KEEP and decisions[-1].reason == KeepReason.NOT_FASTER.value
    store2, clock2, wall2 = FakeStore(), Clock(0.0), Clock(5000.0)
    mons2, drained2 = _nodes(store2, clock2, wall2, StragglerConfig(action="evict", sustain_s=1.0, min_samples=5))
    decisions2 = _run(mons2, store2, clock2, wall2, {"a": 0.10, "b": 0.104, "c": 0.098}, 15)
    assert {d.verdict for d in decisions2} == {Verdict.NONE}
    assert read_evictions(store, "j") == [] and read_evictions(store2, "j") == []
    assert not any(drained.values()) and not any(drained2.values())


def test_only_the_decider_evicts_and_a_new_round_starts_over():
    store, clock, wall = FakeStore(), Clock(0.0), Clock(5000.0)
    cfg = StragglerConfig(action="evict", sustain_s=3.0, min_samples=5)
    mons, drained = _nodes(store, clock, wall, cfg)
    _run(mons, store, clock, wall, {"a": 0.1, "b": 0.1, "c": 0.3}, 8, decider="nobody")
    assert read_evictions(store, "j") == []
    assert mons["a"].last is not None and mons["a"].last.verdict is Verdict.EVICT  # decided, not acted on
    clock.t += 1.0
    mons["a"].tick(store, round_=2, nodes=3, decides=True)  # new world: old records and windows do not count
    assert mons["a"].last.verdict is Verdict.NONE and read_evictions(store, "j") == []


def test_monitor_without_a_store_or_with_a_failing_one_never_raises():
    class Broken(FakeStore):
        def get(self, key):
            raise ConnectionError("store gone")

    mon = StragglerMonitor(StragglerConfig(), job_id="j", node="a", min_nodes=1, interval_s=1.0,
                           request_drain=lambda why: None, clock=Clock(5.0))
    assert mon.tick(None, round_=1, nodes=2, decides=True) is None
    store = Broken()
    store.d["trainguard/straggler/j/nodes"] = b"a\n"
    mon._next = 0.0
    assert mon.tick(store, round_=1, nodes=2, decides=True) is None


def test_spare_waits_out_the_cooldown_retests_after_a_failure_then_is_readmitted():
    store, wall = FakeStore(), Clock(10_000.0)
    cfg = StragglerConfig(action="evict", cooldown_s=60.0, threshold=1.3)
    store.append("trainguard/straggler/j/evictions", Eviction("c", 9_990.0, "straggler", 2.0).to_line())
    store.append("trainguard/straggler/j/nodes", b"a\nb\n")
    store.set("trainguard/straggler/j/selftest/a", json.dumps({"seconds": 1.0}).encode())
    store.set("trainguard/straggler/j/selftest/b", json.dumps({"seconds": 1.2}).encode())
    results = iter([2.0, 1.1])  # throttled, then not
    tests: list[float] = []

    def test() -> float:
        tests.append(wall.t)
        return next(results)

    def sleep(s: float) -> None:
        wall.t += s

    act = wait_as_spare(store, cfg, job_id="j", node="c", stop=lambda: False, wall=wall, sleep=sleep, test=test)
    assert act is AdmissionAct.ADMIT
    assert len(tests) == 2
    assert tests[0] >= 9_990.0 + 60.0  # not before the cool-down
    assert tests[1] >= tests[0] + 60.0  # a failed self-test waits another cool-down
    assert json.loads(store.d["trainguard/straggler/j/selftest/c"])["seconds"] == 1.1


def test_spare_quarantined_after_repeated_evictions_and_never_evicted_node_admitted_at_once():
    store, wall = FakeStore(), Clock(10_000.0)
    cfg = StragglerConfig(action="evict", quarantine_after=2)
    for t in (9_000.0, 9_500.0):
        store.append("trainguard/straggler/j/evictions", Eviction("c", t).to_line())
    ran: list[int] = []
    act = wait_as_spare(store, cfg, job_id="j", node="c", stop=lambda: False, wall=wall, sleep=lambda s: None,
                        test=lambda: ran.append(1) or 1.0)
    assert act is AdmissionAct.QUARANTINE and ran == []
    act = wait_as_spare(store, cfg, job_id="j", node="a", stop=lambda: False, wall=wall, sleep=lambda s: None,
                        test=lambda: ran.append(1) or 1.0)
    assert act is AdmissionAct.ADMIT and ran == [1]  # it publishes a reference for the others


@pytest.mark.parametrize("key,value,env", [
    ("action", "kick", "TRAINGUARD_STRAGGLER_ACTION"),
    ("threshold", "0.9", "TRAINGUARD_STRAGGLER_THRESHOLD"),
    ("margin", "1.5", "TRAINGUARD_STRAGGLER_MARGIN"),
    ("max_evictions_per_hour", "-1", "TRAINGUARD_STRAGGLER_MAX_EVICTIONS_PER_HOUR"),
])
def test_bad_config_names_key_env_var_and_fix(key, value, env):
    with pytest.raises(ConfigError) as e:
        load_config(env={env: value}, path=None)
    text = str(e.value)
    assert f"straggler.{key}" in text and env in text and ":" in text.split(env, 1)[1]


def test_config_defaults_and_direct_validation():
    cfg = TrainguardConfig()
    assert cfg.straggler.action == "report" and cfg.straggler.enabled
    with pytest.raises(FieldError):
        StragglerConfig(threshold=1.0)


def test_selftest_runs_the_fixed_workload_and_reports_the_median_run():
    from trainguard.agent.stragglermon import selftest

    ticks = iter(range(100))
    # runs read the clock at (0,1), (4,9), (16,25) with squares: durations 1, 5, 9 -> the median
    assert selftest(3, clock=lambda: float(next(ticks)) ** 2, runs=3) == 5.0


@pytest.mark.parametrize(("cuda_count", "want"), [(0, ["cpu"]), (1, ["cuda:0"]), (4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])])
def test_the_self_test_times_every_gpu_of_the_node_else_its_cpu(cuda_count, want):
    from trainguard.agent.stragglermon import selftest_devices

    assert selftest_devices(cuda_count) == want


def test_the_self_test_runs_in_a_child_process_and_times_the_cpu_here(monkeypatch):
    """No CUDA context stays in the agent: the self-test runs in a child, which reports its device and
    time (here, without a GPU: the CPU); a child that fails falls back to the agent's CPU."""
    import subprocess

    from trainguard.agent import stragglermon

    seconds = stragglermon.selftest_in_child(5)
    assert 0 < seconds < 60
    calls = []
    monkeypatch.setattr(stragglermon, "selftest", lambda reps, device="cpu", **k: calls.append((reps, device)) or 0.5)

    def broken(*a, **k):
        raise subprocess.CalledProcessError(1, a[0], output="", stderr="boom")

    monkeypatch.setattr(subprocess, "run", broken)
    assert stragglermon.selftest_in_child(7) == 0.5 and calls == [(7, "cpu")]


def test_a_new_world_clears_the_last_worlds_scores_at_once():
    """A member that left (drained, lost) is not exported as scored by the survivors until their next
    decision: the first tick of a new round clears the scores, whatever the interval (seen in the
    real-Prometheus dashboard test: a departed node's score stayed up to one interval)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from trainguard.metrics.straggler import StragglerMetrics

    registry = CollectorRegistry()
    store, clock, wall = FakeStore(), Clock(0.0), Clock(5000.0)
    mons, _ = _nodes(store, clock, wall, StragglerConfig(min_samples=5), names=("a", "b"))
    mons["a"]._observer = SimpleNamespace(straggler=StragglerMetrics(registry))
    _run(mons, store, clock, wall, {"a": 0.1, "b": 0.1}, 8)

    def members():
        return {s.labels["member"] for m in registry.collect() if m.name == "trainguard_straggler_score"
                for s in m.samples}

    assert members() == {"a", "b"}
    mons["a"].interval_s = 1e9
    mons["a"]._next = clock.t + 1e9  # its next decision is far away
    assert mons["a"].tick(store, round_=2, nodes=1, decides=True) is None
    assert members() == set()
