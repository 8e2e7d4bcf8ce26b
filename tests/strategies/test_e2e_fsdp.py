"""FSDP2 through real agents: two nodes (one rank each) train the bundled GPT job with
``--strategy fsdp``; node b is drained over its control socket; every rank saves the emergency
checkpoint of the same step, the survivor re-forms at world size 1, restores that step resharded
(DTensor shards of 2 ranks -> 1) and continues at the next step; then node b rejoins, the survivor
takes a resize checkpoint and the world re-forms at 2 (1 -> 2 reshard). Every sample is used exactly
once, and the loss is continuous: the first step after each restore has the loss it would have had
without the resize (recomputed by a fixed-size segment from the same checkpoint), within 1e-6."""

from __future__ import annotations

import os

import pytest

from tests.e2e.test_drain import check_exactly_once, sample_log, worlds
from tests.harness import Node, free_port, wait_listening, wait_until
from tests.strategies._world import E2E_BATCH, E2E_SIZE, ELASTIC, JOB, continuity, losses
from trainguard.agent import control

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
GLOBAL_BATCH = E2E_BATCH  # what check_exactly_once expects


def test_fsdp_drain_to_1_then_rejoin_to_2_exactly_once_and_loss_continuous(tmp_path):
    tmp = str(tmp_path)
    os.makedirs(os.path.join(tmp, "samples"))
    ep = f"127.0.0.1:{free_port()}"
    ckpt = os.path.join(tmp, "ckpt")
    loss_log = os.path.join(tmp, "loss.jsonl")
    # job "run" is the checkpoint run id run_segment uses, so the references read the same layout.
    # keep_last: the references below restore the emergency and the resize steps after the run.
    common = ["--set", f"checkpoint.url={ckpt}", "--set", "checkpoint.interval_steps=10",
              "--set", "checkpoint.keep_last=1000"]
    args = ["--strategy", "fsdp", "--steps", "100000", *JOB, *E2E_SIZE, "--step-sleep", "0.03", "--log-every", "2",
            "--sample-log", os.path.join(tmp, "samples"), "--loss-log", loss_log]
    a = Node("a", tmp, ep, nnodes="1:2", job="run", script=ELASTIC, script_args=args, extra=common)
    wait_listening(ep)  # a hosts the c10d store; b is the node that leaves
    b = Node("b", tmp, ep, nnodes="1:2", job="run", script=ELASTIC, script_args=args, extra=common)
    nodes = [a, b]
    try:
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2], 90, "world size 2")
        wait_until(lambda: any(e["step"] >= 6 for n in (a, b) for e in n.events("train_step")), 90,
                   "6 steps at world size 2")
        reply = control.request(b.socket, {"op": "drain", "deadline_s": 30})
        assert reply.get("ok"), reply
        assert b.wait(60) == 0, b.dump()
        committed = [e for n in (a, b) for e in n.events("checkpoint_committed")
                     if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"]
        assert len(committed) == 2, a.dump() + b.dump()
        s = committed[0]["step"]
        assert all(e["step"] == s for e in committed) and all(e["before_deadline"] for e in committed)

        wait_until(lambda: worlds(a)[-1:] == [1], 60, "survivor at world size 1")
        resumed = wait_until(lambda: [e for e in a.events("resumed") if e["world_size"] == 1], 60, "resume at 1")
        assert resumed[0]["step"] == s and resumed[0]["strategy"] == "fsdp"
        restored = [e for e in a.events("worker_restored") if e.get("world_size") == 1]
        assert restored and restored[0]["saved_world_size"] == 2
        wait_until(lambda: any(e["world_size"] == 1 and e["step"] >= s + 4 for e in a.events("train_step")), 60,
                   "training at world size 1")

        b2 = Node("b2", tmp, ep, nnodes="1:2", job="run", script=ELASTIC, script_args=args, extra=common)
        nodes.append(b2)
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b2) == [2], 90, "world size 2 again")
        r2 = wait_until(lambda: [e for e in a.events("resumed") if e["world_size"] == 2], 60, "resume at 2")
        r = r2[-1]["step"]
        resize = [e for e in a.events("checkpoint_committed")
                  if e.get("kind") == "resize" and e.get("component") == "trainguard.worker"]
        assert resize and resize[-1]["step"] == r
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= r + 3 for e in a.events("train_step")), 90,
                   "training at world size 2 again")
        for n in (a, b2):
            n.signal(15)
        for n in (a, b2):
            assert n.wait(60) == 0, n.dump()
        seen = check_exactly_once(sample_log(tmp))

        logged = losses(loss_log)
        d1 = continuity(tmp, ckpt, "fsdp", s, 2, logged)  # 2 -> 1: step s+1 as world 2 would have had it
        d2 = continuity(tmp, ckpt, "fsdp", r, 1, logged)  # 1 -> 2: step r+1 as world 1 would have had it
        print(f"fsdp 2->1->2: emergency_step={s} resize_step={r} steps={len(seen) // GLOBAL_BATCH} "
              f"loss_delta_after_drain={d1:.3g} loss_delta_after_rejoin={d2:.3g}")
        assert d1 <= 1e-6 and d2 <= 1e-6, (d1, d2)
    except AssertionError:
        print(*(n.dump(60) for n in nodes), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()
