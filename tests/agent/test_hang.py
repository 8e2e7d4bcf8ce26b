"""Hang detection: the pure decisions (agent/hang.py) as tables with a fake clock, and the watch
(agent/hangwatch.py) over a shared in-memory store with a fake clock. No processes, no sleeps."""

import pytest

from trainguard.agent.configload import load_config
from trainguard.agent.hang import (HangAct, HangConfig, HangVerdict, RankView, StepTimes, Tracker, decide_hang, evictable,
                                   hang_action, hang_threshold, pick_verdict)
from trainguard.agent.probe import Answer
from trainguard.agent.procstat import ProcState
from trainguard.agent.hangwatch import (PROGRESS_KEY, VERDICT_KEY, HangWatch, decode_record, decode_verdict, encode_record,
                                        encode_verdict)
from trainguard.contract.configbase import ConfigError
from trainguard.contract.protocol import Phase, Progress

CFG = HangConfig()
S, A, B, SV, R, P = Phase.STEP, Phase.AGREEMENT, Phase.BUSY, Phase.SAVE, Phase.RESTORE, Phase.PARKED


def rv(rank, *, node="n0", step=60, phase=S, where="train.py:80 main", beat_at=0.0, progress_at=0.0, agent_at=None,
       proc=ProcState.UNKNOWN, proc_since=0.0, answer=Answer.UNKNOWN):
    return RankView(rank, node, step, phase, where, beat_at, progress_at, beat_at if agent_at is None else agent_at,
                    proc, proc_since, answer)


# ---- configuration ---------------------------------------------------------------------------------

def test_defaults_are_valid_and_the_threshold_follows_the_step_time():
    assert hang_threshold(CFG, p99=0.05, known_steps=100) == CFG.min_s
    assert hang_threshold(CFG, p99=40.0, known_steps=100) == 120.0  # a 40 s GPU step: k x p99
    assert hang_threshold(CFG, p99=0.05, known_steps=2) == CFG.warmup_s  # too few steps known yet
    assert hang_threshold(CFG, p99=None, known_steps=0) == CFG.warmup_s


BAD = [
    ("hang:\n  heartbeat_interval_s: 0\n", {}, "hang.heartbeat_interval_s", "must be > 0"),
    ("", {"TRAINGUARD_HANG_MIN_S": "1"}, "hang.min_s", "at least heartbeat_interval_s x stale_beats"),
    ("hang:\n  stale_beats: 1\n", {}, "hang.stale_beats", "must be an integer >= 2"),
    ("hang:\n  step_factor: 0.5\n", {}, "hang.step_factor", "must be >= 1"),
    ("hang:\n  silent_s: 1\n", {}, "hang.silent_s", "between heartbeat_interval_s x stale_beats"),
    ("hang:\n  stopped_s: 0\n", {}, "hang.stopped_s", "must be > 0"),
    ("", {"TRAINGUARD_HANG_STOPPED_S": "7"}, "hang.stopped_s", "at most silent_s (6 s)"),
    ("hang:\n  frozen_s: 1\n", {}, "hang.frozen_s", "between heartbeat_interval_s x stale_beats (2 s)"),
    ("", {"TRAINGUARD_HANG_FROZEN_S": "6.5"}, "hang.frozen_s", "and silent_s (6 s)"),
    ("", {"TRAINGUARD_HANG_SILENT_S": "7"}, "hang.silent_s", "and min_s (6 s)"),
    ("", {"TRAINGUARD_HANG_QUARANTINE_S": "-1"}, "hang.quarantine_s", "must be >= 0"),
    ("hang:\n  probe_timeout_s: -1\n", {}, "hang.probe_timeout_s", "must be >= 0"),
    ("", {"TRAINGUARD_HANG_PROBE_TIMEOUT_S": "3"}, "hang.probe_timeout_s", "at most frozen_s (2 s)"),
    ("hang:\n  probe_port: 70000\n", {}, "hang.probe_port", "integer port 0-65535"),
    ("hang:\n  warmup_s: .nan\n", {}, "hang.warmup_s", "finite"),
]


@pytest.mark.parametrize("text,env,key,fragment", BAD, ids=[b[2] for b in BAD])
def test_bad_hang_config_names_key_env_var_and_fix(tmp_path, text, env, key, fragment):
    path = None
    if text:
        path = tmp_path / "agent.yaml"
        path.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(str(path) if path else None, env)
    msg = str(ei.value)
    assert ei.value.key == key
    assert f"({key} / TRAINGUARD_{key.upper().replace('.', '_')}): " in msg
    assert fragment in msg


# ---- decide_hang -----------------------------------------------------------------------------------
# Ranks 0 and 1 on node n0/n1. t is the fake clock; the hung rank's beats stop at 100.

HUNG_AT = 100.0
T_AFTER = HUNG_AT + CFG.min_s + 1.0
T_BEFORE = HUNG_AT + CFG.min_s - 1.0
FAST = HangConfig(silent_s=4.0)  # hang.silent_s below min_s: a stopped rank is named before the threshold
T_SILENT = HUNG_AT + FAST.silent_s + 0.5
T_NOT_SILENT = HUNG_AT + FAST.silent_s - 0.5

CASES = [
    # id, ranks, now, p99, known steps, hung, culprit rank, why, node frozen
    ("training", [rv(0, beat_at=T_AFTER, progress_at=T_AFTER), rv(1, node="n1", beat_at=T_AFTER, progress_at=T_AFTER)],
     T_AFTER, 0.05, 100, False, None, "", False),
    ("sigstop_before_threshold", [rv(0, beat_at=T_BEFORE, progress_at=HUNG_AT),
                                  rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_BEFORE)],
     T_BEFORE, 0.05, 100, False, None, "", False),
    # every rank beats, none progresses (all wait in one collective): only the threshold names a hang
    ("all_beating_before_threshold", [rv(0, beat_at=T_BEFORE, progress_at=HUNG_AT), rv(1, node="n1", beat_at=T_BEFORE, progress_at=HUNG_AT)],
     T_BEFORE, 0.05, 100, False, None, "", False),
    # warming up (fewer than min_steps step times): a silent rank waits for the warm-up threshold
    ("silent_while_warming_up", [rv(0, beat_at=T_AFTER, progress_at=HUNG_AT),
                                 rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_AFTER)],
     T_AFTER, 0.05, 2, False, None, "", False),
    ("sigstop_worker", [rv(0, beat_at=T_AFTER, progress_at=HUNG_AT), rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_AFTER)],
     T_AFTER, 0.05, 100, True, 1, "heartbeat_stopped_first", False),
    ("frozen_node", [rv(0, beat_at=T_AFTER, progress_at=HUNG_AT), rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT)],
     T_AFTER, 0.05, 100, True, 1, "heartbeat_stopped_first", True),
    ("first_silent_of_two", [rv(0, beat_at=HUNG_AT + 2, progress_at=HUNG_AT, agent_at=T_AFTER),
                             rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_AFTER),
                             rv(2, node="n2", beat_at=T_AFTER, progress_at=HUNG_AT)],
     T_AFTER, 0.05, 100, True, 1, "heartbeat_stopped_first", False),
    # a 40 s GPU step: nothing moves for 60 s (every rank in one kernel or its collective): no hang
    ("gpu_40s_step", [rv(0, beat_at=160.0, progress_at=HUNG_AT), rv(1, node="n1", beat_at=160.0, progress_at=HUNG_AT)],
     160.0, 40.0, 100, False, None, "", False),
    ("gpu_step_stuck_past_k_p99", [rv(0, beat_at=230.0, progress_at=HUNG_AT), rv(1, node="n1", beat_at=230.0, progress_at=HUNG_AT)],
     230.0, 40.0, 100, True, None, "unknown", False),
    # a 5-minute rank-0-only evaluation, no API: rank 0 runs Python (progress), rank 1 waits in the collective
    ("eval_5min_frames_move", [rv(0, beat_at=400.0, progress_at=400.0, where="eval.py:12 evaluate"),
                               rv(1, node="n1", beat_at=400.0, progress_at=HUNG_AT)],
     400.0, 0.05, 100, False, None, "", False),
    # the same, rank 0 blocked in a device sync but inside rt.busy()
    ("eval_5min_busy_api", [rv(0, phase=B, beat_at=400.0, progress_at=HUNG_AT), rv(1, node="n1", beat_at=400.0, progress_at=HUNG_AT)],
     400.0, 0.05, 100, False, None, "", False),
    ("busy_rank_frozen", [rv(0, phase=B, beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_AFTER), rv(1, node="n1", beat_at=T_AFTER, progress_at=HUNG_AT)],
     T_AFTER, 0.05, 100, True, 0, "heartbeat_stopped_first", False),
    ("long_save", [rv(0, phase=SV, beat_at=400.0, progress_at=HUNG_AT), rv(1, node="n1", phase=SV, beat_at=400.0, progress_at=HUNG_AT)],
     400.0, 0.05, 100, False, None, "", False),
    ("long_restore", [rv(0, phase=R, beat_at=400.0, progress_at=HUNG_AT), rv(1, node="n1", beat_at=400.0, progress_at=HUNG_AT)],
     400.0, 0.05, 100, False, None, "", False),
    ("between_worlds", [rv(0, phase=P, beat_at=400.0, progress_at=HUNG_AT), rv(1, node="n1", phase=P, beat_at=400.0, progress_at=HUNG_AT)],
     400.0, 0.05, 100, False, None, "", False),
    # every rank beats; two wait in the agreement, one sits in the step (a stuck data loader read)
    ("outside_the_collective_phase", [rv(0, phase=A, beat_at=T_AFTER, progress_at=HUNG_AT),
                                      rv(1, node="n1", beat_at=T_AFTER, progress_at=HUNG_AT, where="data.py:7 read"),
                                      rv(2, node="n2", phase=A, beat_at=T_AFTER, progress_at=HUNG_AT)],
     T_AFTER, 0.05, 100, True, 1, "outside_the_collective", False),
    ("outside_the_collective_frame", [rv(0, beat_at=T_AFTER, progress_at=HUNG_AT),
                                      rv(1, node="n1", beat_at=T_AFTER, progress_at=HUNG_AT, where="data.py:7 read"),
                                      rv(2, node="n2", beat_at=T_AFTER, progress_at=HUNG_AT)],
     T_AFTER, 0.05, 100, True, 1, "outside_the_collective", False),
    ("warming_up", [rv(0, beat_at=T_AFTER, progress_at=HUNG_AT), rv(1, node="n1", beat_at=T_AFTER, progress_at=HUNG_AT)],
     T_AFTER, 0.05, 2, False, None, "", False),
    ("no_ranks", [], T_AFTER, 0.05, 100, False, None, "", False),
]


@pytest.mark.parametrize("ranks,now,p99,known,hung,culprit,why,frozen", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide_hang(ranks, now, p99, known, hung, culprit, why, frozen):
    v = decide_hang(ranks, now, CFG, p99, known)
    assert v.hung is hung
    assert (v.culprit.rank if v.culprit else None) == culprit
    assert v.why == why
    assert v.node_frozen is frozen
    if hung:
        assert v.stalled_s > v.threshold_s
        assert v.threshold_s == hang_threshold(CFG, p99, known)


SILENT_CASES = [
    # id, config, ranks, now, hung, culprit rank, node frozen
    ("default_waits_for_the_threshold", CFG, [rv(0, beat_at=T_SILENT, progress_at=HUNG_AT),
                                             rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_SILENT)],
     T_SILENT, False, None, False),
    ("before_silent_s", FAST, [rv(0, beat_at=T_NOT_SILENT, progress_at=HUNG_AT),
                               rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_NOT_SILENT)],
     T_NOT_SILENT, False, None, False),
    ("after_silent_s", FAST, [rv(0, beat_at=T_SILENT, progress_at=HUNG_AT),
                              rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_SILENT)],
     T_SILENT, True, 1, False),
    # a silent rank while another runs a long evaluation inside rt.busy(): the job is progressing
    ("a_peer_is_busy", FAST, [rv(0, phase=B, beat_at=T_SILENT, progress_at=HUNG_AT),
                              rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_SILENT)],
     T_SILENT, False, None, False),
    # the job's end on a loaded machine: rank 1 finished (its last beat said so) and its interpreter takes
    # seconds to exit; rank 0 still waits in the teardown's barrier. Neither is hung.
    ("a_finished_rank_is_silent", FAST, [rv(0, beat_at=T_SILENT, progress_at=HUNG_AT),
                                         rv(1, node="n1", phase=Phase.FINISHED, beat_at=HUNG_AT, progress_at=HUNG_AT,
                                            agent_at=T_SILENT)],
     T_SILENT, False, None, False),
    ("every_rank_finished_long_ago", FAST, [rv(0, phase=Phase.FINISHED, beat_at=HUNG_AT, progress_at=HUNG_AT,
                                               agent_at=T_SILENT + 600),
                                            rv(1, node="n1", phase=Phase.FINISHED, beat_at=HUNG_AT, progress_at=HUNG_AT,
                                               agent_at=T_SILENT + 600)],
     T_SILENT + 600, False, None, False),
    # a finished rank is no evidence either way: the stopped rank beside it is still named
    ("a_finished_rank_beside_a_stopped_one", FAST,
     [rv(0, beat_at=T_SILENT, progress_at=HUNG_AT), rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_SILENT),
      rv(2, node="n2", phase=Phase.FINISHED, beat_at=HUNG_AT - 1, progress_at=HUNG_AT - 1, agent_at=T_SILENT)],
     T_SILENT, True, 1, False),
    ("while_warming_up", FAST, [rv(0, beat_at=T_SILENT, progress_at=HUNG_AT),
                                rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_SILENT)],
     T_SILENT, None, None, False),
]


@pytest.mark.parametrize("cfg,ranks,now,hung,culprit,frozen", [c[1:] for c in SILENT_CASES], ids=[c[0] for c in SILENT_CASES])
def test_a_stopped_rank_is_named_at_silent_s_when_set_below_min_s(cfg, ranks, now, hung, culprit, frozen):
    known = 2 if hung is None else 100  # None: the warm-up case (fewer than min_steps step times known)
    v = decide_hang(ranks, now, cfg, 0.05, known)
    assert v.hung is bool(hung)
    assert (v.culprit.rank if v.culprit else None) == culprit
    assert v.node_frozen is frozen
    if hung:
        assert v.why == "heartbeat_stopped_first" and v.threshold_s == cfg.silent_s < v.stalled_s < cfg.min_s


T_FROZEN = HUNG_AT + CFG.frozen_s + 0.5

FROZEN_CASES = [
    # id, ranks, now, hung, culprit rank
    ("frozen_node_named_after_frozen_s", [rv(0, beat_at=T_FROZEN, progress_at=HUNG_AT),
                                          rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT)],
     T_FROZEN, True, 1),
    ("frozen_node_not_yet", [rv(0, beat_at=T_FROZEN - 1, progress_at=HUNG_AT),
                             rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT)],
     T_FROZEN - 1, False, None),
    # its agent silent, but the job still progresses (rank 0 evaluates alone): nothing to evict yet
    ("frozen_node_job_progresses", [rv(0, beat_at=T_FROZEN, progress_at=T_FROZEN - 0.2),
                                    rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT)],
     T_FROZEN, False, None),
    # a hung worker whose agent still publishes is no frozen node (its own agent acts, at silent_s or earlier)
    ("worker_silent_agent_alive", [rv(0, beat_at=T_FROZEN, progress_at=HUNG_AT),
                                   rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_FROZEN)],
     T_FROZEN, False, None),
    # the first of two silent nodes whose agent went quiet is named, not the earlier-silent worker elsewhere
    ("frozen_node_beside_a_silent_worker", [rv(0, node="n0", beat_at=HUNG_AT - 1, progress_at=HUNG_AT, agent_at=T_FROZEN),
                                            rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT),
                                            rv(2, node="n2", beat_at=T_FROZEN, progress_at=HUNG_AT)],
     T_FROZEN, True, 1),
]


@pytest.mark.parametrize("ranks,now,hung,culprit", [c[1:] for c in FROZEN_CASES], ids=[c[0] for c in FROZEN_CASES])
def test_a_node_whose_agent_and_ranks_are_silent_is_named_frozen_at_frozen_s(ranks, now, hung, culprit):
    v = decide_hang(ranks, now, CFG, 0.05, 100)
    assert v.hung is hung
    assert (v.culprit.rank if v.culprit else None) == culprit
    if hung:
        assert v.why == "node_silent" and v.node_frozen and v.threshold_s == CFG.frozen_s < v.stalled_s < CFG.silent_s
        a = hang_action(v, node="n2", previous_hangs=[], now=now, cfg=CFG)
        assert a.act is HangAct.ABORT and a.evict == frozenset({"n1"})


T_PROBE = HUNG_AT + CFG.probe_after_s + 0.1  # past probe_after_s, well before frozen_s
SIL, GONE, ALIVE = Answer.SILENT, Answer.GONE, Answer.ALIVE

PROBE_CASES = [
    # id, ranks, now, hung, culprit rank, why
    # n1's record is late and its agent did not answer a probe asked since: frozen, without frozen_s of silence
    ("unanswered_named_at_probe_after_s", [rv(0, beat_at=T_PROBE, progress_at=HUNG_AT),
                                           rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT, answer=SIL)],
     T_PROBE, True, 1, "agent_unanswered"),
    # its port refused: the agent is dead
    ("gone_named_at_probe_after_s", [rv(0, beat_at=T_PROBE, progress_at=HUNG_AT),
                                     rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT, answer=GONE)],
     T_PROBE, True, 1, "agent_gone"),
    # unanswered, but its record is not late yet: no evidence (a probe is asked only of a late record anyway)
    ("unanswered_record_not_late", [rv(0, beat_at=T_PROBE, progress_at=HUNG_AT),
                                    rv(1, node="n1", beat_at=T_PROBE - 0.1, progress_at=HUNG_AT, agent_at=T_PROBE - 0.1,
                                       answer=SIL)],
     T_PROBE, False, None, ""),
    # unanswered and late, but the job progresses: no verdict (an agent alone may be slow; the workers train)
    ("unanswered_job_progresses", [rv(0, beat_at=T_PROBE, progress_at=T_PROBE - 0.1),
                                   rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT, answer=SIL)],
     T_PROBE, False, None, ""),
    # its agent answered: alive, however late its record; not even frozen_s of silence names it frozen
    ("answered_is_not_frozen_at_frozen_s", [rv(0, beat_at=T_FROZEN, progress_at=HUNG_AT),
                                            rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT,
                                               answer=ALIVE)],
     T_FROZEN, False, None, ""),
    # no answer yet (UNKNOWN): silence alone, as without probes: frozen at frozen_s, not before
    ("no_answer_waits_for_frozen_s", [rv(0, beat_at=T_PROBE, progress_at=HUNG_AT),
                                      rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT)],
     T_PROBE, False, None, ""),
    ("no_answer_frozen_at_frozen_s", [rv(0, beat_at=T_FROZEN, progress_at=HUNG_AT),
                                      rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=HUNG_AT)],
     T_FROZEN, True, 1, "node_silent"),
]


@pytest.mark.parametrize("ranks,now,hung,culprit,why", [c[1:] for c in PROBE_CASES], ids=[c[0] for c in PROBE_CASES])
def test_a_late_node_whose_agent_does_not_answer_a_probe_is_frozen_at_probe_after_s(ranks, now, hung, culprit, why):
    v = decide_hang(ranks, now, CFG, 0.05, 100)
    assert v.hung is hung
    assert (v.culprit.rank if v.culprit else None) == culprit
    if hung:
        assert v.why == why and v.node_frozen
        assert v.threshold_s == (CFG.frozen_s if why == "node_silent" else CFG.ask_after_s)
        a = hang_action(v, node="n0", previous_hangs=[], now=now, cfg=CFG)
        assert a.act is HangAct.ABORT and a.evict == frozenset({"n1"})


T_STOP = HUNG_AT + CFG.stopped_s + 0.3
STOP, BUSY_C, IDLE = ProcState.STOPPED, ProcState.BUSY, ProcState.IDLE

PROC_CASES = [
    # id, config, ranks, now, known steps, hung, culprit rank, why, threshold
    ("stopped_named_after_stopped_s", CFG, [rv(0, beat_at=T_STOP, progress_at=HUNG_AT),
                                            rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_STOP,
                                               proc=STOP, proc_since=HUNG_AT)],
     T_STOP, 100, True, 1, "process_stopped", CFG.stopped_s),
    ("stopped_not_yet_stopped_s", CFG, [rv(0, beat_at=T_STOP, progress_at=HUNG_AT),
                                        rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_STOP,
                                           proc=STOP, proc_since=T_STOP - CFG.stopped_s + 0.1)],
     T_STOP, 100, False, None, "", None),
    # stopped while another rank still progresses (a rank-0-only evaluation elsewhere, or a peer's progress
    # that has not reached this agent yet): named all the same, it takes part in no collective
    ("stopped_while_another_rank_progresses", CFG, [rv(0, beat_at=T_STOP, progress_at=T_STOP - 0.1),
                                                    rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_STOP,
                                                       proc=STOP, proc_since=HUNG_AT)],
     T_STOP, 100, True, 1, "process_stopped", CFG.stopped_s),
    # a stopped process is stopped during warm-up too
    ("stopped_while_warming_up", CFG, [rv(0, beat_at=T_STOP, progress_at=HUNG_AT),
                                       rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_STOP,
                                          proc=STOP, proc_since=HUNG_AT)],
     T_STOP, 2, True, 1, "process_stopped", CFG.stopped_s),
    # the stopped rank is named before an earlier-silent one whose process the kernel says runs
    ("stopped_before_silent", CFG, [rv(0, beat_at=HUNG_AT - 1, progress_at=HUNG_AT, proc=BUSY_C, proc_since=HUNG_AT - 1),
                                    rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_AFTER,
                                       proc=STOP, proc_since=HUNG_AT)],
     T_AFTER, 100, True, 1, "process_stopped", CFG.min_s),
    # silent but the kernel says it runs (C code holding the GIL, or starved): not named at silent_s ...
    ("busy_in_c_not_named_at_silent_s", FAST, [rv(0, beat_at=T_SILENT, progress_at=HUNG_AT),
                                               rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_SILENT,
                                                  proc=BUSY_C, proc_since=HUNG_AT)],
     T_SILENT, 100, False, None, "", None),
    # ... a sleeping one is, as without /proc
    ("idle_silent_named_at_silent_s", FAST, [rv(0, beat_at=T_SILENT, progress_at=HUNG_AT),
                                             rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_SILENT,
                                                proc=IDLE, proc_since=HUNG_AT)],
     T_SILENT, 100, True, 1, "heartbeat_stopped_first", FAST.silent_s),
    # ... and the job's threshold still bounds a busy one (an endless C loop is a hang)
    ("busy_in_c_past_the_threshold", FAST, [rv(0, beat_at=T_AFTER, progress_at=HUNG_AT),
                                            rv(1, node="n1", beat_at=HUNG_AT, progress_at=HUNG_AT, agent_at=T_AFTER,
                                               proc=BUSY_C, proc_since=HUNG_AT)],
     T_AFTER, 100, True, 1, "heartbeat_stopped_first", FAST.min_s),
]


@pytest.mark.parametrize("cfg,ranks,now,known,hung,culprit,why,threshold", [c[1:] for c in PROC_CASES],
                         ids=[c[0] for c in PROC_CASES])
def test_what_the_kernel_says_about_a_local_rank(cfg, ranks, now, known, hung, culprit, why, threshold):
    v = decide_hang(ranks, now, cfg, 0.05, known)
    assert v.hung is hung
    assert (v.culprit.rank if v.culprit else None) == culprit
    assert v.why == why
    if hung and why == "process_stopped":  # the stop itself is the evidence: no stall of the job is waited for
        assert v.threshold_s == threshold
    elif hung:
        assert v.threshold_s == threshold < v.stalled_s


def test_a_40s_step_and_a_5min_evaluation_stream_give_no_false_positive():
    """A scripted run on a fake clock: 10 steps of 40 s, then a 5-minute rank-0-only evaluation (frames
    move on rank 0, rank 1 waits in the collective), then 10 more steps; the watch is asked every 0.5 s.
    The evaluation (no ``rt.busy``) counts as one long step: the threshold grows (conservative), and a
    real stall past it is still detected."""
    t, tr, times = 0.0, Tracker(), StepTimes()
    beats = {0: [0, 0, 0], 1: [0, 0, 0]}  # beat, progress, step at the last beat
    step, detections = 0, 0

    def beat(rank, moved):
        beats[rank][0] += 1
        beats[rank][1] += 1 if moved or beats[rank][2] != step else 0
        beats[rank][2] = step
        tr.beat(f"n{rank}", rank, step, S, "train.py:1 main" if rank else "eval.py:3 run", beats[rank][0], beats[rank][1], t)

    def run(seconds, rank0_moves, step_every):
        nonlocal t, step, detections
        end = t + seconds
        while t < end:
            t += 0.5
            if step_every and t % step_every == 0:
                step += 1
            beat(0, rank0_moves)
            beat(1, False)
            tr.agent("n0", int(t * 2), t)
            tr.agent("n1", int(t * 2), t)
            times.observe(step, S, t)
            detections += decide_hang(tr.views(t, "n0"), t, CFG, times.p99(), times.count).hung

    run(400.0, False, 40.0)
    assert times.count >= CFG.min_steps and 39.0 <= times.p99() <= 41.0
    run(300.0, True, 0)
    run(400.0, False, 40.0)
    assert detections == 0
    threshold = CFG.step_factor * times.p99()
    run(threshold - 45.0, False, 0)  # a stall shorter than the threshold (the last step began <= 40 s earlier)
    assert detections == 0
    run(50.0, False, 0)  # past it (no frame moves, no step): detected
    assert detections > 0


# ---- hang_action -----------------------------------------------------------------------------------

def _verdict(node, frozen=False, culprit=True):
    ranks = [rv(0, node="me", beat_at=T_AFTER, progress_at=HUNG_AT),
             rv(1, node=node, beat_at=HUNG_AT if culprit else T_AFTER, progress_at=HUNG_AT,
                agent_at=HUNG_AT if frozen else T_AFTER)]
    if not culprit:
        ranks = [rv(0, node="me", beat_at=T_AFTER, progress_at=HUNG_AT), rv(1, node=node, beat_at=T_AFTER, progress_at=HUNG_AT)]
    v = decide_hang(ranks, T_AFTER, CFG, 0.05, 100)
    assert v.hung
    return v


ACTIONS = [
    ("culprit_here", "me", False, True, [], HangAct.END_WORKERS, frozenset()),
    ("culprit_here_again", "me", False, True, [T_AFTER - 600.0], HangAct.QUARANTINE, frozenset()),
    ("culprit_here_long_ago", "me", False, True, [T_AFTER - 7200.0], HangAct.END_WORKERS, frozenset()),
    ("culprit_elsewhere", "other", False, True, [], HangAct.WATCH, frozenset()),
    ("culprit_node_frozen", "other", True, True, [], HangAct.ABORT, frozenset({"other"})),
    ("culprit_unknown", "other", False, False, [], HangAct.END_WORKERS, frozenset()),
]


@pytest.mark.parametrize("node,frozen,culprit,previous,act,evict", [a[1:] for a in ACTIONS], ids=[a[0] for a in ACTIONS])
def test_hang_action(node, frozen, culprit, previous, act, evict):
    a = hang_action(_verdict(node, frozen, culprit), node="me", previous_hangs=previous, now=T_AFTER, cfg=CFG)
    assert a is not None and a.act is act and a.evict == evict


def test_no_action_without_a_hang():
    v = decide_hang([rv(0, beat_at=1.0, progress_at=1.0)], 1.0, CFG, None, 0)
    assert hang_action(v, node="n0", previous_hangs=[], now=1.0, cfg=CFG) is None


def test_quarantine_off_with_zero_window():
    cfg = HangConfig(quarantine_s=0.0)
    a = hang_action(_verdict("me"), node="me", previous_hangs=[T_AFTER], now=T_AFTER, cfg=cfg)
    assert a is not None and a.act is HangAct.END_WORKERS


# ---- evictable -------------------------------------------------------------------------------------

EVICT = [
    ("reset_and_missed_heartbeat", {"a": 10.0, "b": 8.5}, True, {"b"}),
    ("reset_but_heartbeat_fresh", {"a": 10.0, "b": 9.5}, True, set()),
    ("no_reset_no_eviction", {"a": 10.0, "b": 1.0}, False, set()),
    ("never_seen_is_left_to_the_keep_alive", {"a": 10.0, "b": None}, True, set()),
    ("never_evicts_itself", {"a": 1.0, "b": 10.0}, True, set()),
]


@pytest.mark.parametrize("agent_at,lost,want", [e[1:] for e in EVICT], ids=[e[0] for e in EVICT])
def test_evictable(agent_at, lost, want):
    assert evictable(("a", "b"), agent_at, 10.0, CFG.missed_s, me="a", peer_lost=lost) == frozenset(want)


EVICT_PROBED = [
    # id, b's record at, b's answer, peer lost, evicted
    ("refused_port_evicts_at_once", 9.9, GONE, True, {"b"}),
    ("refused_port_needs_a_reset", 9.9, GONE, False, set()),
    ("unanswered_and_late_evicts", 10.0 - CFG.probe_after_s - 0.01, SIL, True, {"b"}),
    ("unanswered_not_late_yet", 10.0 - CFG.probe_after_s + 0.01, SIL, True, set()),
    ("answered_waits_for_the_missed_heartbeat", 10.0 - CFG.probe_after_s - 0.01, ALIVE, True, set()),
    ("answered_missed_heartbeat_still_evicts", 10.0 - CFG.missed_s - 0.01, ALIVE, True, {"b"}),
    ("never_seen_is_left_to_the_keep_alive", None, GONE, True, set()),
]


@pytest.mark.parametrize("b_at,answer,lost,want", [e[1:] for e in EVICT_PROBED], ids=[e[0] for e in EVICT_PROBED])
def test_evictable_with_probe_answers(b_at, answer, lost, want):
    got = evictable(("a", "b"), {"a": 10.0, "b": b_at}, 10.0, CFG.missed_s, me="a", peer_lost=lost,
                    answers={"b": answer}, probe_after_s=CFG.probe_after_s)
    assert got == frozenset(want)


# ---- step times and the tracker --------------------------------------------------------------------

def test_step_times_skip_saves_busy_blocks_and_re_formations():
    st = StepTimes()
    for i, (step, phase) in enumerate([(1, S), (2, S), (3, S), (3, SV), (4, S), (5, S), (5, B), (6, S), (7, S)]):
        st.observe(step, phase, float(i))
    # 1->2, 2->3, 4->5, 6->7: one second each; the time spent saving or busy is no step time
    assert st.count == 4 and st.p99() == 1.0


def test_tracker_counts_a_record_read_again_as_no_news():
    tr = Tracker()
    tr.beat("n1", 1, 5, S, "w", beat=3, progress=2, now=1.0)
    tr.beat("n1", 1, 5, S, "w", beat=3, progress=2, now=9.0)  # the same record, read again
    tr.agent("n1", 7, 1.0)
    tr.agent("n1", 7, 9.0)
    (v,) = tr.views(9.0, "n0")
    assert (v.beat_at, v.progress_at, v.agent_at) == (1.0, 1.0, 1.0)
    tr.beat("n1", 1, 5, S, "w", beat=4, progress=2, now=10.0)  # beats, does not progress
    (v,) = tr.views(10.0, "n0")
    assert (v.beat_at, v.progress_at) == (10.0, 1.0)


def test_record_codec_round_trip_and_garbage():
    beats = [Progress(rank=3, local_rank=0, step=7, phase=A, beat=9, progress=4, where="x.py:1 f")]
    seq, got, name, probe = decode_record(encode_record("n1", 5, beats, "node-b", "10.0.0.7:4711"))
    assert (seq, name, probe) == (5, "node-b", "10.0.0.7:4711")
    assert decode_record(b'{"seq": 2, "ranks": []}').probe == ""  # an older agent's record: no probe address
    assert [(b.rank, b.step, b.phase, b.beat, b.progress, b.where) for b in got] == [(3, 7, A, 9, 4, "x.py:1 f")]
    assert decode_record(b"{not json") is None
    assert decode_record(b'{"seq": 1, "ranks": [{"rank": 0}]}') is None


# ---- the watch: two nodes over one store, a fake clock ---------------------------------------------

class DictStore:
    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v

    def check(self, ks):
        return all(k in self.d for k in ks)

    def get(self, k):
        return self.d[k]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _pair(store, clock):
    a = HangWatch(CFG, node_name="node-a", clock=clock)
    b = HangWatch(CFG, node_name="node-b", clock=clock)
    a.start_world(store, "A", ("A", "B"), thread=False)  # the test drives exchange() itself
    b.start_world(store, "B", ("A", "B"), thread=False)
    return a, b


def _tick(clock, a, b, *, a_worker=True, a_agent=True, b_agent=True, step=None):
    clock.t += CFG.heartbeat_interval_s
    _tick.n += 1
    s = step if step is not None else _tick.n
    if a_worker:
        a.on_progress(Progress(rank=0, local_rank=0, step=s, phase=S, beat=_tick.n, progress=_tick.n, where="t.py:1 m"))
    # b's worker waits in the collective once a's stops: it beats, no progress
    b.on_progress(Progress(rank=1, local_rank=0, step=s, phase=S, beat=_tick.n,
                           progress=_tick.n if a_worker else 10**6, where="t.py:1 m"))
    for w, on in ((a, a_agent), (b, b_agent)):
        if on:
            w.exchange()


_tick.n = 0


def _run_until_action(clock, a, b, *, only=("a", "b"), **kw):
    """Tick until both watches (those named in ``only``) acted; their first verdict and action each."""
    got = {}
    for _ in range(200):
        _tick(clock, a, b, **kw)
        for name, w in (("a", a), ("b", b)):
            v, act = w.check()
            if act is not None and name not in got:
                got[name] = (v, act)
        if set(only) <= set(got):
            return got.get("a"), got.get("b")
    raise AssertionError(f"no hang detected by {only}: {got}")


def test_watch_names_a_stopped_worker_and_its_agent_ends_it_then_quarantines_the_second_time():
    store, clock = DictStore(), Clock()
    a, b = _pair(store, clock)
    for _ in range(20):  # training
        _tick(clock, a, b)
        assert a.check()[1] is None and b.check()[1] is None
    stopped_at = clock.t
    (va, aa), (vb, ab) = _run_until_action(clock, a, b, a_worker=False, step=20)
    assert aa.act is HangAct.END_WORKERS and ab.act is HangAct.WATCH
    assert va.culprit.rank == 0 and va.culprit.node == "A" and va.why == "heartbeat_stopped_first"
    assert vb.culprit.rank == 0 and b.name_of(vb.culprit.node) == "node-a"
    assert clock.t - stopped_at >= CFG.min_s
    assert a.check()[1] is None  # once per world
    # the next world: the same node hangs again within hang.quarantine_s
    for w in (a, b):
        w.start_world(store, w.node_id, ("A", "B"), thread=False)
    for _ in range(20):
        _tick(clock, a, b)
    (_, aa), _ = _run_until_action(clock, a, b, a_worker=False, step=40)
    assert aa.act is HangAct.QUARANTINE


def test_watch_evicts_a_frozen_node_and_a_node_whose_agent_missed_a_heartbeat():
    store, clock = DictStore(), Clock()
    a, b = _pair(store, clock)
    for _ in range(20):
        _tick(clock, a, b)
    assert b.evict(("A", "B"), peer_lost=True) == frozenset()
    # a's agent publishes nothing (frozen): its own watch, were it to run, is blind and names nobody
    got_a, (vb, ab) = _run_until_action(clock, a, b, only=("b",), a_worker=False, a_agent=False, step=20)
    assert got_a is None
    assert ab.act is HangAct.ABORT and ab.evict == frozenset({"A"}) and vb.node_frozen
    assert b.evict(("A", "B"), peer_lost=True) == frozenset({"A"})
    assert b.evict(("A", "B"), peer_lost=False) == frozenset()
    assert store.check([PROGRESS_KEY + "B"])


def _settle(w, timeout=10.0):
    """Wait (real time) until no probe of ``w`` is in flight: the prober answers on its own threads."""
    import time as _t
    end = _t.monotonic() + timeout
    while w.prober._flight and _t.monotonic() < end:
        _t.sleep(0.002)


def _probed_pair(ticks):
    """Two watches over one store, a answering probes on a real port, trained ``ticks`` intervals."""
    clock = Clock()
    a, b = _pair(DictStore(), clock)
    assert a.serve_probes("127.0.0.1").startswith("127.0.0.1:")
    for _ in range(ticks):
        _tick(clock, a, b)
        _settle(b)
    return clock, a, b


def _frozen_until_b_acts(clock, a, b, ticks):
    """a frozen (its worker and agent silent): tick until b acts; b's (verdict, action), or None."""
    for _ in range(ticks):
        _tick(clock, a, b, a_worker=False, a_agent=False, step=20)
        _settle(b)
        v, act = b.check()
        if act is not None:
            return v, act
    return None


def test_watch_names_a_frozen_node_whose_agent_does_not_answer_before_frozen_s():
    """a freezes (agent and worker): b's probe of a's agent (a real port, a's address from a's record) gets no
    answer, so b aborts and evicts a once a's record is probe_after_s late - not frozen_s."""
    clock, a, b = _probed_pair(20)
    try:
        assert b.check()[1] is None
        b.prober._probe = lambda host, port, timeout_s: Answer.SILENT  # a's agent stopped: nobody answers
        frozen_at = clock.t
        got = _frozen_until_b_acts(clock, a, b, 40)
        assert got is not None
        v, act = got
        assert v.why == "agent_unanswered" and v.node_frozen and act.act is HangAct.ABORT and act.evict == frozenset({"A"})
        assert clock.t - frozen_at < CFG.frozen_s  # before the silence bound
        assert b.evict(("A", "B"), peer_lost=True) == frozenset({"A"})
    finally:
        a.close()
        b.close()


def test_an_agent_that_answered_and_froze_afterwards_is_asked_again_and_named():
    """a's record is late and its agent still answers (alive: not named, not even at frozen_s); then it stops
    answering: the answer ages, a is asked again and named frozen."""
    clock, a, b = _probed_pair(20)
    try:
        answer = {"now": Answer.ALIVE}
        b.prober._probe = lambda host, port, timeout_s: answer["now"]
        for _ in range(int(CFG.frozen_s / CFG.heartbeat_interval_s) + 4):  # past frozen_s: alive all the same
            _tick(clock, a, b, a_worker=False, a_agent=False, step=20)
            _settle(b)
            assert b.check()[1] is None
        answer["now"] = Answer.SILENT
        got = _frozen_until_b_acts(clock, a, b, 6)
        assert got is not None and got[0].why == "agent_unanswered" and got[1].act is HangAct.ABORT
    finally:
        a.close()
        b.close()


def test_watch_evicts_at_once_after_a_reset_when_the_lost_peers_port_refuses():
    """a's agent dies (its probe port closes) right after a record: after the reset b asks, the port refuses,
    and the next eviction poll removes a with no missed heartbeat; an agent that answers is not removed."""
    clock, a, b = _probed_pair(5)
    try:
        assert b.evict(("A", "B"), peer_lost=True) == frozenset()  # asks; a answers: alive
        _settle(b)
        assert b.evict(("A", "B"), peer_lost=True) == frozenset()
        _settle(b)
        a._probe_server.close()  # the agent died: nobody listens on its port
        clock.t += 0.1
        b.evict(("A", "B"), peer_lost=True)  # the reset: ask
        _settle(b)
        assert b.evict(("A", "B"), peer_lost=True) == frozenset({"A"})
        assert b.evict(("A", "B"), peer_lost=False) == frozenset()  # no reset, no eviction
    finally:
        a.close()
        b.close()


def test_a_hang_with_no_culprit_counts_against_no_node():
    """Every node restarts its workers when nobody can be named; none of them moves towards quarantine."""
    store, clock = DictStore(), Clock()
    a, b = _pair(store, clock)
    for _ in range(20):
        _tick(clock, a, b)
    for _ in range(int(CFG.min_s / CFG.heartbeat_interval_s) + 4):  # both beat, neither progresses
        clock.t += CFG.heartbeat_interval_s
        _tick.n += 1
        for w, r in ((a, 0), (b, 1)):
            w.on_progress(Progress(rank=r, local_rank=0, step=20, phase=S, beat=_tick.n, progress=7, where="t.py:1 m"))
            w.exchange()
    (va, aa), (vb, ab) = (a.check(), b.check())
    assert va.hung and vb.hung and va.culprit is None and vb.culprit is None
    assert aa.act is HangAct.END_WORKERS and ab.act is HangAct.END_WORKERS
    assert a.hangs == [] and b.hangs == []


def test_a_node_cut_off_from_the_store_names_nobody_and_evicts_nobody_on_its_stale_view():
    """A partition cuts b off from the store (its exchanges hang) while a's agent goes on elsewhere (its
    record under this world's prefix stays unchanged, as after a re-formation without b). While cut off,
    and right after the store answers again, b's view of a is no evidence: no verdict, no eviction. Only
    silence b could observe counts."""
    store, clock = DictStore(), Clock()
    a, b = _pair(store, clock)
    for _ in range(20):
        _tick(clock, a, b)
    for _ in range(3 * int(CFG.min_s / CFG.heartbeat_interval_s)):  # cut off: neither record moves in b's view
        _tick(clock, a, b, a_worker=False, a_agent=False, b_agent=False, step=20)
        v, act = b.check()
        assert not v.hung and act is None
        assert b.evict(("A", "B"), peer_lost=True) == frozenset()
    clock.t += CFG.heartbeat_interval_s
    b.exchange()  # the store answers again; a's record is as it was
    assert b.check()[1] is None and b.evict(("A", "B"), peer_lost=True) == frozenset()
    for _ in range(int(CFG.min_s / CFG.heartbeat_interval_s) + 4):  # now b sees a stay silent: evidence
        clock.t += CFG.heartbeat_interval_s
        b.on_progress(Progress(rank=1, local_rank=0, step=20, phase=S, beat=clock.t, progress=7, where="t.py:1 m"))
        b.exchange()
    v, act = b.check()
    assert v.hung and v.node_frozen and act.act is HangAct.ABORT and act.evict == frozenset({"A"})


def test_a_standby_beat_read_from_a_peer_is_no_rank_and_never_the_culprit():
    """Chaos bench, issue 37 (hang_worker twice): b restarted its worker, which waited warm as a standby
    (rank -1, parked) and published that beat; a read b's record while it still held it, right after the
    world re-formed. A standby is no rank of the world (on_progress drops local ones): read from a peer's
    record it must be dropped too, else it stays in the tracker, never beats again, and is named
    "heartbeat_stopped_first" when a real rank hangs, so no agent ends the hung worker."""
    store, clock = DictStore(), Clock()
    a, b = _pair(store, clock)
    for _ in range(20):
        _tick(clock, a, b)
    b.between_worlds()  # b's worker restarts and waits warm, a standby
    clock.t += CFG.heartbeat_interval_s
    b.on_progress(Progress(rank=-1, local_rank=0, step=0, phase=P, beat=1, progress=0, where="reform.py:141 arrive"))
    b.exchange()
    a.start_world(store, "A", ("A", "B"), thread=False)  # the new world; b's record still holds the standby beat
    a.exchange()
    b.start_world(store, "B", ("A", "B"), thread=False)
    for _ in range(20):
        _tick(clock, a, b)
    (va, aa), (vb, ab) = _run_until_action(clock, a, b, a_worker=False, step=40)
    assert aa.act is HangAct.END_WORKERS and ab.act is HangAct.WATCH
    assert (va.culprit.rank, va.culprit.node) == (0, "A") and (vb.culprit.rank, vb.culprit.node) == (0, "A")


# ---- O(N): readers publish verdicts, the others read them (issue 40) -------------------------------

_STOPPED_HERE = HangVerdict(True, 1.0, 0.5, rv(3, node="me"), "process_stopped")
_SILENT_HERE = HangVerdict(True, 7.0, 6.0, rv(3, node="me"), "heartbeat_stopped_first")
_PUBLISHED = HangVerdict(True, 7.0, 6.0, rv(9, node="far"), "heartbeat_stopped_first")
_QUIET = HangVerdict(False, 1.0, 6.0)
PICKS = [
    ("own_stopped_rank_first", _STOPPED_HERE, _PUBLISHED, _STOPPED_HERE),
    ("own_stopped_rank_without_a_verdict", _STOPPED_HERE, None, _STOPPED_HERE),
    ("a_partial_view_names_nobody_else", _SILENT_HERE, _QUIET, _QUIET),
    ("the_published_verdict", _QUIET, _PUBLISHED, _PUBLISHED),
    ("no_fresh_verdict_no_verdict", _SILENT_HERE, None, HangVerdict(False, 7.0, 6.0)),
    ("stopped_elsewhere_is_the_readers_call", HangVerdict(True, 1.0, 0.5, rv(3, node="x"), "process_stopped"), _QUIET, _QUIET),
]


@pytest.mark.parametrize("local,published,want", [p[1:] for p in PICKS], ids=[p[0] for p in PICKS])
def test_pick_verdict(local, published, want):
    assert pick_verdict(local, published, "me") == want


def test_verdict_codec_round_trip_on_the_readers_clock_and_garbage():
    v = HangVerdict(True, 7.25, 6.0, rv(9, node="far", step=12, where="t.py:3 f", beat_at=90.0), "heartbeat_stopped_first", True)
    seq, got, missed = decode_verdict(encode_verdict(4, v, 100.0, {"far": 10.0}), 500.0)
    assert seq == 4 and missed == {"far": 10.0}
    assert (got.hung, got.stalled_s, got.why, got.node_frozen) == (True, 7.25, "heartbeat_stopped_first", True)
    assert (got.culprit.rank, got.culprit.node, got.culprit.step, got.culprit.where, got.culprit.beat_at) == (9, "far", 12, "t.py:3 f", 490.0)
    assert decode_verdict(encode_verdict(1, HangVerdict(False), 0.0, {}), 0.0)[1].culprit is None
    assert decode_verdict(b"{", 0.0) is None and decode_verdict(b'{"seq": 1}', 0.0) is None


class CountingStore(DictStore):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def check(self, ks):
        self.reads += 1
        return super().check(ks)

    def get(self, k):
        self.reads += 1
        return super().get(k)

    def multi_get(self, ks):
        self.reads += 1
        return [self.d[k] for k in ks]


def _world(store, clock, n):
    names = [f"N{i}" for i in range(n)]
    ws = [HangWatch(CFG, node_name=f"node-{i}", clock=clock) for i in range(n)]
    for w, m in zip(ws, names):
        w.start_world(store, m, tuple(names), thread=False)
    return ws


def _tick_all(clock, ws, *, stopped=None, frozen=(), step=None):
    """Every node's rank beats; rank ``stopped`` neither beats nor progresses (the others wait in the
    collective: they beat, no progress); the agents in ``frozen`` publish nothing."""
    clock.t += CFG.heartbeat_interval_s
    _tick.n += 1
    for r, w in enumerate(ws):
        if r != stopped and r not in frozen:
            w.on_progress(Progress(rank=r, local_rank=0, step=step if step is not None else _tick.n, phase=S, beat=_tick.n,
                                   progress=_tick.n if stopped is None else 10**6, where="t.py:1 m"))
    for r, w in enumerate(ws):
        if r not in frozen:
            w.exchange()


def test_only_the_readers_read_every_record_the_others_read_two_verdicts():
    store, clock = CountingStore(), Clock()
    ws = _world(store, clock, 8)
    assert ws[0].readers() == ("N0", "N1") and _world(DictStore(), clock, 3)[0].readers() == ("N0", "N1", "N2")
    for _ in range(10):
        _tick_all(clock, ws)
    before = store.reads
    _tick_all(clock, ws)
    # per interval: each reader one check + one multi_get of the 7 others' records; each of the 6 others one
    # check + one multi_get of the 2 verdicts (a reader with no other reader's verdict to read has one key less)
    assert store.reads - before == 2 * 2 + 6 * 2
    assert all(VERDICT_KEY + r in store.d for r in ("N0", "N1"))
    assert all(w.check()[1] is None for w in ws)


def test_a_culprit_far_away_is_named_on_every_node_through_the_readers_verdict():
    store, clock = DictStore(), Clock()
    ws = _world(store, clock, 6)
    for _ in range(20):
        _tick_all(clock, ws)
    got = {}
    for _ in range(100):
        _tick_all(clock, ws, stopped=5, step=20)
        for i, w in enumerate(ws):
            v, act = w.check()
            if act is not None:
                got[i] = (v, act)
        if len(got) == 6:
            break
    assert got[5][1].act is HangAct.END_WORKERS and got[5][0].culprit.node == "N5"
    assert all(got[i][1].act is HangAct.WATCH and got[i][0].culprit.node == "N5" for i in range(5))


def test_a_frozen_node_is_aborted_and_evicted_by_every_node_and_both_readers_frozen_fall_back_to_reading_all():
    store, clock = DictStore(), Clock()
    ws = _world(store, clock, 6)
    for _ in range(20):
        _tick_all(clock, ws)
    assert ws[3].evict(tuple(w.node_id for w in ws), peer_lost=True) == frozenset()
    got = {}
    for _ in range(100):  # node 4 frozen: its agent and its rank silent
        _tick_all(clock, ws, stopped=4, frozen=(4,), step=20)
        for i, w in enumerate(ws):
            if i != 4 and (a := w.check()[1]) is not None:
                got[i] = a
        if len(got) == 5:
            break
    assert all(a.act is HangAct.ABORT and a.evict == frozenset({"N4"}) for a in got.values())
    members = tuple(w.node_id for w in ws)
    assert ws[3].evict(members, peer_lost=True) == frozenset({"N4"})
    # both readers frozen: no fresh verdict past hang.stale_s, so the others read every record themselves
    ws = _world(store, clock, 6)
    for _ in range(20):
        _tick_all(clock, ws)
    got = {}
    for _ in range(100):
        _tick_all(clock, ws, stopped=0, frozen=(0, 1), step=40)
        for i in range(2, 6):
            if (a := ws[i].check()[1]) is not None:
                got[i] = a
        if len(got) == 4:
            break
    assert all(a.act is HangAct.ABORT and a.evict in (frozenset({"N0"}), frozenset({"N1"})) for a in got.values())
    assert ws[3].evict(members, peer_lost=True) == frozenset({"N0", "N1"})


def test_at_scale_a_dead_agent_found_by_the_readers_probe_is_evicted_by_a_node_that_reads_only_verdicts():
    """Six nodes: only N0 and N1 read every record (and probe). N4's agent dies (its port closes) right after
    a record; 0.7 s later (under the missed heartbeat, 1 s) the readers have asked it, its port refused, and
    their verdict names it missed: N3, which reads only verdicts, evicts it after its reset."""
    store, clock = DictStore(), Clock()
    ws = _world(store, clock, 6)
    for w in ws:
        w.serve_probes("127.0.0.1")
    try:
        for _ in range(5):
            _tick_all(clock, ws)
        for w in ws[:2]:
            w.exchange()  # the readers read N4's last record (published after theirs in the tick)
            _settle(w)
        members = tuple(w.node_id for w in ws)
        assert ws[3].evict(members, peer_lost=True) == frozenset()
        ws[4]._probe_server.close()  # N4's agent is gone
        clock.t += 0.6  # past ask_after_s (one interval), N4 published nothing since
        for w in (ws[0], ws[1]):
            w.exchange()
            _settle(w)
        clock.t += 0.1
        for w in ws[:4] + ws[5:]:
            w.exchange()
        assert 0.7 < CFG.missed_s
        assert ws[3].evict(members, peer_lost=True) == frozenset({"N4"})
        assert ws[3].evict(members, peer_lost=False) == frozenset()
    finally:
        for w in ws:
            w.close()
