"""The drain coordinator: the one owner of every preemption notice.

Every source — the cloud watchers, signals, and ``trainguard drain`` through the control socket (via
the :class:`~trainguard.agent.watchers.manual.ManualWatcher`) — delivers :class:`Notice` values to
:meth:`DrainCoordinator.on_notice`. A pure policy, :func:`decide_notice`, says what each one means
for this node (table-tested in ``tests/agent/test_drain_policy.py``):

=====================================================  ==========================================
notice                                                 action
=====================================================  ==========================================
spot interruption (AWS ``instance-action``), GCP       ``drain``: every rank checkpoints the same
``preempted``, GCP ``TERMINATE_ON_HOST_MAINTENANCE``,  step, this node leaves before the deadline
Azure ``Preempt``/``Terminate``, SIGTERM/SIGINT,       (cloud notices with ``preemption.
SLURM SIGUSR1, ``trainguard drain``                    train_through_notice``, the default: a
                                                       checkpoint now, the drain the lead before
                                                       the deadline, at once when it is closer)
AWS rebalance recommendation, GCP                      ``preemption.on_early_warning``:
``MIGRATE_ON_HOST_MAINTENANCE`` (live migration),      ``checkpoint`` (default: one out-of-cycle
Azure ``Freeze`` (a pause; memory kept)                checkpoint, the node stays), ``drain`` or
                                                       ``ignore``
Azure ``Reboot``/``Redeploy`` (the VM restarts, its    with ``checkpoint``: a checkpoint now and a
processes are lost)                                    drain ``preemption.drain_lead_s`` before
                                                       ``NotBefore`` (at once when the lead is
                                                       shorter); ``drain``: at once
=====================================================  ==========================================

The coordinator carries the decision out through a :class:`DrainTarget` (the supervisor), counts
notices for the metrics, schedules delayed drains, and acknowledges notices at their source (Azure
``StartRequests``) once the emergency checkpoint is committed. It never blocks the watcher threads.

The drain lead (``preemption.drain_lead_s``) is fixed, or ``auto``:
:func:`~trainguard.agent.lead.auto_drain_lead` sizes it at
each notice from what the node's workers reported to the agent (its steps and its longest checkpoint:
:class:`~trainguard.agent.lead.DrainCosts`), so a job whose emergency
checkpoint takes a minute does not train through a 2-minute notice into a missed deadline, and one
that checkpoints in a second does not idle out most of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from trainguard.agent.watchers.base import Notice
from trainguard.agent.lead import LeadCosts, auto_drain_lead
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.drain")

TERMINATE_KINDS = frozenset({"termination", "preempt", "stop", "drain"})
"""Notice kinds after which the node is gone at the deadline."""
EARLY_WARNING_POLICIES = ("checkpoint", "drain", "ignore")
_RESTARTING_EVENTS = frozenset({"Reboot", "Redeploy"})
"""Azure maintenance events that restart the VM: its processes do not survive them."""


class NoticeAction(str, Enum):
    DRAIN = "drain"
    """Checkpoint at an agreed step and leave the job before the deadline."""
    CHECKPOINT = "checkpoint"
    """Take one out-of-cycle checkpoint and stay in the job (maybe drain later: ``drain_at``)."""
    IGNORE = "ignore"


@dataclass(frozen=True, slots=True)
class NoticeDecision:
    action: NoticeAction
    reason: str
    drain_at: float | None = None
    """With ``CHECKPOINT``: wall-clock time at which the node drains after all (None: it stays)."""


CLOUD_SOURCES = frozenset({"aws", "gcp", "azure"})
"""Sources whose termination deadline is the provider's own (``train_through_notice`` applies)."""


def decide_notice(notice: Notice, *, on_early_warning: str, drain_lead_s: float, now: float,
                  train_through: bool = False) -> NoticeDecision:
    """What ``notice`` means for this node. Pure: no clocks, no I/O (``now`` is epoch seconds)."""
    if notice.kind in TERMINATE_KINDS:
        reason = f"{notice.source}_{notice.kind}"
        if train_through and notice.source in CLOUD_SOURCES and notice.deadline - now > drain_lead_s:
            return NoticeDecision(NoticeAction.CHECKPOINT, reason, drain_at=notice.deadline - drain_lead_s)
        return NoticeDecision(NoticeAction.DRAIN, reason)
    event = str(notice.detail.get("EventType") or notice.detail.get("value") or notice.kind)
    if notice.source == "azure" and event in _RESTARTING_EVENTS:
        if on_early_warning == "ignore":
            return NoticeDecision(NoticeAction.IGNORE, f"azure_{event.lower()}_ignored_by_config")
        lead = notice.deadline - now
        if on_early_warning == "drain" or lead <= drain_lead_s:
            return NoticeDecision(NoticeAction.DRAIN, f"azure_{event.lower()}_restarts_the_vm")
        return NoticeDecision(NoticeAction.CHECKPOINT, f"azure_{event.lower()}_restarts_the_vm",
                              drain_at=notice.deadline - drain_lead_s)
    reason = f"{notice.source}_{event.lower()}"
    if on_early_warning == "drain":
        return NoticeDecision(NoticeAction.DRAIN, reason)
    if on_early_warning == "ignore":
        return NoticeDecision(NoticeAction.IGNORE, reason)
    return NoticeDecision(NoticeAction.CHECKPOINT, reason)


class DrainTarget(Protocol):
    """What the coordinator drives (the supervisor)."""

    def request_drain(self, source: str, kind: str, deadline: float, reason: str = "") -> bool: ...

    def request_checkpoint(self, reason: str) -> bool: ...

    def checkpoint_supported(self) -> bool:
        """Whether the workers can take an out-of-cycle checkpoint now (they use the worker API): a
        notice is trained through only then, with its insurance checkpoint."""
        ...


class NoticeObserver(Protocol):
    def notice(self, source: str) -> None: ...


class DrainCoordinator:
    """Owns the notices of one node. Thread-safe: watchers call :meth:`on_notice` on their threads."""

    def __init__(self, target: DrainTarget, *, on_early_warning: str = "checkpoint",
                 drain_lead_s: float | Callable[[], tuple[float, str]] = 20.0,
                 train_through: bool = False, observer: NoticeObserver | None = None,
                 acknowledge: Callable[[Notice], bool] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._target = target
        self.on_early_warning = on_early_warning
        self.drain_lead_s = drain_lead_s
        self.train_through = train_through
        self._observer = observer
        self._acknowledge = acknowledge
        self._clock = clock
        self._lock = threading.Lock()
        self._to_acknowledge: list[Notice] = []
        self._timers: list[threading.Timer] = []
        self._closed = False
        self.decisions: list[tuple[Notice, NoticeDecision]] = []
        """Every notice and what was decided (observability and tests)."""

    def on_notice(self, notice: Notice) -> NoticeDecision:
        """Decide and act on one notice (any thread; returns at once)."""
        now = self._clock()
        lead, basis = self.lead()
        # Training through needs the insurance checkpoint: scripts without the worker API drain at once.
        cloud_end = notice.kind in TERMINATE_KINDS and notice.source in CLOUD_SOURCES
        insured = self.train_through and cloud_end and self._checkpoint_supported()
        d = decide_notice(notice, on_early_warning=self.on_early_warning, drain_lead_s=lead, now=now,
                          train_through=insured)
        with self._lock:
            self.decisions.append((notice, d))
            if d.action is not NoticeAction.IGNORE:
                self._to_acknowledge.append(notice)
        log.warning("notice_decision", source=notice.source, kind=notice.kind, event_id=notice.event_id,
                    action=d.action.value, reason=d.reason, deadline_in_s=round(notice.deadline - now, 1),
                    drain_in_s=None if d.drain_at is None else round(d.drain_at - now, 1),
                    drain_lead_s=round(lead, 2), drain_lead_basis=basis,
                    train_through=insured if cloud_end else None)
        if self._observer is not None:
            try:
                self._observer.notice(notice.source)
            except Exception as e:  # metrics observe, never steer
                log.warning("observer_failed", method="notice", error=str(e))
        if d.action is NoticeAction.DRAIN:
            self._target.request_drain(notice.source, notice.kind, notice.deadline, reason=d.reason)
        elif d.action is NoticeAction.CHECKPOINT:
            self._target.request_checkpoint(d.reason)
            if d.drain_at is not None:
                self._schedule_drain(notice, d)
        return d

    def _checkpoint_supported(self) -> bool:
        probe = getattr(self._target, "checkpoint_supported", None)
        if probe is None:
            return True
        try:
            return bool(probe())
        except Exception as e:  # cannot tell: do not bet the node's work on training through
            log.warning("checkpoint_support_unknown", error=repr(e))
            return False

    def lead(self) -> tuple[float, str]:
        """``(seconds, basis)`` of the drain lead now: ``fixed``, or what the ``auto`` provider says (a
        provider that fails gives the unmeasured default's caution: 30 s, ``provider_failed``)."""
        if not callable(self.drain_lead_s):
            return float(self.drain_lead_s), "fixed"
        try:
            return self.drain_lead_s()
        except Exception as e:  # sizing reads metric files: a bad one must not lose the notice
            log.warning("drain_lead_failed", error=repr(e))
            return 30.0, "provider_failed"

    def _schedule_drain(self, notice: Notice, d: NoticeDecision) -> None:
        assert d.drain_at is not None

        def fire() -> None:
            log.warning("scheduled_drain", source=notice.source, kind=notice.kind, reason=d.reason)
            self._target.request_drain(notice.source, notice.kind, notice.deadline, reason=d.reason)

        timer = threading.Timer(max(0.0, d.drain_at - self._clock()), fire)
        timer.daemon = True
        timer.name = "trainguard-scheduled-drain"
        with self._lock:
            if self._closed:
                return
            self._timers.append(timer)
        timer.start()

    def on_emergency_commit(self) -> None:
        """The emergency checkpoint is committed: acknowledge the notices at their source (Azure
        ``StartRequests`` lets the node go before ``NotBefore``). Called on the control thread."""
        if self._acknowledge is None:
            return
        with self._lock:
            pending, self._to_acknowledge = self._to_acknowledge, []
        for n in pending:
            try:
                if self._acknowledge(n):
                    log.info("notice_acknowledged", source=n.source, event_id=n.event_id)
            except Exception as e:  # an acknowledgement is a courtesy: the deadline stands regardless
                log.warning("notice_acknowledge_failed", source=n.source, event_id=n.event_id, error=str(e))

    def close(self) -> None:
        """Cancel scheduled drains. Idempotent."""
        with self._lock:
            self._closed = True
            timers, self._timers = self._timers, []
        for t in timers:
            t.cancel()

    def describe(self) -> dict[str, Any]:
        return {"on_early_warning": self.on_early_warning,
                "drain_lead_s": "auto" if callable(self.drain_lead_s) else self.drain_lead_s,
                "train_through_notice": self.train_through}


__all__ = ["EARLY_WARNING_POLICIES", "TERMINATE_KINDS", "DrainCoordinator", "DrainTarget", "LeadCosts", "NoticeAction",
           "NoticeDecision", "auto_drain_lead", "decide_notice", "CLOUD_SOURCES"]
