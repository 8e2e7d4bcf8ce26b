"""In-place re-formation end to end: 2 -> drain -> 1 -> join -> 2 -> join -> 3 -> 2 with the surviving node's
worker process never restarted; every sample used exactly once; the loss of the first step after each
change equals that step recomputed by a restart from a checkpoint of the step before (what the restart
path would have computed). Both lose their third node to a drain (an unannounced kill is measured by
``bench/recovery.py`` and the chaos bench; see the test body for why it is not asserted here)."""

import os
import time

import pytest

from tests.e2e.test_drain import GLOBAL_BATCH, check_exactly_once, sample_log, worlds
from tests.emulators.fixtures import aws_imds  # noqa: F401
from tests.harness import REPO, Node, free_port, wait_listening, wait_until
from tests.strategies import _world
from trainguard.agent.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
JOB = [*_world.JOB, *_world.E2E_SIZE]


def reformed(nodes, world):
    """The example's ``reformed`` lines of a world of ``world`` ranks: printed by rank 0, on whichever node
    the rendezvous made rank 0 (it orders the agents by their descriptors, pids included: node a is not
    always rank 0 once other nodes joined)."""
    return [e for n in nodes for e in n.events("reformed") if e["world_size"] == world]


def rejoined(nodes, world, after=-1):
    """The runtime's ``worker_reformed`` lines of a world of ``world`` ranks continuing after step ``after``,
    from every node's workers that re-formed in place: when a joiner is rank 0 (the rendezvous orders agents
    by pid, and pids wrap), the example's ``reformed`` line is not printed (the joiner prints ``resumed``)."""
    return [e for n in nodes for e in n.events("worker_reformed")
            if e["world_size"] == world and e.get("component") == "trainguard.worker" and e["step"] > after]


def stepped(nodes):
    """The example's ``train_step`` lines (rank 0's), from whichever node printed them."""
    return [e for n in nodes for e in n.events("train_step")]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_membership_changes_in_place(tmp_path, aws_imds, strategy):  # noqa: F811
    tmp = str(tmp_path)
    os.makedirs(os.path.join(tmp, "samples"))
    ep = f"127.0.0.1:{free_port()}"
    ckpt = os.path.join(tmp, "ckpt")
    loss_log = os.path.join(tmp, "loss.jsonl")
    # A committed checkpoint of every step, so a restart from the step before any change can be replayed.
    common = ["--set", f"checkpoint.url={ckpt}", "--set", "checkpoint.interval_steps=1", "--set", "checkpoint.keep_last=100000",
              "--set", "checkpoint.when_busy=wait",
              "--set", "rendezvous.keep_alive_interval_s=1", "--set", "rendezvous.keep_alive_max_attempts=3"]
    args = ["--steps", "100000", "--log-every", "1", "--step-sleep", "0.05", "--sample-log", os.path.join(tmp, "samples"),
            "--loss-log", loss_log, "--strategy", strategy, *JOB]
    # The rendezvous orders nodes by address, then pid: the nodes that join sort before a, so rank 0 of
    # each grown world is a fresh process and a's rank changes. Its initial weights must not reach the
    # survivors (DDP's construction broadcasts from rank 0), and a's re-sharded FSDP2 module must shard at
    # a's new rank (DTensor's caches kept the old mesh: every save failed); the loss checks catch both.
    def addr(first):
        return ["--set", f"rendezvous.local_addr=127.0.0.{1 if first else 2}"]

    a = Node("a", tmp, ep, nnodes="1:3", script=ELASTIC, script_args=args, extra=common + addr(False))
    wait_listening(ep)
    b = Node("b", tmp, ep, nnodes="1:3", script=ELASTIC, script_args=args,
             extra=common + ["--set", "preemption.sources=aws", "--set", f"preemption.aws_endpoint={aws_imds.url}",
                             "--set", "preemption.train_through_notice=false", "--set", "preemption.poll_interval_s=0.3"])
    nodes = [a, b]
    try:
        wait_until(lambda: worlds(a)[-1:] == [2] and worlds(b)[-1:] == [2], 120, "world size 2")
        # a may have trained alone before b's agent came up (nnodes 1:3 on a loaded machine): count steps at 2
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= 8 for e in stepped(nodes)), 90, "8 steps at world 2")
        (pid,) = a.worker_pids()

        # 2 -> 1: a spot notice on b
        aws_imds.schedule_termination(in_s=120)
        assert b.wait(90) == ExitCode.DRAINED, b.dump()
        emergency = {e["step"] for n in (a, b) for e in n.events("checkpoint_committed")
                     if e.get("kind") == "emergency" and e.get("component") == "trainguard.worker"}
        assert len(emergency) == 1, emergency
        (s1,) = emergency
        r1 = wait_until(lambda: reformed([a], 1), 60, "a re-formed at world size 1")
        assert r1[0]["step"] == s1 and r1[0]["pid"] == pid  # continues at s1 + 1, same process
        wait_until(lambda: any(e["world_size"] == 1 and e["step"] >= s1 + 3 for e in stepped([a])), 60,
                   "training at world size 1")

        # 1 -> 2 -> 3: two nodes join, each warmed up before the world pauses for it
        b2 = Node("b2", tmp, ep, nnodes="1:3", script=ELASTIC, script_args=args, extra=common + addr(True))
        nodes.append(b2)
        r2 = wait_until(lambda: rejoined(nodes, 2, after=s1), 120, "a and b2 re-formed at world size 2")
        assert b2.events("joiner_warm") and b2.events("joined_running_world"), b2.dump()
        assert b2.events("prestart_adopted"), b2.dump()  # its worker is the interpreter started with the agent
        assert b2.events("rendezvous_complete")[-1]["group_rank"] == 0, b2.dump()  # the joiner is rank 0
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= r2[0]["step"] + 3 for e in stepped(nodes)),
                   60, "training at world size 2")
        c = Node("c", tmp, ep, nnodes="1:3", script=ELASTIC, script_args=args, extra=common + addr(True))
        nodes.append(c)
        r3 = wait_until(lambda: rejoined(nodes, 3), 120, "a, b2 and c re-formed at world size 3")
        wait_until(lambda: any(e["world_size"] == 3 and e["step"] >= r3[0]["step"] + 3 for e in stepped(nodes)),
                   60, "training at world size 3")

        assert a.worker_pids() == [pid], "a's worker process was restarted by 2 -> 1 -> 2 -> 3"
        t_drain = time.monotonic()
        last_before = max(e["step"] for e in stepped(nodes))
        # 3 -> 2: c drains. (An unannounced SIGKILL of c is not part of this test: a survivor's worker can
        # block in a collective the vanished peer never completes and the member-lost fallback restarts
        # it, an open defect; bench/recovery.py's kill run and the chaos bench measure that case.)
        from trainguard.agent import control
        from trainguard.contract.protocol import DrainRequest

        assert control.request(c.socket, DrainRequest(deadline_s=30)).ok
        assert c.wait(60) == ExitCode.DRAINED, c.dump()
        r4 = wait_until(lambda: [e for e in rejoined(nodes, 2) if e["step"] >= r3[0]["step"]],
                        60, "a and b2 re-formed at world size 2")
        drain_to_world = time.monotonic() - t_drain
        assert drain_to_world < 15, drain_to_world
        assert last_before - r4[0]["step"] <= 1
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= r4[0]["step"] + 3 for e in stepped(nodes)),
                   60, "training at world size 2 after the drain")
        assert a.worker_pids() == [pid], "the surviving node's worker process was restarted"
        assert not [e for n in (a, b2) for e in n.events("state_change") if e["new"] == "restarting"]
        # The interval controller counts the two drains the state survived in place (joins are no loss).
        survived = [(e["world_size"], e["survived_losses"]) for e in a.events("worker_reformed")]
        # (before them, a growth 1 -> 2 when a formed its first world alone: (2, 0))
        assert survived[-4:] == [(1, 1), (2, 1), (3, 1), (2, 2)] and set(survived[:-4]) <= {(2, 0)}, survived
        # Tier 0 (on by default) takes no snapshots where the state is replicated and re-forms in place
        # (every live peer holds any rank's state); sharded state keeps them.
        snaps = [f for _, _, names in os.walk(a.memory_root) for f in names if f.endswith(".snap")]
        redundant = [e for n in nodes for e in n.events("memory_tier_redundant")]
        if strategy == "ddp":
            assert redundant and not snaps, (redundant, snaps)
        else:
            assert not redundant and snaps, (redundant, snaps)
        for n in (a, b2):
            n.signal(15)
        for n in (a, b2):
            n.wait(60)
        check_exactly_once(sample_log(tmp))

        # The loss of the first step after each change = that step after a restart from the step before.
        logged = _world.losses(loss_log)
        for r, before in ((r1[0], 2), (r2[0], 1), (r3[0], 2), (r4[0], 3)):
            k, world = r["step"], r["world_size"]
            ref = os.path.join(tmp, f"ref-{k}.jsonl")
            ref_dir = os.path.join(tmp, f"refckpt-{k}")
            import shutil

            shutil.copytree(ckpt, ref_dir)
            _world.run_segment(world, strategy, ref_dir, steps=k + 1, interval=0, fence=10_000 + k, loss_log=ref,
                               extra=[*_world.E2E_SIZE, "--resume-step", str(k)], job_id="job",
                               timeout=300)  # as _world.continuity's: torch start-ups on 2 busy cores
            delta = abs(logged[k + 1] - _world.losses(ref)[k + 1])
            print(f"{strategy}: change at step {k}: world {before} -> {world}, loss delta {delta:.2e}")
            assert delta <= 1e-6, (k, before, world, delta)
        print(f"drain_to_world_s={drain_to_world:.2f} emergency_step={s1}")
    except AssertionError:
        for n in nodes:
            print(n.dump(50))
        raise
    finally:
        for n in nodes:
            n.stop()
