"""Goodput: how much of the paid time trained steps that were kept.

A pure ledger over a timeline of events with an injectable clock, so scripted timelines (a drain, a
crash and restart, a rollback to a checkpoint) are unit-tested without processes or sleeps.

Every second of *paid* time (since the agent started, until it stops) lands in exactly one bucket:

* **productive**: the agent was ``running`` and the steps trained then were not rolled back;
* **wasted[reason]** (:data:`~trainguard.metrics.names.WASTE_REASONS`): downtime, attributed to
  its cause (``startup``, ``drain``, ``resize``, ``restart``, ``other``), or ``recompute``: running
  time whose steps were later rolled back to a checkpoint and trained again.

So ``paid == productive + sum(wasted)`` always holds (the tests assert it), and
``goodput = productive / paid``. Productive time can *decrease* (a rollback reclassifies it), which
is why it is exported as a gauge while paid and wasted time are counters.

Rollback detection needs to know when each step was completed: :meth:`GoodputLedger.progress`
records ``(time, step)`` marks (the agent samples the workers' step once a second; tests call it per
step), and :meth:`GoodputLedger.restored` interpolates the time at which the restored step had been
reached. Marks older than the last committed checkpoint are dropped (:meth:`committed`), because a
restore never goes further back than that.

Threading: not thread-safe; :class:`~trainguard.metrics.agent.AgentMetrics` serialises calls.
Times are seconds on the ledger's clock (``time.monotonic`` by default).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from trainguard.metrics.names import WASTE_REASONS
from trainguard.runtime.protocol import AgentState

TERMINAL_STATES = frozenset(s.value for s in AgentState if s.terminal)
"""States that end the paid clock: the agent is going away or the job is over."""

_INFERRED_CAUSE = {"draining": "drain", "resizing": "resize", "rendezvous": "resize", "starting": "restart",
                   "failed": "restart"}
"""Cause of downtime that begins by leaving ``running`` for this state, when nobody said why."""

MAX_MARKS = 100_000


@dataclass(frozen=True, slots=True)
class GoodputSnapshot:
    """Seconds of paid time split into productive and wasted-by-reason, at one instant."""

    paid_s: float
    productive_s: float
    wasted_s: dict[str, float] = field(default_factory=dict)
    recomputed_steps: int = 0

    @property
    def goodput(self) -> float:
        """Productive / paid time in 0..1 (1.0 before any time has passed)."""
        return self.productive_s / self.paid_s if self.paid_s > 0 else 1.0

    @property
    def wasted_total_s(self) -> float:
        return sum(self.wasted_s.values())


class GoodputLedger:
    """Accumulates the time partition described in the module docstring.

    Call :meth:`set_state` on every agent state change (lower-case state names, see
    :data:`~trainguard.metrics.names.AGENT_STATES`), :meth:`set_cause` when the reason for the
    coming or current downtime is known (a notice means ``drain``, a crash ``restart``),
    :meth:`progress` with the workers' step, :meth:`committed` with the newest committed step and
    :meth:`restored` when workers restart from a checkpoint. Every method takes ``now`` (clock
    seconds) for tests; by default it reads the clock.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, now: float | None = None) -> None:
        self._clock = clock
        t = clock() if now is None else now
        self._start = t
        self._stopped_at: float | None = None
        self._state = "starting"
        self._running_since: float | None = None
        self._intervals: deque[tuple[float, float]] = deque()  # closed productive intervals, in order
        self._finalized_s = 0.0  # productive time no rollback can reach any more
        self._down_since: float | None = t
        self._cause: str | None = "startup"
        self._wasted: dict[str, float] = {r: 0.0 for r in WASTE_REASONS}
        self._marks: deque[tuple[float, int]] = deque(maxlen=MAX_MARKS)  # (time, step), both increasing
        self._recomputed_steps = 0

    # -- events ---------------------------------------------------------------------------------
    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    @property
    def state(self) -> str:
        return self._state

    @property
    def running(self) -> bool:
        return self._running_since is not None

    def set_state(self, state: str, now: float | None = None) -> None:
        """The agent entered ``state`` at ``now``."""
        if self._stopped_at is not None:
            return
        t = self._now(now)
        state = state.lower()
        self._state = state
        if state == "running":
            if self._running_since is None:
                self._close_downtime(t)
                self._down_since = None
                self._running_since = t
                self._cause = None
            return
        if self._running_since is not None:  # leaving running: downtime begins
            self._intervals.append((self._running_since, t))
            self._running_since = None
            self._down_since = t
            if self._cause is None:
                self._cause = _INFERRED_CAUSE.get(state, "other")
        if state in TERMINAL_STATES:
            self.stop(t)

    def set_cause(self, reason: str, now: float | None = None) -> None:
        """Attribute the current downtime (or, while running, the next one) to ``reason``.

        Relabels the whole open downtime segment (since the last state change): a crash found
        during a rendezvous makes that rendezvous ``restart`` time. Segments closed by earlier state
        changes keep their reason. ``now`` is accepted for symmetry; the relabel is instantaneous.
        """
        if reason not in self._wasted:
            reason = "other"
        self._cause = reason

    def progress(self, step: int, now: float | None = None) -> None:
        """Step ``step`` had been completed by ``now``. Non-increasing steps are ignored."""
        if not self._marks or step > self._marks[-1][1]:
            self._marks.append((self._now(now), step))

    def committed(self, step: int, now: float | None = None) -> None:
        """Step ``step`` is in a committed checkpoint: time before it can no longer be rolled back."""
        t_step = self._time_of(step)
        if t_step is None:
            return
        while len(self._marks) > 1 and self._marks[1][1] <= step:
            self._marks.popleft()
        while self._intervals and self._intervals[0][1] <= t_step:
            s, e = self._intervals.popleft()
            self._finalized_s += e - s

    def restored(self, step: int, now: float | None = None) -> tuple[float, int]:
        """Workers restart from checkpoint ``step``: running time spent past it becomes ``recompute``.

        Returns ``(seconds, steps)`` reclassified. Steps are the ones trained beyond ``step`` before
        the rollback (the highest step seen minus ``step``).
        """
        t = self._now(now)
        top = self._marks[-1][1] if self._marks else None
        seconds, steps = 0.0, 0
        if top is not None and step < top:
            t_step = self._time_of(step)
            seconds = self._cut_productive(float("-inf") if t_step is None else t_step, t)
            steps = top - step
            self._wasted["recompute"] += seconds
            self._recomputed_steps += steps
        while self._marks and self._marks[-1][1] >= step:
            self._marks.pop()
        self._marks.append((t, step))
        return seconds, steps

    def lost_work(self, seconds: float, steps: int = 0, reason: str = "recompute", now: float | None = None) -> float:
        """Move the most recent ``seconds`` of productive time to ``wasted[reason]``.

        For callers that measured the loss themselves (the drain coordinator when a deadline was
        missed). Do not also call :meth:`restored` for the same rollback. Returns the seconds moved
        (capped at the productive time still open to rollback).
        """
        if reason not in self._wasted:
            reason = "other"
        t = self._now(now)
        reopen = self._running_since is not None
        if reopen:
            self._intervals.append((self._running_since, t))
            self._running_since = None
        left = max(0.0, seconds)
        moved = 0.0
        while left > 0 and self._intervals:
            s, e = self._intervals.pop()
            take = min(left, e - s)
            left -= take
            moved += take
            if e - take > s:
                self._intervals.append((s, e - take))
                break
        if reopen:
            self._running_since = t
        self._wasted[reason] += moved
        self._recomputed_steps += max(0, steps)
        return moved

    def stop(self, now: float | None = None) -> None:
        """End the paid clock (agent stopping). Idempotent."""
        if self._stopped_at is not None:
            return
        t = self._now(now)
        if self._running_since is not None:
            self._intervals.append((self._running_since, t))
            self._running_since = None
        else:
            self._close_downtime(t)
        self._down_since = None
        self._stopped_at = t

    # -- reading --------------------------------------------------------------------------------
    def snapshot(self, now: float | None = None) -> GoodputSnapshot:
        """The partition at ``now`` (or at the stop time, once stopped)."""
        t = self._now(now) if self._stopped_at is None else self._stopped_at
        productive = self._finalized_s + sum(e - s for s, e in self._intervals)
        wasted = dict(self._wasted)
        if self._running_since is not None:
            productive += t - self._running_since
        elif self._down_since is not None:
            wasted[self._cause or "other"] += t - self._down_since
        return GoodputSnapshot(paid_s=t - self._start, productive_s=productive, wasted_s=wasted,
                               recomputed_steps=self._recomputed_steps)

    # -- internals ------------------------------------------------------------------------------
    def _close_downtime(self, t: float) -> None:
        if self._down_since is not None:
            self._wasted[self._cause or "other"] += t - self._down_since
            self._down_since = t

    def _time_of(self, step: int) -> float | None:
        """When ``step`` was reached, interpolated between marks; ``None`` if before every mark."""
        marks = self._marks
        if not marks or step > marks[-1][1]:
            return marks[-1][0] if marks else None
        steps = [k for _, k in marks]
        i = bisect.bisect_left(steps, step)
        t1, k1 = marks[i]
        if k1 == step:
            return t1
        if i == 0:
            return None
        t0, k0 = marks[i - 1]
        return t0 + (t1 - t0) * (step - k0) / (k1 - k0)

    def _cut_productive(self, t_from: float, t_to: float) -> float:
        """Remove productive time inside ``[t_from, t_to]`` from the intervals; return its length."""
        if self._running_since is not None:
            self._intervals.append((self._running_since, t_to))
            self._running_since = t_to
        kept: deque[tuple[float, float]] = deque()
        cut = 0.0
        for s, e in self._intervals:
            lo, hi = max(s, t_from), min(e, t_to)
            if hi <= lo:
                kept.append((s, e))
                continue
            cut += hi - lo
            if s < lo:
                kept.append((s, lo))
            if hi < e:
                kept.append((hi, e))
        self._intervals = kept
        return cut
