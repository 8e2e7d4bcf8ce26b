"""What a scrape of the agent's registry computes at that moment: the cost, goodput and GPU families
(:func:`computed_families`), the job's stored newest commit as a floor under the workers' series
(:func:`with_stored_commit`) and the ``node`` and ``job_id`` labels on every sample
(:class:`NodeCollector`); plus reading values out of the workers' families
(:func:`values`). A part of :class:`~trainguard.metrics.agent.AgentMetrics`, which
copies its state under its lock and hands it here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from trainguard.metrics import names
from trainguard.metrics.cost import Price, cost_snapshot
from trainguard.metrics.goodput import GoodputSnapshot
from trainguard.metrics.gpu import GpuReading

P = names.PREFIX


def computed_families(worker: list[Metric], g: GoodputSnapshot, rates: tuple[float, float] | None, *,
                      price: Price, currency: str, window_s: float,
                      read_gpu: Callable[[], list[GpuReading]]) -> Iterator[Metric]:
    """The families computed at scrape time from the workers' families ``worker``, the goodput ledger's
    snapshot ``g`` and the throughput ``rates`` (samples/s, tokens/s over ``window_s``; None before two
    samples): paid, productive and wasted seconds, goodput, the price and cost families, and the GPU
    memory and utilisation that ``read_gpu`` reads (NVML) when the iteration reaches them."""
    vals = values(worker)
    c = cost_snapshot(g, price.per_hour, tokens=vals.get(P + "tokens_total", 0.0),
                      samples=vals.get(P + "samples_total", 0.0))

    yield CounterMetricFamily(P + "paid_seconds", "Paid time of this node since the agent started.", value=g.paid_s)
    yield GaugeMetricFamily(P + "productive_seconds",
                            "Paid time spent training steps that were kept (drops when a rollback is found).",
                            value=g.productive_s)
    m = CounterMetricFamily(P + "wasted_seconds", "Paid time not spent on kept training, by reason.", labels=["reason"])
    for reason, s in g.wasted_s.items():
        m.add_metric([reason], s)
    yield m
    yield CounterMetricFamily(P + "recomputed_steps", "Steps rolled back to a checkpoint and trained again.",
                              value=g.recomputed_steps)
    yield GaugeMetricFamily(P + "goodput_ratio", "Productive time / paid time since the agent started (0..1).",
                            value=g.goodput)
    yield GaugeMetricFamily(P + "price_per_hour", "Price of this node per hour, in the currency of trainguard_pricing_info.",
                            value=price.per_hour)
    yield InfoMetricFamily(P + "pricing", "Where the node's price comes from.",
                           value={"capacity": price.capacity, "currency": currency,
                                  "source": price.source.split(":", 1)[0]})
    yield CounterMetricFamily(P + "cost", "Cost of this node since the agent started.", value=c.total)
    m = CounterMetricFamily(P + "cost_wasted", "Cost of wasted time on this node, by reason.", labels=["reason"])
    for reason, v in c.wasted.items():
        m.add_metric([reason], v)
    yield m
    if c.per_million_tokens is not None:
        yield GaugeMetricFamily(P + "cost_per_million_tokens", "This node's cost / its tokens x 1e6.",
                                value=c.per_million_tokens)
    if c.per_thousand_samples is not None:
        yield GaugeMetricFamily(P + "cost_per_thousand_samples", "This node's cost / its samples x 1e3.",
                                value=c.per_thousand_samples)
    if rates is not None:
        yield GaugeMetricFamily(P + "samples_per_second",
                                f"Samples/s on this node over the last {window_s:g} s.",
                                value=rates[0])
        yield GaugeMetricFamily(P + "tokens_per_second",
                                f"Tokens/s on this node over the last {window_s:g} s.",
                                value=rates[1])
    readings = read_gpu()
    if readings:
        used = GaugeMetricFamily(P + "gpu_memory_used_bytes", "GPU memory in use (NVML), per GPU.", labels=["gpu"])
        total = GaugeMetricFamily(P + "gpu_memory_total_bytes", "GPU memory size (NVML), per GPU.", labels=["gpu"])
        util = GaugeMetricFamily(P + "gpu_utilization_ratio",
                                 "Fraction of the last sample period a kernel ran (NVML), per GPU.", labels=["gpu"])
        for rd in readings:
            used.add_metric([rd.label], rd.used_bytes)
            total.add_metric([rd.label], rd.total_bytes)
            if rd.utilization_ratio is not None:
                util.add_metric([rd.label], rd.utilization_ratio)
        yield used
        yield total
        if util.samples:
            yield util


def with_stored_commit(worker: list[Metric], stored: tuple[float, float] | None) -> list[Metric]:
    """The workers' families with the job's newest commit found in the store at start (``stored``: step,
    unix seconds) as a floor under ``..._last_committed_step`` and ``..._last_commit_timestamp_seconds``,
    and those series added where no worker exports them yet (see
    :meth:`AgentMetrics.set_stored_commit <trainguard.metrics.agent.AgentMetrics.set_stored_commit>`)."""
    if stored is None:
        return worker
    want = {P + "checkpoint_last_committed_step": stored[0], P + "checkpoint_last_commit_timestamp_seconds": stored[1]}
    for fam in worker:
        if fam.name in want:
            floor = want.pop(fam.name)
            fam.samples[:] = [s._replace(value=max(s.value, floor)) for s in fam.samples]
    docs = {P + "checkpoint_last_committed_step": "Step of the newest committed checkpoint.",
            P + "checkpoint_last_commit_timestamp_seconds": "Unix time of the newest committed checkpoint."}
    return worker + [GaugeMetricFamily(name, docs[name], value=v) for name, v in want.items()]


def values(families: Iterable[Metric]) -> dict[str, float]:
    """Unlabelled sample values by sample name (labelled samples are summed)."""
    out: dict[str, float] = {}
    for fam in families:
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class NodeCollector:
    """Adds ``node`` and ``job_id`` to every sample and drops ``_created`` samples (noise in the text format)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        node, job_id = self._owner.node, self._owner.job_id
        for fam in self._owner.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                out.samples.append(s._replace(labels={"node": node, "job_id": job_id, **s.labels}))
            yield out
