"""Several agents on localhost stand in for nodes: real rendezvous, real gloo workers, real failures."""

import os
import signal

import pytest

from tests.harness import Node, alive, free_port, wait_listening, wait_until
from trainguard.agent.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
TRAIN = ["--steps", "100000", "--log-every", "5", "--step-sleep", "0.02", "--global-batch", "24"]


def worlds(node):
    return [e["world_size"] for e in node.events("rendezvous_complete")]


def steps_after(node, t_index):
    return [e for e in node.events("train_step")][t_index:]


@pytest.fixture
def nodes(tmp_path):
    started = []

    def start(name, endpoint, **kw):
        n = Node(name, str(tmp_path), endpoint, **kw)
        started.append(n)
        return n

    yield start
    for n in started:
        n.stop()


def test_two_nodes_train_restart_scale_up_and_drain(nodes):
    ep = f"127.0.0.1:{free_port()}"
    a = nodes("a", ep, nnodes="2:3", script_args=TRAIN)
    wait_listening(ep)  # a hosts the store
    b = nodes("b", ep, nnodes="2:3", script_args=TRAIN)
    try:
        # 1. two agents form world size 2 and train
        wait_until(lambda: worlds(a) == [2] and worlds(b) == [2], 60, "world size 2")
        wait_until(lambda: a.events("train_step") or b.events("train_step"), 60, "training steps")
        trainer = a if a.events("train_step") else b  # global rank 0 prints

        # 2. SIGKILL one worker -> both restart (consuming a restart) and training continues
        (victim,) = b.worker_pids()
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: worlds(a) == [2, 2] and worlds(b) == [2, 2], 60, "re-formed world after worker crash")
        restarts = [e for e in b.events("state_change") if e["new"] == "restarting"]
        assert restarts and restarts[0]["exit_codes"] == [-9] and restarts[0]["remaining_restarts"] == 2
        n_before = len(trainer.events("train_step"))
        wait_until(lambda: len(trainer.events("train_step")) > n_before + 2, 60, "training after restart")
        assert not alive(victim)
        from trainguard.agent import control
        from trainguard.contract.protocol import DrainRequest, StatusRequest
        budget = {n.name: control.request(n.socket, StatusRequest()).data["remaining_restarts"] for n in (a, b)}
        assert budget["b"] == 2  # b's own worker crashed: one restart consumed

        # 3. a third agent joins -> world size 3, without consuming a restart
        c = nodes("c", ep, nnodes="2:3", script_args=TRAIN)
        wait_until(lambda: worlds(a)[-1:] == [3] and worlds(b)[-1:] == [3] and worlds(c) == [3], 90, "world size 3")
        assert any(e.get("reason") == "scale_up" for e in a.events("decision"))
        n3 = len(trainer.events("train_step"))
        wait_until(lambda: any(e["world_size"] == 3 for e in trainer.events("train_step")[n3:]), 60, "training at 3")

        # 4. an agent that does not host the store leaves (drain) -> survivors continue at 2
        assert control.request(c.socket, DrainRequest(deadline_s=20, reason="test")).ok
        assert c.wait(60) == ExitCode.DRAINED
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2], 90, "survivors re-form at 2")
        n2 = len(trainer.events("train_step"))
        wait_until(lambda: any(e["world_size"] == 2 for e in trainer.events("train_step")[n2:]), 60, "training at 2 again")
        assert [e["new"] for e in c.events("state_change")][-2:] == ["draining", "stopped"]
        # the survivors' re-formations for the scale-up and for the peer's drain were free
        assert {n.name: control.request(n.socket, StatusRequest()).data["remaining_restarts"] for n in (a, b)} == budget
        # The survivor whose worker notices first says peer_drain; the other may see it waiting in the
        # next round first and call it a scale-up (the same restart, no restart consumed).
        last = {n.name: [e["reason"] for e in n.events("decision")][-1] for n in (a, b)}
        assert "peer_drain" in last.values() and set(last.values()) <= {"peer_drain", "scale_up"}, last
    except AssertionError:
        print(a.dump(), b.dump(), sep="\n")
        raise


def test_agent_sigkill_leaves_no_orphan_worker(nodes):
    a = nodes("solo", f"127.0.0.1:{free_port()}", nnodes="1:1", script_args=TRAIN)
    wait_until(lambda: a.events("train_step"), 60, "training")
    (worker,) = a.worker_pids()
    assert alive(worker)
    a.proc.kill()
    a.proc.wait(10)
    wait_until(lambda: not alive(worker), 10, f"worker {worker} to die with its agent")
