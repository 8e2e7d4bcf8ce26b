"""The in-memory checkpoint tiers end to end (gloo, ``workers.reform: restart`` unless said, no periodic checkpoint
in storage): every restore must come from memory, lose at most the step in flight, and keep every sample
trained exactly once in the committed lineage.

* tier 0, DDP: three agents; the test SIGKILLs one worker (its agent lives): the world restarts at the
  same size and every rank restores the newest step all of them hold in their agent's shared memory;
  then it SIGKILLs a whole node: the two survivors re-form a world of 2 and restore from their own
  nodes' memory (DDP state is replicated: any rank's snapshot restores any rank at any world size).
  The snapshot folders survive the workers and go with the agents.
* tier 1, FSDP2: three agents replicate their snapshots to a buddy node; a whole node is SIGKILLed and a
  replacement joins (min nodes 3): the lost rank's state comes from its buddy's replica.
* tier 1, FSDP2, no replacement (min nodes 2): the two survivors re-form a world of 2 and reshard the
  three ranks' snapshots (their own and the lost node's replica) into their new shards.
* tier 1, FSDP2: a worker is killed between writing its snapshot and committing it (that slot torn):
  every rank restores the step before, which every rank still holds in its other slot.
* tier 1, TP + FSDP2 on a (2, 2) mesh, a node killed: (1, 2) reshards from memory, restarted or in place.
* tier 1, FSDP2, ``workers.reform: in-process``: the survivors of a node kill reshard in place.
"""

import json
import os
import signal
import time

import pytest

from tests import samples
from tests.harness import REPO, Node, free_port, running, wait_listening, wait_until
from tests.strategies import _world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")


def restored(node):
    return [e for e in node.events("worker_restored")]


def _restoring_worlds(nodes) -> int:
    """How many worlds have reported restores so far (the growth of a world that first formed without
    every node, e.g. on a loaded machine, is one: it restores the resize checkpoint from storage)."""
    return len({e["round"] for n in nodes for e in restored(n)})


def _restores_after(nodes, n_before, world):
    """The restore reports (one per rank) of the newest world, once ``world`` ranks of a world formed after
    ``n_before`` restoring worlds have reported."""
    got = sorted((e for n in nodes for e in restored(n)), key=lambda e: (e["round"], e["rank"]))
    rounds = sorted({e["round"] for e in got})
    if not rounds:
        return None
    last = [e for e in got if e["round"] == rounds[-1]]
    return last if len(rounds) > n_before and len(last) == world else None


def _lost(folder, back):
    """(restored step, newest step any rank of the dead world trained before it)."""
    (step,) = {e["step"] for e in back}  # every rank restored the same step
    new_round = min(e["round"] for e in back)
    return step, max(r["step"] for r in samples.read(folder) if r["round"] < new_round)


def test_worker_then_node_sigkill_resume_from_memory(tmp_path):
    tmp = str(tmp_path)
    folder = os.path.join(tmp, "samples")
    os.makedirs(folder)
    shm = os.path.join(tmp, "shm")
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", "checkpoint.interval=off",
              "--set", "checkpoint.memory_interval_steps=1", "--set", "checkpoint.memory_max_overhead=0", "--set", f"checkpoint.memory_dir={shm}",
              "--set", "workers.reform=restart",
              "--set", "rendezvous.keep_alive_interval_s=1", "--set", "rendezvous.keep_alive_max_attempts=3"]
    args = ["--steps", "100000", "--log-every", "1", "--step-sleep", "0.05", "--sample-log", folder,
            *_world.JOB[:-4], *_world.E2E_SIZE]
    a = Node("a", tmp, ep, nnodes="2:3", script=ELASTIC, script_args=args, extra=common)
    wait_listening(ep)
    b = Node("b", tmp, ep, nnodes="2:3", script=ELASTIC, script_args=args, extra=common)
    c = Node("c", tmp, ep, nnodes="2:3", script=ELASTIC, script_args=args, extra=common)
    nodes = [a, b, c]
    try:
        wait_until(lambda: any(e["world_size"] == 3 and e["step"] >= 8 for e in a.events("train_step")), 150,
                   "8 steps at world size 3")
        assert sorted(os.listdir(shm)) == ["trainguard-job-a", "trainguard-job-b", "trainguard-job-c"]

        # 1. one worker SIGKILLed, its agent lives: the world of 3 restarts and restores from memory
        grown = _restoring_worlds(nodes)  # a and b (min nodes 2) may have formed a world before c came up
        (victim,) = b.worker_pids()
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        back = wait_until(lambda: _restores_after(nodes, grown, 3), 120, "three ranks restored")
        resumed_s = time.monotonic() - t_kill
        # From memory: this node's tier 0, or (replicated DDP state) a survivor's newer snapshot when the
        # survivors finished the step the victim died in (the overlapped step agreement does not hold them).
        assert {e["source"] for e in back} <= {"memory", "peer"} and sorted(e["rank"] for e in back) == [0, 1, 2], back
        step1, last1 = _lost(folder, back)
        assert 0 <= last1 - step1 <= 1, (last1, step1)
        wait_until(lambda: any(e["step"] >= step1 + 3 for e in a.events("train_step")), 60, "training again")

        # 2. node c SIGKILLed whole (agent and worker): the survivors form a world of 2 and restore from
        # their own nodes' memory (replicated DDP state), not from storage
        _kill_node(c)
        back2 = wait_until(lambda: _restores_after([a, b], grown + 1, 2), 120, "two ranks restored in a world of 2")
        assert {e["source"] for e in back2} <= {"memory", "peer"}, back2
        step2, last2 = _lost(folder, back2)
        assert 0 <= last2 - step2 <= 1, (last2, step2)
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= step2 + 3 for e in a.events("train_step")), 60,
                   "training at world size 2")
        assert not [e for n in nodes for e in restored(n) if e.get("source") == "storage" and e["round"] >= back[0]["round"]]
        own = sorted(f for f in os.listdir(os.path.join(shm, "trainguard-job-a")))
        assert own[:2] == ["rank-00000-0.snap", "rank-00000-1.snap"], own  # the agents own them: still there
        for n in (a, b):
            n.signal(signal.SIGTERM)  # a drain of the whole job: both agents stop and remove their folders
        for n in (a, b):
            n.wait(60)
        redone = samples.check_lineage_exactly_once(folder, _world.E2E_BATCH)
        assert sorted(redone) == [*range(step1 + 1, last1 + 1), *range(step2 + 1, last2 + 1)], redone
        assert sorted(os.listdir(shm)) == ["trainguard-job-c"]  # a and b removed theirs; c was killed
        print(f"worker kill: restored step {step1}, lost {last1 - step1}, all ranks restored {resumed_s:.1f} s "
              f"after the kill; node kill: world of 2 restored step {step2}, lost {last2 - step2}")
    except AssertionError:
        for n in nodes:
            print(n.dump(60))
        raise
    finally:
        for n in nodes:
            n.stop()


def _kill_node(node) -> None:
    """SIGKILL a whole node: its agent and its workers."""
    kids = node.worker_pids()
    node.proc.kill()
    for p in kids:
        os.kill(p, signal.SIGKILL)


def _fsdp_tier1(tmp_path, reform: str = "restart") -> tuple[str, str, str, str, list[str], list[str]]:
    """Three FSDP2 nodes' set-up with tiers 0 and 1, a snapshot every step, no periodic checkpoint in
    storage and ``workers.reform`` = ``reform``: ``(tmp, samples folder, shm folder, endpoint, agent
    options, job arguments)``."""
    tmp = str(tmp_path)
    folder = os.path.join(tmp, "samples")
    os.makedirs(folder)
    shm = os.path.join(tmp, "shm")
    ep = f"127.0.0.1:{free_port()}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", "checkpoint.interval=off",
              "--set", "checkpoint.memory_interval_steps=1", "--set", "checkpoint.memory_max_overhead=0", "--set", "checkpoint.memory_replica=true",
              "--set", f"checkpoint.memory_dir={shm}", "--set", f"workers.reform={reform}",
              "--set", "rendezvous.keep_alive_interval_s=1", "--set", "rendezvous.keep_alive_max_attempts=3"]
    args = ["--steps", "100000", "--log-every", "1", "--step-sleep", "0.05", "--sample-log", folder,
            "--strategy", "fsdp", *_world.JOB[:-4], *_world.E2E_SIZE]
    return tmp, folder, shm, ep, common, args


def _three_nodes(tmp: str, ep: str, common: list[str], args: list[str]) -> list[Node]:
    """Agents a, b and c of a job of 2 to 3 nodes (a first: it hosts the rendezvous)."""
    a = Node("a", tmp, ep, nnodes="2:3", script=ELASTIC, script_args=args, extra=common)
    wait_listening(ep)
    return [a, *(Node(n, tmp, ep, nnodes="2:3", script=ELASTIC, script_args=args, extra=common) for n in "bc")]


def test_node_sigkill_restores_the_lost_rank_from_its_buddy(tmp_path):
    """Tier 1: three FSDP2 nodes replicate their snapshots to the next node; node c (agent and worker) is
    SIGKILLed; a replacement node joins (min_nodes 3) and gets c's rank, whose state comes from the
    replica its buddy (node a) holds. Lost work <= memory interval + one replica lag; every sample once."""
    tmp, folder, shm, ep, common, args = _fsdp_tier1(tmp_path)

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
        _kill_node(c)
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


@pytest.mark.parametrize("tier1", ["copies", "parity"])
def test_node_sigkill_without_replacement_reshards_from_memory(tmp_path, tier1):
    """Tier 1 at another world size: three FSDP2 nodes replicate their snapshots to the next node; node c
    (agent and worker) is SIGKILLed and not replaced (min nodes 2): the survivors form a world of 2 and
    every rank takes the rows of its new shards from the three ranks' snapshots (a's and b's own, c's
    replica on its buddy). Lost work <= memory interval + one replica lag; every sample once; there is
    no periodic checkpoint in storage at all. ``parity`` (``checkpoint.memory_replica_parity``): no
    replica is kept; c's snapshot is rebuilt from a's and b's parity blocks and snapshots at restore."""
    tmp, folder, shm, ep, common, args = _fsdp_tier1(tmp_path)
    if tier1 == "parity":
        common += ["--set", "checkpoint.memory_replica_parity=true"]
    a, b, c = _three_nodes(tmp, ep, common, args)
    with running([a, b, c], 60) as nodes:
        wait_until(lambda: any(e["world_size"] == 3 and e["step"] >= 8 for e in a.events("train_step")), 150,
                   "8 steps at world size 3")
        held = os.listdir(os.path.join(shm, "trainguard-job-a"))
        if tier1 == "parity":  # one own slot and parity blocks, no copy of anyone's snapshot
            assert sorted(n for n in held if not n.startswith("parity-")) == ["rank-00000-0.snap"], held
            assert any(n.startswith("parity-00000-") for n in held), held
        n_before = _restoring_worlds(nodes)
        _kill_node(c)
        back = wait_until(lambda: _restores_after((a, b), n_before, 2), 120, "a world of 2 restored")
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= back[0]["step"] + 3
                               for e in a.events("train_step")), 60, "training at world size 2")
        assert {e["source"] for e in back} == {"peer"}, back
        resharded = [e for n in (a, b) for e in n.events("checkpoint_restored") if e.get("resharded_from") == 3]
        assert len(resharded) == 2, [e for n in (a, b) for e in n.events("checkpoint_restored")]
        step, last = _lost(folder, back)
        assert 0 <= last - step <= 2, (last, step)
        if tier1 == "parity":
            rebuilt = [e for n in (a, b) for e in n.events("memory_parity_rebuilt")]
            assert [(e["rank"], e["step"]) for e in rebuilt] == [(2, step)], rebuilt
        for n in (a, b):
            n.signal(signal.SIGTERM)
        for n in (a, b):
            n.wait(60)
        redone = samples.check_lineage_exactly_once(folder, _world.E2E_BATCH)
        assert sorted(redone) == list(range(step + 1, last + 1)), (redone, step, last)
        print(f"resharded step {step} from 3 ranks to 2, lost {last - step} step(s)")


@pytest.mark.parametrize("tier1", ["copies", "parity"])
def test_worker_killed_mid_snapshot_restores_the_step_before(tmp_path, tier1):
    """The torn-write guarantee end to end (FSDP2, tiers 0 and 1): node b's worker is SIGKILLed after it
    wrote its snapshot of step s into a slot and before it committed it (a test fault hook), so that slot
    is torn. The world restarts at the same size and restores step s - 1, which every rank still holds
    in its other slot (the other ranks hold step s too: never chosen, b lacks it): never a mix of steps,
    every sample once. ``parity``: there is no other slot; the parity of step s was committed by every
    rank before any own slot was written, so b's step s is rebuilt from it and step s itself restored."""
    tmp, folder, shm, ep, common, args = _fsdp_tier1(tmp_path)
    if tier1 == "parity":
        common += ["--set", "checkpoint.memory_replica_parity=true"]
    flag = os.path.join(tmp, "torn.flag")
    open(flag, "w").close()  # the fault is held back until the world trains
    fault = ["--set", "workers.env=" + json.dumps({"TRAINGUARD_RT_INJECT_FAULT": f"snapshot_written:{flag}"})]
    a = Node("a", tmp, ep, nnodes="3:3", script=ELASTIC, script_args=args, extra=common)
    wait_listening(ep)
    b = Node("b", tmp, ep, nnodes="3:3", script=ELASTIC, script_args=args, extra=[*common, *fault])
    c = Node("c", tmp, ep, nnodes="3:3", script=ELASTIC, script_args=args, extra=common)
    with running([a, b, c], 60) as nodes:
        wait_until(lambda: any(e["world_size"] == 3 and e["step"] >= 8 for e in a.events("train_step")), 150,
                   "8 steps at world size 3")
        n_before = _restoring_worlds(nodes)
        os.remove(flag)  # b's worker dies at its next snapshot
        back = wait_until(lambda: _restores_after(nodes, n_before, 3), 120, "the world of 3 restored")
        with open(flag) as fh:
            torn = int(fh.read())
        wait_until(lambda: any(e["step"] >= torn + 3 for e in a.events("train_step")), 60, "training again")
        step, last = _lost(folder, back)
        if tier1 == "parity":
            assert {e["source"] for e in back} == {"peer"}, back  # b's rank handed over from its rebuilder
            assert step == torn, (step, torn)
            rebuilt = [e for n in nodes for e in n.events("memory_parity_rebuilt")]
            assert [e["step"] for e in rebuilt] == [torn], rebuilt  # b's rank, the one whose own slot is torn
        else:
            assert {e["source"] for e in back} == {"memory"}, back  # every rank from its own node's memory
            assert step == torn - 1, (step, torn)
        assert 0 <= last - step <= 2, (last, step)
        for n in nodes:
            n.signal(signal.SIGTERM)
        for n in nodes:
            n.wait(60)
        redone = samples.check_lineage_exactly_once(folder, _world.E2E_BATCH)
        assert sorted(redone) == list(range(step + 1, last + 1)), (redone, step, last)
        print(f"b's worker killed mid-snapshot of step {torn}; every rank restored step {step} from memory")


@pytest.mark.parametrize("reform", ["restart", "in-process"])
def test_model_parallel_node_sigkill_reshards_from_memory(tmp_path, reform):
    """Tier 1 at another data-parallel size, tensor parallelism + FSDP2 on a 2-D mesh: two nodes of two
    ranks ((dp, tp) = (2, 2)) replicate their snapshots to each other; node b is SIGKILLed whole and not
    replaced: node a's two ranks form (1, 2) (restarted, or re-formed in place: the same processes) and
    take their new shards from the four ranks' snapshots (their own, b's replicas), placements
    ``_StridedShard``/``Shard``/``Replicate`` over the old mesh. Lost work <= memory interval + one
    replica lag; every sample once per data-parallel share in the committed lineage."""
    from tests.strategies.test_e2e_resize import MP_ARGS, MP_SIZE, check_model_parallel_samples

    tmp, folder, shm, ep, common, _ = _fsdp_tier1(tmp_path, reform)
    args = ["--strategy", "model_parallel", *MP_ARGS, "--steps", "100000", *_world.JOB[:-4], *MP_SIZE,
            "--step-sleep", "0.05", "--log-every", "1", "--sample-log", folder]
    extra = ["--nproc-per-node", "2", *common]
    a = Node("a", tmp, ep, nnodes="1:2", script=_world.MODEL_PARALLEL, script_args=args, extra=extra)
    wait_listening(ep)
    b = Node("b", tmp, ep, nnodes="1:2", script=_world.MODEL_PARALLEL, script_args=args, extra=extra)
    with running([a, b], 60) as nodes:
        wait_until(lambda: any(e["world_size"] == 4 and e["step"] >= 6 for e in a.events("train_step")), 240,
                   "6 steps at (dp, tp) = (2, 2)")
        n_before = _restoring_worlds(nodes)
        survivors = sorted(a.worker_pids())
        _kill_node(b)
        back = wait_until(lambda: _restores_after([a], n_before, 2), 180, "(1, 2) restored")
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= back[0]["step"] + 3
                               for e in a.events("train_step")), 90, "training at (1, 2)")
        assert {e["source"] for e in back} == {"peer"}, back
        resharded = [e for e in a.events("checkpoint_restored") if e.get("resharded_from") == 4]
        assert len(resharded) == 2, a.events("checkpoint_restored")
        assert sorted(tuple(e["needed"]) for e in resharded) == [(0, 2), (1, 3)], resharded
        # in place: a's two workers re-formed the world without a restart; else both were restarted
        assert (sorted(a.worker_pids()) == survivors) == (reform == "in-process"), (survivors, a.worker_pids())
        step, last = _lost(folder, back)
        assert 0 <= last - step <= 2, (last, step)
        a.signal(signal.SIGTERM)
        a.wait(60)
        check_model_parallel_samples(folder, 16, lineage=True)
        # the steps trained again after the restored one (a step rolled back mid-way in place is void, not redone)
        redone = samples.check_lineage_exactly_once(folder, 16)
        assert sorted(redone) == list(range(step + 1, step + 1 + len(redone))) and len(redone) <= 2, (redone, step, last)
        print(f"(2, 2) -> (1, 2), {reform}: resharded step {step} from 4 ranks' snapshots, lost {last - step} step(s)")


@pytest.mark.parametrize("tier1", ["copies", "parity"])
def test_in_place_node_sigkill_reshards_from_memory_without_restarting_the_survivors(tmp_path, tier1):
    """Tier 1 with in-place re-formation (``workers.reform: in-process``): three FSDP2 nodes; node c is
    SIGKILLed whole and not replaced: the survivors' worker processes re-form a world of 2 in place (the
    same pids) and reshard the newest snapshots (their own, c's replica) into their new shards instead
    of reading storage (there is none). Lost work <= memory interval + one replica lag; every sample once.
    ``parity``: c's snapshot is rebuilt from the survivors' parity blocks (an exchange that was running
    when c died is left behind by the parked survivors: the previous step stands)."""
    tmp, folder, shm, ep, common, args = _fsdp_tier1(tmp_path, "in-process")
    if tier1 == "parity":
        common += ["--set", "checkpoint.memory_replica_parity=true"]
    a, b, c = _three_nodes(tmp, ep, common, args)
    with running([a, b, c], 60) as nodes:
        wait_until(lambda: any(e["world_size"] == 3 and e["step"] >= 8 for e in a.events("train_step")), 150,
                   "8 steps at world size 3")
        pids = {n.name: n.worker_pids() for n in (a, b)}
        # a and b (min nodes 2) may have formed a world before c came up: its growth restored from storage
        grown = {n.name: len(n.events("checkpoint_restored")) for n in (a, b)}
        _kill_node(c)
        resharded = wait_until(lambda: [e for n in (a, b) for e in n.events("checkpoint_restored")
                                        if e.get("resharded_from") == 3] or None, 120, "a world of 2 resharded")
        wait_until(lambda: len([e for n in (a, b) for e in n.events("checkpoint_restored")
                                if e.get("resharded_from") == 3]) == 2, 60, "both ranks resharded")
        step = resharded[0]["step"]
        wait_until(lambda: any(e["world_size"] == 2 and e["step"] >= step + 3 for e in a.events("train_step")), 60,
                   "training at world size 2")
        assert {n.name: n.worker_pids() for n in (a, b)} == pids  # re-formed in place: no worker restarted
        assert {e["tier"] for n in (a, b) for e in n.events("checkpoint_restored")[grown[n.name]:]} == {"peer"}
        if tier1 == "parity":
            assert [e["step"] for n in (a, b) for e in n.events("memory_parity_rebuilt")] == [step]
        for n in (a, b):
            n.signal(signal.SIGTERM)
        for n in (a, b):
            n.wait(60)
        redone = samples.check_lineage_exactly_once(folder, _world.E2E_BATCH)  # steps trained again after it
        assert sorted(redone) == list(range(step + 1, step + 1 + len(redone))) and len(redone) <= 2, (redone, step)
        print(f"in place: resharded step {step} from 3 ranks to 2, lost {len(redone)} step(s)")
