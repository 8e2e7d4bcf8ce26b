"""Eviction on evidence (agent/elastic.py ``evict_nodes``) against torch's own rendezvous state type:
a member removed as torch's sanitizer removes one whose keep-alive expired, without waiting for it."""

from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (RendezvousSettings, RendezvousTimeout, _NodeDesc,
                                                                      _RendezvousState)

from trainguard.agent.elastic import Plan, evict_nodes


def _state(complete=True):
    settings = RendezvousSettings("job", min_nodes=1, max_nodes=3, timeout=RendezvousTimeout(),
                                  keep_alive_interval=timedelta(seconds=2), keep_alive_max_attempt=3)
    st = _RendezvousState()
    nodes = [_NodeDesc("127.0.0.1", 100 + i, 0) for i in range(3)]
    now = datetime.now(timezone.utc)
    for rank, n in enumerate(nodes):
        st.participants[n] = rank
        st.last_heartbeats[n] = now
    st.complete, st.round = complete, 4
    return st, settings, nodes


def test_an_evicted_member_leaves_participants_and_heartbeats_now():
    st, settings, (a, b, c) = _state()
    assert evict_nodes(st, settings, frozenset({str(c)})) == [str(c)]
    assert c not in st.participants and c not in st.last_heartbeats
    assert set(st.participants) == {a, b} and st.complete and st.round == 4  # the others are still in it
    assert evict_nodes(st, settings, frozenset({str(c)})) == []  # idempotent


def test_the_round_advances_once_nobody_is_left_in_a_completed_round():
    """The survivors left the completed round to re-form (torch's exit op); the lost member was the
    last one in it: removing it opens the next round at once (the keep-alive expiry did this before)."""
    st, settings, (a, b, c) = _state()
    del st.participants[a], st.participants[b]
    assert evict_nodes(st, settings, frozenset({str(c)})) == [str(c)]
    assert not st.participants and not st.complete and st.round == 5


def test_unknown_ids_and_waiting_nodes():
    st, settings, (a, b, c) = _state(complete=False)
    w = _NodeDesc("127.0.0.2", 7, 0)
    st.wait_list.add(w)
    st.last_heartbeats[w] = datetime.now(timezone.utc)
    assert evict_nodes(st, settings, frozenset({"nobody_1_0", str(w)})) == [str(w)]
    assert w not in st.wait_list and set(st.participants) == {a, b, c}


def test_a_plan_with_an_eviction_source_compares_by_membership():
    assert Plan(frozenset({"a"}), lost=True, evict=lambda: frozenset()) == Plan(frozenset({"a"}), lost=True)


def test_the_join_executor_evicts_what_the_plan_names_once_and_never_itself():
    from types import SimpleNamespace

    from trainguard.agent.elastic import _Executor

    st, settings, (a, b, c) = _state()
    dirty = []
    holder = SimpleNamespace(state=st, sync=lambda: None, mark_dirty=lambda: dirty.append(1))
    ex = _Executor(SimpleNamespace(_node=a, _state_holder=holder, _settings=settings), 0.01,
                   evict=lambda: frozenset({str(a), str(c)}))
    ex._state = st
    assert ex._evict() is True and ex.evicted == [str(c)] and dirty == [1]
    assert a in st.participants and c not in st.participants
    assert ex._evict() is False and dirty == [1]  # already gone: nothing written again
    assert _Executor(SimpleNamespace(_node=a, _state_holder=holder, _settings=settings), 0.01)._evict() is False


def test_no_eviction_once_the_rendezvous_moved_on_to_another_round():
    """A node cut off by a partition re-forms on its stale view when it reconnects: its peers' agents look
    silent to it (it could not read them), but they re-formed without it in a newer round, where they are
    the live members. Evidence about round 4 removes nobody from round 5."""
    from types import SimpleNamespace

    from trainguard.agent.elastic import _Executor

    st, settings, (a, b, c) = _state()
    st.round = 5  # b and c re-formed without a
    del st.participants[a], st.last_heartbeats[a]
    holder = SimpleNamespace(state=st, sync=lambda: None, mark_dirty=lambda: None)
    ex = _Executor(SimpleNamespace(_node=a, _state_holder=holder, _settings=settings), 0.01,
                   evict=lambda: frozenset({str(b), str(c)}), evict_round=4)
    ex._state = st
    assert ex._evict() is False and ex.evicted == []
    assert set(st.participants) == {b, c} and set(st.last_heartbeats) == {b, c}
    ex.evict_round = 5  # evidence about the round the state is at still applies
    assert ex._evict() is True and ex.evicted == [str(b), str(c)]
