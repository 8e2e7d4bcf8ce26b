"""The shipped rules and dashboard: static checks, promtool, and a real Prometheus scraping real workers."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from trainguard.metrics.agent import AgentMetrics
from trainguard.metrics.config import CostConfig, MetricsConfig

from .conftest import FakeNvml, Workers, promtool
from .promql import DASHBOARD, RULES, _substitute, alert_rules, dashboard_exprs, referenced_metrics, split_comparison

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = Path(__file__).with_name("snapshot_metrics.json")


def _known_sample_names() -> set[str]:
    snap = json.loads(SNAPSHOT.read_text())
    return {s for fam in snap.values() for s in fam["samples"]}


@pytest.mark.timeout(30)
def test_files_ship_as_package_data() -> None:
    assert DASHBOARD.is_file() and RULES.is_file()
    dash = json.loads(DASHBOARD.read_text())
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("throughput", "world size", "gpu memory", "checkpoint", "cost", "wasted", "goodput"):
        assert topic in titles, topic
    assert {r["alert"] for r in alert_rules()} == {"TrainguardJobDown", "TrainguardNoProgress",
                                                   "TrainguardPreemptionRateHigh", "TrainguardCheckpointFailing",
                                                   "TrainguardCheckpointStale", "TrainguardCheckpointCorrupt",
                                                   "TrainguardGoodputLow"}


@pytest.mark.timeout(30)
def test_every_referenced_metric_exists() -> None:
    known = _known_sample_names()
    exprs = [e.expr for e in dashboard_exprs()] + [r["expr"] for r in alert_rules()]
    unknown = {m for e in exprs for m in referenced_metrics(e)} - known
    assert not unknown, f"dashboard/rules use metrics nobody exports: {sorted(unknown)}"


@pytest.mark.timeout(30)
def test_alerts_follow_the_one_comparison_convention() -> None:
    for rule in alert_rules():
        lhs, op, rhs = split_comparison(rule["expr"])
        assert lhs and rhs and op in (">", "<", ">=", "<="), rule["alert"]
        assert rule.get("annotations", {}).get("summary"), rule["alert"]
    assert split_comparison('a{x="1>2"} > 3 * (b > 0)') == ('a{x="1>2"}', ">", "3 * (b > 0)")
    with pytest.raises(ValueError):
        split_comparison("a > 1 and b")


@pytest.mark.timeout(60)
def test_promtool_check_rules() -> None:
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 7 rules found" in r.stdout


def _panel_expr(title: str, index: int = 0, **values: str) -> str:
    dash = json.loads(DASHBOARD.read_text())
    [panel] = [p for p in dash["panels"] if p.get("title") == title]
    return _substitute(panel["targets"][index]["expr"], **values)


@pytest.mark.timeout(60)
def test_alert_scenarios_and_dashboard_totals_in_promtool(tmp_path) -> None:
    """Issue 43 item 8, in Prometheus's own rule engine (promtool test rules): two jobs in one scrape
    job, an agent restart, a node leaving, the whole job dead (tests/metrics/alerts_test.yml); and the
    dashboard's job totals over a node that left and an agent that restarted."""
    doc = yaml.safe_load((Path(__file__).with_name("alerts_test.yml")).read_text())
    doc["rule_files"] = [str(RULES)]
    node_left = {  # node n2 (spot) leaves at 30m; n1's agent restarts at 40m (its counters reset)
        "interval": "1m",
        "input_series": [
            {"series": 'trainguard_cost_total{job="trainguard",job_id="spot",node="n1"}', "values": "0+1x40 0+1x20"},
            {"series": 'trainguard_cost_total{job="trainguard",job_id="spot",node="n2"}', "values": "0+1x30 stale"},
            {"series": 'trainguard_cost_total{job="trainguard",job_id="other",node="n3"}', "values": "0+100x60"},
            {"series": 'trainguard_paid_seconds_total{job="trainguard",job_id="spot",node="n1"}', "values": "0+60x40 0+60x20"},
            {"series": 'trainguard_wasted_seconds_total{job="trainguard",job_id="spot",node="n1",reason="drain"}',
             "values": "0+15x40 0+15x20"},
            {"series": 'trainguard_productive_seconds{job="trainguard",job_id="spot",node="n1"}', "values": "0+45x40 0+45x20"},
        ],
        "promql_expr_test": [
            # n1: 40 before its restart + 19 since (restarted at 41m from 0); n2, gone since 30m: 30 + half
            # a step extrapolated past its last sample. The old `sum(trainguard_cost_total)` read 19.
            {"expr": _panel_expr("Cost so far", job_id="spot", node=".*"), "eval_time": "60m",
             "exp_samples": [{"labels": "{}", "value": 89.5}]},
            {"expr": _panel_expr("Goodput", job_id="spot", node=".*"), "eval_time": "60m",
             "exp_samples": [{"labels": "{}", "value": 0.75}]},
        ],
    }
    doc["tests"].append(node_left)
    f = tmp_path / "alerts_test.yml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([promtool(), "test", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@pytest.mark.timeout(60)
def test_promtool_check_scrape_config_example(tmp_path) -> None:
    cfg = yaml.safe_load((REPO / "docs" / "prometheus" / "prometheus.yml").read_text())
    cfg["rule_files"] = [str(RULES)]  # the example points at /etc/prometheus/rules/
    f = tmp_path / "prometheus.yml"
    f.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([promtool(), "check", "config", str(f)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_real_prometheus_gets_data_for_every_dashboard_and_alert_expression(
        tmp_path, workers: Workers, prometheus_factory) -> None:
    """An exporter fed by real worker processes through a drain and a crash/restart, scraped every second."""
    stop = tmp_path / "stop"
    m = AgentMetrics(MetricsConfig(port=0, sample_interval_s=0.25, throughput_window_s=3.0),
                     CostConfig(spot_price_per_hour=2.5), "node-a", job_id="job-a", run_dir=str(tmp_path / "run"),
                     nvml=FakeNvml([(3 << 30, 80 << 30, 60), (5 << 30, 80 << 30, 90)]))
    try:
        ex = m.serve()
        m.set_state("rendezvous")
        m.set_world(2, 1, 1)
        m.set_checkpoint_interval(30.0)
        m.straggler.set_scores({"node-a": 1.0, "node-b": 1.6})  # what the straggler monitor and NVML would set
        m.straggler.set_gpu_health("GPU-0", "ok")
        prom = prometheus_factory([f"127.0.0.1:{ex.port}"], rule_files=[RULES])
        env = m.worker_env()
        prom.wait_for('up{job="trainguard"} == 1')  # watched from before the first step, as in production

        def start_world(start_step: int, n: int, **kw: str) -> list:
            args = ["--start-step", str(start_step), "--step-time", "0.02", "--ckpt-every", "25",
                    "--stop-file", str(stop)]
            for k, v in kw.items():
                args += [f"--{k.replace('_', '-')}", v]
            return [workers.start(env, *args, "--rank", str(r), "--local-rank", str(r),
                                  "--gpu-peak", str((r + 1) << 30)) for r in range(n)]

        # Round 1: two workers; one checkpoint save fails (step 50).
        procs = start_world(0, 2, fail_ckpt_at="50")
        m.set_state("running")
        workers.wait_step(procs[0], 60)
        # A preemption notice: drain (workers stop at a step boundary), resize to one worker.
        m.notice("aws")
        m.set_state("draining")
        stop.write_text("")
        for p in procs:
            assert p.wait(timeout=30) == 0
            m.mark_worker_dead(p.pid)
        m.drain_done(2.5)
        m.set_state("resizing")
        m.set_world(1, 1, 2)
        stop.unlink()
        time.sleep(1.0)
        procs = start_world(75, 1)
        m.set_state("running")
        workers.wait_step(procs[0], 110)
        # A crash: SIGKILL, restart, roll back to the last committed step (100).
        procs[0].kill()
        procs[0].wait(timeout=10)
        m.set_state("rendezvous")
        m.restart("worker_failure")
        m.mark_worker_dead(procs[0].pid)
        seconds, steps = m.restored(100)
        assert steps >= 10 and seconds > 0
        time.sleep(1.0)
        procs = start_world(100, 1)
        m.set_state("running")
        workers.wait_step(procs[0], 140)

        # Every dashboard expression and both sides of every alert return (finite) data.
        checks = [(e.where, e.expr) for e in dashboard_exprs()]
        for rule in alert_rules():
            lhs, _, rhs = split_comparison(rule["expr"])
            if rule["alert"] == "TrainguardJobDown":  # empty while an agent is up: its parts have data
                lhs = 'count by (job_id) (max_over_time(trainguard_agent_start_time_seconds{job_id="job-a"}[6h]))'
            checks += [(f"alert {rule['alert']} lhs", lhs), (f"alert {rule['alert']} rhs", rhs)]
        failures = []
        deadline = time.monotonic() + 30
        for where, expr in checks:
            try:
                prom.wait_for(expr, timeout_s=max(1.0, deadline - time.monotonic()))
            except AssertionError as e:
                failures.append(f"{where}: {e}")
        assert not failures, "\n".join(failures)

        # The scripted timeline shows up in Prometheus as it happened.
        assert prom.wait_for('trainguard_wasted_seconds_total{reason="drain"} > 0')
        assert prom.wait_for('trainguard_wasted_seconds_total{reason="restart"} > 0')
        assert prom.wait_for('trainguard_wasted_seconds_total{reason="recompute"} > 0')
        assert prom.wait_for('trainguard_restarts_total{reason="worker_failure"} == 1')
        assert prom.wait_for("max_over_time(trainguard_world_size[5m]) == 2")
        assert prom.wait_for("trainguard_world_size == 1")
        assert prom.wait_for("trainguard_goodput_ratio < 1 and trainguard_goodput_ratio > 0")

        # Prometheus loaded and evaluated every rule without error; the injected failure is alerting.
        deadline = time.monotonic() + 20
        while True:
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            if rules and all(r.get("lastEvaluation", "").startswith("2") and r["health"] == "ok" for r in rules):
                break
            assert time.monotonic() < deadline, f"rules not all healthy: {rules}"
            time.sleep(0.5)
        assert len(rules) == len(alert_rules())
        alerts = {a["labels"]["alertname"]: a["state"] for a in prom.api("alerts")["alerts"]}
        assert alerts.get("TrainguardCheckpointFailing") in ("pending", "firing"), alerts
        assert "TrainguardNoProgress" not in alerts and "TrainguardCheckpointStale" not in alerts
    finally:
        m.close()
