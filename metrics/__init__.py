"""trainguard.metrics: Prometheus metrics of a node, its workers, GPUs, checkpoints and cost.

Agent side: :class:`AgentMetrics` (registry, sampler, goodput ledger) and
:class:`MetricsExporter` (``/metrics``, ``/healthz``); worker side: :class:`WorkerMetrics`;
the channel between them: :func:`worker_env` (see :mod:`trainguard.metrics.channel`).
Every metric is listed in ``docs/metrics.md``.
"""

from trainguard.metrics.channel import worker_env

__all__ = ["AgentMetrics", "MetricsExporter", "WorkerMetrics", "worker_env"]


def __getattr__(name: str):  # lazy: a worker must not import the agent side (and vice versa)
    if name == "AgentMetrics":
        from trainguard.metrics.agent import AgentMetrics
        return AgentMetrics
    if name == "MetricsExporter":
        from trainguard.metrics.exporter import MetricsExporter
        return MetricsExporter
    if name == "WorkerMetrics":
        from trainguard.metrics.worker import WorkerMetrics
        return WorkerMetrics
    raise AttributeError(name)
