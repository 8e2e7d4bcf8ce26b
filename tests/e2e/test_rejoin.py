"""A worker that dies on one node of an in-place world (agents/decisions.py ``Decision.rejoin``).

Its agent leaves the round at once: the other node re-forms in place without it (its worker keeps its
pid and goes on at world size 1), while the failed node's new worker starts in standby; once warm, the
node rejoins like any joiner and the world is back at 2. Before, the survivor waited in the next round
for the failed node's backoff and its new worker's start-up (``bench/peers.py`` kill_worker: 3.7 s).
No timed assertion: the figures are the peers bench's."""

import os
import signal

import pytest

from tests import samples
from tests.harness import REPO, Node, free_port, running, wait_listening, wait_until
from tests.strategies import _world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")


def steps(*nodes):
    return [e for n in nodes for e in n.events("train_step")]


def test_a_killed_worker_leaves_its_peer_going_on_in_place_and_rejoins_warm(tmp_path):
    tmp = str(tmp_path)
    folder = os.path.join(tmp, "samples")
    os.makedirs(folder)
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", "checkpoint.interval=20",
              "--set", "rendezvous.keep_alive_interval_s=5", "--set", "rendezvous.keep_alive_max_attempts=3"]
    args = ["--steps", "100000", "--log-every", "1", "--step-sleep", "0.03", "--sample-log", folder,
            *_world.JOB[:-4], *_world.E2E_SIZE]
    a = Node("a", tmp, ep, nnodes="1:2", script=ELASTIC, script_args=args, extra=common)
    wait_listening(ep)
    b = Node("b", tmp, ep, nnodes="1:2", script=ELASTIC, script_args=args, extra=common)
    with running([a, b]):
        def at_2():
            s2 = [e["step"] for e in steps(a, b) if e["world_size"] == 2]
            return s2 and max(s2) - min(s2) >= 20
        wait_until(at_2, 180, "20 steps at world size 2")
        (pa,), (pb,) = a.worker_pids(), b.worker_pids()
        os.kill(pb, signal.SIGKILL)
        killed_at = max(e["step"] for e in steps(a, b))

        left = wait_until(lambda: b.events("left_to_rejoin"), 60, "b leaves the round to rejoin")[0]
        assert left["reason"] == "worker_failure"
        # a goes on alone, in place (keep-alive 5 s x 3: not by b's heartbeat expiring, b left)
        wait_until(lambda: any(e["world_size"] == 1 and e["step"] > killed_at for e in steps(a)), 60,
                   "a trains on at world size 1")
        assert [e for e in a.events("worker_reformed") if e.get("reason") == "peer_lost"], a.dump()
        assert not a.events("member_lost"), "a waited for b's keep-alive to expire"
        # b's new worker warmed up in standby and joined the running world: back at 2
        assert wait_until(lambda: b.events("joined_running_world"), 90, "b rejoins warm")
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] > killed_at + 5 for e in steps(a, b)), 90,
                   "training at world size 2 again")
        assert a.worker_pids() == [pa], "the survivor's worker was restarted"
        assert pb not in b.worker_pids()
        assert not [e for e in a.events("state_change") if e["new"] == "restarting"]
        assert [e for e in b.events("state_change") if e["new"] == "restarting"][0]["reason"] == "worker_failure"
        for n in (a, b):
            n.signal(signal.SIGTERM)
        for n in (a, b):
            n.wait(60)
    samples.check_lineage_exactly_once(folder, _world.E2E_BATCH)
