"""Goodput: how much of the paid time trained steps that were kept.

A pure ledger over a timeline of observations with an injectable clock, so scripted timelines (a
start-up, a drain, a crash and restart, a rollback to a checkpoint) are unit-tested without processes.

Every second of *paid* time (since the agent started, until it stops) lands in exactly one bucket:

* **productive**: wall time of training steps that were kept, i.e. that end up in the final lineage.
  Workers on the trainguard API report it (``trainguard_training_seconds_total``: the wall time of
  each completed step, from the end of the previous step boundary to the start of this one);
* **wasted[reason]** (:data:`~trainguard.metrics.names.WASTE_REASONS`): everything else, by cause:

  - downtime (the agent not ``running``): ``startup`` before the first run, ``drain`` after a notice,
    ``resize`` for a planned re-formation, ``restart`` after a failure, ``other`` when nobody said;
  - ``running`` before the first step of a run completes (process start, imports, model build,
    restore): the cause of the downtime that preceded it, ``startup`` for the first run;
  - ``running`` between steps once they flow: ``checkpoint`` (saves blocking training, the per-step
    agreement on drains and saves);
  - ``recompute``: step time of steps that were rolled back to a checkpoint and trained again.

So ``paid == productive + sum(wasted)`` always holds (the tests assert it), and
``goodput = productive / paid``. Productive time can *decrease* (a rollback reclassifies it), which
is why it is exported as a gauge while paid and wasted time are counters.

How time is split: the caller reports, at each sample and on each state change, the node's cumulative
step wall time ``S`` (:meth:`GoodputLedger.progress`). The time between two reports (a *window*) is
``ΔS`` of steps plus non-step time, which goes to the cause in effect during the window. Step time
comes late (workers flush it at agreement boundaries, and a step that straddles the end of a window is
reported in the next one), so the non-step time of a window in which the workers run is held back for
:data:`LATE_S` before it is booked: step time reported beyond its own window's length takes it back,
the newest first. What is left over is carried into the next steady window's non-step time (the
``checkpoint`` cause; a downtime's window never pays it). So no bucket ever decreases and the totals stay
exact, also when a run ends (a drain, a re-formation) right after steps that were not yet reported. The
open window (since the last report) and the held-back time count as productive until they are booked.

Scripts that report no step time (unmodified torchrun scripts, "tier 1") keep the state-only view:
time ``running`` is productive. Until a node's workers report (they declare the series at set-up,
before their first step) its running time is *pending*: productive for now, and turned into waste of
the run's cause when the first report shows the workers use the worker API, or when the agent stops
first (workers that never reached set-up trained nothing). After :data:`TIER1_AFTER_S` seconds of
running without a report the node is taken for tier 1 and its pending time stays productive.

Rollbacks: :meth:`GoodputLedger.progress` records ``(step, kept step seconds)`` marks and
:meth:`GoodputLedger.restored` interpolates the kept seconds at the restored step; everything past
it becomes ``recompute``. Marks before the last committed checkpoint are dropped (:meth:`committed`).

Threading: not thread-safe; :class:`~trainguard.metrics.agent.AgentMetrics` serialises calls.
Times are seconds on the ledger's clock (``time.monotonic`` by default).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.contract.protocol import AgentState
from trainguard.metrics.names import WASTE_REASONS

TERMINAL_STATES = frozenset(s.value for s in AgentState if s.terminal)
"""States that end the paid clock: the agent is going away or the job is over."""

_INFERRED_CAUSE = {"draining": "drain", "resizing": "resize", "rendezvous": "resize", "starting": "restart",
                   "restarting": "restart", "failed": "restart"}
"""Cause of downtime that begins by leaving ``running`` for this state, when nobody said why."""

STEADY_CAUSE = "checkpoint"
"""Non-step time of a run once its steps flow: checkpoint saves and the per-step agreement."""

LATE_S = 2.0
"""How long the non-step time of a window in which steps flow is held back before it is booked as
waste: step time reported up to that late (workers flush it at agreement boundaries, every
``workers.step_agreement_period_s``; the agent reads it every ``metrics.sample_interval_s``) takes
it back. Step time later than that is carried (see :class:`GoodputLedger`)."""

MAX_MARKS = 100_000

TIER1_AFTER_S = 120.0
"""Running time without a step report after which a node's workers are taken for a tier-1 script."""


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
    :meth:`progress` with the workers' step and step time, :meth:`committed` with the newest committed
    step and :meth:`restored` when workers restart from a checkpoint. Every method takes ``now``
    (clock seconds) for tests; by default it reads the clock.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, now: float | None = None) -> None:
        self._clock = clock
        t = clock() if now is None else now
        self._start = t
        self._stopped_at: float | None = None
        self._state = "starting"
        self._running = False
        self._down_cause: str | None = "startup"  # cause of the current (or next) downtime
        self._run_cause = "startup"  # cause of a run's time before its first step
        self._stepped = False  # a step completed in the current run
        self._reporting = False  # workers report step time (else: tier-1 view)
        self._t = t  # start of the open window
        self._s = 0.0  # step seconds reported so far (cumulative)
        self._s_window = 0.0  # ... at the start of the open window
        self._carry = 0.0  # step time reported beyond a window's length (<= 0), owed by the next windows
        self._held: deque[list[Any]] = deque()  # [end, seconds, cause]: running non-step time not booked yet
        self._open_cause: str | None = None  # set_cause while running: the open window's non-step time
        self._pending: dict[str, float] = {}  # running time before any report, by cause (see module doc)
        self._tier1 = False
        self._kept = 0.0  # step seconds not rolled back
        self._wasted: dict[str, float] = {r: 0.0 for r in WASTE_REASONS}
        self._marks: deque[tuple[int, float]] = deque(maxlen=MAX_MARKS)  # (step, kept seconds), increasing
        self._recomputed_steps = 0

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    @property
    def state(self) -> str:
        return self._state

    @property
    def running(self) -> bool:
        return self._running

    @property
    def reporting(self) -> bool:
        """Whether the workers report step time (the step view) or not (the tier-1 view)."""
        return self._reporting

    # -- windows --------------------------------------------------------------------------------
    def _cause_now(self) -> str:
        if self._running:
            return STEADY_CAUSE if self._stepped else self._run_cause
        return self._down_cause or "other"

    def _close(self, t: float, *, force: bool) -> None:
        """Close the open window at ``t``; ``force`` for state changes (tier-1 running time then ends)."""
        if self._stopped_at is not None or t < self._t:
            return
        if self._running and not self._reporting:
            if self._tier1:  # tier-1 view: the run's time is productive; nothing to attribute
                self._t = t
                self._s_window = self._s
                return
            cause = self._open_cause or self._run_cause
            self._open_cause = None
            self._pending[cause] = self._pending.get(cause, 0.0) + (t - self._t)
            self._t = t
            self._s_window = self._s
            if sum(self._pending.values()) >= TIER1_AFTER_S:
                self._tier1 = True
                self._pending.clear()
            return
        elapsed = t - self._t
        ds = max(0.0, self._s - self._s_window)
        cause = self._open_cause or self._cause_now()
        self._open_cause = None
        # Step time that arrives late (workers flush their step seconds at agreement boundaries) was
        # non-step time of the steady windows it ran in: only steady windows pay that carry back, so a
        # short downtime (an in-place re-formation's tens of ms) is never swallowed by it.
        steady = cause == STEADY_CAUSE and self._running and self._stepped
        nonstep = elapsed - ds + (self._carry if steady else 0.0)
        while nonstep < 0 and self._held:  # late step time ran in the running windows held back: the newest first
            back = min(self._held[-1][1], -nonstep)
            self._held[-1][1] -= back
            nonstep += back
            if self._held[-1][1] <= 0:
                self._held.pop()
        if nonstep < 0:
            self._carry = nonstep if steady else self._carry + nonstep
        elif self._running:  # some of it may be step time reported later
            self._held.append([t, nonstep, cause])
            if steady:
                self._carry = 0.0
        else:
            self._wasted[cause] += nonstep
        self._book_held(t - LATE_S)
        self._kept += ds
        if ds > 0 and self._running:
            self._stepped = True
        self._t = t
        self._s_window = self._s

    # -- events ---------------------------------------------------------------------------------
    def set_state(self, state: str, now: float | None = None) -> None:
        """The agent entered ``state`` at ``now``."""
        if self._stopped_at is not None:
            return
        t = self._now(now)
        state = state.lower()
        self._close(t, force=True)
        self._state = state
        if state == "running":
            if not self._running:
                self._running = True
                self._stepped = False
                self._run_cause = self._down_cause or "other"
                self._down_cause = None
            return
        if self._running:  # leaving running: downtime begins
            self._running = False
            if self._down_cause is None:
                self._down_cause = _INFERRED_CAUSE.get(state, "other")
        if state in TERMINAL_STATES:
            self.stop(t)

    def set_cause(self, reason: str, now: float | None = None) -> None:
        """Attribute the current downtime (or, while running, the next one) to ``reason``.

        Applies from the open window on (windows close at every sample and state change): while
        running, the time since the last sample is the failure's or notice's too. The supervisor says
        why before it changes state, so whole downtimes get their cause.
        """
        if reason not in self._wasted:
            reason = "other"
        self._down_cause = reason
        if self._running:
            self._open_cause = reason

    def progress(self, step: int | None, now: float | None = None, *, train_s: float | None = None) -> None:
        """A sample of the workers: ``step`` completed (None: no live worker), ``train_s`` seconds of
        step time so far on this node (cumulative; None: the workers do not report it)."""
        t = self._now(now)
        if train_s is not None:
            if not self._reporting:
                self._reporting = True
                self._tier1 = False
                self._s_window = self._s  # nothing was reported before: the open window starts at 0
                self._resolve_pending()
            if train_s >= self._s:
                self._s = train_s
        self._close(t, force=False)
        if step is not None and (not self._marks or step > self._marks[-1][0]):
            self._marks.append((step, self._kept))

    def committed(self, step: int, now: float | None = None) -> None:
        """Step ``step`` is in a committed checkpoint: work before it can no longer be rolled back."""
        while len(self._marks) > 1 and self._marks[1][0] <= step:
            self._marks.popleft()

    def restored(self, step: int, now: float | None = None, *, newest: int | None = None) -> tuple[float, int]:
        """Workers restarted from checkpoint ``step``: kept step time past it becomes ``recompute``.

        Call before reporting the restored workers' own progress. Returns ``(seconds, steps)``
        reclassified; steps are the highest step seen (or ``newest``, a newer committed step the restore
        skipped, if higher: those steps were trained once, perhaps before this agent started) minus
        ``step``; seconds only what this ledger saw trained.
        """
        top = self._marks[-1][0] if self._marks else None
        if newest is not None and (top is None or newest > top):
            top = newest
        seconds, steps = 0.0, 0
        if top is not None and step < top:
            kept_at = self._kept_at(step) if self._marks else self._kept
            seconds = max(0.0, self._kept - kept_at)
            steps = top - step
            self._kept -= seconds
            self._wasted["recompute"] += seconds
            self._recomputed_steps += steps
        while self._marks and self._marks[-1][0] >= step:
            self._marks.pop()
        self._marks.append((step, self._kept))
        return seconds, steps

    def lost_work(self, seconds: float, steps: int = 0, reason: str = "recompute", now: float | None = None) -> float:
        """Move ``seconds`` of productive time to ``wasted[reason]`` (capped at the productive time).

        For callers that measured the loss themselves (e.g. a drain that missed its deadline). Do not
        also call :meth:`restored` for the same rollback. Returns the seconds moved.
        """
        if reason not in self._wasted:
            reason = "other"
        t = self._now(now)
        self._close(t, force=True)
        moved = min(max(0.0, seconds), max(0.0, self.snapshot(t).productive_s))
        self._wasted[reason] += moved
        self._kept = max(0.0, self._kept - moved)
        self._recomputed_steps += max(0, steps)
        return moved

    def _book_held(self, until: float) -> None:
        """Book the held non-step time of the windows that ended by ``until`` as waste of their causes."""
        while self._held and self._held[0][0] <= until:
            _, seconds, cause = self._held.popleft()
            self._wasted[cause] += seconds

    def stop(self, now: float | None = None) -> None:
        """End the paid clock (agent stopping). Idempotent."""
        if self._stopped_at is not None:
            return
        t = self._now(now)
        self._close(t, force=True)
        self._book_held(t)
        self._resolve_pending()  # workers that never reported trained nothing
        self._stopped_at = t

    def _resolve_pending(self) -> None:
        """Running time before any report was start-up of a worker-API job: waste of its cause."""
        for cause, seconds in self._pending.items():
            self._wasted[cause] += seconds
        self._pending.clear()

    # -- reading --------------------------------------------------------------------------------
    def snapshot(self, now: float | None = None) -> GoodputSnapshot:
        """The partition at ``now`` (or at the stop time, once stopped). Productive time is what is
        not wasted: kept step time, the open window, the held-back non-step time (see :data:`LATE_S`),
        and a tier-1 node's running time."""
        t = self._now(now) if self._stopped_at is None else self._stopped_at
        paid = max(0.0, t - self._start)
        wasted = dict(self._wasted)
        return GoodputSnapshot(paid_s=paid, productive_s=paid - sum(wasted.values()), wasted_s=wasted,
                               recomputed_steps=self._recomputed_steps)

    # -- internals ------------------------------------------------------------------------------
    def _kept_at(self, step: int) -> float:
        """Kept step seconds when ``step`` was completed, interpolated between marks."""
        marks = self._marks
        steps = [k for k, _ in marks]
        i = bisect.bisect_left(steps, step)
        if i >= len(marks):
            return marks[-1][1]
        k1, s1 = marks[i]
        if k1 == step:
            return s1
        if i == 0:  # before every mark: all kept time is past it
            return 0.0
        k0, s0 = marks[i - 1]
        return s0 + (s1 - s0) * (step - k0) / (k1 - k0)
