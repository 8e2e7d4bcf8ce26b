"""The acceptance run for metrics: the bundled elastic job under two real agents, scraped every second
by a real Prometheus (Debian ``prometheus``), through periodic checkpoints and a drain of node b.
Every PromQL expression of the shipped dashboard and alert rules must return data, and the values
must match what the job did."""

from __future__ import annotations

import os
import time

import pytest

from tests.fixtures.prometheus import prometheus_factory  # noqa: F401  (fixture)
from tests.harness import REPO, Node, continued, free_port, wait_listening, wait_until
from tests.metrics.promql import RULES, alert_rules, dashboard_exprs, referenced_metrics, split_comparison
from trainguard.agent import control
from trainguard.agent.exitcodes import ExitCode
from trainguard.contract.protocol import DrainRequest

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


def at(prom, expr: str, t: float | None) -> list[dict]:
    """Instant query, evaluated at unix time ``t`` (now when None)."""
    if t is None:
        return prom.wait_for(expr, timeout_s=10)
    data = prom.api("query", query=expr, time=f"{t:.3f}")
    assert data["resultType"] == "vector" and data["result"], f"no data at {t} for: {expr}"
    return data["result"]


def value(prom, expr: str, t: float | None = None) -> float:
    res = at(prom, expr, t)
    assert len(res) == 1, (expr, res)
    return float(res[0]["value"][1])


def by_node(prom, expr: str, t: float | None = None) -> dict[str, float]:
    return {r["metric"]["node"]: float(r["value"][1]) for r in at(prom, expr, t)}


def test_dashboard_and_alert_queries_return_data_from_the_real_job(tmp_path, prometheus_factory):  # noqa: F811
    tmp = str(tmp_path)
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", "checkpoint.interval_steps=10",
              "--set", f"cost.spot_price_per_hour={SPOT}", "--set", f"cost.on_demand_price_per_hour={ON_DEMAND}",
              "--set", "metrics.sample_interval_s=0.25", "--set", "metrics.throughput_window_s=3"]
    args = ["--steps", "100000", "--log-every", "5", "--step-sleep", "0.03", "--global-batch", str(GLOBAL_BATCH),
            "--seq-len", str(SEQ_LEN)]
    t0 = time.monotonic()
    a = Node("a", tmp, ep, script=ELASTIC, script_args=args, extra=common)
    nodes = [a]
    try:
        # a hosts the c10d store (listening before b starts), so b can leave without taking it along.
        wait_listening(ep)
        b = Node("b", tmp, ep, script=ELASTIC, script_args=args, extra=common + ["--set", "cost.capacity=on_demand"])
        nodes.append(b)
        targets = [exporter_target(a), exporter_target(b)]
        prom = prometheus_factory(targets, rule_files=[RULES])
        prom.wait_for('count(up{job="trainguard"} == 1) == 2', timeout_s=20)

        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2], 90, "world size 2")
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= 25 for e in a.events("train_step")), 90,
                   "25 steps at world size 2")
        # Seen by Prometheus at world size 2, with a periodic checkpoint committed.
        prom.wait_for("min(trainguard_world_size) == 2 and count(trainguard_world_size) == 2", timeout_s=10)
        prom.wait_for("max(trainguard_checkpoint_last_committed_step) >= 10", timeout_s=10)
        steps_before = value(prom, "max(trainguard_step)")

        # b knows it is being scraped periodically (it waits for one last scrape before it exits).
        prom.wait_for(f'count_over_time(up{{instance="{targets[1]}"}}[1m]) >= 3', timeout_s=10)

        # The straggler panels score the members of the current world against each other: they have data
        # while the world has 2 nodes, none once a is alone (checked below).
        scored = [(e.where, e.expr) for e in dashboard_exprs()
                  if "trainguard_straggler_score" in referenced_metrics(e.expr)]
        assert scored, "the dashboard has a straggler score panel"
        for where, expr in scored:
            prom.wait_for(expr, timeout_s=60)
        # One drain of node b, as `trainguard drain` does it.
        reply = control.request(b.socket, DrainRequest(deadline_s=30))
        assert reply.ok, reply
        assert b.wait(60) == ExitCode.DRAINED, b.dump()
        # b's final values (drain duration, stopped state) were scraped before it went away.
        assert [e["scraped"] for e in b.events("metrics_final_scrape")] == [True], b.dump()
        wait_until(lambda: worlds(a)[-1:] == [1], 60, "survivor at world size 1")
        resumed = wait_until(lambda: continued(a, 1), 60, "resume at 1")
        wait_until(lambda: any(e["world_size"] == 1 and e["step"] >= resumed[0]["step"] + 10
                               for e in a.events("train_step")), 60, "training at world size 1")

        # Every dashboard expression and both sides of every alert return finite data, except the
        # GPU series: on a machine without GPUs they are absent (never faked).
        checks = [(e.where, e.expr) for e in dashboard_exprs()]
        empty_while_up = []
        for rule in alert_rules():
            lhs, _, rhs = split_comparison(rule["expr"])
            if rule["alert"] == "TrainguardJobDown":  # empty while any agent of the job is up: check its parts
                empty_while_up.append(lhs)
                parts = ["count by (job_id) (max_over_time(trainguard_agent_start_time_seconds[6h]))",
                         "count by (job_id) (trainguard_agent_start_time_seconds)"]
                assert all(p in lhs for p in parts), lhs
                checks += [(f"alert {rule['alert']} part", p) for p in parts] + [(f"alert {rule['alert']} rhs", rhs)]
                continue
            checks += [(f"alert {rule['alert']} lhs", lhs), (f"alert {rule['alert']} rhs", rhs)]
        assert empty_while_up, "the rules page when a whole job is down"
        gpu = [(w, e) for w, e in checks if any(m.startswith("trainguard_gpu_") for m in referenced_metrics(e))]
        assert gpu, "the dashboard has GPU panels"
        failures = []
        deadline = time.monotonic() + 20
        for where, expr in checks:
            if (where, expr) in gpu or (where, expr) in scored:
                continue
            try:
                prom.wait_for(expr, timeout_s=max(1.0, deadline - time.monotonic()))
            except AssertionError as e:
                failures.append(f"{where}: {e}")
        assert not failures, "\n".join(failures)
        for expr in empty_while_up:
            assert prom.query(expr) == [], f"the job is up, yet: {expr}"
        for where, expr in gpu:
            assert prom.query(expr) == [], f"{where}: GPU series on a machine without GPUs: {expr}"
        # a is alone: it scores nobody, and exports no score of b, which left (gone at a's first scrape
        # after the re-formation: the last one may have come just before it)
        prom.wait_gone('trainguard_straggler_score{node="a",member="b"}', timeout_s=10)
        for n in (a, b):
            assert len(n.events("gpu_metrics_unavailable")) == 1, n.dump()

        # The values are the job's, all read at one instant (the job keeps training meanwhile), once
        # Prometheus has seen the survivor train on at world size 1.
        prom.wait_for(f'trainguard_step{{node="a"}} >= {resumed[0]["step"] + 10}', timeout_s=20)
        # The step gauge is read live from the workers at a scrape, the goodput ledger at its own samples:
        # the survivor's re-formation (tens of ms in place) is attributed when a sample closes its window.
        prom.wait_for('trainguard_wasted_seconds_total{node="a",reason="resize"} > 0', timeout_s=10)
        t = time.time()
        assert value(prom, "max_over_time(max(trainguard_world_size)[5m:1s])", t) == 2
        assert value(prom, 'trainguard_world_size{node="a"}', t) == 1
        assert value(prom, 'max_over_time(trainguard_nodes{node="a"}[5m])', t) == 2
        assert value(prom, 'trainguard_nodes{node="a"}', t) == 1
        assert value(prom, "max(trainguard_step)", t) > steps_before
        # Every step of the job was counted once (local rank 0 of each node), each with 24 samples
        # split over the ranks of its world: sum over nodes of samples == 24 x steps of the job.
        steps_a = value(prom, 'trainguard_steps_total{node="a"}', t)
        samples = value(prom, "sum(max_over_time(trainguard_samples_total[5m]))", t)
        tokens = value(prom, "sum(max_over_time(trainguard_tokens_total[5m]))", t)
        step_now = value(prom, 'trainguard_step{node="a"}', t)
        # (A scrape can land between a worker's counter updates of one step: allow that one step.)
        assert step_now <= steps_a <= step_now + 1, (steps_a, step_now)  # no step redone: the drain lost nothing
        assert GLOBAL_BATCH * (steps_a - 1) <= samples <= GLOBAL_BATCH * steps_a, (samples, steps_a)
        assert SEQ_LEN * (samples - GLOBAL_BATCH) <= tokens <= SEQ_LEN * samples, (tokens, samples)
        assert value(prom, "min(trainguard_samples_per_second)", t) > 0
        assert value(prom, "max(trainguard_checkpoint_last_committed_step)", t) >= resumed[0]["step"] > 0
        saves = by_node(prom, 'max_over_time(trainguard_checkpoint_saves_total{kind="periodic"}[5m])', t)
        assert saves.get("a", 0) >= 2 and saves.get("b", 0) >= 2, saves
        emergency = by_node(prom, 'max_over_time(trainguard_checkpoint_saves_total{kind="emergency"}[5m])', t)
        assert emergency == {"a": 1, "b": 1}, emergency
        assert value(prom, 'max_over_time(trainguard_preemption_notices_total{node="b",source="manual"}[5m])', t) == 1
        assert value(prom, 'max_over_time(trainguard_drain_duration_seconds_count{node="b"}[5m])', t) == 1
        assert value(prom, 'max_over_time(trainguard_agent_state{node="b",state="stopped"}[5m])', t) == 1
        # What b's workers logged is what b exported (b's last scrape came after its workers exited):
        # bytes its ranks wrote and saves committed, per kind; nothing was rolled back by the drain.
        logged = [e for e in b.events("checkpoint_committed") if e.get("component") == "trainguard.checkpoint"]
        assert logged and all(e["rank_bytes"] > 0 for e in logged), b.dump()
        for kind in ("periodic", "emergency"):
            mine = [e for e in logged if e["kind"] == kind]
            written = value(prom, f'max_over_time(trainguard_checkpoint_written_bytes_total{{node="b",kind="{kind}"}}[5m])', t)
            raw = prom.api("query", query=f'trainguard_checkpoint_written_bytes_total{{node="b",kind="{kind}"}}[5m]',
                           time=f"{t:.3f}")["result"]  # every scraped sample, to tell when a mismatch came
            assert written == sum(e["rank_bytes"] for e in mine), (
                kind, written, [(e["step"], e["rank_bytes"], e["timestamp"]) for e in mine], raw)
            persisted = value(prom, f'max_over_time(trainguard_checkpoint_persist_duration_seconds_count{{node="b",kind="{kind}"}}[5m])', t)
            assert persisted == len(mine), (kind, persisted, len(mine))
        assert value(prom, "sum(max_over_time(trainguard_recomputed_steps_total[5m]))", t) == 0
        assert value(prom, 'trainguard_wasted_seconds_total{node="a",reason="recompute"}', t) == 0
        # A planned drain is no restart (it must not consume one, nor count as one).
        assert value(prom, "sum(max_over_time(trainguard_restarts_total[5m]))", t) == 0
        assert value(prom, 'trainguard_wasted_seconds_total{node="a",reason="resize"}', t) > 0
        assert value(prom, 'max_over_time(trainguard_wasted_seconds_total{node="b",reason="drain"}[5m])', t) > 0
        # interval_steps=10 x the step time, estimated by the agent (the staleness alert's yardstick).
        assert 0 < value(prom, 'trainguard_checkpoint_interval_seconds{node="a"}', t) < 60
        # Cost: the configured price of each node, and money spent.
        assert by_node(prom, "max_over_time(trainguard_price_per_hour[5m])", t) == {"a": SPOT, "b": ON_DEMAND}
        assert value(prom, 'trainguard_cost_total{node="a"}', t) > 0
        assert 0 < value(prom, 'trainguard_goodput_ratio{node="a"}', t) < 1
        # Prometheus evaluates every rule on this data without error. Nothing fires (one notice is no
        # high rate; the others have a `for`); nothing failed and steps ran, so those two are not even
        # pending. (CheckpointStale and GoodputLow may be: the resize outlasts 3 intervals of ~1 s.)
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        assert len(rules) == len(alert_rules()) and all(r["health"] == "ok" for r in rules), rules
        alerts = {x["labels"]["alertname"]: x["state"] for x in prom.api("alerts")["alerts"]}
        assert "firing" not in alerts.values(), alerts
        assert "TrainguardNoProgress" not in alerts and "TrainguardCheckpointFailing" not in alerts, alerts

        a.signal(15)
        assert a.wait(60) == ExitCode.STOPPED, a.dump()
        interval = value(prom, 'trainguard_checkpoint_interval_seconds{node="a"}', t)
        print(f"metrics_e2e_s={time.monotonic() - t0:.1f} steps={steps_a:.0f} samples={samples:.0f} "
              f"checkpoint_interval_s={interval:.2f}")
    except AssertionError:
        print(*(n.dump(60) for n in nodes), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()
