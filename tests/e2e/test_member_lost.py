"""A node lost while the new world's workers are still starting: the survivors' workers wait in
process-group set-up for a rank that never comes, and nothing fails on its own until the process-group
timeout (10 minutes by default). The agents watch the round's membership in every phase and re-form
without the lost node."""

import os
import signal
import time

import pytest

from tests.harness import REPO, Node, free_port, running, wait_listening, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
SLOW = os.path.join(REPO, "tests", "e2e", "_slow_start.py")
ARGS = ["--steps", "100000", "--log-every", "2", "--step-sleep", "0.03", "--global-batch", "24"]


def worlds(node):
    return [e["world_size"] for e in node.events("rendezvous_complete")]


def steps(*nodes):
    """The ``train_step`` lines of ``nodes`` (the script logs them on global rank 0, which can be any node)."""
    return [e for n in nodes for e in n.events("train_step")]


def two_training_nodes(tmp, *settings):
    """Nodes a and b (of up to 3) training at world size 2 on a store of a's; returns (a, b, endpoint,
    their agent flags) for the third node to use."""
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", "rendezvous.keep_alive_interval_s=1",
              "--set", "rendezvous.keep_alive_max_attempts=3"]
    for s in settings:
        common += ["--set", s]
    a = Node("a", tmp, ep, nnodes="1:3", script=ELASTIC, script_args=ARGS, extra=common)
    wait_listening(ep)
    b = Node("b", tmp, ep, nnodes="1:3", script=ELASTIC, script_args=ARGS, extra=common)
    try:
        wait_until(lambda: any(e["world_size"] == 2 for e in steps(a, b)), 120, "training at world size 2")
    except AssertionError:
        for n in (a, b):
            print(n.dump(40))
            n.stop()
        raise
    return a, b, ep, common


def test_node_lost_during_worker_start_up_does_not_hang_the_survivors(tmp_path):
    tmp = str(tmp_path)
    a, b, ep, common = two_training_nodes(tmp, "workers.reform=restart")
    with running([a, b]) as nodes:
        c = Node("c", tmp, ep, nnodes="1:3", script=SLOW, script_args=ARGS, extra=common, env={"SLOW_START_S": "60"})
        nodes.append(c)
        wait_until(lambda: worlds(c)[-1:] == [3], 90, "c in a world of 3 (its worker still starting)")
        kids = c.worker_pids()
        c.proc.kill()  # the node vanishes: agent and its (sleeping) worker
        for p in kids:
            os.kill(p, signal.SIGKILL)
        t_kill = time.monotonic()
        at_2 = len([e for e in steps(a, b) if e["world_size"] == 2])
        # a and b restarted their workers for the world of 3: they now wait for rank 2 in set-up.
        lost = wait_until(lambda: a.events("member_lost") or b.events("member_lost"), 60, "a member_lost report")
        assert lost
        wait_until(lambda: worlds(a)[-1:] == [2] and len([e for e in steps(a, b) if e["world_size"] == 2]) > at_2,
                   90, "training at world size 2 again")
        recovered_s = time.monotonic() - t_kill
        assert recovered_s < 60, recovered_s  # not the 600 s process-group timeout
        # One of the survivors restarts on member_lost; the other may see that one re-enter the
        # rendezvous first and restart for it (scale_up): either way nothing consumed a restart.
        decisions = [e for n in (a, b) for e in n.events("decision") if e.get("reason") == "member_lost"]
        assert decisions and not [e for n in (a, b) for e in n.events("state_change") if e["new"] == "restarting"]
        print(f"recovered {recovered_s:.1f} s after the kill")


def test_in_place_a_member_lost_before_the_new_world_forms_costs_no_step(tmp_path):
    """In-place re-formation (the default): node c joins a running world of 2 and vanishes after the
    round of 3 completed but before its worker joined the new world (its warmed-up worker is stopped
    first, so the window is certain). The survivors' workers wait in the world's arrival count; their
    agents see the member go and call the join off: the workers park again with their state and re-form
    at 2, same processes, no step redone (the chaos case `sigterm_agent @ rendezvous`, which planned
    leaves hit the same way)."""
    tmp = str(tmp_path)
    a, b, ep, common = two_training_nodes(tmp)
    with running([a, b]) as nodes:
        pids = (a.worker_pids(), b.worker_pids())
        c = Node("c", tmp, ep, nnodes="1:3", script=ELASTIC, script_args=ARGS, extra=common)
        nodes.append(c)
        wait_until(lambda: c.events("joiner_warm") or c.events("worker_warm"), 120, "c's worker warm")
        kids = c.worker_pids()
        for p in kids:
            os.kill(p, signal.SIGSTOP)  # c will join the round, but its worker never the world
        wait_until(lambda: worlds(a)[-1:] == [3] and worlds(b)[-1:] == [3], 90, "a and b in the round of 3")
        time.sleep(1.0)  # a's and b's workers are in the new world's arrival count now
        last = max(e["step"] for e in steps(a, b))
        c.proc.kill()
        for p in kids:
            os.kill(p, signal.SIGKILL)
        # The re-formed world's own lines: a step line alone can be the parked step's, logged late (the
        # agent tails the worker's output), which satisfied this wait before a's worker re-formed once.
        wait_until(lambda: worlds(a)[-1:] == [2] and any(e["reason"] == "peer_lost" for e in a.events("worker_reformed"))
                   and any(e["world_size"] == 2 and e["step"] > last for e in steps(a, b)), 90, "training at 2 again")
        assert a.events("join_aborted") and b.events("join_aborted")
        assert (a.worker_pids(), b.worker_pids()) == pids  # the same processes, never restarted
        assert not [e for n in (a, b) for e in n.events("state_change") if e["new"] == "restarting"]
        logged = [e["step"] for e in steps(a, b)]
        assert len(logged) == len(set(logged)), "a step was trained twice"
        assert not a.events("step_rolled_back") and not b.events("step_rolled_back")
        # The interval controller saw a loss the state survived (no rollback to storage).
        lost = [e["survived_losses"] for e in a.events("worker_reformed") if e["reason"] == "peer_lost"]
        assert lost[:1] == [1], lost
