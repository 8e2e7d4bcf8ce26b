"""A node of the keyed rendezvous on a ``TCPStore`` waits for its round with one blocking read of its wake key
(:meth:`trainguard.agent.membership_kv.TcpKv.wait_round`): the decider's publication ends it with ``go`` and the
node's assignment; without one, the node's own alarm ends it. On a real ``TCPStore``."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainguard.agent.membership import WAKE_MARK, Go, Record, encode_assignment, rec_key, wake_key
from trainguard.agent.membership_kv import TcpKv


class _Counted:
    """The store's requests, by name."""

    def __init__(self, store):
        self._store, self.calls = store, []

    def __getattr__(self, name):
        fn = getattr(self._store, name)

        def call(*args):
            self.calls.append(name)
            return fn(*args)
        return call


@pytest.fixture()
def store_port():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield master.port
    del master


def _kv(port, counted=False):
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    store = dist.PrefixStore("trainguard.keyed.job", client)
    store = _Counted(store) if counted else store
    return TcpKv(store, 2, 3), store


def _waiter(port):
    kv, counted = _kv(port, counted=True)
    beat, _ = _kv(port)
    kv.wake_via = lambda: beat
    return kv, counted


def _publish(kv, t, members):
    go = Go(1, len(members), 0).encode()
    assigned = [(n, encode_assignment(i, len(members))) for i, n in enumerate(members)]
    assert kv.publish_round(t, 1, b"1 x", assigned, Record(t, tuple(members), (), 0, 1).encode(), go) == go
    return go


def test_a_published_round_ends_a_blocked_wait_in_one_request(store_port):
    waiter, counted = _waiter(store_port)
    decider, _ = _kv(store_port)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", waiter.wait_round(1, "b", 2.5)))
    t.start()
    t.join(0.4)
    assert t.is_alive()  # blocked: nothing published yet
    go = _publish(decider, 1, ["a", "b"])
    t.join(10)
    assert out["r"] == (Go.decode(go), encode_assignment(1, 2))
    assert counted.calls == ["get"]  # no poll, no read of go or of the assignment after it


def test_the_nodes_alarm_ends_a_wait_without_a_round(store_port):
    waiter, counted = _waiter(store_port)
    reader, store = _kv(store_port)
    assert waiter.wait_round(1, "b", 0.6) is None
    assert counted.calls[:2] == ["get", "delete_key"]  # ended by its mark, which it took away
    assert not store.check([wake_key(1, "b")])  # the next wait blocks again


def test_a_round_published_after_the_mark_is_read_when_its_wake_was_deleted(store_port):
    # The decider created go (and its wake values) after the mark ended the wait; the node's delete then took
    # the wake value away: the read of go after the delete finds the round.
    waiter, _ = _waiter(store_port)
    decider, store = _kv(store_port)
    store.set(wake_key(1, "b"), WAKE_MARK)
    go = Go(1, 2, 0).encode()
    store.set(f"r/1/1/a/b", encode_assignment(1, 2))
    store.set(rec_key(1, 1), Record(1, ("a", "b"), (), 0, 1).encode())
    store.set("r/1/go", go)
    assert waiter.wait_round(1, "b", 2.0) == (Go.decode(go), encode_assignment(1, 2))


def test_a_spare_is_woken_with_its_rank_of_minus_one(store_port):
    waiter, _ = _waiter(store_port)
    decider, _ = _kv(store_port)
    go = Go(1, 1, 0).encode()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", waiter.wait_round(1, "s", 2.5)))
    t.start()
    assert decider.publish_round(1, 1, b"1 x", [("a", encode_assignment(0, 1)), ("s", encode_assignment(-1, 1))],
                                 Record(1, ("a",), ("s",), 0, 1).encode(), go) == go
    t.join(10)
    assert out["r"] == (Go.decode(go), encode_assignment(-1, 1))


def test_a_short_wait_polls_go(store_port):
    waiter, counted = _waiter(store_port)
    assert waiter.wait_round(1, "b", 0.3) is None
    assert set(counted.calls) == {"check"}
