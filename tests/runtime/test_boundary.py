"""The step-boundary agreement as a table: the flags each rank packs, the world's MAX of them, and
what a rank does with it (``decide_boundary``). No process group: the rows are the cases the
runtime's ``_act`` carried out before it only executed the decision."""

from __future__ import annotations

import itertools

import pytest

from trainguard.contract.protocol import StopReason as S
from trainguard.runtime.boundary import MAX_STRIDE, BoundaryAct as A, BoundaryDecision, Flags, SaveAsk as Save, decide_boundary
from trainguard.strategies.base import ReformState as R

P, N = Save.PERIODIC, Save.NOTICE


def world(*ranks: Flags) -> Flags:
    """What every rank reads after the MAX all-reduce of the ranks' packed flags."""
    return Flags.unpack([max(col) for col in zip(*(f.pack() for f in ranks))])


@pytest.mark.parametrize("flags", [
    Flags(),
    Flags(stop=S.DRAIN, save=N, deadline=1_790_000_000.125, busy=True, overlapped=True, stride=7, memory_every=3),
    Flags(stop=S.RESIZE, save=P, blocking=True, stride=MAX_STRIDE, memory_every=1),
])
def test_pack_unpack_round_trip(flags):
    assert len(flags.pack()) == Flags.WIDTH
    assert Flags.unpack(flags.pack()) == flags


def test_the_max_of_packed_flags_is_what_the_world_agrees():
    a = Flags(stop=S.RESIZE, save=P, deadline=2000.5, overlapped=True, stride=8, memory_every=2)
    b = Flags(stop=S.DRAIN, deadline=1000.25, busy=True, blocking=True, stride=3, memory_every=5)
    c = Flags(save=N, overlapped=True, stride=12, memory_every=1)
    assert world(a, b, c) == Flags(stop=S.DRAIN, save=N, deadline=1000.25, busy=True, overlapped=True, blocking=True,
                                   stride=3, memory_every=5)  # the earliest deadline, the smallest stride
    assert world(Flags(), Flags(deadline=5.0)).deadline == 5.0  # a rank without a deadline never wins
    assert world(Flags(), Flags()).deadline is None


def decide(agreed: Flags, mine: S = S.NONE, *, in_place: bool = False, state: R = R.REPLICATED, defer: bool = True,
           deferred: bool = False, mixed: bool = False) -> BoundaryDecision:
    return decide_boundary(agreed, mine=mine, reform_in_place=in_place, reform_state=state, defer_when_busy=defer,
                           save_deferred=deferred, mixed=mixed)


CASES = [
    # (name, agreed flags, decide() options, act, save, save still owed afterwards)
    ("nothing agreed", Flags(), {}, A.CONTINUE, Save.NONE, False),
    ("periodic save due", Flags(save=P), {}, A.CONTINUE, P, False),
    ("periodic save while one persists: deferred", Flags(save=P, busy=True), {}, A.CONTINUE, Save.NONE, True),
    ("when_busy wait: taken anyway", Flags(save=P, busy=True), {"defer": False}, A.CONTINUE, P, False),
    ("out-of-cycle save is never deferred", Flags(save=N, busy=True), {}, A.CONTINUE, N, False),
    ("owed save, none agreed: still owed", Flags(), {"deferred": True}, A.CONTINUE, Save.NONE, True),
    ("owed save, still busy: still owed", Flags(save=P, busy=True), {"deferred": True}, A.CONTINUE, Save.NONE, True),
    ("owed save taken", Flags(save=P), {"deferred": True}, A.CONTINUE, P, False),
    ("out-of-cycle save pays the owed one", Flags(save=N, busy=True), {"deferred": True}, A.CONTINUE, N, False),
    # stops, restarting the world
    ("resize, workers restart", Flags(stop=S.RESIZE), {}, A.STOP, Save.NONE, False),
    ("drain, workers restart", Flags(stop=S.DRAIN, save=P), {}, A.STOP, P, False),
    ("in place, this node drains: it leaves", Flags(stop=S.DRAIN, save=P), {"in_place": True, "mine": S.DRAIN},
     A.STOP, P, False),
    ("in place, this node drains, nothing else due", Flags(stop=S.DRAIN), {"in_place": True, "mine": S.DRAIN},
     A.STOP, Save.NONE, False),
    # stops survived in place
    ("in place, a peer drains", Flags(stop=S.DRAIN), {"in_place": True}, A.SURVIVE, Save.NONE, False),
    ("in place, a peer drains: the emergency save covers the periodic one", Flags(stop=S.DRAIN, save=P),
     {"in_place": True}, A.SURVIVE, Save.NONE, False),
    ("in place, resize, replicated state: periodic save first", Flags(stop=S.RESIZE, save=P), {"in_place": True},
     A.SURVIVE, P, False),
    ("in place, resize, checkpoint state: its resize save covers it", Flags(stop=S.RESIZE, save=P),
     {"in_place": True, "state": R.CHECKPOINT}, A.SURVIVE, Save.NONE, False),
    ("in place, resize asked here", Flags(stop=S.RESIZE), {"in_place": True, "mine": S.RESIZE}, A.SURVIVE,
     Save.NONE, False),
    ("in place, resize, save deferred", Flags(stop=S.RESIZE, save=P, busy=True), {"in_place": True}, A.SURVIVE,
     Save.NONE, True),
]


@pytest.mark.parametrize("name,agreed,opts,act,save,owed", CASES, ids=[c[0] for c in CASES])
def test_decide_boundary(name, agreed, opts, act, save, owed):
    kw = dict(opts)
    d = decide(agreed, kw.pop("mine", S.NONE), **kw)
    assert (d.act, d.save, d.save_deferred) == (act, save, owed)
    assert (d.stop, d.deadline) == (agreed.stop, agreed.deadline)


@pytest.mark.parametrize("proposed,agreed", [(-3, 1), (0, 1), (1, 1), (5, 5), (MAX_STRIDE, MAX_STRIDE),
                                             (MAX_STRIDE + 1, MAX_STRIDE)])
def test_the_stride_is_clamped(proposed, agreed):
    assert decide(Flags(stride=proposed)).stride == agreed


@pytest.mark.parametrize("proposed,agreed", [(0, 1), (1, 1), (4, 4)])
def test_the_snapshot_interval_is_at_least_one(proposed, agreed):
    assert decide(Flags(memory_every=proposed)).memory_every == agreed


@pytest.mark.parametrize("overlapped,blocking,before", list(itertools.product([False, True], repeat=3)))
def test_ranks_configured_apart_agree_blocking_for_good(overlapped, blocking, before):
    d = decide(Flags(overlapped=overlapped, blocking=blocking), mixed=before)
    assert d.mixed is (before or (overlapped and blocking))
