"""Tier 0 end to end: two agents train DDP on gloo with an in-memory snapshot every step and no durable
checkpoint in storage; the test SIGKILLs one worker (its agent lives). The agents restart the world
(``workers.reform: restart``), and every rank restores the newest step all of them hold in their
agent's shared memory: at most ``memory_interval_steps`` (1) steps are lost, every sample is trained
exactly once in the committed lineage, and the snapshot folders survive the worker and go with the agents."""

import os
import signal
import time

import pytest

from tests import samples
from tests.harness import REPO, Node, free_port, wait_listening, wait_until
from tests.strategies import _world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")


def restored(node):
    return [e for e in node.events("worker_restored")]


def test_worker_sigkill_resumes_from_memory(tmp_path):
    tmp = str(tmp_path)
    folder = os.path.join(tmp, "samples")
    os.makedirs(folder)
    shm = os.path.join(tmp, "shm")
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", "checkpoint.interval=off",
              "--set", "checkpoint.memory_interval_steps=1", "--set", f"checkpoint.memory_dir={shm}",
              "--set", "workers.reform=restart"]
    args = ["--steps", "100000", "--log-every", "1", "--step-sleep", "0.05", "--sample-log", folder,
            *_world.JOB[:-4], *_world.E2E_SIZE]
    a = Node("a", tmp, ep, script=ELASTIC, script_args=args, extra=common)
    wait_listening(ep)
    b = Node("b", tmp, ep, script=ELASTIC, script_args=args, extra=common)
    nodes = [a, b]
    try:
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= 8 for e in a.events("train_step")), 120,
                   "8 steps at world size 2")
        node_dirs = sorted(os.listdir(shm))
        assert node_dirs == ["trainguard-job-a", "trainguard-job-b"], node_dirs
        (victim,) = b.worker_pids()
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        back = wait_until(lambda: [e for e in restored(a) + restored(b) if e.get("source") == "memory"], 90,
                          "the restarted world restoring from memory")
        wait_until(lambda: any(e["step"] >= back[0]["step"] + 3 for e in a.events("train_step")
                               if e["world_size"] == 2 and a.events("resumed")), 60, "training again")
        resumed_s = time.monotonic() - t_kill
        back = [e for e in restored(a) + restored(b)]  # both ranks' reports by now
        steps = {e["step"] for e in back}
        assert len(steps) == 1, back  # every rank restored the same step
        (step,) = steps
        assert sorted(e["rank"] for e in back) == [0, 1] and {e["source"] for e in back} == {"memory"}, back
        # the newest step any rank of the killed world trained (the survivor may finish one the victim did not)
        new_round = min(e["round"] for e in back)
        last = max(r["step"] for r in samples.read(folder) if r["round"] < new_round)
        lost = last - step
        assert 0 <= lost <= 1, (last, step)
        assert not [e for n in nodes for e in n.events("worker_restored") if e.get("source") == "storage"]
        # the snapshot files of both ranks are still there (the agents own them), two slots each
        files = sorted(f for d in os.listdir(shm) for f in os.listdir(os.path.join(shm, d)))
        assert files == ["rank-00000-0.snap", "rank-00000-1.snap", "rank-00001-0.snap", "rank-00001-1.snap"], files
        for n in nodes:
            n.signal(signal.SIGTERM)  # a drain of the whole job: both agents stop and remove their folders
        for n in nodes:
            n.wait(60)
        redone = samples.check_lineage_exactly_once(folder, _world.E2E_BATCH)
        assert sorted(redone) == list(range(step + 1, last + 1)), (redone, step, last)
        assert os.listdir(shm) == [], os.listdir(shm)
        print(f"restored step {step}, lost {lost} step(s), training again {resumed_s:.1f} s after the kill")
    except AssertionError:
        for n in nodes:
            print(n.dump(60))
        raise
    finally:
        for n in nodes:
            n.stop()


def test_node_sigkill_restores_the_lost_rank_from_its_buddy(tmp_path):
    """Tier 1: three FSDP2 nodes replicate their snapshots to the next node; node c (agent and worker) is
    SIGKILLed; a replacement node joins (min_nodes 3) and gets c's rank, whose state comes from the
    replica its buddy (node a) holds. Lost work <= memory interval + one replica lag; every sample once."""
    tmp = str(tmp_path)
    folder = os.path.join(tmp, "samples")
    os.makedirs(folder)
    shm = os.path.join(tmp, "shm")
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", "checkpoint.interval=off",
              "--set", "checkpoint.memory_interval_steps=1", "--set", "checkpoint.memory_replica=true",
              "--set", f"checkpoint.memory_dir={shm}", "--set", "workers.reform=restart",
              "--set", "rendezvous.keep_alive_interval_s=1", "--set", "rendezvous.keep_alive_max_attempts=3"]
    args = ["--steps", "100000", "--log-every", "1", "--step-sleep", "0.05", "--sample-log", folder,
            "--strategy", "fsdp", *_world.JOB[:-4], *_world.E2E_SIZE]

    def node(name, zone):  # each node names its failure domain: buddies are chosen across them
        return Node(name, tmp, ep, nnodes="3:3", script=ELASTIC, script_args=args,
                    extra=[*common, "--set", f"checkpoint.memory_failure_domain={zone}"])

    a = node("a", "zone-a")
    wait_listening(ep)
    b, c = node("b", "zone-b"), node("c", "zone-c")
    nodes = [a, b, c]
    try:
        wait_until(lambda: any(e["world_size"] == 3 and e["step"] >= 8 for e in a.events("train_step")), 150,
                   "8 steps at world size 3")
        assert "replica-00002-0.snap" in os.listdir(os.path.join(shm, "trainguard-job-a"))  # a holds c's rank 2
        plan = a.events("memory_replica_buddies")
        assert plan and plan[0]["separated"] and plan[0]["domains"] == ["zone-a", "zone-b", "zone-c"], plan
        kids = c.worker_pids()
        c.proc.kill()  # the whole node: agent and worker
        for p in kids:
            os.kill(p, signal.SIGKILL)
        d = node("d", "zone-c")  # the replacement, in the lost node's zone
        nodes.append(d)
        back = wait_until(lambda: [e for n in (a, b, d) for e in restored(n)] if len(
            [e for n in (a, b, d) for e in restored(n)]) == 3 else None, 120, "three ranks restored")
        wait_until(lambda: any(e["step"] >= back[0]["step"] + 3 for e in a.events("train_step")), 60, "training again")
        assert {e["source"] for e in back} == {"peer"}, back
        (step,) = {e["step"] for e in back}
        d_rank = [e["rank"] for e in restored(d)]
        assert d_rank == [2], d_rank  # the replacement took the lost rank: its state came from a's replica
        new_round = min(e["round"] for e in back)
        last = max(r["step"] for r in samples.read(folder) if r["round"] < new_round)
        lost = last - step
        assert 0 <= lost <= 2, (last, step)
        for n in (a, b, d):
            n.signal(signal.SIGTERM)
        for n in (a, b, d):
            n.wait(60)
        redone = samples.check_lineage_exactly_once(folder, _world.E2E_BATCH)
        assert sorted(redone) == list(range(step + 1, last + 1)), (redone, step, last)
        print(f"restored step {step} from the buddy replica, lost {lost} step(s)")
    except AssertionError:
        for n in nodes:
            print(n.dump(60))
        raise
    finally:
        for n in nodes:
            n.stop()
