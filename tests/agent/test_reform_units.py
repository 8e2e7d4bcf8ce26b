"""In-place re-formation, the agent's pure parts: the planned-membership rule, the decision table
rows and the protocol messages (the worker's side: tests/runtime/test_reform.py)."""

import pytest

from trainguard.agent.decisions import Act, Asked, Observation, decide
from trainguard.agent.elastic import Plan, planned_complete
from trainguard.agent.elastic_join import waits_for_leavers
from trainguard.contract import protocol as proto

W = proto.WorkerStatus

PLAN_CASES = [
    # (name, members, leaving, participants, waiting, min, max, complete)
    ("drain 2->1: the survivor alone", {"a", "b"}, {"b"}, {"a"}, set(), 1, 3, True),
    ("drain 3->2: one survivor not there yet", {"a", "b", "c"}, {"c"}, {"a"}, set(), 1, 3, False),
    ("drain 3->2: both survivors", {"a", "b", "c"}, {"c"}, {"a", "b"}, set(), 1, 3, True),
    ("scale-up 1->2: the joiner still waiting", {"a"}, set(), {"a"}, {"j"}, 1, 3, False),
    ("scale-up 1->2: the joiner joined", {"a"}, set(), {"a", "j"}, set(), 1, 3, True),
    ("a newcomer that was not planned counts too", {"a", "b"}, {"b"}, {"a"}, {"x"}, 1, 3, False),
    ("below min_nodes never completes early", {"a", "b"}, {"b"}, {"a"}, set(), 2, 3, False),
    ("above max_nodes never completes", {"a"}, set(), {"a", "j", "k"}, set(), 1, 2, False),
    ("everyone leaving: nothing to complete", {"a"}, {"a"}, set(), set(), 1, 2, False),
]


@pytest.mark.parametrize("name,members,leaving,parts,waiting,lo,hi,want", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_planned_complete(name, members, leaving, parts, waiting, lo, hi, want):
    assert planned_complete(Plan(frozenset(members), frozenset(leaving)), parts, waiting, lo, hi) is want


LOST_CASES = [
    # (name, members, alive (heartbeats in the state), participants, waiting, complete)
    ("the lost node's heartbeat expired, both survivors joined", {"a", "b", "c"}, {"a", "b"}, {"a", "b"}, set(), True),
    ("not expired yet: wait for it (or the last call)", {"a", "b", "c"}, {"a", "b", "c"}, {"a", "b"}, set(), False),
    ("a live survivor not joined yet", {"a", "b", "c"}, {"a", "b"}, {"a"}, set(), False),
    ("a newcomer waiting joins this round", {"a", "b", "c"}, {"a", "b", "j"}, {"a", "b"}, {"j"}, False),
    ("... and completes it once in", {"a", "b", "c"}, {"a", "b", "j"}, {"a", "b", "j"}, set(), True),
]


@pytest.mark.parametrize("name,members,alive,parts,waiting,want", LOST_CASES, ids=[c[0] for c in LOST_CASES])
def test_planned_complete_after_a_loss_expects_the_live_members(name, members, alive, parts, waiting, want):
    plan = Plan(frozenset(members), lost=True)
    assert planned_complete(plan, parts, waiting, 1, 3, alive=alive) is want
    # A plan for a planned change ignores the heartbeats: every member not leaving is expected.
    assert planned_complete(Plan(frozenset(members)), parts, waiting, 1, 3, alive=alive) is (want and alive >= members)


LEAVER_CASES = [
    # (name, plan (members, leaving, round) or None, state round, complete, participants, fast poll)
    ("drain 2->1: the leaver still in the round it leaves", ({"a", "b"}, {"b"}, 0), 0, True, {"b"}, True),
    ("drain 3->1: both leavers still in it", ({"a", "b", "c"}, {"b", "c"}, 4), 4, True, {"b", "c"}, True),
    ("drain 3->2: a survivor still in it too (its own re-formation)", ({"a", "b", "c"}, {"c"}, 0), 0, True,
     {"b", "c"}, False),
    ("the leaver left: the next round is forming", ({"a", "b"}, {"b"}, 0), 1, False, {"a"}, False),
    ("nobody left in it (the round advances at the next write)", ({"a", "b"}, {"b"}, 0), 0, True, set(), False),
    ("another round than the plan's", ({"a", "b"}, {"b"}, 0), 3, True, {"b"}, False),
    ("no leaver announced (a scale-up, a loss)", ({"a", "b"}, set(), 0), 0, True, {"b"}, False),
    ("no plan (torch's last-call rule)", None, 0, True, {"b"}, False),
]


@pytest.mark.parametrize("name,plan,round_,complete,parts,want", LEAVER_CASES, ids=[c[0] for c in LEAVER_CASES])
def test_a_re_formation_polls_fast_only_while_announced_leavers_hold_it_up(name, plan, round_, complete, parts, want):
    p = None if plan is None else Plan(frozenset(plan[0]), frozenset(plan[1]), round=plan[2])
    assert waits_for_leavers(p, round_, complete, parts) is want


DECISIONS = [
    ("all local workers parked -> reform", Observation(W.HEALTHY, nproc=2, parked=2, park_reason=proto.ParkReason.DRAIN),
     Act.REFORM, "drain"),
    ("one of two parked -> wait for the other", Observation(W.HEALTHY, nproc=2, parked=1, park_reason=proto.ParkReason.DRAIN),
     Act.WAIT, ""),
    ("parked while this node drains -> leave", Observation(W.HEALTHY, nproc=1, parked=1, draining=True, asked=Asked.DRAIN),
     Act.LEAVE, "drained"),
    ("a member lost while ours run on -> restart, no restart consumed",
     Observation(W.HEALTHY, member_lost=True, api_workers=True), Act.RESTART, "member_lost"),
    ("the member lost had announced its drain, ours still run on -> the same restart, named a peer drain",
     Observation(W.HEALTHY, member_lost=True, peer_draining=True), Act.RESTART, "peer_drain"),
    ("a member gone, ours re-form in place -> ask them back (a join waiting for it is called off)",
     Observation(W.HEALTHY, member_gone=True, api_workers=True, reform_in_place=True), Act.ASK_RESIZE, "member_lost"),
    ("a member gone, restart mode -> wait out the grace period",
     Observation(W.HEALTHY, member_gone=True, api_workers=True), Act.WAIT, ""),
    ("a member gone, the workers asked already -> wait for them to park",
     Observation(W.HEALTHY, member_gone=True, api_workers=True, reform_in_place=True, asked=Asked.RESIZE), Act.WAIT, ""),
    ("a member gone while this node drains -> the drain goes on",
     Observation(W.HEALTHY, member_gone=True, api_workers=True, reform_in_place=True, draining=True), Act.ASK_DRAIN,
     "notice"),
    ("emergency committed -> leave without waiting for the exit",
     Observation(W.HEALTHY, draining=True, asked=Asked.DRAIN, api_workers=True, emergency_committed=True), Act.LEAVE, "drained"),
]


@pytest.mark.parametrize("name,obs,act,reason", DECISIONS, ids=[d[0] for d in DECISIONS])
def test_reform_decisions(name, obs, act, reason):
    d = decide(obs)
    assert (d.act, d.reason) == (act, reason)
    assert not d.consume_restart


@pytest.mark.parametrize("msg", [
    proto.Parked(rank=3, local_rank=1, step=17, reason=proto.ParkReason.PEER_LOST),
    proto.Parked(rank=-1, local_rank=0, step=0, reason=proto.ParkReason.STANDBY),
    proto.Reform(rank=1, world_size=3, local_rank=0, local_world_size=1, master_addr="10.0.0.2", master_port=29500,
                 round=7, group_rank=1, nodes=3),
    proto.CheckpointNow(why="aws_rebalance"),
    proto.Joined(rank=2, local_rank=0, round=9),
    proto.Restored(step=5, rank=0, kind=proto.CheckpointKind.EMERGENCY),
])
def test_messages_round_trip(msg):
    assert proto.decode(proto.encode(msg)) == msg


@pytest.mark.parametrize("line,where", [
    (b'{"op": "reform", "rank": 3, "world_size": 3, "local_rank": 0, "local_world_size": 1, "master_addr": "h", '
     b'"master_port": 1, "round": 1}', "rank"),
    (b'{"op": "reform", "rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1, "master_addr": "h", '
     b'"master_port": 0, "round": 1}', "master_port"),
    (b'{"op": "parked", "rank": 0, "local_rank": 0, "step": 1, "reason": "bored"}', "reason"),
])
def test_bad_messages_name_the_field(line, where):
    with pytest.raises(proto.ProtocolError, match=where):
        proto.decode(line)


def test_runtime_env_round_trip_with_reform_fields():
    env = proto.RuntimeEnv(job_id="j", reform=True, reform_timeout_s=30.0, standby=True, inject_fault="reform:/x")
    back = proto.RuntimeEnv.from_env(env.to_env())
    assert (back.reform, back.reform_timeout_s, back.standby, back.inject_fault) == (True, 30.0, True, "reform:/x")
