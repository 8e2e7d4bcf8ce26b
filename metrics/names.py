"""Metric names, label values and buckets shared by the worker and agent sides.

Names follow the Prometheus naming guide: prefix ``trainguard_``, base units (``_seconds``,
``_bytes``, ``_ratio`` in 0..1), ``_total`` on counters. Every series carries ``node`` (added by
the agent at exposition). Other labels have small, fixed value sets so cardinality is bounded:
``gpu`` (device index), ``kind``, ``reason``, ``source``, ``state``. The full list with help texts
is in ``docs/metrics.md``; ``tests/metrics/snapshot_metrics.json`` freezes it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable

from trainguard.contract.protocol import AgentState, CheckpointKind, CheckpointTier, EvictionCause, NoticeSource, Phase

PREFIX = "trainguard_"

AGENT_STATES: tuple[str, ...] = tuple(s.value for s in AgentState)
"""States of the agent's state machine (:class:`~trainguard.contract.protocol.AgentState`); one gauge
series per state."""

CHECKPOINT_KINDS: tuple[str, ...] = (*(k.value for k in CheckpointKind), "other")
"""``kind`` label of checkpoint metrics (:class:`~trainguard.contract.protocol.CheckpointKind`):
``periodic`` the interval save; ``emergency`` taken on a drain; ``resize`` taken before a re-formation;
``final`` at the end of training; ``notice`` out of cycle on an early warning; ``other`` anything else."""

CHECKPOINT_TIERS: tuple[str, ...] = tuple(t.value for t in CheckpointTier)
"""``tier`` label of restores (:class:`~trainguard.contract.protocol.CheckpointTier`): ``memory`` the
node's in-memory snapshots (tier 0), ``peer`` a buddy's replica (tier 1), ``storage`` a committed
checkpoint, ``none`` nothing to restore."""

MEMORY_BUCKETS_S: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Buckets of the in-memory snapshot time (a memory copy: milliseconds)."""

NOTICE_SOURCES: tuple[str, ...] = tuple(s.value for s in NoticeSource)
"""``source`` label of preemption notices (:class:`~trainguard.contract.protocol.NoticeSource`)."""

RESTART_REASONS: tuple[str, ...] = ("worker_failure", "worker_hang", "rendezvous_failure", "agent_restart")
"""``reason`` values pre-declared for ``trainguard_restarts_total`` (others are accepted, up to
:data:`MAX_DYNAMIC_LABEL_VALUES`)."""

WASTE_REASONS: tuple[str, ...] = ("startup", "drain", "resize", "restart", "recompute", "checkpoint", "other")
"""``reason`` label of wasted time/cost: ``startup`` until the first step completes; ``drain`` from a
preemption notice until a step completes again; ``resize`` a planned re-formation, likewise;
``restart`` from a failure, likewise (each includes the new workers' start-up and restore);
``recompute`` step time of steps later rolled back and recomputed; ``checkpoint`` time between the
steps of a running job (saves blocking training, the per-step agreement); ``other`` downtime with no
known cause."""

HANG_PHASES: tuple[str, ...] = tuple(p.value for p in Phase if p is not Phase.FINISHED)
"""``phase`` label of detected hangs (:class:`~trainguard.contract.protocol.Phase`): where the culprit
rank was (``step``, ``agreement``, ``save``, ``restore``, ``busy``, ``parked``; a ``finished`` rank is
never named hung)."""

EVICTION_CAUSES: tuple[str, ...] = tuple(c.value for c in EvictionCause)
"""``reason`` label of evictions (:class:`~trainguard.contract.protocol.EvictionCause`): ``hang`` a hung
rank's workers ended by its agent; ``frozen`` a frozen node removed by its peers; ``lost`` a node whose
connections reset and whose agent missed a heartbeat, removed at once; ``quarantine`` a node that hung
twice within ``hang.quarantine_s`` and left; ``straggler`` a straggler drained (counted by the deciding node);
``gpu_health`` a node drained for a fatal GPU condition (counted by that node)."""

HANG_DETECT_BUCKETS_S: tuple[float, ...] = (1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)

MAX_DYNAMIC_LABEL_VALUES = 16
"""Beyond this many distinct values of one free-form label, further values are reported as ``other``."""

STEP_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CHECKPOINT_BUCKETS_S: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
DRAIN_BUCKETS_S: tuple[float, ...] = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

_LABEL_VALUE = re.compile(r"^[a-z0-9_]{1,40}$")


def normalize_label(value: str) -> str:
    """``"Worker-Failure"`` -> ``"worker_failure"``; anything unusable becomes ``other``."""
    v = re.sub(r"[^a-z0-9_]+", "_", str(value).strip().lower()).strip("_")
    return v if _LABEL_VALUE.match(v) else "other"


class BoundedLabels:
    """Free-form label values, normalised, at most :data:`MAX_DYNAMIC_LABEL_VALUES` distinct."""

    def __init__(self, known: Iterable[str]) -> None:
        self.seen = set(known)
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        v = normalize_label(value)
        with self._lock:
            if v in self.seen:
                return v
            if len(self.seen) >= MAX_DYNAMIC_LABEL_VALUES:
                return "other"
            self.seen.add(v)
            return v
