"""Clamp a cloud notice's deadline to what the provider documents.

A metadata server's time is data, not truth: an AWS ``instance-action`` time in the past (clock skew,
a replayed answer) would make the deadline minus millions of seconds — the agent would kill the
workers at once, with no checkpoint — and a time in the year 2999 would never escalate. The window
between a notice and the action is documented per provider, so the deadline is kept within
``[received + DEADLINE_FLOOR_S, received + cap]``:

======  ===========================================  ===========================================
source  kind                                         cap (documented notice)
======  ===========================================  ===========================================
aws     termination, rebalance                       120 s (spot two-minute warning)
gcp     preempt                                      30 s (preemption notice)
gcp     termination, maintenance                     60 s (``maintenance-event`` lead time)
azure   every Scheduled Event (``NotBefore``)        900 s (the longest lead time, 15 minutes)
======  ===========================================  ===========================================

The floor gives a notice whose deadline is already past (or nearly) a few seconds for an emergency
checkpoint instead of none. Signals and manual drains carry configured deadlines and are not
clamped. :func:`clamp_deadline` is pure; :meth:`Watcher.emit` applies it and logs
``notice_deadline_clamped`` when it changes a deadline.
"""

from __future__ import annotations

import dataclasses

from trainguard.agent.watchers.base import Notice

DEADLINE_FLOOR_S = 5.0
"""Least time a cloud notice leaves for the drain, whatever its deadline says."""

AWS_NOTICE_S = 120.0
GCP_PREEMPT_NOTICE_S = 30.0
GCP_MAINTENANCE_NOTICE_S = 60.0
AZURE_MAX_NOTICE_S = 900.0

CAPS: dict[tuple[str, str], float] = {
    ("aws", "termination"): AWS_NOTICE_S,
    ("aws", "rebalance"): AWS_NOTICE_S,
    ("gcp", "preempt"): GCP_PREEMPT_NOTICE_S,
    ("gcp", "termination"): GCP_MAINTENANCE_NOTICE_S,
    ("gcp", "maintenance"): GCP_MAINTENANCE_NOTICE_S,
}
SOURCE_CAPS: dict[str, float] = {"aws": AWS_NOTICE_S, "gcp": GCP_MAINTENANCE_NOTICE_S, "azure": AZURE_MAX_NOTICE_S}


def cap_for(source: str, kind: str) -> float | None:
    """The documented longest notice of ``source``/``kind`` (seconds), None for unclamped sources."""
    return CAPS.get((source, kind), SOURCE_CAPS.get(source))


def clamp_deadline(notice: Notice) -> tuple[Notice, str | None]:
    """``(notice with its deadline clamped, why)``; ``why`` is None when nothing changed."""
    cap = cap_for(notice.source, notice.kind)
    if cap is None:
        return notice, None
    left = notice.deadline - notice.received_at
    if left < DEADLINE_FLOOR_S:
        why = "in_the_past" if left < 0 else "below_floor"
        new = notice.received_at + DEADLINE_FLOOR_S
    elif left > cap:
        why = "beyond_documented_notice"
        new = notice.received_at + cap
    else:
        return notice, None
    detail = {**notice.detail, "deadline_clamped": why, "deadline_given": notice.deadline}
    return dataclasses.replace(notice, deadline=new, detail=detail), why
