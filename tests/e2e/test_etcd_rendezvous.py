"""Three agents on etcd v3 with TLS, client certificates and RBAC: one scenario, four world changes.

3 nodes -> SIGKILL of the node holding group rank 0 (no notice) -> the two survivors re-form and go on
-> one of them drains (SIGTERM: emergency checkpoint, planned leave) -> the last one goes on alone ->
a new node joins (scale-up) -> 2 nodes, with the default ``workers.reform`` (in place). Every sample
id is trained exactly once in the committed lineage (``tests/samples.py``), on the sample cursor's
batch for its step; only the step the SIGKILL interrupted is rolled back and redone, the drain and
the scale-up redo none. The job's keys, including the drain record, are under the job user's prefix
in etcd.
"""

from __future__ import annotations

import os
import time

import pytest

from tests import samples
from tests.fixtures.etcd import SECURE_JOB, b64, gateway, prefix_end, secure_etcd  # noqa: F401
from tests.harness import REPO, Node, alive, wait_until
from trainguard.agent.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
GLOBAL_BATCH = 24
INTERVAL = 10


def worlds(node):
    return [e["world_size"] for e in node.events("rendezvous_complete")]


def last_world(node):
    ev = node.events("rendezvous_complete")
    return ev[-1] if ev else {}


def steps_at(node, world_size):
    return [e["step"] for e in node.events("train_step") if e["world_size"] == world_size]


def first_step_at(tmp, world_size, after=0):
    """The first step a world of ``world_size`` trained (from the sample log), after step ``after``."""
    return min(r["step"] for r in samples.read(os.path.join(tmp, "samples"))
               if r.get("world_size") == world_size and r["step"] > after)


def cursor_batches(n_steps):
    """The global batch of each step as the sample cursor serves it (the example's defaults: 2 MB of
    corpus, 64-byte samples, seed 1234), whatever the world size."""
    from trainguard.examples.train_gpt import load_corpus
    from trainguard.runtime.cursor import GlobalSampleCursor

    cursor = GlobalSampleCursor((len(load_corpus(2_000_000)) - 1) // 64, GLOBAL_BATCH, seed=1234)
    return {step: cursor.next_global_batch() for step in range(1, n_steps + 1)}


def etcd_keys(etcd, prefix):
    """Every key under ``prefix`` (read as root, over a raw gateway call)."""
    status, answer = gateway(etcd.url, "kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix)), "keys_only": True},
                             etcd.pki.client_context(), etcd.root_token())
    assert status == 200, answer
    import base64

    return [base64.b64decode(kv["key"]).decode() for kv in answer.get("kvs", [])]


def test_three_agents_on_secure_etcd_survive_sigkill_drain_and_scale_up(tmp_path, secure_etcd):  # noqa: F811
    tmp = str(tmp_path)
    os.makedirs(os.path.join(tmp, "samples"))
    common = [*secure_etcd.set_flags(), "--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}",
              "--set", f"checkpoint.interval_steps={INTERVAL}", "--set", "rendezvous.join_timeout_s=180"]
    args = ["--steps", "100000", "--log-every", "5", "--step-sleep", "0.03", "--global-batch", str(GLOBAL_BATCH),
            "--sample-log", os.path.join(tmp, "samples")]

    def node(name):
        return Node(name, tmp, secure_etcd.endpoint, nnodes="1:3", job=SECURE_JOB, script=ELASTIC, script_args=args,
                    extra=common, backend="etcd")

    nodes = [node(n) for n in "abc"]
    try:
        for n in nodes:
            wait_until(lambda n=n: n.events("etcd_connected"), 60, f"{n.name} connected to etcd")
            assert n.events("etcd_connected")[0]["tls"] is True and n.events("etcd_connected")[0]["user"] == "tg-job"
        wait_until(lambda: all(worlds(n)[-1:] == [3] for n in nodes), 150, "world size 3")
        wait_until(lambda: any(s >= INTERVAL + 5 for n in nodes for s in steps_at(n, 3)), 120, "a checkpoint and 5 steps at 3")

        # 1. A spot node vanishes: SIGKILL the one holding group rank 0 (its workers' store, the printing rank).
        victim = next(n for n in nodes if last_world(n).get("group_rank") == 0)
        kids = victim.worker_pids()
        victim.proc.kill()
        victim.proc.wait(10)
        wait_until(lambda: not any(alive(k) for k in kids), 10, "the victim's workers to die with it")
        survivors = [n for n in nodes if n is not victim]
        t_kill = time.monotonic()
        wait_until(lambda: all(worlds(n)[-1:] == [2] for n in survivors), 120, "survivors re-form at world size 2")
        leader = next(n for n in survivors if last_world(n).get("group_rank") == 0)
        wait_until(lambda: len(steps_at(leader, 2)) >= 2, 90, "training at world size 2")
        # the nodes may have formed smaller worlds while the others came up: count from the first step at 3
        first_w3 = first_step_at(tmp, 3)
        first_w2 = first_step_at(tmp, 2, after=first_w3)
        print(f"re-formed at 2 after SIGKILL of {victim.name} in {time.monotonic() - t_kill:.1f} s, "
              f"going on from step {first_w2}")

        # 2. A drain: SIGTERM to the new group rank 0 (emergency checkpoint on every rank, planned leave).
        drained, last = leader, next(n for n in survivors if n is not leader)
        restarts_before = len([e for e in last.events("state_change") if e["new"] == "restarting"])
        drained.signal(15)
        assert drained.wait(90) == ExitCode.STOPPED, drained.dump()
        committed = [e for n in survivors for e in n.events("checkpoint_committed")
                     if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"]
        assert len(committed) == 2, committed  # both ranks of the world of 2
        s = committed[0]["step"]
        assert all(e["step"] == s for e in committed)
        wait_until(lambda: worlds(last)[-1:] == [1], 60, "the last node at world size 1")
        wait_until(lambda: len(steps_at(last, 1)) >= 2, 90, "training at world size 1")
        assert first_step_at(tmp, 1, after=first_w3) == s + 1  # nothing lost, nothing redone
        draining = [k for k in etcd_keys(secure_etcd, secure_etcd.job_prefix) if k.endswith("trainguard/draining")]
        assert draining, "the drain record is not under the job's prefix in etcd"

        # 3. Scale-up: a new node joins and the world re-forms at 2 at a step boundary.
        d = node("d")
        nodes.append(d)
        wait_until(lambda: worlds(last)[-1:] == [2] and worlds(d)[-1:] == [2], 120, "world size 2 again")
        wait_until(lambda: any(x > s + 1 for n in (last, d) for x in steps_at(n, 2)), 90, "training at world size 2 again")
        w1 = [r["step"] for r in samples.read(os.path.join(tmp, "samples")) if r.get("world_size") == 1]
        assert first_step_at(tmp, 2, after=s) == max(w1) + 1  # the joiner cost no step
        restarts_after = len([e for e in last.events("state_change") if e["new"] == "restarting"])
        assert restarts_after == restarts_before, "a drain or a scale-up consumed a restart"

        for n in (last, d):
            n.signal(15)
        for n in (last, d):
            assert n.wait(60) == ExitCode.STOPPED, n.dump()

        # Exactly once: every step committed once, on the cursor's batch for that step, whatever the
        # world size; the only void attempts are those the SIGKILL interrupted (redone, same samples).
        folder = os.path.join(tmp, "samples")
        samples.check_exactly_once(folder, GLOBAL_BATCH)
        steps = samples.committed_batches(folder)
        expected = cursor_batches(max(steps))
        assert all(steps[k]["ids"] == expected[k] for k in steps), "a step trained other samples than the cursor's"
        rolled_back = sorted({r["step"] for r in samples.read(folder) if r.get("rolled_back")})
        assert set(rolled_back) <= {first_w2}, (rolled_back, first_w2)
        keys = etcd_keys(secure_etcd, "/")
        assert all(k.startswith(secure_etcd.job_prefix) for k in keys), [k for k in keys if not k.startswith(secure_etcd.job_prefix)]
        print(f"rolled back by the SIGKILL: {rolled_back}; emergency step {s}; steps {max(steps)}; keys in etcd: {len(keys)}")
    except AssertionError:
        print(*(n.dump(60) for n in nodes), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()
