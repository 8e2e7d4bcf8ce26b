"""Each sharded strategy through real agents: two nodes (one rank each) train the bundled GPT job;
node b is drained over its control socket; both ranks save the emergency checkpoint of the same step;
the survivor re-forms at world size 1, restores that step resharded (FSDP2: DTensor shards of 2 ranks
-> 1; DeepSpeed: full fp32 state re-partitioned for one rank) and continues at the next step; node b
rejoins, the running world takes a resize checkpoint and re-forms at world size 2 (1 -> 2).

Checked: every sample is used exactly once and every step logged once, and the loss is continuous —
the first step after each restore has the loss it would have had without the resize (the same step
recomputed from the same checkpoint at the old world size), within 1e-6 (fp32).

``model_parallel`` the same way with two ranks per node, tensor-parallel within each node: ``(dp, tp) =
(2, 2) -> (1, 2) -> (2, 2)`` (TP + FSDP2); the ranks of a tensor-parallel
group train on the same samples and every sample is used once per data-parallel share. A world of 3
ranks with ``tp_size=2`` is refused with an error naming the setting."""

from __future__ import annotations

import glob
import json
import os

import pytest

from tests import samples
from tests.e2e.test_drain import check_exactly_once, sample_log, worlds
from tests.harness import Node, continued, free_port, wait_listening, wait_until
from tests.strategies._world import E2E_BATCH, E2E_SIZE, ELASTIC, JOB, MODEL_PARALLEL, continuity
from trainguard.agent import control
from trainguard.agent.exitcodes import ExitCode
from trainguard.contract.protocol import DrainRequest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# (strategy, its flags for the bundled job). DeepSpeed is checked without importing it here: importing
# it sets env vars, which the suite's leak guard would blame on the test. One ZeRO stage: the drain and
# rejoin path (restart, restore from storage) is the same for both; what differs between the stages is
# the checkpoint layout, which tests/strategies/test_deepspeed.py resizes for both (4 -> 2 and 3 ranks).
CASES = [
    pytest.param("fsdp", [], id="fsdp"),
    pytest.param("deepspeed", ["--zero-stage", "3"], id="deepspeed-zero3",
                 marks=pytest.mark.skipif(not _has("deepspeed"), reason="deepspeed is not installed (.ci/test runs "
                                          "pip install --no-build-isolation 'deepspeed>=0.15')")),
]


@pytest.mark.parametrize(("strategy", "strategy_args"), CASES)
def test_drain_to_1_then_rejoin_to_2_exactly_once_and_loss_continuous(tmp_path, strategy, strategy_args):
    tmp = str(tmp_path)
    os.makedirs(os.path.join(tmp, "samples"))
    ep = f"127.0.0.1:{free_port()}"
    ckpt = os.path.join(tmp, "ckpt")
    loss_log = os.path.join(tmp, "loss.jsonl")
    # job "run" is the checkpoint run id the continuity references use; keep_last: they restore the
    # emergency and the resize steps after the run.
    common = ["--set", f"checkpoint.url={ckpt}", "--set", "checkpoint.interval_steps=10",
              "--set", "checkpoint.keep_last=1000"]
    args = ["--strategy", strategy, *strategy_args, "--steps", "100000", *JOB, *E2E_SIZE, "--step-sleep", "0.03",
            "--log-every", "2", "--sample-log", os.path.join(tmp, "samples"), "--loss-log", loss_log]

    def node(name: str) -> Node:
        return Node(name, tmp, ep, nnodes="1:2", job="run", script=ELASTIC, script_args=args, extra=common)

    a = node("a")
    nodes = [a]
    try:
        wait_listening(ep)  # a hosts the c10d store; b is the node that leaves (pytorch#67742)
        b = node("b")
        nodes.append(b)
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2], 90, "world size 2")
        # a may have trained alone before b's agent came up (nnodes 1:2 on a loaded machine): steps at 2
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= 6 for n in (a, b) for e in n.events("train_step")),
                   90, "6 steps at world size 2")
        reply = control.request(b.socket, DrainRequest(deadline_s=30))
        assert reply.ok, reply
        assert b.wait(60) == ExitCode.DRAINED, b.dump()
        committed = [e for n in (a, b) for e in n.events("checkpoint_committed")
                     if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"]
        assert len(committed) == 2, a.dump() + b.dump()
        s = committed[0]["step"]
        assert all(e["step"] == s for e in committed) and all(e["before_deadline"] for e in committed)

        if strategy == "deepspeed":  # no in-memory hand-over: it says so and takes the restart path
            unsupported = [e for n in (a, b) for e in n.events("reform_in_place_unsupported")]
            assert unsupported and all(e["strategy"] == "deepspeed" for e in unsupported), a.dump() + b.dump()
        wait_until(lambda: worlds(a)[-1:] == [1], 60, "survivor at world size 1")
        # fsdp re-forms in place (``reformed``), deepspeed restarts from the checkpoint (``resumed``)
        resumed = wait_until(lambda: continued(a, 1), 60, "resume at 1")
        assert resumed[0]["step"] == s and resumed[0]["event"] == ("reformed" if strategy == "fsdp" else "resumed")
        assert resumed[0].get("strategy", strategy) == strategy
        restored = [e for e in a.events("worker_restored") if e.get("world_size") == 1]
        assert restored and restored[0]["saved_world_size"] == 2
        wait_until(lambda: any(e["world_size"] == 1 and e["step"] >= s + 4 for e in a.events("train_step")), 60,
                   "training at world size 1")

        b2 = node("b2")
        nodes.append(b2)
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b2) == [2], 90, "world size 2 again")
        # A restarted world's rank 0 may be on either node (torch orders the rendezvous' members).
        r2 = wait_until(lambda: [e for e in continued(a, 2) + continued(b2, 2) if e["step"] > s], 60, "resume at 2")
        r = r2[-1]["step"]
        resize = [e for e in a.events("checkpoint_committed")
                  if e.get("kind") == "resize" and e.get("component") == "trainguard.worker"]
        assert resize and resize[-1]["step"] == r
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= r + 3 for n in (a, b2) for e in n.events("train_step")),
                   90, "training at world size 2 again")
        for n in (a, b2):
            n.signal(15)
        for n in (a, b2):
            assert n.wait(60) == ExitCode.STOPPED, n.dump()  # SIGTERM: stopped, work committed

        seen = check_exactly_once(sample_log(tmp))
        with open(loss_log) as fh:
            recs = [json.loads(line) for line in fh]
        assert [x["step"] for x in recs] == list(range(1, len(recs) + 1)), "a step was logged twice or skipped"
        loss = {x["step"]: x["loss"] for x in recs}
        size = {x["step"]: x["world_size"] for x in recs}
        assert size[s] == 2 and size[s + 1] == 1 and size[r] == 1 and size[r + 1] == 2
        d1 = continuity(tmp, ckpt, strategy, s, 2, loss, strategy_args)  # step s+1 as world 2 would have had it
        d2 = continuity(tmp, ckpt, strategy, r, 1, loss, strategy_args)  # step r+1 as world 1 would have had it
        print(f"{strategy} {' '.join(strategy_args)} 2->1->2: emergency_step={s} resize_step={r} "
              f"steps={len(seen) // E2E_BATCH} loss_delta_after_drain={d1:.3g} loss_delta_after_rejoin={d2:.3g}")
        assert d1 <= 1e-6 and d2 <= 1e-6, (d1, d2)
    except AssertionError:
        print(*(n.dump(60) for n in nodes), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()


# ---- model_parallel: (dp, tp) = (2, 2) -> (1, 2) -> (2, 2), two ranks per node ------------------------------

# No torch.compile here (4 ranks on 2 cores recompile at every restart): test_model_parallel.py compiles.
MP_ARGS = ["--tp-size", "2"]
# 16 = dp 2 x 2 micro-batches x 4 = dp 1 x 4 x 4
MP_SIZE = ["--global-batch", "16", "--micro-batch", "4"]


def check_model_parallel_samples(folder: str, global_batch: int, lineage: bool = False) -> list[int]:
    """Every sample once (``tests/samples.py``: one valid attempt per step, the whole global batch; with
    ``lineage``, in the committed lineage: a step redone after a restore from a snapshot counts once, its
    newest attempt), and in each step's counted attempt: the ranks of one data-parallel share (a TP group)
    trained the same samples, and the shares in order are the global batch."""
    if lineage:
        samples.check_lineage_exactly_once(folder, global_batch)
        committed, _ = samples.lineage_batches(folder)
        seen = [i for s in sorted(committed) for i in committed[s]["ids"]]
    else:
        seen = samples.check_exactly_once(folder, global_batch)
        committed = samples.committed_batches(folder)
    recs = [r for r in samples.read(folder) if not r.get("rolled_back")
            and committed.get(r["step"], {}).get("round") == r["round"]]
    by_step: dict[int, list[dict]] = {}
    for r in recs:
        by_step.setdefault(r["step"], []).append(r)
    assert sorted(by_step) == sorted(committed)
    for step, rs in by_step.items():
        world, dp = rs[0]["world_size"], rs[0]["dp_size"]
        assert sorted(r["rank"] for r in rs) == list(range(world)), f"step {step}: {rs}"
        shares: dict[int, list[int]] = {}
        for r in rs:
            assert r["dp_rank"] == r["rank"] // (world // dp), f"step {step}: rank {r['rank']} in share {r['dp_rank']}"
            assert shares.setdefault(r["dp_rank"], r["mine"]) == r["mine"], f"step {step}: a TP group split its samples"
        assert sorted(shares) == list(range(dp))
        assert [i for d in sorted(shares) for i in shares[d]] == committed[step]["ids"], f"step {step}"
    return seen


@pytest.mark.parametrize("reform", ["restart", "in-process"])
def test_model_parallel_2x2_drain_to_1x2_rejoin_to_2x2(tmp_path, reform):
    """``restart``: every change restarts the workers, which resume from the checkpoint committed at it;
    ``in-process``: node a's workers re-form each world in place (the same processes: the strategy
    parallelises a fresh meta-device copy of the model over the new mesh and reloads that checkpoint)."""
    tmp = str(tmp_path)
    os.makedirs(os.path.join(tmp, "samples"))
    ep = f"127.0.0.1:{free_port()}"
    ckpt = os.path.join(tmp, "ckpt")
    loss_log = os.path.join(tmp, "loss.jsonl")
    common = ["--nproc-per-node", "2", "--set", f"checkpoint.url={ckpt}", "--set", "checkpoint.interval_steps=10",
              "--set", "checkpoint.keep_last=1000", "--set", f"workers.reform={reform}"]
    event = "resumed" if reform == "restart" else "reformed"  # what the example prints after a change
    args = ["--strategy", "model_parallel", *MP_ARGS, "--steps", "100000", *JOB, *MP_SIZE, "--step-sleep", "0.03",
            "--log-every", "2", "--sample-log", os.path.join(tmp, "samples"), "--loss-log", loss_log]

    def node(name: str) -> Node:
        # The rendezvous orders nodes by address, then pid: a sorts before b and after b2, so a's workers
        # are ranks 0, 1 of the first (2, 2) world and 2, 3 of the second: in place, the re-sharded model
        # must not take the first world's mesh of the same shape (DTensor's caches compare meshes without
        # their rank: runtime.reform.clear_dtensor_caches).
        addr = ["--set", f"rendezvous.local_addr=127.0.0.{ {'a': 2, 'b': 3}.get(name, 1) }"]
        return Node(name, tmp, ep, nnodes="1:2", job="run", script=MODEL_PARALLEL, script_args=args, extra=common + addr)

    def steps_at(n: Node, world: int, at_least: int) -> bool:
        return any(e["world_size"] == world and e["step"] >= at_least for e in n.events("train_step"))

    a = node("a")
    nodes = [a]
    try:
        wait_listening(ep)
        b = node("b")
        nodes.append(b)
        wait_until(lambda: worlds(a)[-1:] == [4] and worlds(b)[-1:] == [4], 90, "world size 4")
        wait_until(lambda: steps_at(a, 4, 6) or steps_at(b, 4, 6), 240, "6 steps at (dp, tp) = (2, 2)")
        # a may have formed a world alone before b's agent came up (nnodes 1:2; a loaded machine): the world
        # of 4 is then its second, which its rank 0 enters with "resumed" (restart) or "reformed" (in place)
        first4 = [e for n in (a, b) for e in n.events() if e.get("event") in ("started", "resumed", "reformed")
                  and e.get("world_size") == 4]
        assert first4 and first4[0]["dp_size"] == 2 and first4[0]["tp_size"] == 2
        ranks4 = [e["group_rank"] for e in a.events("rendezvous_complete") if e["world_size"] == 4]
        assert ranks4 and set(ranks4) == {0}, a.dump()  # a sorts before b: ranks 0, 1 of the (2, 2) world
        pids = sorted(a.worker_pids())
        reply = control.request(b.socket, DrainRequest(deadline_s=60))
        assert reply.ok, reply
        assert b.wait(90) == ExitCode.DRAINED, b.dump()
        committed = [e for n in (a, b) for e in n.events("checkpoint_committed")
                     if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"]
        assert len(committed) == 4, a.dump() + b.dump()  # every rank of both nodes
        s = committed[0]["step"]
        assert all(e["step"] == s for e in committed)

        resumed = wait_until(lambda: [e for e in a.events(event) if e["world_size"] == 2], 180, f"{event} at 2")
        assert resumed[0]["step"] == s and resumed[0]["dp_size"] == 1 and resumed[0]["tp_size"] == 2
        wait_until(lambda: steps_at(a, 2, s + 4), 120, "training at (1, 2)")

        b2 = node("b2")
        nodes.append(b2)
        wait_until(lambda: worlds(a)[-1:] == [4] and worlds(b2) == [4], 120, "world size 4 again")
        assert a.events("rendezvous_complete")[-1]["group_rank"] == 1, a.dump()  # b2 sorts first now
        # The new world's rank 0 may be on either node (torch orders the rendezvous' members by address and
        # pid); in place, when it is b2's (a joiner), it prints "resumed" and a's workers change rank.
        names = {event} if reform == "restart" else {"reformed", "resumed"}
        r2 = wait_until(lambda: [e for n in (a, b2) for e in n.events() if e.get("event") in names
                                 and e.get("world_size") == 4 and e.get("step", 0) > s], 180, f"{event} at 4")
        r = r2[-1]["step"]
        assert r2[-1]["dp_size"] == 2
        resize = [e for e in a.events("checkpoint_committed")
                  if e.get("kind") == "resize" and e.get("component") == "trainguard.worker"]
        assert resize and resize[-1]["step"] == r
        wait_until(lambda: steps_at(a, 4, r + 3) or steps_at(b2, 4, r + 3), 180, "training at (2, 2) again")
        # in place, node a's two workers lived through both changes; restarted, they are new processes
        assert (sorted(a.worker_pids()) == pids) == (reform == "in-process"), (pids, a.worker_pids())
        for n in (a, b2):
            n.signal(15)
        for n in (a, b2):
            assert n.wait(90) == ExitCode.STOPPED, n.dump()  # SIGTERM: stopped, work committed

        seen = check_model_parallel_samples(sample_log(tmp), 16)
        with open(loss_log) as fh:
            recs = [json.loads(line) for line in fh]
        assert [x["step"] for x in recs] == list(range(1, len(recs) + 1)), "a step was logged twice or skipped"
        loss = {x["step"]: x["loss"] for x in recs}
        dp = {x["step"]: x["dp_size"] for x in recs}
        assert dp[s] == 2 and dp[s + 1] == 1 and dp[r] == 1 and dp[r + 1] == 2
        d1 = continuity(tmp, ckpt, "model_parallel", s, 4, loss, MP_ARGS, script=MODEL_PARALLEL, size=MP_SIZE)
        d2 = continuity(tmp, ckpt, "model_parallel", r, 2, loss, MP_ARGS, script=MODEL_PARALLEL, size=MP_SIZE)
        print(f"model_parallel (2,2)->(1,2)->(2,2), {reform}: emergency_step={s} resize_step={r} steps={len(seen) // 16} "
              f"loss_delta_after_drain={d1:.3g} loss_delta_after_rejoin={d2:.3g}")
        assert d1 <= 1e-6 and d2 <= 1e-6, (d1, d2)
    except AssertionError:
        print(*(n.dump(60) for n in nodes), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()


def test_model_parallel_refuses_a_world_of_3_ranks_with_tp_size_2(tmp_path):
    """One node of 3 ranks: every rank refuses at setup with one line naming ``tp_size``, and the agent
    (``workers.max_restarts=0``) fails the job instead of restarting it."""
    tmp = str(tmp_path)
    n = Node("a", tmp, f"127.0.0.1:{free_port()}", nnodes="1:1", job="run", script=MODEL_PARALLEL,
             script_args=["--tp-size", "2", "--steps", "2", *JOB, "--global-batch", "12", "--micro-batch", "2"],
             extra=["--nproc-per-node", "3", "--set", "workers.max_restarts=0"])
    try:
        assert n.wait(120) != 0, n.dump()
        # Each rank's own log file (torch's redirect): the agent's merged output may miss a line of a rank
        # whose world is being torn down (torch's log tailer read it half-written in a run here).
        refused = []
        for path in glob.glob(os.path.join(tmp, "logs-a", "**", "stdout.log"), recursive=True):
            with open(path) as fh:
                refused += [json.loads(line) for line in fh if line.startswith('{"event": "setup_refused"')]
        assert sorted(e["rank"] for e in refused) == [0, 1, 2], n.dump()
        msg = refused[0]["error"]
        assert "3 ranks" in msg and "`tp_size=2`" in msg and "Fix:" in msg and "--tp-size" in msg, msg
        assert not any("Traceback" in line for line in n.lines()), n.dump()
    finally:
        n.stop()
