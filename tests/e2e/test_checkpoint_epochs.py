"""Checkpoint epochs end to end, with real agents (``trainguard run``) and ``trainguard store``.

One scenario, the stories of issue 10 in sequence (one set of agent generations for all of them):

1. nodes a and b train at world size 2 (round 0); b drains; a re-forms alone (round 1);
2. the ``trainguard store`` is restarted mid-job: the job goes on saving;
3. split brain: node b2 starts with the same job id and URL on the restarted store (a fresh store:
   round 0) while a still runs on its connection to the old one, which it never re-establishes: two
   worlds on two stores. b2 restores the newest step and claims a newer epoch; a's next commit is
   refused, it logs one ``checkpoint_fenced`` error, stops saving and keeps running (no crash loop),
   while b2 commits. (With the old fence, the rendezvous round, b2's round 0 was "older" than a's
   round 1: b2 crash-looped on ``FencedError`` and a kept committing.)
4. the whole job is killed and relaunched (node c) on another fresh store with the same job id and
   checkpoint URL: it restores the newest step and commits new checkpoints.

Throughout, no committed step is deleted or overwritten (retention is set high enough to keep all),
and no two worlds ever hold the same epoch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import REPO, Node, free_port, wait_listening, wait_until
from trainguard.checkpoint.discovery import StepRef, scan_run
from trainguard.checkpoint.storage import Storage
from trainguard.agent.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
ARGS = ["--steps", "100000", "--log-every", "5", "--step-sleep", "0.03", "--global-batch", "24"]


class Store:
    """A ``trainguard store`` process on a fixed port (so it can be restarted there)."""

    def __init__(self, tmp: str, name: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.name = name
        self._log = open(os.path.join(tmp, f"store-{name}.log"), "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "trainguard.agent.cli", "store", "--host", "127.0.0.1",
                                      "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_listening(self.endpoint, 30)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def worlds(node: Node) -> list[int]:
    return [e["world_size"] for e in node.events("rendezvous_complete")]


def ckpt_events(node: Node, event: str) -> list[dict]:
    return [e for e in node.events(event) if e.get("component") == "trainguard.checkpoint"]


def committed_refs(node: Node) -> set[StepRef]:
    return {StepRef(e["step"], e["epoch"]) for e in ckpt_events(node, "checkpoint_committed")}


def claims(node: Node) -> list[dict]:
    return ckpt_events(node, "checkpoint_epoch_claimed")


def steps_at(node: Node) -> int:
    ev = node.events("train_step")
    return ev[-1]["step"] if ev else 0


def test_relaunch_store_restart_and_split_brain_keep_every_checkpoint(tmp_path) -> None:
    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "ckpt")
    common = ["--set", f"checkpoint.url={ckpt}", "--set", "checkpoint.interval_steps=5",
              "--set", "checkpoint.keep_last=1000", "--set", "rendezvous.is_host=false"]
    nodes: list[Node] = []
    stores: list[Store] = []

    def node(name: str, store: Store) -> Node:
        n = Node(name, tmp, store.endpoint, nnodes="1:2", script=ELASTIC, script_args=ARGS, extra=common)
        nodes.append(n)
        return n

    try:
        # 1. world of 2 at round 0, then b drains and a re-forms alone at round 1.
        s1 = Store(tmp, "s1")
        stores.append(s1)
        a, b = node("a", s1), node("b", s1)
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2], 120, "world size 2")
        wait_until(lambda: len(committed_refs(a)) >= 2, 120, "two commits at world size 2")
        b.signal(15)
        assert b.wait(90) == ExitCode.STOPPED, b.dump()
        wait_until(lambda: worlds(a)[-1:] == [1] and len(claims(a)) >= 2, 90, "a re-formed alone, new epoch")
        e_alone = claims(a)[-1]["epoch"]
        wait_until(lambda: any(r.epoch == e_alone for r in committed_refs(a)), 90, "a commit by the re-formed world")

        # 2. restart the store on its port: the running world goes on saving, and a's agent reconnects
        # (republishing its round into the empty store).
        s1.stop()
        s1b = Store(tmp, "s1b", port=s1.port)
        stores.append(s1b)
        before = len(committed_refs(a))
        wait_until(lambda: len(committed_refs(a)) >= before + 2, 90, "a goes on saving after the store restart")
        wait_until(lambda: a.events("rendezvous_store_reconnected"), 60, "a reconnected to the restarted store")

        # 3. split brain: b2 forms a second world of the same job on another store (round 0), e.g. the
        # default endpoint copied to a node that cannot reach the first one.
        s3 = Store(tmp, "s3")
        stores.append(s3)
        b2 = node("b2", s3)
        wait_until(lambda: worlds(b2)[-1:] == [1] and len(committed_refs(b2)) >= 2, 150, "b2 commits")
        b2_claim = claims(b2)[-1]
        assert b2_claim["rdzv_round"] == 0 and b2_claim["epoch"] > claims(a)[-1]["epoch"]
        assert b2.events("resumed")[0]["step"] == b2_claim["base_step"] >= max(r.step for r in committed_refs(a)) - 5
        wait_until(lambda: ckpt_events(a, "checkpoint_fenced"), 90, "a is fenced at its next save")
        t_fenced = steps_at(a)
        wait_until(lambda: steps_at(a) >= t_fenced + 15, 90, "a keeps training (no crash loop)")
        assert len(ckpt_events(a, "checkpoint_fenced")) == 1  # one clear error, not one per save
        assert not [e for e in a.events("state_change") if e.get("new") == "restarting"]
        fenced_at = next(i for i, ln in enumerate(a.lines()) if "checkpoint_fenced" in ln)
        later = [ln for ln in a.lines()[fenced_at:] if '"checkpoint_committed"' in ln and "trainguard.checkpoint" in ln]
        assert not later, later  # a stopped saving ...
        assert all(r.epoch < b2_claim["epoch"] for r in committed_refs(a))  # ... and never committed as epoch >= b2's
        assert not [e for e in ckpt_events(b2, "checkpoint_save_failed")]

        # 4. kill everything; relaunch on a fresh store with the same job id and URL.
        newest_before = max(committed_refs(b2))
        for n in (a, b2):
            n.proc.kill()
        for n in (a, b2):
            n.wait(30)
        s2 = Store(tmp, "s2")
        stores.append(s2)
        c = node("c", s2)
        resumed = wait_until(lambda: c.events("resumed"), 120, "c resumed")
        assert resumed[0]["step"] >= newest_before.step
        wait_until(lambda: len(committed_refs(c)) >= 2, 120, "c commits new checkpoints")
        assert claims(c)[-1]["rdzv_round"] == 0 and claims(c)[-1]["epoch"] > b2_claim["epoch"]

        # Nothing committed by anyone was deleted or overwritten; epochs only grew.
        everything = set().union(*(committed_refs(n) for n in nodes))
        scan = scan_run(Storage(ckpt), "job")
        assert everything <= set(scan.committed), sorted(everything - set(scan.committed))
        for n in nodes:
            for e in ckpt_events(n, "checkpoint_committed"):
                m = scan.committed[StepRef(e["step"], e["epoch"])]
                assert m.total_bytes == e["bytes"]  # the very commit that was logged, not a rewrite
        all_claims = [x for n in nodes for x in claims(n)]
        assert len({x["epoch"] for x in all_claims}) == len(all_claims)  # no epoch held by two worlds
        assert not [e for n in nodes if n is not a for e in n.events() if "FencedError" in json.dumps(e)]
        print(f"epochs={sorted(x['epoch'] for x in all_claims)} rounds={[x['rdzv_round'] for x in all_claims]} "
              f"committed={len(everything)}")
    except AssertionError:
        for n in nodes:
            print(n.dump(40))
        raise
    finally:
        for n in nodes:
            n.stop()
        for s in stores:
            s.stop()
