"""The agent's policy as a table: observation -> action. No processes, no clocks."""

import pytest

import itertools

from trainguard.agent.decisions import PARK_PRECEDENCE, Act, Asked, Observation, decide, park_reason
from trainguard.contract.protocol import EXIT_RESIZE, ParkReason as P, WorkerStatus as W, classify_exit

R = EXIT_RESIZE

CASES = [
    # (name, observation, expected act, expected reason, consumes a restart)
    ("healthy idle", Observation(W.HEALTHY, remaining_restarts=3), Act.WAIT, "", False),
    ("all succeeded", Observation(W.EXITED, (0, 0)), Act.SUCCEED, "workers_finished", False),
    ("crash consumes", Observation(W.EXITED, (1, -15), remaining_restarts=2), Act.RESTART, "worker_failure", True),
    ("sigkill is a crash", Observation(W.EXITED, (-9,), remaining_restarts=1), Act.RESTART, "worker_failure", True),
    ("crash, none left", Observation(W.EXITED, (1,), remaining_restarts=0), Act.FAIL, "max_restarts_exhausted", False),
    ("unknown state is a crash", Observation(W.UNKNOWN, remaining_restarts=1), Act.RESTART, "worker_failure", True),
    ("resize never consumes", Observation(W.EXITED, (R,), remaining_restarts=0), Act.RESTART, "resize", False),
    ("resize + terminated siblings", Observation(W.EXITED, (R, -15, -15), remaining_restarts=0), Act.RESTART, "resize", False),
    ("resize we asked for", Observation(W.EXITED, (R, R), asked=Asked.RESIZE), Act.RESTART, "resize", False),
    ("drain asked, not leaving, resize exit", Observation(W.EXITED, (R,), asked=Asked.DRAIN), Act.RESTART, "drain", False),
    ("resize mixed with crash", Observation(W.EXITED, (R, 1), remaining_restarts=1), Act.RESTART, "worker_failure", True),
    ("drained node leaves", Observation(W.EXITED, (R,), draining=True, asked=Asked.DRAIN), Act.LEAVE, "drained", False),
    ("drained, workers died", Observation(W.EXITED, (-15,), draining=True), Act.LEAVE, "drained_workers_failed", False),
    ("success wins over drain", Observation(W.EXITED, (0,), draining=True), Act.SUCCEED, "workers_finished", False),
    ("notice, API workers", Observation(W.HEALTHY, draining=True, api_workers=True), Act.ASK_DRAIN, "notice", False),
    ("notice, plain script", Observation(W.HEALTHY, draining=True), Act.TERMINATE, "notice", False),
    ("drain asked, waiting", Observation(W.HEALTHY, draining=True, asked=Asked.DRAIN, api_workers=True), Act.WAIT, "draining", False),
    ("drain deadline passed", Observation(W.HEALTHY, draining=True, asked=Asked.DRAIN, drain_deadline_passed=True, api_workers=True),
     Act.TERMINATE, "drain_deadline_passed", False),
    ("scale-up, API workers", Observation(W.HEALTHY, nodes_waiting=1, api_workers=True), Act.ASK_RESIZE, "scale_up", False),
    ("scale-up asked, waiting", Observation(W.HEALTHY, nodes_waiting=1, api_workers=True, asked=Asked.RESIZE), Act.WAIT, "", False),
    ("resize asked, overdue", Observation(W.HEALTHY, nodes_waiting=1, api_workers=True, asked=Asked.RESIZE, resize_overdue=True),
     Act.RESTART, "resize_overdue", False),
    ("overdue ignored unless resize asked", Observation(W.HEALTHY, nodes_waiting=1, api_workers=True, resize_overdue=True),
     Act.ASK_RESIZE, "scale_up", False),
    ("scale-up, plain script", Observation(W.HEALTHY, nodes_waiting=1), Act.RESTART, "scale_up", False),
    ("drain beats scale-up", Observation(W.HEALTHY, nodes_waiting=2, draining=True, api_workers=True), Act.ASK_DRAIN, "notice", False),
    ("peer drained plain scripts", Observation(W.EXITED, (1,), peer_draining=True, remaining_restarts=0), Act.RESTART, "peer_drain", False),
    ("peer drained, API workers crash", Observation(W.EXITED, (1,), peer_draining=True, api_workers=True, remaining_restarts=1),
     Act.RESTART, "worker_failure", True),
]


@pytest.mark.parametrize("name,obs,act,reason,consume", CASES, ids=[c[0] for c in CASES])
def test_decide(name, obs, act, reason, consume):
    d = decide(obs)
    assert d.act is act
    assert d.reason == reason
    assert d.consume_restart is consume


REJOIN_CASES = [
    # (name, observation, whether the restart leaves the round at once and rejoins warm)
    ("in place, 2 nodes", Observation(W.EXITED, (-9,), remaining_restarts=1, reform_in_place=True, world_nodes=2), True),
    ("in place, alone", Observation(W.EXITED, (-9,), remaining_restarts=1, reform_in_place=True, world_nodes=1), False),
    ("restart mode, 2 nodes", Observation(W.EXITED, (-9,), remaining_restarts=1, world_nodes=2), False),
    ("unknown state, in place, 3 nodes", Observation(W.UNKNOWN, remaining_restarts=1, reform_in_place=True, world_nodes=3), True),
    ("resize exit never rejoins", Observation(W.EXITED, (R,), reform_in_place=True, world_nodes=2), False),
    ("member lost restart never rejoins", Observation(W.HEALTHY, member_lost=True, reform_in_place=True, world_nodes=2), False),
]


@pytest.mark.parametrize("name,obs,rejoin", REJOIN_CASES, ids=[c[0] for c in REJOIN_CASES])
def test_a_worker_failure_in_a_world_that_re_forms_in_place_leaves_and_rejoins_warm(name, obs, rejoin):
    d = decide(obs)
    assert d.act is Act.RESTART
    assert d.rejoin is rejoin


PARK_CASES = [
    # (the local workers' reasons, the node's re-formation reason)
    ((), None),
    ((P.DRAIN,), P.DRAIN),
    ((P.DRAIN, P.PEER_LOST), P.PEER_LOST),
    ((P.PEER_LOST, P.RESIZE), P.RESIZE),
    ((P.RESIZE, P.STANDBY), P.STANDBY),
    ((P.DRAIN, P.DRAIN, P.PEER_LOST, P.DRAIN), P.PEER_LOST),
    ((P.STANDBY, P.PEER_LOST, P.DRAIN, P.RESIZE), P.STANDBY),
]


@pytest.mark.parametrize("reasons,expected", PARK_CASES)
def test_park_reason_precedence(reasons, expected):
    assert park_reason(reasons) is expected
    assert park_reason(reversed(reasons)) is expected


def test_park_precedence_names_every_reason_once_and_keeps_the_old_rule():
    assert sorted(PARK_PRECEDENCE) == sorted(P)
    for n in range(1, len(P) + 1):  # the supervisor's former rule: the largest value
        for reasons in itertools.combinations(P, n):
            assert park_reason(reasons) is P(max(r.value for r in reasons))


@pytest.mark.parametrize("reason", [None, *P])
def test_reform_reason_is_the_park_reason(reason):
    d = decide(Observation(W.HEALTHY, nproc=2, parked=2, park_reason=reason))
    assert d.act is Act.REFORM and d.reason == (reason.value if reason else "reform")


@pytest.mark.parametrize("codes,kind", [
    ([], "success"), ([0, 0], "success"), ([75], "resize"), ([75, -15], "resize"), ([75, 0], "resize"),
    ([75, 1], "crash"), ([-15], "crash"), ([1], "crash"), ([-9, 75], "resize"), ([-9], "crash"),
])
def test_classify_exit_codes(codes, kind):
    assert classify_exit(codes) == kind
