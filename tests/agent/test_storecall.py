"""Rendezvous-store calls bounded by the keep-alive (issue 37 (b)): the pure decisions, table-tested, and a
real ``TCPStore`` behind a proxy on 127.0.0.1 that black-holes its connections (accepts, then forwards
nothing, sockets left open: a partition without reset) and heals for new connections only - the old ones
stay silent, as a connection whose bytes wait for TCP's retransmission backoff does."""

from __future__ import annotations

import pickle
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from trainguard.agent.storecall import BoundedC10dBackend, Link, backoff_s, call_bound_s, may_connect, on_failure, on_success


@pytest.mark.parametrize("interval, attempts, bound", [(2, 3, 6.0), (1, 2, 2.0), (5, 4, 20.0), (0.5, 3, 1.5)])
def test_call_bound_is_the_keep_alive_expiry(interval, attempts, bound):
    assert call_bound_s(interval, attempts) == bound


@pytest.mark.parametrize("failures, want", [(0, 0.0), (1, 2.0), (2, 4.0), (3, 6.0), (4, 6.0), (1000, 6.0)])
def test_backoff_doubles_from_the_interval_capped_at_the_bound(failures, want):
    assert backoff_s(failures, 2.0, 6.0) == want


@pytest.mark.parametrize("link, now, want_link, began", [
    (Link(), 10.0, Link(10.0, 1, 12.0), True),  # the outage begins: logged once
    (Link(10.0, 1, 12.0), 13.0, Link(10.0, 2, 17.0), False),  # same outage, longer backoff
    (Link(10.0, 5, 40.0), 41.0, Link(10.0, 6, 47.0), False),  # capped at the bound
])
def test_on_failure(link, now, want_link, began):
    assert on_failure(link, now, 2.0, 6.0) == (want_link, began)


@pytest.mark.parametrize("link, now, want", [
    (Link(), 5.0, (Link(), None)),  # healthy stays healthy, nothing to log
    (Link(10.0, 3, 20.0), 22.5, (Link(), 12.5)),  # an outage of 12.5 s ends
])
def test_on_success(link, now, want):
    assert on_success(link, now) == want


@pytest.mark.parametrize("link, now, want", [
    (Link(), 0.0, True), (Link(1.0, 1, 3.0), 2.9, False), (Link(1.0, 1, 3.0), 3.0, True)])
def test_may_connect(link, now, want):
    assert may_connect(link, now) is want


class BlackHoleProxy:
    """127.0.0.1 proxy to ``target``; ``cut()`` silences every connection (old and new: accepted, nothing
    forwarded, nothing closed), ``heal()`` forwards again for new connections only."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.cut_gen, self.healed_gen = target, -1, 0
        self.gen = 0
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.socks: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self.gen += 1
        self.cut_gen = self.gen  # connections opened in generation <= cut_gen never forward again

    def heal(self) -> None:
        self.gen += 1

    def _silent(self, born: int) -> bool:
        return born <= self.cut_gen

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            born = self.gen
            u = socket.create_connection(self.target)
            self.socks += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b, born), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, born: int) -> None:
        while not self.stop.is_set():
            try:
                data = a.recv(65536)
            except OSError:
                return
            if not data:
                return
            while self._silent(born) and not self.stop.is_set():  # black hole: hold the bytes, close nothing
                time.sleep(0.05)
            if self.stop.is_set():
                return
            try:
                b.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        for s in [self.lsock, *self.socks]:
            s.close()


@pytest.fixture()
def proxied_store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    proxy = BlackHoleProxy(("127.0.0.1", server.port))
    yield server, proxy
    proxy.close()
    del server


def test_a_blocked_call_gives_up_within_the_bound_and_a_new_connection_works_after_the_heal(proxied_store):
    server, proxy = proxied_store
    bound = 1.5
    connect = lambda: dist.TCPStore("127.0.0.1", proxy.port, is_master=False, multi_tenant=True,  # noqa: E731
                                    timeout=timedelta(seconds=bound))
    renewed = []
    backend = BoundedC10dBackend(connect(), "job", host="127.0.0.1", port=proxy.port, bound_s=bound, interval_s=0.5,
                                 on_reconnected=lambda: renewed.append(time.monotonic()), connect=connect)
    _, token, ok = backend.set_state(pickle.dumps({"round": 1}))
    assert ok and pickle.loads(backend.get_state()[0]) == {"round": 1}

    proxy.cut()
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError):
        backend.get_state()
    waited = time.monotonic() - t0
    assert waited < bound + 3.0, f"a call blocked {waited:.1f} s past its bound of {bound} s"  # generous on a loaded box
    assert not backend.connected and backend.link.failures == 1
    # While cut: no call goes to the network before the backoff, and a connect attempt fails (bounded).
    with pytest.raises(RendezvousConnectionError, match="next connect in"):
        backend.get_state()
    time.sleep(backend.link.next_connect_at - time.monotonic() + 0.01)
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError):
        backend.get_state()
    assert time.monotonic() - t0 < bound + 3.0
    assert backend.link.failures == 2 and not renewed

    proxy.heal()  # new connections forward again; the old ones stay black-holed
    time.sleep(max(0.0, backend.link.next_connect_at - time.monotonic()) + 0.01)
    state, _ = backend.get_state()
    assert pickle.loads(state) == {"round": 1}
    assert backend.connected and backend.link == Link() and len(renewed) == 1
    # Writes go through on the new connection and reach the store.
    assert backend.set_state(pickle.dumps({"round": 2}), backend.get_state()[1])[2]
    direct = dist.TCPStore("127.0.0.1", server.port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=5))
    assert direct.check(["torch.rendezvous.job"])


def test_a_store_that_lost_the_round_is_not_read_as_an_empty_state(proxied_store):
    server, proxy = proxied_store
    connect = lambda: dist.TCPStore("127.0.0.1", proxy.port, is_master=False, multi_tenant=True,  # noqa: E731
                                    timeout=timedelta(seconds=1))
    backend = BoundedC10dBackend(connect(), "job2", host="127.0.0.1", port=proxy.port, bound_s=1.0, interval_s=0.2,
                                 connect=connect)
    backend.set_state(pickle.dumps("s"))
    backend._inner = None  # as after a call that gave up
    server.delete_key("torch.rendezvous.job2")  # as a restarted store: the round is gone
    with pytest.raises(RendezvousConnectionError, match="lost the round"):
        backend.get_state()
    assert not server.check(["torch.rendezvous.job2"]), "a reconnect wrote the sentinel into a restarted store"


def test_a_round_replaced_by_the_sentinel_is_not_read_as_an_empty_state(proxied_store):
    """The key is there but holds torch's no-state sentinel: a peer's reconnect created its backend on the restarted
    store (which writes the sentinel) an instant before republishing its copy of the round. A backend that has seen
    a state refuses to hand that to torch's holder as the job's state, read or written; one that never has (a new
    job) reads None as torch's does, and the republished round is read again."""
    server, _ = proxied_store
    key = "torch.rendezvous.job3"
    connect = lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False, multi_tenant=True,  # noqa: E731
                                    timeout=timedelta(seconds=5))
    fresh = BoundedC10dBackend(connect(), "job3", host="127.0.0.1", port=server.port, bound_s=5.0, interval_s=0.2,
                               connect=connect)
    assert fresh.get_state() is None  # a new job: no state yet, torch's answer
    backend = BoundedC10dBackend(connect(), "job3", host="127.0.0.1", port=server.port, bound_s=5.0, interval_s=0.2,
                                 connect=connect)
    _, token, ok = backend.set_state(pickle.dumps({"round": 4}))
    assert ok
    sentinel = BoundedC10dBackend._NULL_SENTINEL
    server.set(key, sentinel)  # the restarted store, between a peer's backend creation and its republish
    with pytest.raises(RendezvousConnectionError, match="holds no round"):
        backend.get_state()
    with pytest.raises(RendezvousConnectionError, match="holds no round"):
        backend.set_state(pickle.dumps({"round": 4, "mine": True}), token)
    assert server.get(key) == sentinel.encode(), "a refused write changed the store"
    assert backend.connected  # the connection is fine: only the store's content is not a round
    # The republish (a CAS against the sentinel, as reconnect_store does it), then reads go on.
    assert BoundedC10dBackend(connect(), "job3", host="127.0.0.1", port=server.port, bound_s=5.0, interval_s=0.2,
                              connect=connect).set_state(pickle.dumps({"round": 4}), None)[2]
    assert pickle.loads(backend.get_state()[0]) == {"round": 4}


def test_a_guarded_client_gives_up_fails_fast_then_renews_after_the_heal(proxied_store):
    from trainguard.agent.storecall import BoundedStore, ClientGuard, StoreCallTimeout

    server, proxy = proxied_store
    bound = 1.5
    connect = lambda: dist.TCPStore("127.0.0.1", proxy.port, is_master=False, multi_tenant=True,  # noqa: E731
                                    timeout=timedelta(seconds=bound))
    slot = [connect()]
    renewals = []

    def renew():
        renewals.append(slot[0])  # kept alive: a dropped client's thread may still be blocked in it
        slot[0] = connect()
    guard = ClientGuard(lambda: slot[0], renew, bound_s=bound, interval_s=0.5, name="test")
    store = BoundedStore(guard, lambda c: dist.PrefixStore("p", c))
    store.set("k", "v")
    assert store.check(["k"]) and bytes(store.get("k")) == b"v"

    proxy.cut()
    t0 = time.monotonic()
    with pytest.raises(StoreCallTimeout):
        store.check(["k"])  # blocks forever on the bare client (tested by the probe in the module doc)
    assert time.monotonic() - t0 < bound + 3.0
    t0 = time.monotonic()
    with pytest.raises(StoreCallTimeout, match="next connect in"):
        store.get("k")  # the stuck client is not used again: fails at once
    assert time.monotonic() - t0 < 0.5 and not renewals

    proxy.heal()
    time.sleep(max(0.0, guard.link.next_connect_at - time.monotonic()) + 0.01)
    assert bytes(store.get("k")) == b"v"  # on a new connection
    assert len(renewals) == 1 and guard.link == Link() and guard.stuck is None
    store.add("n", 2)
    assert int(bytes(server.get("p/n"))) == 2


def test_a_call_thread_runs_calls_in_turn_on_one_thread_and_is_abandoned_to_a_stuck_call():
    """storecall.CallThread: a client's bounded calls on one thread (no thread started per call); a call past
    its bound raises StoreCallTimeout and leaves the thread to it; abandon() ends the thread once it returns."""
    from trainguard.agent.storecall import CallThread, StoreCallTimeout

    th = threading

    calls = CallThread("test-calls")
    idents = {calls.call(th.get_ident, 1.0) for _ in range(20)}
    assert len(idents) == 1 and th.get_ident() not in idents
    with pytest.raises(ValueError, match="bad"):
        calls.call(lambda: (_ for _ in ()).throw(ValueError("bad")), 1.0)
    release = th.Event()
    with pytest.raises(StoreCallTimeout, match="get gave no answer within 0.2 s"):
        calls.call(lambda: release.wait(10), 0.2, "get")
    calls.abandon()
    release.set()
    calls._thread.join(5)
    assert not calls._thread.is_alive()


def test_a_posted_call_runs_after_the_queued_ones_without_being_waited_for():
    """CallThread.post / BoundedStore.post (a keyed node's alarm writes its wake mark so): the caller returns at
    once, the write lands after the calls queued before it, and a posted call that fails stops nothing."""
    from trainguard.agent.storecall import BoundedStore, CallThread, ClientGuard

    calls = CallThread("test-post")
    order: list[str] = []
    release = threading.Event()
    waiter = threading.Thread(target=lambda: calls.call(lambda: (release.wait(10), order.append("first")), 10.0))
    waiter.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    calls.post(lambda: order.append("posted"))
    calls.post(lambda: 1 / 0)
    assert time.monotonic() - t0 < 1.0 and order == []  # not waited for: the first call still blocks
    release.set()
    waiter.join(5)
    assert calls.call(lambda: list(order), 5.0) == ["first", "posted"]
    calls.abandon()

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    guard = ClientGuard(lambda: client, lambda: None, bound_s=5.0, interval_s=0.5, name="test")
    store = BoundedStore(guard, lambda c: dist.PrefixStore("p", c))
    store.post("compare_set", "k", b"", b"v")
    store.post("compare_set", "k", b"", b"w")  # (create-once: the first stands)
    assert bytes(store.get("k")) == b"v"  # queued after both posts on the same thread
    assert bytes(server.get("p/k")) == b"v"
