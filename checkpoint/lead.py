"""How far ahead of a termination deadline a node must start its drain (``preemption.drain_lead_s: auto``).

A drain stops the world at the next step boundary and takes an emergency checkpoint of that step, so
the lead must cover a step plus a checkpoint, with margin: :func:`auto_drain_lead` takes
:data:`FACTOR` times their sum as measured on the node, plus the longest wait for the ranks' next
step agreement (``workers.step_agreement_period_s``: a stop is acted on there), at least :data:`MIN_S`, and
:data:`UNMEASURED_S` before anything was measured. Pure: the agent measures (its workers' histograms)
and decides with it at each notice; the spot-trace simulation sizes the lead the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

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


__all__ = ["FACTOR", "MIN_S", "UNMEASURED_S", "LeadCosts", "auto_drain_lead"]
