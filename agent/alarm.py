"""One timer thread per process: callbacks at deadlines, cancellable, without a thread per timer.

Why: a node of the keyed rendezvous on a ``TCPStore`` waits for its round with one blocking read of its own
wake key (:meth:`~trainguard.agent.membership_kv.TcpKv.wait_round`), which the decider writes when it
publishes. A ``TCPStore`` wait must not time out by itself: a timed-out wait costs the client a cancel round
trip, and 1,024 clients whose 2 s waits timed out together had not all returned after 200 s (torch 2.13,
measured here, 2026-11-29). So the waiting node ends its own wait: at its deadline an alarm writes a mark to
its wake key over another connection. ``bench/control_plane.py`` runs 256 nodes per process, each waiting
every round: a ``threading.Timer`` each would start a thread per wait; here one thread keeps a heap, and the
callbacks (one store request each) run on a small pool so that a slow store does not hold up the others'
alarms."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.alarm")

RUNNERS = 4
"""Threads that run due callbacks (a callback is a store request bounded by its client's guard)."""


class Alarms:
    """``arm(delay_s, fn) -> ticket``; ``disarm(ticket)`` -> True when ``fn`` had not been started."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._fns: dict[int, Callable[[], object]] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    def arm(self, delay_s: float, fn: Callable[[], object]) -> int:
        ticket = next(self._ids)
        with self._cond:
            if self._thread is None:
                self._pool = ThreadPoolExecutor(RUNNERS, thread_name_prefix="trainguard-alarm-run")
                self._thread = threading.Thread(target=self._loop, name="trainguard-alarms", daemon=True)
                self._thread.start()
            self._fns[ticket] = fn
            heapq.heappush(self._heap, (time.monotonic() + max(0.0, delay_s), ticket))
            self._cond.notify()
        return ticket

    def disarm(self, ticket: int) -> bool:
        with self._cond:
            return self._fns.pop(ticket, None) is not None

    def pending(self) -> int:
        with self._cond:
            return len(self._fns)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][1] not in self._fns:
                        heapq.heappop(self._heap)  # (disarmed)
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        _, ticket = heapq.heappop(self._heap)
                        fn = self._fns.pop(ticket)
                        break
                    self._cond.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
            assert self._pool is not None
            self._pool.submit(_run, fn)


def _run(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the waiter's own bound ends its wait then
        log.warning("alarm_failed", error=f"{type(e).__name__}: {e}"[:200])


ALARMS = Alarms()
"""The process's alarms."""

__all__ = ["ALARMS", "Alarms", "RUNNERS"]
