"""Rendezvous-store calls bounded by the keep-alive, and a new connection after a call gave up (issue 37).

A ``TCPStore`` client is one TCP connection. Cut off by a partition (packets dropped, no reset), a call
waits for the store's read timeout (torch's c10d backend: ``read_timeout``, 60 s), and once the network
heals the bytes still queued on that connection wait for TCP's retransmission backoff (the retransmission
timeout doubles up to 120 s): the node came back 19-28 s after healing in the runs of 2026-11-27, but
nothing bounded it. Worse, the client's timeout does not bound such a call at all (see
:func:`call_with_deadline`): a ``get`` blocks until the connection answers or TCP gives up. Here the
rendezvous backend's calls (the state sync of the keep-alive thread and of every rendezvous operation) use a
connection of their own and give up after ``keep_alive_interval_s x keep_alive_max_attempts`` (the time
after which the peers count this node dead anyway); a call that gave up drops its connection (a late
answer would be read as the answer to the next request, and its queued bytes wait for TCP's backoff) and
the next call after a backoff opens a new one, whose first packets go out at once when the network is
back. Once the backend is back after an outage, the handler's own client (rank assignment of the next
round, the round store) is replaced too (``on_reconnected``; wired by
:meth:`~trainguard.agent.elastic.ElasticAdapter.bound_store_calls`).

Bound after healing: a call in flight gives up within ``bound`` and the next connect is at most one
backoff (capped at ``bound``) later; the connect itself is bounded by ``bound``. So the backend answers
again at most ``3 x bound`` after the network healed (18 s with the defaults 2 s x 3), then the round is
joined like any joiner's.

The decisions (:func:`call_bound_s`, :func:`on_failure`, :func:`on_success`, :func:`may_connect`) are pure
and table-tested; :class:`BoundedC10dBackend` carries them out."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Sequence
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.storecall")


class StoreCallTimeout(TimeoutError):
    """A store call did not answer within its bound (its thread is left to the dropped connection)."""


class CallThread:
    """One thread that runs a client's calls in turn, each bounded (see :func:`call_with_deadline` for why),
    without a thread started per call: a keyed agent polls ``go`` every 0.25 s, and ``bench/control_plane.py``
    runs 256 such agents per process, where a thread start per call made the simulator what was measured
    (a planned leave at 1,024 nodes on ``trainguard store`` took 5.4 s instead of 1.1 s). A call that gave up
    leaves this thread to its dropped connection: the owner takes a new :class:`CallThread` (:meth:`abandon`
    ends the old one once that call returns)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, box, done = item
            try:
                box["out"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["exc"] = exc
            done.set()

    def call(self, fn: Callable[[], Any], bound_s: float, what: str = "store call") -> Any:
        """``fn()`` on this thread, or :class:`StoreCallTimeout` when it gave no answer within ``bound_s``
        (counted from now: a call queued behind another waits its turn within its own bound)."""
        box: dict[str, Any] = {}
        done = threading.Event()
        self._queue.put((fn, box, done))
        if not done.wait(bound_s):
            raise StoreCallTimeout(f"{what} gave no answer within {bound_s:g} s")
        if "exc" in box:
            raise box["exc"]
        return box.get("out")

    def post(self, fn: Callable[[], Any]) -> None:
        """``fn()`` on this thread after the calls queued before it, without waiting for it (its outcome is
        dropped: for a write whose effect the caller sees some other way)."""
        self._queue.put((fn, {}, threading.Event()))

    def abandon(self) -> None:
        """No more calls: the thread ends after the call it is in (if any)."""
        self._queue.put(None)


def call_with_deadline(fn: Callable[[], Any], bound_s: float, what: str = "store call") -> Any:
    """``fn()``, or :class:`StoreCallTimeout` after ``bound_s``. A ``TCPStore`` client's timeout does not
    bound a call on a connection whose peer went silent: measured on torch 2.13 through a black-holing
    proxy, ``get``, ``check``, ``add``, ``compare_set``, ``multi_get`` and the connect itself blocked past
    a 1.5 s timeout (``get`` times out its wait, then blocks reading the cancel's answer); only ``set``
    (no answer awaited) returned. So the call runs in a thread of its own (a one-call :class:`CallThread`),
    abandoned on timeout with its connection (the caller drops the client); the thread ends when that socket
    answers or fails."""
    calls = CallThread("trainguard-store-call")
    try:
        return calls.call(fn, bound_s, what)
    finally:
        calls.abandon()


def call_bound_s(keep_alive_interval_s: float, keep_alive_max_attempts: int) -> float:
    """How long one rendezvous-store call may wait: the peers count this node dead after as long."""
    return float(keep_alive_interval_s) * int(keep_alive_max_attempts)


@dataclass(frozen=True)
class Link:
    """The backend connection's health: when the outage began, how many calls failed in it, when the
    next connect may be tried."""

    down_since: float | None = None
    failures: int = 0
    next_connect_at: float = 0.0


def backoff_s(failures: int, interval_s: float, bound_s: float) -> float:
    """Wait before the next connect after ``failures`` failed calls: the keep-alive interval, doubling,
    never more than ``bound_s`` (so a healed network is seen within one bound)."""
    if failures <= 0:
        return 0.0
    return min(interval_s * 2 ** min(failures - 1, 30), bound_s)


def on_failure(link: Link, now: float, interval_s: float, bound_s: float) -> tuple[Link, bool]:
    """A call or a connect failed: the new state and whether this begins an outage (log it once)."""
    failures = link.failures + 1
    began = link.down_since is None
    return Link(now if began else link.down_since, failures, now + backoff_s(failures, interval_s, bound_s)), began


def on_success(link: Link, now: float) -> tuple[Link, float | None]:
    """A call answered: the healthy state and, if an outage ended, how long it lasted."""
    if link.down_since is None:
        return link, None
    return Link(), now - link.down_since


def may_connect(link: Link, now: float) -> bool:
    """Whether a call may open a new connection now (else it fails at once, without touching the network)."""
    return now >= link.next_connect_at


class BoundedC10dBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous backend (its public surface: ``get_state``/``set_state``) on a connection
    of its own: each call gives up after ``bound_s`` (the client's timeout), a call that gave up drops the
    connection, and a later call (after :func:`backoff_s`) opens a new one. A new connection to a store
    that lost the rendezvous key (it restarted) counts as a failure too: republishing the round there is
    the supervisor's reconnect (:meth:`~trainguard.agent.elastic.ElasticAdapter.reconnect_store`), never
    an empty state read here. ``on_reconnected`` is called, outside the lock, when the store answers
    again after an outage."""

    def __init__(self, store: Any, run_id: str, *, host: str, port: int, bound_s: float, interval_s: float,
                 on_reconnected: Callable[[], None] | None = None, connect: Callable[[], Any] | None = None) -> None:
        super().__init__(store, run_id)  # the sentinel for a first round, as torch's backend writes it
        self.run_id, self.host, self.port = run_id, host, int(port)
        self.bound_s, self.interval_s = float(bound_s), float(interval_s)
        self.on_reconnected = on_reconnected
        self._connect_fn = connect or self._connect
        self._lock = threading.Lock()
        self._link = Link()
        self._inner: C10dRendezvousBackend | None = C10dRendezvousBackend(store, run_id)
        self._seen_state = False  # a state read or written once: a store without one restarted (_no_lost_round)

    def _connect(self) -> Any:
        timeout = timedelta(seconds=self.bound_s)
        return dist.TCPStore(self.host, self.port, is_master=False, multi_tenant=True, timeout=timeout)

    @property
    def link(self) -> Link:
        return self._link

    @property
    def connected(self) -> bool:
        return self._inner is not None

    def get_state(self) -> Any:
        return self._no_lost_round(self._bounded("get_state", lambda b: b.get_state()))

    def set_state(self, state: bytes, token: Any = None) -> Any:
        return self._no_lost_round(self._bounded("set_state", lambda b: b.set_state(state, token)))

    def _no_lost_round(self, answer: Any) -> Any:
        """``answer`` (``None``: the store holds no state, torch's sentinel), unless this backend has read a
        state before: then the store restarted and nobody has republished the round yet, and torch's holder
        would take the empty state for the job's (a round 0 without members: every member of the running
        world "lost", and the agents re-formed without each other right after a store restart). The key
        exists meanwhile: a peer's reconnect writes the sentinel (torch's backend does, when it is created)
        an instant before its copy of the round."""
        if answer is not None:
            self._seen_state = True
        elif self._seen_state:
            raise RendezvousConnectionError("the rendezvous store holds no round (it restarted, and the round is not "
                                            "republished yet); the supervisor republishes it")
        return answer

    def _open(self) -> C10dRendezvousBackend:
        client = self._connect_fn()
        if not client.check(["torch.rendezvous." + self.run_id]):
            raise RendezvousConnectionError("the rendezvous store answers but lost the round (it restarted); "
                                            "the supervisor republishes it")
        return C10dRendezvousBackend(client, self.run_id)

    def _bounded(self, op: str, call: Callable[[C10dRendezvousBackend], Any]) -> Any:
        ended = None
        with self._lock:
            t0 = time.monotonic()
            if self._inner is None:
                if not may_connect(self._link, t0):
                    raise RendezvousConnectionError(
                        f"the rendezvous store {self.host}:{self.port} is unreachable; next connect in "
                        f"{self._link.next_connect_at - t0:.1f} s")
                try:
                    self._inner = call_with_deadline(self._open, self.bound_s, "connect")
                except Exception as exc:  # noqa: BLE001 - any failure to connect counts the same
                    self._failed("connect", exc, t0)
                    raise RendezvousConnectionError(f"cannot reach the rendezvous store: {exc}") from exc
            inner = self._inner
            try:
                try:
                    out = call_with_deadline(lambda: call(inner), self.bound_s, op)
                except StoreCallTimeout as exc:
                    raise RendezvousConnectionError(str(exc)) from exc
            except RendezvousConnectionError as exc:
                # Drop the connection: its unanswered request would pair a late answer with the next
                # call, and its queued bytes wait for TCP's retransmission backoff after a heal.
                self._inner = None
                self._failed(op, exc, t0)
                raise
            self._link, ended = on_success(self._link, time.monotonic())
        if ended is not None:
            log.info("store_reconnected", endpoint=f"{self.host}:{self.port}", down_s=round(ended, 3),
                     bound_s=self.bound_s)
            if self.on_reconnected is not None:
                try:
                    self.on_reconnected()
                except Exception as exc:  # noqa: BLE001 - the supervisor's own reconnect covers it later
                    log.warning("store_client_renew_failed", error=f"{type(exc).__name__}: {exc}"[:300])
        return out

    def _failed(self, op: str, exc: BaseException, t0: float) -> None:
        now = time.monotonic()
        self._link, began = on_failure(self._link, now, self.interval_s, self.bound_s)
        if began:
            cause = exc.__cause__ or exc
            log.warning("store_unreachable", endpoint=f"{self.host}:{self.port}", op=op,
                        waited_s=round(now - t0, 3), bound_s=self.bound_s,
                        error=f"{type(cause).__name__}: {cause}"[:300],
                        effect="store calls give up after bound_s; a new connection after each backoff")


class ClientGuard:
    """One client slot (the handler's client, or a thread's own) shared by every :class:`BoundedStore`
    over it. A call that gave up leaves its client with a request in flight (the client holds its own
    lock meanwhile: a second call on it would wait behind the first, or read its late answer), so from
    then on calls fail at once until ``renew()`` put a new client in the slot, tried at most once per
    :func:`backoff_s` (the backend's ``on_reconnected`` may renew the slot first)."""

    def __init__(self, current: Callable[[], Any], renew: Callable[[], None], *, bound_s: float, interval_s: float,
                 name: str) -> None:
        self.current, self.renew, self.name = current, renew, name
        self.bound_s, self.interval_s = float(bound_s), float(interval_s)
        self.link = Link()
        self.stuck: Any = None
        self._lock = threading.Lock()
        self._calls: CallThread | None = None
        """The thread this slot's calls run on (:class:`CallThread`); a new one after a call gave up."""

    def _call_thread(self) -> CallThread:
        with self._lock:
            if self._calls is None:
                self._calls = CallThread(f"trainguard-store-{self.name}")
            return self._calls

    def call(self, view: Callable[[Any], Any], op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        client = self._usable()
        t0 = time.monotonic()
        calls = self._call_thread()
        try:
            out = calls.call(lambda: getattr(view(client), op)(*args, **kwargs), self.bound_s, op)
        except (StoreCallTimeout, dist.DistNetworkError) as exc:  # (a broken connection: a restarted store)
            with self._lock:
                self.stuck = client
                if isinstance(exc, StoreCallTimeout) and self._calls is calls:
                    self._calls = None  # its thread waits in that call on the dropped connection
                    calls.abandon()
                self._note_failure(op, exc, t0)
            raise
        ended = None
        with self._lock:
            self.link, ended = on_success(self.link, time.monotonic())
        if ended is not None:
            log.info("store_reconnected", client=self.name, down_s=round(ended, 3), bound_s=self.bound_s)
        return out

    def post(self, view: Callable[[Any], Any], op: str, args: tuple[Any, ...]) -> None:
        """``op(*args)`` on the current client, queued on its call thread without waiting (:meth:`CallThread.post`):
        no reconnect is tried for it, and its failure is not counted (the next :meth:`call` finds out)."""
        client = self.current()
        self._call_thread().post(lambda: getattr(view(client), op)(*args))

    def _usable(self) -> Any:
        with self._lock:
            client = self.current()
            if self.stuck is None or client is not self.stuck:
                return client
            now = time.monotonic()
            if not may_connect(self.link, now):
                raise StoreCallTimeout(f"the {self.name} store client gave up a call; next connect in "
                                       f"{self.link.next_connect_at - now:.1f} s")
            try:
                call_with_deadline(self.renew, self.bound_s, "connect")
            except Exception as exc:  # noqa: BLE001 - not back yet
                self._note_failure("connect", exc, now)
                raise StoreCallTimeout(f"the {self.name} store client cannot reconnect: {exc}") from exc
            self.stuck = None
            return self.current()

    def _note_failure(self, op: str, exc: BaseException, t0: float) -> None:
        now = time.monotonic()
        self.link, began = on_failure(self.link, now, self.interval_s, self.bound_s)
        if began:
            log.warning("store_unreachable", client=self.name, op=op, waited_s=round(now - t0, 3), bound_s=self.bound_s,
                        error=f"{type(exc).__name__}: {exc}"[:300],
                        effect="its calls fail at once until a new connection answers (tried after each backoff)")


class BoundedStore:
    """A store whose every method call (``set``, ``get``, ``check``, ``add``, ...) runs through a
    :class:`ClientGuard`: on ``view(client)`` (a ``PrefixStore`` over it, or the client itself)."""

    def __init__(self, guard: ClientGuard, view: Callable[[Any], Any] = lambda c: c) -> None:
        self._guard, self._view = guard, view

    def __getattr__(self, op: str) -> Callable[..., Any]:
        if op.startswith("_"):
            raise AttributeError(op)
        return lambda *args, **kwargs: self._guard.call(self._view, op, args, kwargs)

    def post(self, op: str, *args: Any) -> None:
        """``op(*args)`` queued on the guard's call thread, not waited for (:meth:`ClientGuard.post`)."""
        self._guard.post(self._view, op, args)

    @property
    def unbounded(self) -> Any:
        """The store itself, for code that needs a real ``torch.distributed.Store``."""
        return self._view(self._guard.current())



def read_many(store: Any, keys: Sequence[str]) -> list[bytes | None]:
    """The values of ``keys`` (None where absent): one ``check`` and one ``multi_get`` when all are there (a
    store without ``multi_get``, or one that refuses it, is read key by key), else key by key."""
    keys = list(keys)
    if not keys:
        return []
    if store.check(keys) and hasattr(store, "multi_get"):
        try:
            return [bytes(v) for v in store.multi_get(keys)]
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            pass
    return [bytes(store.get(k)) if store.check([k]) else None for k in keys]

__all__ = ["BoundedC10dBackend", "BoundedStore", "CallThread", "ClientGuard", "Link", "StoreCallTimeout", "backoff_s", "call_bound_s", "call_with_deadline",
           "may_connect", "on_failure", "on_success", "read_many"]
