"""Tier 1: unmodified torchrun scripts (plain DDP, Lightning Fabric, HF Accelerate) under ``trainguard run``.

Each script only reads the torchelastic env; none imports trainguard. For each one, two agents
(``tests.harness.Node``, ``--nnodes 1:2``, one worker each) stand in for two nodes:

1. the script trains at world size 2 (its own ``train_step`` lines) and writes its own periodic
   checkpoint; each node's metrics endpoint serves ``trainguard_world_size`` 2 and state ``running``;
2. a drain of node b over its control socket (what ``trainguard drain`` sends): b's agent SIGTERMs its
   worker with ``preemption.term_grace_s`` (logged ``workers_terminating`` with ``grace_s`` and the
   worker's pid), the worker (which does
   nothing about SIGTERM, like most such scripts) dies well within the grace, without a SIGKILL, and
   b's agent exits 3, drained (``draining`` -> ``stopped``);
3. the survivor's worker loses its peer; its agent re-forms the world at size 1 without consuming a
   restart (``peer_drain``), and the script resumes from its own last checkpoint and trains on at
   world size 1 (metrics: world size 1, no restart counted).

Lightning Fabric and Accelerate come with the ``test`` extra; without them their case is skipped
with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
import urllib.request

import pytest

from tests.harness import REPO, Node, alive, free_port, wait_listening, wait_until
from trainguard.agent.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
GRACE_S = 5
CKPT_EVERY = 4
SCRIPTS = {
    "ddp": ("train_gpt.py", None),
    "fabric": ("train_fabric.py", "lightning_fabric"),
    "accelerate": ("train_accelerate.py", "accelerate"),
}


def worlds(node: Node) -> list[int]:
    return [e["world_size"] for e in node.events("rendezvous_complete")]


def train_steps(*nodes: Node) -> list[dict]:
    return [e for n in nodes for e in n.events("train_step")]


def scrape(node: Node) -> dict[tuple[str, tuple], float]:
    """One scrape of the node's exporter (URL from the agent's ``metrics_serving`` event)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = wait_until(lambda: node.events("metrics_serving"), 30, f"{node.name}'s metrics_serving")[0]["url"]
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    found = [v for (n, lab), v in samples.items() if n == name and want <= set(lab)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.mark.parametrize("kind", list(SCRIPTS))
def test_unmodified_script_trains_gets_sigterm_on_drain_and_survivor_resumes(kind, tmp_path):
    script, needs = SCRIPTS[kind]
    # find_spec, not importorskip: the script imports it in the worker; importing lightning_fabric
    # here would also set PYTORCH_NVML_BASED_CUDA_CHECK in the test process (the suite's env-leak guard).
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed: the `test` extra installs it (pip install -e '.[test]')")
    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "ckpt")
    args = ["--steps", "100000", "--log-every", "2", "--step-sleep", "0.05", "--global-batch", "8",
            "--d-model", "32", "--layers", "1", "--max-bytes", "200000", "--ckpt-dir", ckpt,
            "--ckpt-every", str(CKPT_EVERY)]
    common = ["--set", f"preemption.term_grace_s={GRACE_S}"]
    path = os.path.join(REPO, "examples", script)
    ep = f"127.0.0.1:{free_port()}"
    t_start = time.monotonic()
    a = Node("a", tmp, ep, script=path, script_args=args, extra=common)
    nodes = [a]
    try:
        # a hosts the c10d store (b starts once it listens): b is the node that leaves.
        wait_listening(ep)
        b = Node("b", tmp, ep, script=path, script_args=args, extra=common)
        nodes.append(b)

        # 1. world size 2: the script's own output, a periodic checkpoint, node-level metrics.
        # (a may start alone at world size 1 and re-form at 2 when b joins, as torchrun does.)
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b) == [2], 90, "world size 2")
        first2 = wait_until(lambda: [e["step"] for e in train_steps(a, b) if e["world_size"] == 2], 90,
                            "training at world size 2")[0]
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= first2 + CKPT_EVERY + 2 for e in train_steps(a, b)),
                   90, "steps past a checkpoint at world size 2")
        # (One scrape per exporter: an agent that sees periodic scrapes waits for one more before it
        # exits, so that its final values reach the scraper.)
        m = scrape(b)
        assert metric(m, "trainguard_world_size", node="b") == 2
        assert metric(m, "trainguard_nodes", node="b") == 2
        assert metric(m, "trainguard_agent_state", node="b", state="running") == 1
        t_world2 = time.monotonic()

        # 2. drain b: its worker gets SIGTERM with the configured grace and dies of it.
        (worker,) = b.worker_pids()
        from trainguard.agent import control
        from trainguard.contract.protocol import DrainRequest

        t0 = time.monotonic()
        assert control.request(b.socket, DrainRequest(deadline_s=30)).ok
        wait_until(lambda: not alive(worker), GRACE_S + 5, f"b's worker {worker} to exit")
        worker_exit_s = time.monotonic() - t0
        assert b.wait(60) == ExitCode.DRAINED, b.dump()
        (term,) = b.events("workers_terminating")
        assert term["reason"] == "notice" and term["grace_s"] == GRACE_S, term
        log = "\n".join(b.lines())
        assert term["pids"] == [worker], term  # SIGTERMed by the agent (torch's own line is dropped on a drain)
        assert "forcefully exiting" not in log, b.dump()  # no SIGKILL was needed
        assert worker_exit_s < GRACE_S, f"worker took {worker_exit_s:.1f}s to exit"
        assert [e["new"] for e in b.events("state_change")][-2:] == ["draining", "stopped"]

        # 3. the survivor: re-formed at world size 1 for free, resumed from its own checkpoint.
        wait_until(lambda: worlds(a)[-1:] == [1], 60, "survivor at world size 1")
        resumed = wait_until(lambda: [e for e in a.events("resumed") if e["world_size"] == 1], 60,
                             "the script's own resume at world size 1")
        s = resumed[0]["step"]
        assert s >= first2 and s % CKPT_EVERY == 0, (resumed, first2)  # a checkpoint of the world-2 phase
        wait_until(lambda: any(e["world_size"] == 1 and e["step"] >= s + 4 for e in a.events("train_step")), 60,
                   "training at world size 1")
        assert [e["reason"] for e in a.events("decision")][-1] == "peer_drain", a.dump()
        assert not [e for e in a.events("state_change") if e["new"] == "restarting"]
        m = scrape(a)
        assert metric(m, "trainguard_world_size", node="a") == 1
        assert metric(m, "trainguard_nodes", node="a") == 1
        assert metric(m, "trainguard_agent_state", node="a", state="running") == 1
        assert sum(v for (n, _), v in m.items() if n == "trainguard_restarts_total") == 0
        t_resumed = time.monotonic()

        a.signal(signal.SIGTERM)  # a SIGTERM to the agent is a drain too
        assert a.wait(60) == ExitCode.STOPPED, a.dump()
        print(f"{kind}: to_world2_s={t_world2 - t_start:.1f} worker_exit_after_drain_s={worker_exit_s:.2f} "
              f"drain_to_resumed_training_s={t_resumed - t0:.1f} resumed_step={s} "
              f"stop_s={time.monotonic() - t_resumed:.1f}")
    except AssertionError:
        print(*(n.dump(60) for n in nodes), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()
