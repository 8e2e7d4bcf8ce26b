"""``trainguard status``: the node's live view, read from its agent's ``/metrics``.

Reads only the exporter (no agent internals), so it works against any running agent the operator
can reach, and shows exactly what Prometheus would see.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families

DEFAULT_URL = "http://127.0.0.1:9400"


class StatusError(RuntimeError):
    """The agent's endpoint could not be read."""


def fetch_metrics(url: str, timeout_s: float = 5.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET ``<url>/metrics`` and return ``{sample name: [(labels, value), ...]}``."""
    target = url.rstrip("/")
    if not target.endswith("/metrics"):
        target += "/metrics"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8")
    except (urllib.error.URLError, OSError) as e:
        raise StatusError(f"cannot read {target}: {getattr(e, 'reason', e)}. Fix: is the agent running on this node, "
                          "and does --url match metrics.bind_address/metrics.port "
                          "(env TRAINGUARD_METRICS_BIND_ADDRESS/TRAINGUARD_METRICS_PORT)?") from e
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def build_view(m: dict[str, list[tuple[dict[str, str], float]]], now: float | None = None) -> dict[str, Any]:
    """Reduce parsed samples to the fields ``trainguard status`` prints (``None`` when absent)."""
    now = time.time() if now is None else now

    def one(name: str) -> float | None:
        vals = m.get(name)
        return sum(v for _, v in vals) if vals else None

    state = next((lbl.get("state") for lbl, v in m.get("trainguard_agent_state", []) if v == 1), None)
    node = next((lbl.get("node") for vals in m.values() for lbl, _ in vals if "node" in lbl), None)
    pricing = next((lbl for lbl, _ in m.get("trainguard_pricing_info", [])), {})
    ckpt_ts = one("trainguard_checkpoint_last_commit_timestamp_seconds")
    wasted = {lbl.get("reason", "?"): v for lbl, v in m.get("trainguard_cost_wasted_total", []) if v > 0}
    gpus = {lbl.get("gpu"): v for lbl, v in m.get("trainguard_gpu_memory_used_bytes", [])}
    gpu_total = {lbl.get("gpu"): v for lbl, v in m.get("trainguard_gpu_memory_total_bytes", [])}
    return {
        "node": node,
        "state": state,
        "world_size": one("trainguard_world_size"),
        "nodes": one("trainguard_nodes"),
        "rendezvous_round": one("trainguard_rendezvous_round"),
        "step": one("trainguard_step"),
        "samples_per_second": one("trainguard_samples_per_second"),
        "tokens_per_second": one("trainguard_tokens_per_second"),
        # Before the first commit the gauges read 0 (a timestamp of 0 is 1970, not a checkpoint).
        "last_checkpoint_step": one("trainguard_checkpoint_last_committed_step") if ckpt_ts else None,
        "last_checkpoint_age_s": max(0.0, now - ckpt_ts) if ckpt_ts else None,
        "checkpoint_failures": one("trainguard_checkpoint_failures_total"),
        "restarts": one("trainguard_restarts_total"),
        "cost": one("trainguard_cost_total"),
        "currency": pricing.get("currency", ""),
        "price_per_hour": one("trainguard_price_per_hour"),
        "cost_wasted": wasted,
        "goodput_ratio": one("trainguard_goodput_ratio"),
        "gpu_memory": {g: (gpus[g], gpu_total.get(g)) for g in sorted(gpus, key=lambda x: int(x or 0))},
    }


def _fmt(v: Any, spec: str = "g", unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:{spec}}{unit}"


def format_view(v: dict[str, Any]) -> str:
    """The human-readable table printed by ``trainguard status``."""
    cur = v["currency"]
    ckpt = "none yet" if v["last_checkpoint_step"] is None else (
        f"step {v['last_checkpoint_step']:.0f}, {v['last_checkpoint_age_s']:.0f} s ago")
    wasted = ", ".join(f"{r} {c:.4f}" for r, c in sorted(v["cost_wasted"].items())) or "none"
    lines = [
        f"node              {v['node'] or '-'}",
        f"state             {v['state'] or '-'}",
        f"world size        {_fmt(v['world_size'], '.0f')} workers on {_fmt(v['nodes'], '.0f')} nodes "
        f"(round {_fmt(v['rendezvous_round'], '.0f')})",
        f"step              {_fmt(v['step'], '.0f')}",
        f"throughput        {_fmt(v['samples_per_second'], '.1f')} samples/s, {_fmt(v['tokens_per_second'], '.0f')} tokens/s",
        f"last checkpoint   {ckpt} (failures: {_fmt(v['checkpoint_failures'], '.0f')})",
        f"restarts          {_fmt(v['restarts'], '.0f')}",
        f"cost              {_fmt(v['cost'], '.4f')} {cur} at {_fmt(v['price_per_hour'], '.4f')} {cur}/h; wasted: {wasted}",
        f"goodput           {_fmt(None if v['goodput_ratio'] is None else v['goodput_ratio'] * 100, '.1f', ' %')}",
    ]
    for g, (used, total) in v["gpu_memory"].items():
        tot = "-" if total is None else f"{total / 2**30:.1f}"
        lines.append(f"gpu {g:<14}{used / 2**30:.1f} / {tot} GiB")
    return "\n".join(lines) + "\n"


def status(url: str = DEFAULT_URL, *, timeout_s: float = 5.0, out: TextIO | None = None,
           err: TextIO | None = None) -> int:
    """Print the node's live view from ``url``; return the process exit code (0, or 1 if unreachable)."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        view = build_view(fetch_metrics(url, timeout_s))
    except StatusError as e:
        print(f"trainguard status: {e}", file=err)
        return 1
    out.write(format_view(view))
    return 0
