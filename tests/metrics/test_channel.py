"""The worker -> agent channel (prometheus_client multiprocess mode) with real worker processes."""

from __future__ import annotations

import os
import signal
import time

import pytest
from structlog.testing import capture_logs

from trainguard.metrics import channel, worker_env
from trainguard.metrics.agent import AgentMetrics
from trainguard.metrics.config import CostConfig, MetricsConfig
from trainguard.metrics.worker import MetricsChannelError, WorkerMetrics

from .conftest import FakeNvml, Workers


def test_worker_env_and_prepare_dir(tmp_path) -> None:
    env = worker_env(str(tmp_path))
    assert env == {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prometheus_multiproc")}
    d = tmp_path / "prometheus_multiproc"
    d.mkdir()
    (d / "counter_123.db").write_bytes(b"x")
    (d / "keep.txt").write_text("not ours")
    channel.prepare_dir(str(d))
    assert sorted(p.name for p in d.iterdir()) == ["keep.txt"]


def test_worker_metrics_without_channel_is_a_noop_with_one_warning() -> None:
    # This test process imported prometheus_client without PROMETHEUS_MULTIPROC_DIR.
    with capture_logs() as logs:
        w = WorkerMetrics(0, 0)
        w.observe_step(1, 8, 1024, 0.1)
        w.observe_checkpoint("periodic", 0.1, 0.2, 0.1, 10, 1, True)
        w.observe_gpu_peak(1)
    assert not w.enabled
    assert [e["event"] for e in logs] == ["worker_metrics_disabled"]
    with pytest.raises(MetricsChannelError, match="PROMETHEUS_MULTIPROC_DIR.*Fix:"):
        WorkerMetrics(0, 0, strict=True)


def _values(m: AgentMetrics) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for fam in m.registry.collect():
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("node", "job_id")))] = s.value
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_real_workers_report_and_a_dead_worker_is_marked(tmp_path, workers: Workers) -> None:
    m = AgentMetrics(MetricsConfig(port=0, sample_interval_s=0.2, throughput_window_s=2.0), CostConfig(),
                     "node-a", run_dir=str(tmp_path), nvml=FakeNvml([]), start_sampler=True)
    try:
        env = m.worker_env()
        m.set_state("running")
        # Rank 0 trains 60 steps and exits; rank 1 runs until killed; rank 2 keeps running.
        p0 = workers.start(env, "--rank", "0", "--local-rank", "0", "--steps", "60", "--step-time", "0.01",
                           "--ckpt-every", "20", "--gpu-peak", "1000")
        p1 = workers.start(env, "--rank", "1", "--local-rank", "1", "--step-time", "0.01", "--gpu-peak", "5000")
        p2 = workers.start(env, "--rank", "2", "--local-rank", "2", "--step-time", "0.01", "--gpu-peak", "3000")
        assert p0.wait(timeout=60) == 0
        m.mark_worker_dead(p0.pid)
        workers.wait_step(p1, 30)
        workers.wait_step(p2, 30)
        p1.send_signal(signal.SIGKILL)
        p1.wait(timeout=10)
        before = _values(m)
        dead_samples = before["trainguard_samples_total"][()]
        m.mark_worker_dead(p1.pid)
        time.sleep(0.6)  # let the sampler see a few progress marks

        v = _values(m)
        # Compaction changes no total (rank 2 is still running, so only compare what is frozen).
        assert v["trainguard_steps_total"] == before["trainguard_steps_total"]
        assert v["trainguard_checkpoint_written_bytes_total"] == before["trainguard_checkpoint_written_bytes_total"]
        # Counters keep the dead workers' contributions: totals never go backwards.
        assert v["trainguard_samples_total"][()] >= dead_samples >= 8 * (60 + 30 + 30)
        assert v["trainguard_steps_total"][()] == 60  # local rank 0 only
        assert v["trainguard_step_duration_seconds_count"][()] >= 120
        # Live gauges: only rank 2 is alive.
        assert v["trainguard_gpu_allocator_peak_bytes"] == {(("gpu", "2"),): 3000.0}
        assert v["trainguard_step"][()] >= 30
        # Max gauges survive their worker: rank 0 committed steps 20, 40, 60.
        assert v["trainguard_checkpoint_last_committed_step"][()] == 60
        assert v["trainguard_checkpoint_saves_total"][(("kind", "periodic"),)] == 3
        assert v["trainguard_samples_per_second"][()] > 0
        assert v["trainguard_tokens_per_second"][()] == pytest.approx(128 * v["trainguard_samples_per_second"][()])
        assert v["trainguard_cost_per_million_tokens"][()] == 0.0  # price unset: 0, stated in the log
        # Dead workers' files are folded into the archive: a scrape reads live workers + 1 archive.
        left = sorted(os.listdir(m.multiproc_dir))
        assert not [f for f in left if str(p0.pid) in f or str(p1.pid) in f], left
        assert "counter_archive.db" in left and "histogram_archive.db" in left and "gauge_max_archive.db" in left

        # Rollback: rank 2 is past step 30; restoring 20 turns the time since step 20 into recompute.
        p2.send_signal(signal.SIGKILL)
        p2.wait(timeout=10)
        m.set_state("rendezvous")
        m.restart("worker_failure")
        seconds, steps = m.restored(20)
        m.mark_worker_dead(p2.pid)
        assert steps >= 10 and seconds > 0
        assert _values(m)["trainguard_wasted_seconds_total"][(("reason", "recompute"),)] == pytest.approx(seconds)
        assert "trainguard_step" not in _values(m)  # no live worker: absent, not stale
    finally:
        m.close()


def test_a_file_being_created_does_not_break_a_scrape(tmp_path) -> None:
    """A worker creating its file leaves it empty for a moment (seen in the benchmark as struct.error)."""
    m = AgentMetrics(MetricsConfig(port=0), CostConfig(), "node-a", run_dir=str(tmp_path), nvml=FakeNvml([]),
                     start_sampler=False)
    try:
        open(os.path.join(m.multiproc_dir, "counter_4242.db"), "wb").close()
        m.sample()
        assert "trainguard_agent_state" in {f.name for f in m.registry.collect()}
    finally:
        m.close()


def test_async_checkpoint_is_recorded_when_its_future_finishes() -> None:
    from concurrent.futures import Future

    w = WorkerMetrics(0, 0)
    calls: list[tuple] = []
    w._f = object()  # enabled, with the recording below instead of the multiprocess files
    w.observe_checkpoint = lambda *a: calls.append(a)  # type: ignore[method-assign]
    ok, bad = Future(), Future()
    w.observe_checkpoint_async(ok, "periodic", 0.01, 0.01, 10)
    w.observe_checkpoint_async(bad, "periodic", 0.02, 0.02, 20)
    assert calls == []  # nothing before the background save finishes
    time.sleep(0.05)
    ok.set_result(10)
    bad.set_exception(RuntimeError("storage down"))
    (k1, s1, p1, b1, n1, st1, ok1), (k2, s2, p2, b2, n2, st2, ok2) = calls
    assert (k1, s1, b1, n1, st1, ok1) == ("periodic", 0.01, 0.01, 0, 10, True) and p1 >= 0.05
    assert (k2, st2, ok2) == ("periodic", 20, False)
    done = Future()
    done.set_result(30)
    w.observe_checkpoint_async(done, "periodic", 0.0, 0.0, 30)  # already finished: recorded at once
    assert calls[-1][5:] == (30, True)


def test_gpu_peak_only_from_a_process_that_uses_cuda(monkeypatch) -> None:
    import torch

    w = WorkerMetrics(0, 1)
    peaks: list[int] = []
    w._f = object()
    w.observe_gpu_peak = lambda n, gpu=None: peaks.append(n)  # type: ignore[method-assign]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 << 30)
    w.sample_gpu_peak(100.0)
    assert peaks == []  # CUDA not used by this process (yet): absent, not 0
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    w.sample_gpu_peak(101.0)  # throttled: the next read is due at 105
    w.sample_gpu_peak(105.0)
    w.sample_gpu_peak(106.0)
    assert peaks == [3 << 30]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    w2 = WorkerMetrics(0, 0)
    w2._f = object()
    w2.observe_gpu_peak = lambda n, gpu=None: peaks.append(n)  # type: ignore[method-assign]
    for t in range(100):
        w2.sample_gpu_peak(float(t) * 10)
    assert peaks == [3 << 30]  # no GPU: never read


class _Rec:
    """A metric that records what would reach the multiprocess files."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def inc(self, v: float = 1.0) -> None:
        self.calls.append(v)

    set = observe = inc


def test_step_time_from_gpu_events_counts_as_training_time() -> None:
    # On CUDA the runtime reports each step without its time and the time later, when the GPU's events
    # complete (StepTimer): the step must not fail, and the node's training seconds (goodput's productive
    # time, local rank 0) come from the late time.
    from types import SimpleNamespace

    fams = []
    for local_rank in (0, 1):
        w = WorkerMetrics(local_rank, local_rank)
        f = SimpleNamespace(**{k: _Rec() for k in ("steps", "samples", "tokens", "step_time", "step", "last_step_ts",
                                                   "train_s")})
        w._f = f  # type: ignore[assignment]
        w.observe_step(7, 8, 1024, None)
        assert f.step_time.calls == [] and f.train_s.calls == [] and f.step.calls == [7]
        w.observe_step_time(0.25)
        w.observe_step(8, 8, 1024, 0.5)  # the host-timed path
        assert f.step_time.calls == [0.25, 0.5]
        fams.append(f)
    assert fams[0].train_s.calls == [0.25, 0.5] and fams[0].steps.calls == [1, 1]
    assert fams[1].train_s.calls == [] and fams[1].steps.calls == []  # counted by local rank 0 only


def test_deferred_steps_write_what_the_ledger_reads_and_the_rest_at_the_flush() -> None:
    # The runtime defers between its step agreements: the counters, the step gauge and the training
    # seconds (what the goodput ledger samples, what a scrape compares) are written at every step; the
    # step-time histogram and the last step's time at flush().
    from types import SimpleNamespace

    w = WorkerMetrics(0, 0)
    f = SimpleNamespace(**{k: _Rec() for k in ("steps", "samples", "tokens", "step_time", "step", "last_step_ts",
                                               "train_s")})
    w._f = f  # type: ignore[assignment]
    for step, t in ((1, 0.1), (2, 0.2), (3, 0.3)):
        w.observe_step(step, 8, 1024, t, defer=True)
    w.observe_step_time(0.4, defer=True)
    assert f.steps.calls == [1, 1, 1] and f.step.calls == [1, 2, 3] and f.train_s.calls == [0.1, 0.2, 0.3, 0.4]
    assert f.samples.calls == [8, 8, 8] and f.tokens.calls == [1024] * 3
    assert f.step_time.calls == f.last_step_ts.calls == []
    w.flush()
    assert f.step_time.calls == [0.1, 0.2, 0.3, 0.4] and len(f.last_step_ts.calls) == 1
    w.flush()  # nothing pending: nothing written again
    assert len(f.last_step_ts.calls) == 1 and len(f.step_time.calls) == 4
    w.observe_step(4, 8, 1024, 0.5)  # not deferred: written at once
    assert f.step.calls[-1] == 4 and f.step_time.calls[-1] == 0.5 and len(f.last_step_ts.calls) == 2


def test_the_drain_lead_the_agent_sized_is_exported(tmp_path) -> None:
    """The agent sizes ``drain_lead_s: auto`` from its workers' reports (:class:`trainguard.agent.lead.DrainCosts`,
    tests/agent/test_lead.py); the metrics only export the lead it chose."""
    m = AgentMetrics(MetricsConfig(port=0), CostConfig(), "node-a", run_dir=str(tmp_path), nvml=FakeNvml([]),
                     start_sampler=False)
    try:
        m.set_drain_lead(10.0)
        assert _values(m)["trainguard_drain_lead_seconds"][()] == 10.0
    finally:
        m.close()
