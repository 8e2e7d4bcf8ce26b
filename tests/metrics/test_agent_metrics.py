"""AgentMetrics, the exporter, the NVML path (fake NVML), ``trainguard status`` — in one process."""

from __future__ import annotations

import io
import json
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from trainguard.contract.configbase import ConfigError
from trainguard.metrics.agent import AgentMetrics
from trainguard.metrics.config import CostConfig, MetricsConfig
from trainguard.metrics.exporter import MetricsExporter
from trainguard.metrics.status import build_view, fetch_metrics, status

from .conftest import FakeNvml

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def samples(m: AgentMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in m.registry.collect() for s in fam.samples}


def value(m: AgentMetrics, name: str, **labels: str) -> float:
    want = tuple(sorted({"node": m.node, "job_id": m.job_id, **labels}.items()))
    return samples(m)[(name, want)]


@pytest.fixture
def metrics_factory():
    made: list[AgentMetrics] = []

    def make(**kw) -> AgentMetrics:
        kw.setdefault("nvml", FakeNvml([]))
        cfg = kw.pop("config", MetricsConfig(port=0))
        cost = kw.pop("cost", CostConfig(spot_price_per_hour=3.6))
        m = AgentMetrics(cfg, cost, kw.pop("node", "node-a"), start_sampler=False, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def test_agent_timeline_drives_exported_cost_and_goodput(metrics_factory) -> None:
    clock = Clock(100.0)
    m = metrics_factory(clock=clock, wall_clock=lambda: 1.7e9)
    m.set_state("RENDEZVOUS")
    clock.t += 20
    m.set_world(8, 2, 1)
    m.set_state("running")
    clock.t += 3600
    m.notice("aws")
    m.set_state("draining")
    clock.t += 60
    m.drain_done(55.0)
    m.set_state("resizing")
    m.set_world(4, 1, 2)
    clock.t += 40
    m.set_state("running")
    clock.t += 1000
    m.restart("Worker-Failure")
    m.set_state("rendezvous")
    clock.t += 80
    assert m.lost_work(300, 30) == pytest.approx(300)
    m.set_state("running")
    clock.t += 500

    assert value(m, "trainguard_agent_state", state="running") == 1
    assert value(m, "trainguard_agent_state", state="rendezvous") == 0
    assert value(m, "trainguard_world_size") == 4
    assert value(m, "trainguard_rendezvous_rounds_total") == 2
    assert value(m, "trainguard_restarts_total", reason="worker_failure") == 1
    assert value(m, "trainguard_preemption_notices_total", source="aws") == 1
    assert value(m, "trainguard_drain_duration_seconds_count") == 1
    paid = 20 + 3600 + 60 + 40 + 1000 + 80 + 500
    assert value(m, "trainguard_paid_seconds_total") == pytest.approx(paid)
    assert value(m, "trainguard_wasted_seconds_total", reason="startup") == pytest.approx(20)
    assert value(m, "trainguard_wasted_seconds_total", reason="drain") == pytest.approx(100)
    assert value(m, "trainguard_wasted_seconds_total", reason="restart") == pytest.approx(80)
    assert value(m, "trainguard_wasted_seconds_total", reason="recompute") == pytest.approx(300)
    productive = 3600 + 1000 + 500 - 300
    assert value(m, "trainguard_productive_seconds") == pytest.approx(productive)
    assert value(m, "trainguard_goodput_ratio") == pytest.approx(productive / paid)
    assert value(m, "trainguard_cost_total") == pytest.approx(paid / 3600 * 3.6)
    assert value(m, "trainguard_cost_wasted_total", reason="drain") == pytest.approx(0.1)
    assert value(m, "trainguard_pricing_info", capacity="spot", currency="USD", source="config") == 1
    # No worker channel and no tokens: the unit-cost series are absent, never inf.
    names = {n for n, _ in samples(m)}
    assert "trainguard_cost_per_million_tokens" not in names
    assert not any(n.endswith("_created") for n in names)


def test_unknown_labels_are_normalised_and_bounded(metrics_factory) -> None:
    m = metrics_factory()
    for i in range(40):
        m.restart(f"reason {i}")
    reasons = {dict(lbl)["reason"] for n, lbl in samples(m) if n == "trainguard_restarts_total"}
    assert len(reasons) <= 17 and "other" in reasons
    m.set_state("SomethingNew")
    assert value(m, "trainguard_agent_state", state="somethingnew") == 1


def test_gpu_series_from_fake_nvml(metrics_factory, fake_nvml: FakeNvml) -> None:
    m = metrics_factory(nvml=fake_nvml)
    assert value(m, "trainguard_gpu_memory_used_bytes", gpu="0") == 1 << 30
    assert value(m, "trainguard_gpu_memory_total_bytes", gpu="1") == 80 << 30
    assert value(m, "trainguard_gpu_utilization_ratio", gpu="1") == pytest.approx(0.75)
    m.close()
    assert fake_nvml.shutdown_calls == 1


def test_gpu_read_failure_drops_only_that_gpu(metrics_factory) -> None:
    nvml = FakeNvml([(1, 2, 3), (4, 5, 6)], broken=(1,))
    with capture_logs() as logs:
        m = metrics_factory(nvml=nvml)
        samples(m)
        got = samples(m)
    gpus = {dict(lbl)["gpu"] for n, lbl in got if n == "trainguard_gpu_memory_used_bytes"}
    assert gpus == {"0"}
    assert [e["event"] for e in logs].count("gpu_read_failed") == 1


@pytest.mark.parametrize("nvml, reason", [
    (FakeNvml([], fail_init=True), "NVML init failed"),
    (FakeNvml([]), "no GPU"),
])
def test_no_gpu_means_absent_series_and_one_log_line(metrics_factory, nvml, reason) -> None:
    with capture_logs() as logs:
        m = metrics_factory(nvml=nvml)
        for _ in range(3):
            got = samples(m)
    assert not any(n.startswith("trainguard_gpu_") for n, _ in got)
    lines = [e for e in logs if e["event"] == "gpu_metrics_unavailable"]
    assert len(lines) == 1 and reason in lines[0]["reason"]


def test_gpu_disabled_by_config(metrics_factory, fake_nvml) -> None:
    with capture_logs() as logs:
        m = metrics_factory(config=MetricsConfig(port=0, gpu=False), nvml=fake_nvml)
    assert fake_nvml.init_calls == 0
    assert "metrics.gpu" in [e for e in logs if e["event"] == "gpu_metrics_unavailable"][0]["reason"]
    assert not any(n.startswith("trainguard_gpu_") for n, _ in samples(m))


def test_exporter_serves_metrics_and_healthz(metrics_factory) -> None:
    m = metrics_factory()
    ex = m.serve()
    assert ex.port != 0 and ex.url == f"http://127.0.0.1:{ex.port}"
    text = urllib.request.urlopen(ex.url + "/metrics", timeout=5).read().decode()
    fams = {f.name for f in text_string_to_metric_families(text)}
    assert {"trainguard_agent_state", "trainguard_cost", "trainguard_goodput_ratio"} <= fams
    health = json.loads(urllib.request.urlopen(ex.url + "/healthz", timeout=5).read())
    assert health["ok"] is True and health["node"] == "node-a"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(ex.url + "/nope", timeout=5)
    assert e.value.code == 404
    port = ex.port
    m.close()
    m.close()  # idempotent
    from prometheus_client import CollectorRegistry

    with MetricsExporter(CollectorRegistry(), "127.0.0.1", port) as again:  # the port is released
        assert again.port == port


def test_healthz_503_when_unhealthy() -> None:
    from prometheus_client import CollectorRegistry

    with MetricsExporter(CollectorRegistry(), "127.0.0.1", 0, health=lambda: {"ok": False, "why": "x"}) as ex:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(ex.url + "/healthz", timeout=5)
        assert e.value.code == 503


def test_exporter_port_in_use_names_the_setting() -> None:
    from prometheus_client import CollectorRegistry

    with MetricsExporter(CollectorRegistry(), "127.0.0.1", 0) as first:
        with pytest.raises(ConfigError) as e:
            MetricsExporter(CollectorRegistry(), "127.0.0.1", first.port)
    assert "metrics.port" in str(e.value) and "TRAINGUARD_METRICS_PORT" in str(e.value)


def test_status_prints_the_live_view(metrics_factory, fake_nvml) -> None:
    m = metrics_factory(nvml=fake_nvml, node="gpu-node-7")
    m.set_state("running")
    m.set_world(16, 2, 3)
    ex = m.serve()
    out = io.StringIO()
    assert status(ex.url, out=out) == 0
    text = out.getvalue()
    assert "gpu-node-7" in text and "running" in text and "16 workers on 2 nodes (round 3)" in text
    assert "USD" in text and "gpu 0" in text
    view = build_view(fetch_metrics(ex.url))
    assert view["state"] == "running" and view["world_size"] == 16


def test_status_unreachable_names_the_fix() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = io.StringIO()
    assert status(f"http://127.0.0.1:{port}", out=io.StringIO(), err=err, timeout_s=2) == 1
    assert "metrics.bind_address" in err.getvalue() and "--url" in err.getvalue()


def _worker_counters(steps: float, samples: float = 0.0) -> list:
    from prometheus_client.metrics_core import CounterMetricFamily

    return [CounterMetricFamily("trainguard_steps", "", value=steps),
            CounterMetricFamily("trainguard_samples", "", value=samples)]


def test_checkpoint_interval_from_the_policy(metrics_factory, tmp_path) -> None:
    m = metrics_factory(config=MetricsConfig(port=0, throughput_window_s=4.0), run_dir=str(tmp_path))
    assert value(m, "trainguard_checkpoint_interval_seconds") == 0  # periodic checkpoints off
    m.set_checkpoint_policy(interval_s=120.0)
    assert value(m, "trainguard_checkpoint_interval_seconds") == 120.0  # exported at once
    # interval_steps: steps x the job's step time, estimated by the sampler from trainguard_steps_total.
    m.set_checkpoint_policy(interval_steps=50)
    feed = {"steps": 0.0}
    m._worker_families = lambda pattern="*.db": _worker_counters(feed["steps"])
    for t in range(5):
        feed["steps"] = 4.0 * t  # 4 steps/s
        m.sample(now=float(t))
    assert value(m, "trainguard_checkpoint_interval_seconds") == pytest.approx(12.5)
    for t in range(5, 12):  # no step runs (a drain, a rendezvous): the estimate is kept
        m.sample(now=float(t))
    assert value(m, "trainguard_checkpoint_interval_seconds") == pytest.approx(12.5)
    m.set_checkpoint_policy(interval_s=10.0, interval_steps=50)  # both: the shorter one
    for t in range(12, 17):
        feed["steps"] += 4.0
        m.sample(now=float(t))
    assert value(m, "trainguard_checkpoint_interval_seconds") == pytest.approx(10.0)


def test_final_scrape_waits_only_for_a_periodic_scraper(metrics_factory) -> None:
    import threading
    import time

    m = metrics_factory()
    assert m.await_final_scrape() is False  # no exporter
    ex = m.serve()
    get = lambda: urllib.request.urlopen(ex.url + "/metrics", timeout=5).read()  # noqa: E731
    t0 = time.monotonic()
    assert m.await_final_scrape() is False and time.monotonic() - t0 < 0.5  # never scraped: no wait
    get()
    assert ex.scrape_interval_s() is None and m.await_final_scrape() is False  # one look (trainguard status)
    time.sleep(0.2)
    get()
    gap = ex.scrape_interval_s()
    assert gap is not None and 0.15 < gap < 2
    # A scraper every ~0.2 s: the exit waits for the next scrape, which then sees the final state.
    m.set_state("stopped")
    later = threading.Timer(0.1, get)
    later.start()
    with capture_logs() as logs:
        t0 = time.monotonic()
        assert m.await_final_scrape() is True
    later.join()
    assert time.monotonic() - t0 < 2 * gap + 0.5
    assert [e["scraped"] for e in logs if e["event"] == "metrics_final_scrape"] == [True]
    # Nobody comes: bounded by two intervals; a drain deadline already (nearly) passed: no wait.
    t0 = time.monotonic()
    assert m.await_final_scrape() is False
    assert time.monotonic() - t0 < 2 * gap + 0.5
    t0 = time.monotonic()
    assert m.await_final_scrape(deadline=time.time() + 0.5) is False and time.monotonic() - t0 < 0.1


def test_wait_for_next_scrape_ignores_a_scrape_begun_before() -> None:
    import threading

    from prometheus_client import CollectorRegistry

    with MetricsExporter(CollectorRegistry(), "127.0.0.1", 0) as ex:
        assert ex.wait_for_next_scrape(0.05) is False
        urllib.request.urlopen(ex.url + "/metrics", timeout=5).read()
        assert ex.wait_for_next_scrape(0.05) is False  # that one was before the call
        later = threading.Timer(0.1, lambda: urllib.request.urlopen(ex.url + "/metrics", timeout=5).read())
        later.start()
        assert ex.wait_for_next_scrape(5) is True
        later.join()
        text = urllib.request.urlopen(ex.url + "/metrics", timeout=5).read()  # the body is unchanged
        assert text == b"" or b"# HELP" in text


def test_gpu_series_labelled_by_uuid_when_nvml_says(metrics_factory, fake_nvml: FakeNvml) -> None:
    """NVML side labelled by UUID (as the workers' allocator peak: rt.device's UUID), not by NVML index."""
    fake_nvml.nvmlDeviceGetUUID = lambda h: [b"GPU-aaaa-0000", "bbbb-1111"][h]  # bytes or str, prefix or not
    m = metrics_factory(nvml=fake_nvml)
    assert value(m, "trainguard_gpu_memory_used_bytes", gpu="GPU-aaaa-0000") == 1 << 30
    assert value(m, "trainguard_gpu_memory_used_bytes", gpu="GPU-bbbb-1111") == 2 << 30
    with pytest.raises(KeyError):
        value(m, "trainguard_gpu_memory_used_bytes", gpu="0")
    m.close()


def test_a_busy_fixed_port_is_retried_until_the_previous_agent_lets_it_go(metrics_factory) -> None:
    """Issue 43 item 5: a restart right after a drain finds the old agent still on its port."""
    import socket
    import threading
    import time

    from trainguard.contract.configbase import ConfigError
    from trainguard.metrics.agent import PORT_BUSY_WAIT_S

    old = socket.socket()
    old.bind(("127.0.0.1", 0))
    old.listen()
    port = old.getsockname()[1]
    threading.Timer(1.0, old.close).start()
    with capture_logs() as logs:
        ex = metrics_factory(config=MetricsConfig(port=port, bind_address="127.0.0.1")).serve()
    assert ex.port == port
    assert [e["port"] for e in logs if e["event"] == "metrics_port_busy"] == [port]
    # a port that stays taken still ends in the error naming metrics.port, after the bounded retry
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="metrics.port"):
            metrics_factory(config=MetricsConfig(port=held.getsockname()[1], bind_address="127.0.0.1")).serve()
        assert PORT_BUSY_WAIT_S <= time.monotonic() - t0 < PORT_BUSY_WAIT_S + 2


@pytest.mark.parametrize("seen_before", [0, 300])
def test_a_restore_past_a_corrupt_step_counts_the_rollback_and_the_corrupt_step(metrics_factory, tmp_path, workers,
                                                                                 seen_before) -> None:
    """Issue 43 item 3: the restarted agent never saw steps 136..266 trained, yet the worker restored
    136 because committed step 266 was corrupt: 130 steps are recomputed and one corrupt step counted.
    An agent that saw the workers reach 300 counts 164 (from what it saw; the skipped step is inside)."""
    clock = Clock(0.0)
    m = metrics_factory(run_dir=str(tmp_path), clock=clock)
    assert value(m, "trainguard_recomputed_steps_total") == 0
    assert value(m, "trainguard_checkpoint_corrupt_steps_total") == 0  # exported from the start: increase() sees 1
    if seen_before:
        p = workers.start(m.worker_env(), "--start-step", str(seen_before - 2), "--steps", "2", "--step-time", "0")
        assert p.wait(timeout=60) == 0
        clock.t = 1.0
        m.sample()
        m.mark_worker_dead(p.pid)
    p = workers.start(m.worker_env(), "--restored", "136", "--skipped", "266", "--corrupt", "1", "--steps", "2",
                      "--step-time", "0")
    assert p.wait(timeout=60) == 0
    clock.t = 2.0
    with capture_logs() as logs:
        m.sample()
    want = (seen_before or 266) - 136
    assert value(m, "trainguard_recomputed_steps_total") == want
    assert value(m, "trainguard_checkpoint_corrupt_steps_total") == 1
    assert [(e["restored_step"], e["recomputed_steps"]) for e in logs if e["event"] == "work_lost"] == [(136, want)]
    clock.t = 3.0
    m.sample()  # the same restore is not counted twice
    assert value(m, "trainguard_checkpoint_corrupt_steps_total") == 1
    assert value(m, "trainguard_recomputed_steps_total") == want
