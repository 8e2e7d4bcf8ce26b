"""The agent's hang and eviction series (issue 37), a part of :class:`~trainguard.metrics.agent.AgentMetrics`
on its registry:

* ``trainguard_hangs_detected_total{phase}``: hangs this node detected, by the culprit's phase;
* ``trainguard_hang_detection_seconds``: from the job's last progress to the detection;
* ``trainguard_evictions_total{reason}``: workers ended or nodes removed, by cause (``names.EVICTION_CAUSES``:
  hang, frozen, lost, quarantine, and the straggler and GPU-health drains);
* ``trainguard_quarantined_nodes``: 1 while this node is quarantined.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trainguard.metrics import names

P = names.PREFIX


class HangMetrics:
    """Mixin of :class:`~trainguard.metrics.agent.AgentMetrics`: its hang and eviction series."""

    def _init_hang_metrics(self, r: CollectorRegistry) -> None:
        self._m_hangs = Counter(P + "hangs_detected", "Hangs this node detected (no rank of the job progressed for the "
                                "hang threshold), by the culprit's phase; every node that sees one counts it: max by job.",
                                ["phase"], registry=r)
        for ph in names.HANG_PHASES:
            self._m_hangs.labels(phase=ph)
        self._m_hang_detect = Histogram(P + "hang_detection_seconds", "Time from the job's last progress to the hang "
                                        "being detected.", buckets=names.HANG_DETECT_BUCKETS_S, registry=r)
        self._m_evictions = Counter(P + "evictions", "Workers ended or nodes removed on evidence, by cause.", ["reason"],
                                    registry=r)
        for c in names.EVICTION_CAUSES:
            self._m_evictions.labels(reason=c)
        self._m_quarantined = Gauge(P + "quarantined_nodes", "1 while this node is quarantined (its rank hung twice "
                                    "within hang.quarantine_s; it left the job): sum by job.", registry=r)

    def hang_detected(self, phase: str, seconds: float) -> None:
        """A hang was detected, the culprit in ``phase``, ``seconds`` after the job's last progress."""
        if phase in names.HANG_PHASES:
            self._m_hangs.labels(phase=phase).inc()
        if math.isfinite(seconds) and seconds >= 0:
            self._m_hang_detect.observe(seconds)

    def evicted(self, cause: str, count: int = 1) -> None:
        """``count`` nodes (or a node's workers) evicted for ``cause`` (see names.EVICTION_CAUSES)."""
        if cause in names.EVICTION_CAUSES and count > 0:
            self._m_evictions.labels(reason=cause).inc(count)

    def set_quarantined(self, quarantined: bool) -> None:
        self._m_quarantined.set(1 if quarantined else 0)
