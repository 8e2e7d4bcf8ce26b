"""The acceptance run for metrics: the bundled elastic job under two real agents, scraped every second
by a real Prometheus (Debian ``prometheus``), through periodic checkpoints and a drain of node b.
Every PromQL expression of the shipped dashboard and alert rules must return data, and the values
must match what the job did."""

from __future__ import annotations

import os
import time

import pytest

from tests.fixtures.prometheus import prometheus_factory  # noqa: F401  (fixture)
from tests.harness import REPO, Node, free_port, wait_until
from tests.metrics.promql import RULES, alert_rules, dashboard_exprs, referenced_metrics, split_comparison
from trainguard.agent import control

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
GLOBAL_BATCH = 24
SEQ_LEN = 64  # the example's default: tokens per sample
SPOT, ON_DEMAND = 2.5, 7.25


def worlds(node):
    return [e["world_size"] for e in node.events("rendezvous_complete")]


def exporter_target(node) -> str:
    ev = wait_until(lambda: node.events("metrics_serving"), 60, f"{node.name}'s metrics_serving event")
    url = ev[0]["url"]
    assert url and url.startswith("http://127.0.0.1:"), ev
    return url.removeprefix("http://")


def value(prom, expr: str) -> float:
    res = prom.wait_for(expr, timeout_s=10)
    assert len(res) == 1, (expr, res)
    return float(res[0]["value"][1])


def by_node(prom, expr: str) -> dict[str, float]:
    return {r["metric"]["node"]: float(r["value"][1]) for r in prom.wait_for(expr, timeout_s=10)}


def test_dashboard_and_alert_queries_return_data_from_the_real_job(tmp_path, prometheus_factory):  # noqa: F811
    tmp = str(tmp_path)
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", "checkpoint.interval_steps=10",
              "--set", f"cost.spot_price_per_hour={SPOT}", "--set", f"cost.on_demand_price_per_hour={ON_DEMAND}",
              "--set", "metrics.sample_interval_s=0.25", "--set", "metrics.throughput_window_s=3"]
    args = ["--steps", "100000", "--log-every", "5", "--step-sleep", "0.03", "--global-batch", str(GLOBAL_BATCH),
            "--seq-len", str(SEQ_LEN)]
    a = Node("a", tmp, ep, script=ELASTIC, script_args=args, extra=common)
    time.sleep(0.5)
    b = Node("b", tmp, ep, script=ELASTIC, script_args=args,
             extra=common + ["--set", "cost.capacity=on_demand"])
    nodes = [a, b]
    t0 = time.monotonic()
    try:
        targets = [exporter_target(a), exporter_target(b)]
        prom = prometheus_factory(targets, rule_files=[RULES])
        prom.wait_for('count(up{job="trainguard"} == 1) == 2', timeout_s=20)

        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2], 90, "world size 2")
        wait_until(lambda: any(e["step"] >= 25 for e in a.events("train_step")), 90, "25 steps at world size 2")
        # Seen by Prometheus at world size 2, with a periodic checkpoint committed.
        prom.wait_for("min(trainguard_world_size) == 2 and count(trainguard_world_size) == 2", timeout_s=10)
        prom.wait_for("max(trainguard_checkpoint_last_committed_step) >= 10", timeout_s=10)
        steps_before = value(prom, "max(trainguard_step)")

        # One drain of node b, as `trainguard drain` does it.
        reply = control.request(b.socket, {"op": "drain", "deadline_s": 30})
        assert reply.get("ok"), reply
        assert b.wait(60) == 0, b.dump()
        wait_until(lambda: worlds(a)[-1:] == [1], 60, "survivor at world size 1")
        resumed = wait_until(lambda: [e for e in a.events("resumed") if e["world_size"] == 1], 60, "resume at 1")
        wait_until(lambda: any(e["world_size"] == 1 and e["step"] >= resumed[0]["step"] + 10
                               for e in a.events("train_step")), 60, "training at world size 1")

        # Every dashboard expression and both sides of every alert return finite data, except the
        # GPU series: on a machine without GPUs they are absent (never faked).
        checks = [(e.where, e.expr) for e in dashboard_exprs()]
        for rule in alert_rules():
            lhs, _, rhs = split_comparison(rule["expr"])
            checks += [(f"alert {rule['alert']} lhs", lhs), (f"alert {rule['alert']} rhs", rhs)]
        gpu = [(w, e) for w, e in checks if any(m.startswith("trainguard_gpu_") for m in referenced_metrics(e))]
        assert gpu, "the dashboard has GPU panels"
        failures = []
        deadline = time.monotonic() + 20
        for where, expr in checks:
            if (where, expr) in gpu:
                continue
            try:
                prom.wait_for(expr, timeout_s=max(1.0, deadline - time.monotonic()))
            except AssertionError as e:
                failures.append(f"{where}: {e}")
        assert not failures, "\n".join(failures)
        for where, expr in gpu:
            assert prom.query(expr) == [], f"{where}: GPU series on a machine without GPUs: {expr}"
        for n in (a, b):
            assert len(n.events("gpu_metrics_unavailable")) == 1, n.dump()

        # The values are the job's.
        assert value(prom, "max_over_time(max(trainguard_world_size)[5m:1s])") == 2
        assert value(prom, 'trainguard_world_size{node="a"}') == 1
        assert value(prom, 'max_over_time(trainguard_nodes{node="a"}[5m])') == 2
        assert value(prom, 'trainguard_nodes{node="a"}') == 1
        assert value(prom, "max(trainguard_step)") > steps_before
        # Every step of the job was counted once (local rank 0 of each node), each with 24 samples
        # split over the ranks of its world: sum over nodes of samples == 24 x steps of the job.
        steps_a = value(prom, 'trainguard_steps_total{node="a"}')
        samples = value(prom, "sum(max_over_time(trainguard_samples_total[5m]))")
        tokens = value(prom, "sum(max_over_time(trainguard_tokens_total[5m]))")
        step_now = value(prom, 'trainguard_step{node="a"}')
        assert steps_a == step_now, (steps_a, step_now)  # no step redone: the drain lost nothing
        assert samples == GLOBAL_BATCH * steps_a, (samples, steps_a)
        assert tokens == samples * SEQ_LEN
        assert value(prom, "min(trainguard_samples_per_second)") > 0
        assert value(prom, "max(trainguard_checkpoint_last_committed_step)") >= resumed[0]["step"] > 0
        saves = by_node(prom, 'max_over_time(trainguard_checkpoint_saves_total{kind="periodic"}[5m])')
        assert saves.get("a", 0) >= 2 and saves.get("b", 0) >= 2, saves
        emergency = by_node(prom, 'max_over_time(trainguard_checkpoint_saves_total{kind="emergency"}[5m])')
        assert emergency == {"a": 1, "b": 1}, emergency
        assert value(prom, 'max_over_time(trainguard_preemption_notices_total{node="b",source="manual"}[5m])') == 1
        assert value(prom, 'max_over_time(trainguard_drain_duration_seconds_count{node="b"}[5m])') == 1
        assert value(prom, 'max_over_time(trainguard_agent_state{node="b",state="stopped"}[5m])') == 1
        # A planned drain is no restart (it must not consume one, nor count as one).
        assert value(prom, "sum(max_over_time(trainguard_restarts_total[5m]))") == 0
        assert value(prom, 'trainguard_wasted_seconds_total{node="a",reason="resize"}') > 0
        assert value(prom, 'max_over_time(trainguard_wasted_seconds_total{node="b",reason="drain"}[5m])') > 0
        assert value(prom, "trainguard_checkpoint_interval_seconds") > 0
        # Cost: the configured price of each node, and money spent.
        assert by_node(prom, "max_over_time(trainguard_price_per_hour[5m])") == {"a": SPOT, "b": ON_DEMAND}
        assert value(prom, 'trainguard_cost_total{node="a"}') > 0
        assert 0 < value(prom, 'trainguard_goodput_ratio{node="a"}') < 1
        alerts = {x["labels"]["alertname"] for x in prom.api("alerts")["alerts"]}
        assert not alerts & {"TrainguardNoProgress", "TrainguardCheckpointStale", "TrainguardCheckpointFailing"}, alerts

        for n in nodes:
            n.signal(15)
        for n in nodes:
            n.wait(60)
        print(f"metrics_e2e_s={time.monotonic() - t0:.1f} steps={steps_a:.0f}")
    except AssertionError:
        print(a.dump(60), b.dump(60), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()
