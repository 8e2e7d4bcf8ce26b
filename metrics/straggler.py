"""Straggler and node-health series of the agent (issue 38), on the agent's registry.

* ``trainguard_straggler_score{member}``: each member node's pace score as this agent last computed it
  (its local compute time per step over the other nodes' median; 1 is the pace of the rest). ``member``
  names the node scored (``node`` is the exporting agent, as on every series). Only the current world's
  members have a series.
* ``trainguard_straggler_seconds_total``: time this node spent in a world with a sustained straggler
  (kept or being evicted). Every node counts it: take ``max by (job_id)``.
* evictions are counted in the agent's one ``trainguard_evictions_total{reason}`` (``straggler``: by the
  deciding node; ``gpu_health``: by the sick node), beside the hang and loss evictions.
* ``trainguard_node_readmissions_total{cause}``: this node entered a world again after an eviction
  (``selftest_passed``).
* ``trainguard_gpu_health_state{gpu,state}``: 1 for each GPU's current health (``ok``, ``degraded``,
  ``fatal``), 0 for the others; absent without NVML.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from trainguard.metrics import names

P = names.PREFIX
READMISSION_CAUSES: tuple[str, ...] = ("selftest_passed",)
GPU_HEALTH_STATES: tuple[str, ...] = ("ok", "degraded", "fatal")
"""The values of ``trainguard.agent.health.GpuHealth`` (a test keeps them equal)."""
MAX_MEMBERS = 256
"""At most this many ``member`` series (a larger world is scored, not exported member by member)."""


class StragglerMetrics:
    """Thread-safe (prometheus_client's own locks; the score set is replaced under one lock)."""

    def __init__(self, registry: CollectorRegistry,
                 count_eviction: Callable[[str, int], None] | None = None) -> None:
        r = registry
        self._count_eviction = count_eviction
        self._score = Gauge(P + "straggler_score", "Each member node's pace score: its local compute time per step "
                            "over the other nodes' median (1 is the rest's pace).", ["member"], registry=r)
        self._time = Counter(P + "straggler_seconds", "Time spent in a world with a sustained straggler (kept or "
                             "being evicted).", registry=r)
        self._readmissions = Counter(P + "node_readmissions", "This node entered a world again after an eviction, "
                                     "by cause.", ["cause"], registry=r)
        self._health = Gauge(P + "gpu_health_state", "1 for each GPU's current health state, 0 for the others.",
                             ["gpu", "state"], registry=r)
        for c in READMISSION_CAUSES:
            self._readmissions.labels(cause=c)
        self._lock = threading.Lock()

    def set_scores(self, scores: Mapping[str, float]) -> None:
        with self._lock:
            self._score.clear()
            for member, s in sorted(scores.items())[:MAX_MEMBERS]:
                self._score.labels(member=member).set(s)

    def straggler_time(self, seconds: float) -> None:
        if seconds > 0:
            self._time.inc(seconds)

    def evicted(self, cause: str) -> None:
        """Counted in ``trainguard_evictions_total{reason}`` (:meth:`AgentMetrics.evicted`)."""
        if self._count_eviction is not None:
            self._count_eviction(cause, 1)

    def readmitted(self, cause: str) -> None:
        self._readmissions.labels(cause=cause if cause in READMISSION_CAUSES else "other").inc()

    def set_gpu_health(self, gpu: str, state: str) -> None:
        for s in GPU_HEALTH_STATES:
            self._health.labels(gpu=gpu, state=s).set(1 if s == state else 0)
