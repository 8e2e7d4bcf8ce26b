"""How far ahead of a termination deadline a node must start its drain (``preemption.drain_lead_s: auto``).

A drain stops the world at the next step boundary and takes an emergency checkpoint of that step, so
the lead must cover a step plus a checkpoint, with margin: :func:`auto_drain_lead` takes
:data:`FACTOR` times their sum as measured on the node, plus the longest wait for the ranks' next
step agreement (``workers.step_agreement_period_s``: a stop is acted on there), at least :data:`MIN_S`, and
:data:`UNMEASURED_S` before anything was measured. The rule is pure; the spot-trace simulation sizes the
lead the same way.

What was measured is the agent's own :class:`DrainCosts`, fed by the reports its workers send over the
control socket (:class:`~trainguard.contract.protocol.Pace`: the time of their steps and the stage and
persist seconds of the checkpoints they committed since the last report;
:class:`~trainguard.contract.protocol.Committed`: those of a resize, emergency or final checkpoint). The metrics observe the same path and export the lead; they never size it (DESIGN).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from trainguard.contract import protocol as proto

MIN_S = 10.0
"""The shortest lead (``preemption.drain_lead_min_s``)."""
FACTOR = 3.0
"""The lead as a multiple of the measured drain cost (``preemption.drain_lead_factor``)."""
UNMEASURED_S = 30.0
"""The lead while nothing was measured (``preemption.drain_lead_unmeasured_s``)."""


@dataclass(frozen=True, slots=True)
class LeadCosts:
    """What a drain costs on this node, as measured (seconds; None: nothing measured yet)."""

    step_s: float | None = None
    """A step (a drain stops the world at a step boundary first): the agent takes the 99th percentile."""
    checkpoint_s: float | None = None
    """The longest checkpoint stage + persist (any kind: periodic, resize, emergency)."""
    agreement_s: float = 0.0
    """The longest wait for the ranks' next step agreement, where a stop is acted on (a bound from the
    config, ``workers.step_agreement_period_s``, added once: it is not a measurement)."""


def auto_drain_lead(costs: LeadCosts, *, min_s: float = MIN_S, factor: float = FACTOR,
                    unmeasured_s: float = UNMEASURED_S) -> tuple[float, str]:
    """``(lead seconds, basis)``: ``factor`` times a step plus a checkpoint, plus the agreement wait,
    at least ``min_s``;
    ``unmeasured_s`` while neither was measured. ``basis`` is ``measured``, ``floor`` (``min_s`` won)
    or ``unmeasured``."""
    parts = [c for c in (costs.step_s, costs.checkpoint_s) if c is not None and c >= 0]
    if not parts:
        return unmeasured_s, "unmeasured"
    lead = factor * sum(parts) + max(0.0, costs.agreement_s)
    return (lead, "measured") if lead > min_s else (min_s, "floor")


STEP_QUANTILE = 0.99
"""The share of the reported steps the step bound covers (a first step that compiled or autotuned for a
minute is no drain's step)."""
STEP_WINDOW = 1024
"""How many of the newest reported steps :class:`DrainCosts` keeps (all local ranks together)."""


class DrainCosts:
    """What a drain costs on this node, from its workers' reports (see the module docstring): the
    :data:`STEP_QUANTILE` quantile of the whole time of the last :data:`STEP_WINDOW` steps any local rank
    reported (:attr:`Pace.step_s <trainguard.contract.protocol.Pace.step_s>`), and the longest stage +
    persist of a checkpoint a worker committed, any kind (:attr:`Pace.checkpoint_s
    <trainguard.contract.protocol.Pace.checkpoint_s>`, and a :class:`~trainguard.contract.protocol.Committed`
    report of a saved one).

    Thread-safe: :meth:`observe` runs on the control socket's threads, :meth:`costs` at a notice."""

    def __init__(self, window: int = STEP_WINDOW) -> None:
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=window)
        self._checkpoint_s: float | None = None

    def observe(self, msg: proto.Message) -> None:
        """A worker's report (any message: those that measure nothing are ignored)."""
        if isinstance(msg, proto.Pace):
            with self._lock:
                self._steps.extend(msg.step_s)
                if msg.checkpoint_s:
                    self._checkpoint(max(msg.checkpoint_s))
        elif isinstance(msg, proto.Committed) and msg.saved:
            with self._lock:
                self._checkpoint(msg.stage_s + msg.persist_s)

    def _checkpoint(self, seconds: float) -> None:
        self._checkpoint_s = seconds if self._checkpoint_s is None else max(self._checkpoint_s, seconds)

    def costs(self, agreement_s: float = 0.0) -> LeadCosts:
        """What :func:`auto_drain_lead` sizes the lead from (``agreement_s``: see :attr:`LeadCosts.agreement_s`)."""
        with self._lock:
            steps = sorted(self._steps)
            checkpoint_s = self._checkpoint_s
        step_s = steps[max(0, math.ceil(STEP_QUANTILE * len(steps)) - 1)] if steps else None
        return LeadCosts(step_s=step_s, checkpoint_s=checkpoint_s, agreement_s=agreement_s)


__all__ = ["FACTOR", "MIN_S", "STEP_QUANTILE", "STEP_WINDOW", "UNMEASURED_S", "DrainCosts", "LeadCosts", "auto_drain_lead"]
