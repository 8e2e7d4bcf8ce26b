"""Three agents on etcd v3 with TLS, client certificates and RBAC: one scenario, four world changes.

3 nodes -> SIGKILL of the node holding group rank 0 (no notice) -> the two survivors re-form and go on
from the last checkpoint -> one of them drains (SIGTERM: emergency checkpoint, planned leave) -> the
last one goes on alone -> a new node joins (scale-up, resize checkpoint) -> 2 nodes. Every sample id
is trained exactly once in the final trajectory; only the steps after the last checkpoint before the
SIGKILL are redone (with the same ids), the drain and the scale-up redo none. The job's keys,
including the drain record, are under the job user's prefix in etcd.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import time

import pytest

from tests.fixtures.etcd import SECURE_JOB, b64, gateway, prefix_end, secure_etcd  # noqa: F401
from tests.harness import REPO, Node, alive, wait_until

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


def read_samples(tmp):
    recs = []
    for path in glob.glob(os.path.join(tmp, "samples", "*.jsonl")):
        with open(path) as fh:
            recs += [json.loads(line) for line in fh if line.strip()]
    return recs


def final_trajectory(recs):
    """Check the sample log allowing for re-done steps; return the steps that ran more than once.

    The sample cursor is deterministic, so every run of a step, at any world size, must train the
    same global batch (and each rank of a world the same share). A step counts as done when some
    world logged it on every one of its ranks; a killed world may have logged it on some only.
    """
    by_step = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in recs:
        by_step[r["step"]][(r["world_size"], r["rank"])].append(r["ids"])
    batches, redone = {}, []
    for step in sorted(by_step):
        shares = by_step[step]
        for (w, rank), copies in shares.items():
            assert all(c == copies[0] for c in copies), f"step {step}: rank {rank}/{w} trained different ids on a re-run"
        sizes = {w for w, _ in shares}
        complete = [w for w in sizes if all((w, r) in shares for r in range(w))]
        assert complete, f"step {step} never finished on every rank of a world: {sorted(shares)}"
        full = {w: sorted(i for r in range(w) for i in shares[(w, r)][0]) for w in complete}
        batch = full[complete[0]]
        assert all(b == batch for b in full.values()), f"step {step}: worlds {complete} trained different batches"
        assert len(batch) == GLOBAL_BATCH, f"step {step}: global batch {len(batch)}"
        for (w, rank), copies in shares.items():
            assert set(copies[0]) <= set(batch), f"step {step}: a partial run of rank {rank}/{w} used other ids"
        if len(sizes) > 1 or any(len(c) > 1 for c in shares.values()):
            redone.append(step)
        batches[step] = batch
    assert sorted(batches) == list(range(1, max(batches) + 1)), "a step is missing"
    ids = [i for b in batches.values() for i in b]
    assert len(ids) == len(set(ids)), "a sample id was trained in two different steps"
    return redone


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
        resumed_after_kill = wait_until(lambda: [e for e in leader.events("resumed") if e["world_size"] == 2], 90,
                                        "resume at world size 2")[0]["step"]
        wait_until(lambda: any(s >= resumed_after_kill + 10 for s in steps_at(leader, 2)), 90, "training at world size 2")
        print(f"re-formed at 2 after SIGKILL of {victim.name} in {time.monotonic() - t_kill:.1f} s, "
              f"resumed from step {resumed_after_kill}")

        # 2. A drain: SIGTERM to the new group rank 0 (emergency checkpoint on every rank, planned leave).
        drained, last = leader, next(n for n in survivors if n is not leader)
        restarts_before = len([e for e in last.events("state_change") if e["new"] == "restarting"])
        drained.signal(15)
        assert drained.wait(90) == 0, drained.dump()
        committed = [e for n in survivors for e in n.events("checkpoint_committed")
                     if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"]
        assert len(committed) == 2, committed  # both ranks of the world of 2
        s = committed[0]["step"]
        assert all(e["step"] == s for e in committed)
        wait_until(lambda: worlds(last)[-1:] == [1], 60, "the last node at world size 1")
        resumed = wait_until(lambda: [e for e in last.events("resumed") if e["world_size"] == 1], 60, "resume at 1")
        assert resumed[0]["step"] == s  # continues at s + 1
        wait_until(lambda: any(x >= s + 10 for x in steps_at(last, 1)), 90, "training at world size 1")
        draining = [k for k in etcd_keys(secure_etcd, secure_etcd.job_prefix) if k.endswith("trainguard/draining")]
        assert draining, "the drain record is not under the job's prefix in etcd"

        # 3. Scale-up: a new node joins; the running world takes a resize checkpoint and re-forms at 2.
        d = node("d")
        nodes.append(d)
        wait_until(lambda: worlds(last)[-1:] == [2] and worlds(d)[-1:] == [2], 120, "world size 2 again")
        new_leader = next(n for n in (last, d) if last_world(n).get("group_rank") == 0)
        r2 = wait_until(lambda: [e for e in new_leader.events("resumed") if e["world_size"] == 2], 90, "resume at 2")
        resize = [e for e in last.events("checkpoint_committed") if e.get("kind") == "resize" and e.get("component") == "trainguard.worker"]
        assert resize and r2[-1]["step"] == resize[-1]["step"]
        wait_until(lambda: any(x > r2[-1]["step"] + 5 for x in steps_at(new_leader, 2)), 90, "training at world size 2 again")
        restarts_after = len([e for e in last.events("state_change") if e["new"] == "restarting"])
        assert restarts_after == restarts_before, "a drain or a scale-up consumed a restart"

        for n in (last, d):
            n.signal(15)
        for n in (last, d):
            assert n.wait(60) == 0, n.dump()

        redone = final_trajectory(read_samples(tmp))
        # Only the SIGKILL loses work: the steps after the checkpoint the survivors resumed from.
        assert redone == list(range(resumed_after_kill + 1, resumed_after_kill + 1 + len(redone))), redone
        assert len(redone) <= 2 * INTERVAL, redone
        assert not redone or redone[-1] < s
        keys = etcd_keys(secure_etcd, "/")
        assert all(k.startswith(secure_etcd.job_prefix) for k in keys), [k for k in keys if not k.startswith(secure_etcd.job_prefix)]
        print(f"redone after SIGKILL: {len(redone)} steps; emergency step {s}; keys in etcd: {len(keys)}")
    except AssertionError:
        print(*(n.dump(60) for n in nodes), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()
