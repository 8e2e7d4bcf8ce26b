"""Preemption notices and the watcher base class.

A *watcher* turns one source of "this node is going away" (a cloud metadata endpoint, a signal,
the CLI) into :class:`Notice` values delivered to one callback. Every watcher is a daemon thread
that survives anything a metadata server can answer: each poll runs inside a try/except, a failed
poll is logged as ``watcher_error`` (URL, status, body excerpt) and the next poll goes on. The same
event is reported once (deduplicated by ``(kind, event_id)``), not on every poll.

Threading contract for the owner (drain coordinator):

* ``on_notice`` runs on the watcher's own thread; it must be quick and thread-safe (put the
  notice on a queue, set an event). An exception in it is logged (``watcher_callback_error``) and
  the watcher goes on.
* :meth:`Watcher.stop` is idempotent, safe on a watcher that never started, aborts an in-flight
  request and joins the thread within ``timeout`` seconds.
"""

from __future__ import annotations

import abc
import calendar
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainguard.agent.watchers.http import HttpClient, MetadataError, WatcherError
from trainguard.contract.log import get_logger

__all__ = [
    "KIND_PRIORITY",
    "Notice",
    "PartialPoll",
    "QueueWatcher",
    "Watcher",
    "WatcherError",
    "MetadataError",
    "most_urgent",
    "parse_iso8601_utc",
    "parse_rfc1123",
]

KIND_PRIORITY: dict[str, int] = {
    "termination": 100,  # the instance is terminated/stopped at the deadline (AWS, Azure Terminate)
    "preempt": 100,      # spot/preemptible reclaim (GCP preempted, Azure Preempt, SLURM SIGUSR1)
    "stop": 90,          # SIGTERM/SIGINT to the agent (systemd stop, pod deletion)
    "drain": 80,         # manual `trainguard drain`
    "maintenance": 50,   # host maintenance (GCP maintenance-event, Azure Reboot/Redeploy/Freeze)
    "rebalance": 10,     # AWS rebalance recommendation: early warning, no hard deadline
}
"""Higher wins. Termination-type kinds beat maintenance, which beats early warnings."""

EARLY_WARNING_PRIORITY = 50
"""Notices with a priority at or below this are warnings the owner may act on, not must-leave."""


@dataclass(frozen=True, slots=True)
class Notice:
    """One preemption/stop notice. Immutable; safe to pass between threads.

    ``deadline`` and ``received_at`` are absolute wall-clock epoch seconds (``time.time()``
    domain) because cloud deadlines are wall-clock times; compare them with ``time.time()``.
    ``priority`` defaults from :data:`KIND_PRIORITY` (unknown kinds: 0).
    ``event_id`` identifies the event at its source (Azure ``EventId``, AWS action+time, signal
    name+count); it is what deduplication and Azure acknowledgement use.
    """

    source: str
    """``aws`` | ``gcp`` | ``azure`` | ``signal`` | ``manual``."""
    kind: str
    """``termination`` | ``preempt`` | ``stop`` | ``drain`` | ``maintenance`` | ``rebalance``."""
    deadline: float
    """Absolute epoch seconds by which the node may be gone."""
    received_at: float
    """Absolute epoch seconds at which this agent detected the notice."""
    detail: dict[str, Any] = field(default_factory=dict)
    """Source-specific facts (raw action/time, EventType, signal name...); JSON-able."""
    event_id: str = ""
    """Identity of the event at its source."""
    priority: int = -1
    """Defaults from :data:`KIND_PRIORITY`."""

    def __post_init__(self) -> None:
        if self.priority < 0:
            object.__setattr__(self, "priority", KIND_PRIORITY.get(self.kind, 0))

    @property
    def is_early_warning(self) -> bool:
        """True for notices that do not by themselves mean the node goes away (rebalance, migrate)."""
        return self.priority <= EARLY_WARNING_PRIORITY

    def remaining_s(self, now: float | None = None) -> float:
        """Seconds left until the deadline (negative when past)."""
        return self.deadline - (time.time() if now is None else now)

    def log_fields(self) -> dict[str, Any]:
        return {"source": self.source, "kind": self.kind, "deadline": self.deadline,
                "received_at": self.received_at, "remaining_s": round(self.deadline - self.received_at, 3),
                "priority": self.priority, "event_id": self.event_id, "detail": self.detail}


def most_urgent(notices: Iterable[Notice]) -> Notice | None:
    """Pure: the notice to act on — highest priority, then earliest deadline, then earliest received."""
    best: Notice | None = None
    for n in notices:
        if best is None or (-n.priority, n.deadline, n.received_at) < (-best.priority, best.deadline,
                                                                         best.received_at):
            best = n
    return best


_ISO_Z = re.compile(r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(\.\d{1,9})?Z$")
_RFC1123 = re.compile(
    r"^(Mon|Tue|Wed|Thu|Fri|Sat|Sun), (\d{2}) (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) "
    r"(\d{4}) (\d{2}):(\d{2}):(\d{2}) GMT$")
_MONTHS = {m: i for i, m in enumerate(
    ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), start=1)}


def _epoch(y: int, mo: int, d: int, h: int, mi: int, s: int) -> float:
    # calendar.timegm validates nothing; time.strptime-free range checks keep this locale-proof.
    if not (1 <= mo <= 12 and 1 <= d <= calendar.monthrange(y, mo)[1] and h <= 23 and mi <= 59 and s <= 60):
        raise ValueError("date/time field out of range")
    return float(calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0)))


def parse_iso8601_utc(text: str) -> float:
    """Strict ``YYYY-MM-DDTHH:MM:SS[.fff]Z`` (AWS) -> epoch seconds; ``ValueError`` otherwise."""
    m = _ISO_Z.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"not an ISO-8601 UTC time like 2026-11-22T12:00:00Z: {text!r}")
    frac = float(m.group(7)) if m.group(7) else 0.0
    return _epoch(*(int(g) for g in m.groups()[:6])) + frac


def parse_rfc1123(text: str) -> float:
    """Strict ``Mon, 19 Sep 2016 18:29:47 GMT`` (Azure ``NotBefore``) -> epoch seconds.

    Parsed by hand (not ``strptime``) so the result does not depend on the process locale.
    """
    m = _RFC1123.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"not an RFC 1123 time like 'Mon, 19 Sep 2016 18:29:47 GMT': {text!r}")
    _, d, mon, y, h, mi, s = m.groups()
    return _epoch(int(y), _MONTHS[mon], int(d), int(h), int(mi), int(s))


class Watcher(abc.ABC):
    """A daemon thread that polls one source and reports each new :class:`Notice` once.

    Subclasses implement :meth:`poll` (one round; may block up to its request timeout) and may
    override :meth:`delay_after` (seconds to wait before the next round), :meth:`on_poll_error`
    (reset state after a failure), :meth:`acknowledge` and :meth:`_interrupt`.

    ``clock`` is the wall clock (epoch seconds) used for ``received_at`` and deadlines; tests
    inject a fixed one.
    """

    source: ClassVar[str] = "?"
    ERROR_LOG_FIRST = 3
    """Log every one of the first N consecutive failures, then every ``ERROR_LOG_EVERY``-th."""
    ERROR_LOG_EVERY = 30

    def __init__(self, *, name: str | None = None, poll_interval_s: float = 2.0,
                 clock: Callable[[], float] = time.time) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.name = name or self.source
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self.log = get_logger(f"trainguard.watchers.{self.name}")
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_notice: Callable[[Notice], None] | None = None
        self._seen: set[tuple[str, str]] = set()
        self._seen_lock = threading.Lock()
        self._consecutive_errors = 0
        self._clients: list[HttpClient] = []
        self._started = False
        self._stopped = False

    # ----------------------------------------------------------------- lifecycle
    def start(self, on_notice: Callable[[Notice], None]) -> None:
        """Start the daemon thread; ``on_notice`` is called on it once per new notice."""
        if self._started:
            raise RuntimeError(f"watcher {self.name!r} was already started (watchers are single-use)")
        self._started = True
        self._on_notice = on_notice
        self._thread = threading.Thread(target=self._run, name=f"trainguard-watcher-{self.name}", daemon=True)
        self._thread.start()
        self.log.info("watcher_started", source=self.source, watcher=self.name)

    def request_stop(self) -> None:
        """Ask the thread to end and abort any in-flight request; does not wait (idempotent)."""
        self._stop_event.set()
        try:
            self._interrupt()
        except Exception as e:  # never let a half-built watcher break shutdown
            self.log.warning("watcher_error", source=self.source, watcher=self.name,
                             error=f"interrupt failed: {type(e).__name__}: {e}")

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop polling, abort any in-flight request and join the thread (idempotent).

        Returns True when the thread is gone (or never ran) within ``timeout`` seconds.
        """
        first = not self._stopped
        self._stopped = True
        self.request_stop()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        alive = t is not None and t.is_alive()
        if first and self._started:
            self.log.info("watcher_stopped", source=self.source, watcher=self.name, joined=not alive)
        return not alive

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def acknowledge(self, notice: Notice) -> bool:
        """Tell the source the node is ready to go (Azure StartRequests). Default: nothing to do.

        Called by the owner after the emergency checkpoint is committed. Returns True when the
        source accepted the acknowledgement. Never raises for source errors (they are logged).
        """
        return False

    # ----------------------------------------------------------------- subclass hooks
    @abc.abstractmethod
    def poll(self) -> Iterable[Notice]:
        """One round of checks; returns the notices seen now (duplicates are filtered by the base).
        Raises on failure; :class:`PartialPoll` when some checks found notices and others failed."""

    def delay_after(self, ok: bool) -> float:
        """Seconds to wait before the next :meth:`poll`; ``ok`` says whether this one succeeded."""
        return self.poll_interval_s

    def on_poll_error(self, exc: BaseException) -> None:
        """Reset source state after a failed poll (e.g. drop a cached token or ETag)."""

    def _interrupt(self) -> None:
        """Unblock whatever :meth:`poll` may be blocked in (called from :meth:`stop`).

        The default aborts every client made by :meth:`make_client`.
        """
        for c in self._clients:
            c.abort()

    # ----------------------------------------------------------------- machinery
    def _run(self) -> None:
        while not self._stop_event.is_set():
            ok = True
            try:
                notices = list(self.poll())
            except Exception as e:
                ok = False
                notices = []
                if isinstance(e, PartialPoll):
                    notices = e.notices
                    for err in e.errors[:-1]:
                        self.report_error(err)
                    e = e.errors[-1]  # type: ignore[assignment]
                if not self._stop_event.is_set():
                    self.report_error(e)
                try:
                    self.on_poll_error(e)
                except Exception as e2:
                    self.log.error("watcher_error", source=self.source, watcher=self.name,
                                   error=f"on_poll_error failed: {type(e2).__name__}: {e2}")
            else:
                if self._consecutive_errors:
                    self.log.info("watcher_recovered", source=self.source, watcher=self.name,
                                  after_errors=self._consecutive_errors)
                    self._consecutive_errors = 0
            for n in notices:
                self.emit(n)
            delay = self.delay_after(ok)
            if delay > 0:
                self._stop_event.wait(delay)

    def report_error(self, exc: BaseException, **extra: Any) -> None:
        """Log one failed check as ``watcher_error`` (rate-limited for long outages)."""
        self._consecutive_errors += 1
        n = self._consecutive_errors
        if n > self.ERROR_LOG_FIRST and n % self.ERROR_LOG_EVERY:
            return
        fields: dict[str, Any] = {"source": self.source, "watcher": self.name, "consecutive_errors": n, **extra}
        if isinstance(exc, MetadataError):
            fields.update(exc.log_fields())
            self.log.warning("watcher_error", **fields)
        else:  # a bug, not a bad answer: keep the traceback
            self.log.error("watcher_error", error=f"{type(exc).__name__}: {exc}", exc_info=exc, **fields)

    def seen(self, notice: Notice) -> bool:
        """Whether ``notice`` (by ``(kind, event_id)``) was delivered already. Thread-safe."""
        with self._seen_lock:
            return (notice.kind, notice.event_id) in self._seen

    def emit(self, notice: Notice) -> bool:
        """Deliver ``notice`` unless ``(kind, event_id)`` was delivered before. Thread-safe.

        A cloud notice's deadline is first clamped to what its provider documents
        (:mod:`trainguard.agent.watchers.deadline`), logged as ``notice_deadline_clamped``."""
        from trainguard.agent.watchers.deadline import clamp_deadline

        key = (notice.kind, notice.event_id)
        with self._seen_lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        notice, why = clamp_deadline(notice)
        if why is not None:
            self.log.warning("notice_deadline_clamped", source=notice.source, kind=notice.kind, reason=why,
                             given_in_s=round(notice.detail["deadline_given"] - notice.received_at, 1),
                             deadline_in_s=round(notice.deadline - notice.received_at, 1))
        self.log.warning("preemption_notice", watcher=self.name, **notice.log_fields())
        cb = self._on_notice
        if cb is not None:
            try:
                cb(notice)
            except Exception as e:
                self.log.error("watcher_callback_error", source=self.source, watcher=self.name,
                               error=f"{type(e).__name__}: {e}", exc_info=e)
        return True

    def make_client(self, timeout_s: float) -> HttpClient:
        """An :class:`HttpClient` that :meth:`stop` aborts."""
        client = HttpClient(timeout_s)
        self._clients.append(client)
        return client


class PartialPoll(Exception):
    """Raised by :meth:`Watcher.poll` when some checks found notices and others failed: the base
    delivers ``notices`` first, then treats the poll as failed (logs ``errors``, backs off)."""

    def __init__(self, notices: list[Notice], errors: list[BaseException]) -> None:
        super().__init__(f"{len(errors)} check(s) failed")
        self.notices = notices
        self.errors = errors


class QueueWatcher(Watcher):
    """A watcher fed by a thread-safe, signal-handler-safe queue (signals, manual drain).

    Producers call :meth:`push` from any thread or from a signal handler (``queue.SimpleQueue`` is
    reentrant); the watcher thread logs and delivers, so ``on_notice`` never runs inside a signal
    handler.
    """

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._queue: queue.SimpleQueue[Notice | None] = queue.SimpleQueue()

    def push(self, notice: Notice) -> None:
        self._queue.put(notice)

    def poll(self) -> Iterable[Notice]:
        """See base class. Blocks up to ``poll_interval_s`` for the next notice."""
        try:
            first = self._queue.get(timeout=self.poll_interval_s)
        except queue.Empty:
            return []
        out = [first]
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return [n for n in out if n is not None]

    def delay_after(self, ok: bool) -> float:
        return 0.0 if ok else self.poll_interval_s

    def _interrupt(self) -> None:
        self._queue.put(None)  # wake the blocked get()
