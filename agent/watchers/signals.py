"""SIGTERM / SIGINT (and optionally SIGUSR1) to the agent as notices.

* SIGTERM / SIGINT (systemd stop, Kubernetes pod deletion, Ctrl-C): a ``stop`` notice with
  ``deadline = now + signal_deadline_s`` (set it to systemd ``TimeoutStopSec`` or the pod's
  ``terminationGracePeriodSeconds`` minus a margin).
* SIGUSR1 when ``sigusr1`` is on (SLURM ``--signal=USR1@N``): a ``preempt`` notice, same deadline.
* Escalation (``signal_escalate``, on by default): the *second* SIGTERM/SIGINT produces another
  ``stop`` notice with ``deadline = now`` and ``detail["escalated"] = True`` — the operator insists,
  skip the checkpoint and stop the workers now. The *third* restores the handlers that were installed
  before :meth:`SignalWatcher.start` and re-delivers the signal, so a wedged agent can always be
  killed the usual way (Ctrl-C three times, or systemd's SIGTERM then SIGKILL). With escalation off,
  repeated signals are reported as new ``stop`` notices with the normal deadline.

Python runs signal handlers only in the main thread, so :meth:`SignalWatcher.start` and
:meth:`SignalWatcher.stop` must be called from it (``start`` raises otherwise; ``stop`` from another
thread cannot restore the old handlers and logs that). The handler itself only stamps the time and
puts a Notice on a reentrant queue: no logging, no locks, no callback inside a signal handler (the
interrupted main thread may hold the very lock they would need). The watcher thread delivers it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from trainguard.agent.watchers.base import Notice, QueueWatcher
from trainguard.agent.watchers.config import PreemptionConfig

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalWatcher(QueueWatcher):
    """Turns process signals into notices (see module docstring)."""

    source = "signal"

    def __init__(self, *, signal_deadline_s: float = 30.0, sigusr1: bool = False, escalate: bool = True,
                 poll_interval_s: float = 0.5, clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="signal", poll_interval_s=poll_interval_s, clock=clock)
        if signal_deadline_s <= 0:
            raise ValueError(f"preemption.signal_deadline_s must be > 0, got {signal_deadline_s}")
        self.signal_deadline_s = signal_deadline_s
        self.escalate = escalate
        self.signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT) + (
            (signal.SIGUSR1,) if sigusr1 else ())
        self._previous: dict[signal.Signals, _Handler] = {}
        self._stop_count = 0
        self._count = 0

    @classmethod
    def from_config(cls, cfg: PreemptionConfig, **kw: Any) -> SignalWatcher:
        return cls(signal_deadline_s=cfg.signal_deadline_s, sigusr1=cfg.sigusr1, escalate=cfg.signal_escalate, **kw)

    def start(self, on_notice: Callable[[Notice], None]) -> None:
        """See base class. Installs the handlers; must run in the main thread."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("SignalWatcher.start() must be called from the main thread "
                               "(Python delivers signals only there); start the watchers before spawning threads")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        super().start(on_notice)

    def stop(self, timeout: float = 5.0) -> bool:
        """See base class. Restores the previous handlers (main thread only)."""
        self._restore()
        return super().stop(timeout)

    def _restore(self) -> None:
        if not self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            self.log.error("watcher_error", source=self.source, watcher=self.name,
                           error="stop() outside the main thread cannot restore signal handlers",
                           fix="call stop() of the signal watcher from the main thread")
            return
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: stamp, build, enqueue. Nothing that can block."""
        now = self.clock()
        sig = signal.Signals(signum)
        self._count += 1
        detail: dict[str, Any] = {"signal": sig.name}
        if sig == signal.SIGUSR1:
            self.push(Notice(source=self.source, kind="preempt", deadline=now + self.signal_deadline_s,
                             received_at=now, detail=detail, event_id=f"{sig.name}#{self._count}"))
            return
        self._stop_count += 1
        deadline = now + self.signal_deadline_s
        if self.escalate and self._stop_count == 2:
            deadline = now
            detail["escalated"] = True
        elif self.escalate and self._stop_count >= 3:
            self._restore()
            signal.raise_signal(signum)  # the pre-existing disposition handles it (default: die)
            return
        detail["count"] = self._stop_count
        self.push(Notice(source=self.source, kind="stop", deadline=deadline, received_at=now, detail=detail,
                         event_id=f"{sig.name}#{self._count}"))
