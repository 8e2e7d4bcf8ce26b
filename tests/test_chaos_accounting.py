"""The chaos benchmark's bookkeeping (pure parts of ``bench/chaos.py``): the sample accounting that
decides "skipped / repeated" for every case, and the seeded case windows that add up to the matrix."""

from __future__ import annotations

import json
import os

import pytest

from tests.harness import bench_module


@pytest.fixture(scope="module")
def chaos():
    with bench_module("chaos.py") as mod:
        yield mod


def write(folder, recs):
    with open(os.path.join(folder, "samples-1.jsonl"), "a") as fh:
        for r in recs:
            fh.write(json.dumps(r) + "\n")


def rec(chaos, step, rnd, rank=0, ids=None):
    return {"step": step, "rank": rank, "world_size": 2, "round": rnd,
            "ids": chaos.expected_batch(step) if ids is None else ids}


def test_clean_log_counts_nothing_even_across_epochs(chaos, tmp_path):
    n_steps = 300  # more than one epoch of the bench's dataset (ids recur by design)
    write(tmp_path, [rec(chaos, s, 0, rank) for s in range(1, n_steps + 1) for rank in (0, 1)])
    assert chaos.sample_account(str(tmp_path)) == (0, 0, [])


def test_redone_step_is_repeated_rolled_back_attempt_is_not(chaos, tmp_path):
    write(tmp_path, [rec(chaos, 1, 0), rec(chaos, 2, 0), rec(chaos, 3, 0),
                     rec(chaos, 3, 1), {"step": 3, "rank": 0, "round": 1, "rolled_back": True},  # void
                     rec(chaos, 3, 2), rec(chaos, 4, 2)])  # step 3 valid in rounds 0 and 2: trained twice
    skipped, repeated, errors = chaos.sample_account(str(tmp_path))
    assert (skipped, repeated) == (0, chaos.GLOBAL_BATCH)
    assert errors and "committed twice" in errors[0]


def test_missing_step_and_wrong_batch_are_skipped(chaos, tmp_path):
    wrong = list(reversed(chaos.expected_batch(5)))
    write(tmp_path, [rec(chaos, 1, 0), rec(chaos, 2, 0), rec(chaos, 4, 0), rec(chaos, 5, 0, ids=wrong)])
    skipped, repeated, errors = chaos.sample_account(str(tmp_path))
    assert (skipped, repeated) == (2 * chaos.GLOBAL_BATCH, 0)
    assert any("[5]" in e for e in errors)


def test_seeded_windows_partition_the_matrix(chaos):
    full = chaos.plan(7, False, None)
    phases = chaos.PHASES + chaos.TIMED_PHASES
    assert len(full) == len(chaos.FAULTS) * len(phases) * len(chaos.TARGETS) == len(set(full)) == 144
    windows = [chaos.plan(7, False, 20, skip) for skip in range(0, 144, 20)]
    assert [c for w in windows for c in w] == full
    # the timed phases come after the first 96 cases, whose numbers stay what earlier windows ran
    assert {p for _, p, _ in full[:96]} == set(chaos.PHASES) and {p for _, p, _ in full[96:]} == set(chaos.TIMED_PHASES)
    assert chaos.plan(8, False, None) != full and sorted(chaos.plan(8, False, None)) == sorted(full)
    quick = chaos.plan(7, True, None)
    assert {k for k, _, _ in quick} == {"drain", "sigkill_worker", "sigkill_node", "metadata_garbage", "storage_503"}


def test_network_kinds_run_only_when_named_and_never_beside_the_localhost_servers(chaos):
    """``partition`` and ``packet_loss`` need the agents in network namespaces: the seeded matrix (and its
    numbers) stays as it was, ``--only`` adds them (phase ``step``, each target), and a run that would
    also need the S3 fault proxy or a metadata emulator (out of the namespaces' reach) is refused."""
    assert not [c for c in chaos.plan(7, False, None) if c[0] in chaos.NET_KINDS]
    assert chaos.plan(7, False, None, only="partition@*,packet_loss@step") == [
        ("partition", "step", "rank0"), ("partition", "step", "peer"),
        ("packet_loss", "step", "rank0"), ("packet_loss", "step", "peer")]
    assert chaos.needs_netns(chaos.plan(7, False, None, only="partition@*,drain@step"))
    assert not chaos.needs_netns(chaos.plan(7, False, None, only="drain@*"))
    for clash in ("partition@*,storage_503@save", "packet_loss@*,drain@commit"):
        with pytest.raises(SystemExit, match="network namespaces"):
            chaos.needs_netns(chaos.plan(7, False, None, only=clash))


def test_dirty_kinds_run_only_when_named_and_need_no_namespaces(chaos):
    """``hang_worker``, ``freeze_node`` and ``late_joiner`` (issue 37) leave the seeded matrix and ``--quick`` as
    they were; ``--only`` adds them at phase ``step``, each target once (``late_joiner``: once, no target)."""
    assert not [c for c in chaos.plan(7, False, None) + chaos.plan(7, True, None) if c[0] in chaos.DIRTY_KINDS]
    cases = chaos.plan(7, False, None, only="hang_worker,freeze_node@step,late_joiner@*")
    assert cases == [("hang_worker", "step", "rank0"), ("hang_worker", "step", "peer"),
                     ("freeze_node", "step", "rank0"), ("freeze_node", "step", "peer"), ("late_joiner", "step", "-")]
    assert not chaos.needs_netns(cases)
    assert chaos.plan(7, False, None, only="hang_worker@save") == []  # named kinds run at phase step only
    assert not chaos.KINDS["freeze_node"].removes  # SIGCONTed: it comes back (see the Kind's comment)


def test_late_job_arguments_end_the_job_and_keep_the_rest(chaos, tmp_path):
    late = chaos.script_args(chaos.LATE_STEPS)
    assert late[late.index("--steps") + 1] == str(chaos.LATE_STEPS)
    assert [a for i, a in enumerate(late) if i != late.index("--steps") + 1] == \
        [a for i, a in enumerate(chaos.SCRIPT_ARGS) if i != chaos.SCRIPT_ARGS.index("--steps") + 1]
    assert chaos.script_args() == chaos.SCRIPT_ARGS
    assert chaos.samples_dir(str(tmp_path)) != chaos.samples_dir(str(tmp_path), chaos.late_job(1))
    # one rendezvous id per case: the first short job's end closes its rendezvous for good (--repeat 3 saw
    # the second case's nodes find it closed at once and exit not_needed before training)
    assert len({chaos.late_job(i) for i in range(1, 4)} | {chaos.JOB_ID}) == 4
    assert len({chaos.samples_dir(str(tmp_path), chaos.late_job(i)) for i in range(1, 4)}) == 3


@pytest.mark.parametrize("code,events,want", [
    (0, [{"event": "job_already_complete"}, {"event": "state_change", "new": "succeeded", "reason": "not_needed"}],
     "not_needed"),
    (0, [{"event": "state_change", "new": "succeeded", "reason": "not_needed"}], "not_needed"),
    (0, [{"event": "joined_running_world"}, {"event": "state_change", "new": "succeeded"}], "succeeded"),
    (0, [{"event": "state_change", "new": "rendezvous"}], None),  # exit 0 without saying why: not accepted
    (1, [{"event": "job_already_complete"}], None),
    (None, [{"event": "job_already_complete"}], None),  # still running
    (0, [], None),
])
def test_late_outcome(chaos, code, events, want):
    assert chaos.late_outcome(code, events) == want


class FakeAgent:
    def __init__(self, evs):
        self.evs = evs  # (time, event dict)

    def events(self, name, since=0.0):
        return [(t, e) for t, e in self.evs if t >= since and e.get("event") == name]


def test_epoch_claims_and_stale_commits_of_a_cut_off_or_woken_node(chaos):
    """partition and freeze_node: the others' first claim after the fault, and the node's commits under an
    epoch not newer than it (the worker's ``trainguard.checkpoint`` lines only)."""
    ck = "trainguard.checkpoint"
    others = [FakeAgent([(5.0, {"event": "checkpoint_epoch_claimed", "epoch": 3, "component": ck})]),
              FakeAgent([(4.0, {"event": "checkpoint_epoch_claimed", "epoch": 4, "component": ck}),
                         (1.0, {"event": "checkpoint_epoch_claimed", "epoch": 2, "component": ck}),
                         (6.0, {"event": "checkpoint_epoch_claimed", "epoch": 9, "component": "other"})])]
    assert chaos.epoch_claims(others, 2.0) == [(4.0, 4), (5.0, 3)]
    node = FakeAgent([(3.0, {"event": "checkpoint_committed", "step": 10, "epoch": 2, "component": ck}),
                      (6.0, {"event": "checkpoint_committed", "step": 20, "epoch": 2, "component": ck}),
                      (7.0, {"event": "checkpoint_committed", "step": 30, "epoch": 5, "component": ck}),
                      (8.0, {"event": "checkpoint_committed", "step": 40, "epoch": 1, "component": "other"})])
    assert chaos.stale_commits(node, 4.0, 4) == ["step 20 epoch 2"]
