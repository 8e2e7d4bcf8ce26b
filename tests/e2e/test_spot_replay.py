"""The spot-trace bench's pipeline on a tiny trace, against real agents: a notice (drain), a join, an
unannounced ``kill -9`` and the end of the trace. One scenario checks that

* the bench writes every figure it promises (ETTR, cost per committed sample, waste by cause, per-change
  phases, lost steps, skipped/repeated samples) and the simulator's prediction;
* no sample of the final lineage is skipped or repeated;
* each agent that was not killed exports a ``trainguard_goodput_ratio`` within 0.01 of the ground truth
  computed offline from its workers' per-step timestamps (kept steps only), and cost figures within 1 %:
  worker start-up, restores and rolled-back steps are not productive (the lineage and the agents agree
  whether the kill is survived by a restart from a checkpoint or by an in-place re-formation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

TRACE = """time_ms,event,node
0,add,n1
0,add,n2
18000,remove,n2
27000,add,n3
40000,remove,n1
"""


def test_replay_of_a_tiny_trace_measures_goodput_like_the_agents_export_it(tmp_path) -> None:
    trace = tmp_path / "tiny.csv"
    trace.write_text(TRACE)
    out = tmp_path / "spot.json"
    # Removal 0 comes with a 6 s notice; removal 1 is a kill -9 (--unannounced-indices).
    cmd = [sys.executable, os.path.join(REPO, "bench", "spot_trace.py"), "--trace", str(trace), "--nodes-per-agent", "1",
           "--max-agents", "3", "--speed", "1", "--hours", str(58 / 3600), "--lead-s", "6", "--unannounced-indices", "1",
           "--runs", "trainguard-fixed50", "--sim-seeds", "1", "--no-sweep", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())

    for key in ("ettr", "cost_per_sample", "on_demand_cost_per_sample", "waste_by_cause", "changes", "lost_steps",
                "skipped_samples", "repeated_samples", "full_trace", "measured_costs"):
        assert key in res, key
    assert res["leftover_processes"] == 0
    run = res["runs"]["trainguard-fixed50"]
    assert 0 < run["ettr"] < 1 and run["final_step"] > 0
    assert res["skipped_samples"] == 0 and res["repeated_samples"] == 0
    kinds = [c["kind"] for c in res["changes"]]
    assert kinds == ["start", "notice", "join", "kill"], res["changes"]
    # Steps trained and not kept (a restart rolls back to the last checkpoint; an in-place re-formation
    # loses at most the interrupted step) are exactly the ones the lineage dropped.
    assert run["lost_steps"] == sum(c.get("recomputed_steps", 0) for c in res["changes"]) >= 0
    assert set(res["waste_by_cause"]) >= {"restore", "recompute", "notice_lead"}
    assert 0 <= run["predicted"]["ettr"] <= 1

    agents = run["agents"]
    # The scaled trace removes the longest-present agent: agent1 at 22 s (notice), agent2 at 50 s (kill).
    assert agents["agent1"]["end"] == "drained" and agents["agent2"]["end"] == "killed"
    checked = []
    for name, ag in agents.items():
        if ag["end"] == "killed":
            continue  # its final values died with it
        assert ag["final_scrape"], (name, ag)
        assert ag["metric_goodput"] == pytest.approx(ag["truth_goodput"], abs=0.01), (name, ag)
        assert ag["metric_cost_total"] == pytest.approx(ag["truth_cost_total"], rel=0.01), (name, ag)
        assert abs(ag["metric_cost_wasted"] - ag["truth_cost_wasted"]) <= 0.01 * ag["truth_cost_total"], (name, ag)
        # Start-up is not productive: the agent's start to its workers' first step is exported as start-up
        # waste (measured against the step timestamps, not a floor: prestarted workers made it shorter).
        assert ag["truth_first_step_s"] > 0, (name, ag)
        assert ag["metric_wasted_s"]["startup"] == pytest.approx(ag["truth_first_step_s"], abs=0.25), (name, ag)
        checked.append(name)
    assert sorted(checked) == ["agent1", "agent3"]
