"""Freeze the public metric surface: names, types and label names (STYLE.md section 8).

A rename is a deliberate change: regenerate with
``TRAINGUARD_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/metrics/test_snapshot.py``, update
``docs/metrics.md`` and say so in the README/changelog.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from trainguard.metrics.agent import AgentMetrics
from trainguard.metrics.config import CostConfig, MetricsConfig

from .conftest import FakeNvml, Workers

SNAPSHOT = Path(__file__).with_name("snapshot_metrics.json")
REPO = Path(__file__).resolve().parents[2]


def exposed_surface(tmp_path: Path, workers: Workers) -> dict[str, dict[str, object]]:
    """Every family a fully-fed node exposes: agent, workers (real process), GPUs (fake NVML)."""
    m = AgentMetrics(MetricsConfig(port=0), CostConfig(spot_price_per_hour=1.0), "node-a", run_dir=str(tmp_path),
                     nvml=FakeNvml([(1, 2, 3)]), start_sampler=False)
    try:
        p = workers.start(m.worker_env(), "--steps", "2", "--step-time", "0", "--ckpt-every", "1", "--gpu-peak", "1")
        assert p.wait(timeout=60) == 0
        m.sample(now=0.0)
        m.sample(now=1.0)
        m.straggler.set_scores({"node-b": 1.0})  # straggler and GPU-health series exist once fed (issue 38)
        m.straggler.set_gpu_health("GPU-0", "ok")
        surface: dict[str, dict[str, object]] = {}
        for fam in m.registry.collect():
            labels = sorted({k for s in fam.samples for k in s.labels} - {"le"})
            surface[fam.name] = {"type": fam.type, "labels": labels,
                                 "samples": sorted({s.name for s in fam.samples})}
        return dict(sorted(surface.items()))
    finally:
        m.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_metric_names_and_labels_are_frozen(tmp_path, workers) -> None:
    got = exposed_surface(tmp_path, workers)
    if os.environ.get("TRAINGUARD_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(json.dumps(got, indent=2) + "\n")
    want = json.loads(SNAPSHOT.read_text())
    assert got == want, ("metric surface changed; if deliberate, regenerate with TRAINGUARD_UPDATE_SNAPSHOTS=1 "
                         "and update docs/metrics.md")


def test_snapshot_is_sane_and_documented() -> None:
    snap = json.loads(SNAPSHOT.read_text())
    docs = (REPO / "docs" / "metrics.md").read_text()
    for name, fam in snap.items():
        assert name.startswith("trainguard_")
        assert {"node", "job_id"} <= set(fam["labels"]), name
        assert set(fam["labels"]) <= {"node", "job_id", "gpu", "kind", "reason", "source", "state", "capacity", "currency", "tier",
                                       "phase", "member", "cause"}, name
        if fam["type"] == "counter":
            assert fam["samples"] == [name + "_total"], name
        for sample in fam["samples"]:
            if not sample.endswith(("_bucket", "_sum", "_count")):
                assert f"`{sample}`" in docs, f"{sample} is not listed in docs/metrics.md"
    assert not [n for n in snap if re.search(r"_(milli|micro|nano|kilo|mega|giga)(seconds|bytes)|_(ms|us|kb|mb|gb)(_|$)", n)], "use base units"


@pytest.mark.timeout(60)
def test_the_agreed_snapshot_interval_is_exported(tmp_path, workers) -> None:
    """The tier-0 interval the world agreed (stretched under ``checkpoint.memory_max_overhead``) is a gauge."""
    m = AgentMetrics(MetricsConfig(port=0), CostConfig(spot_price_per_hour=1.0), "node-a", run_dir=str(tmp_path),
                     nvml=FakeNvml([(1, 2, 3)]), start_sampler=False)
    try:
        p = workers.start(m.worker_env(), "--steps", "2", "--step-time", "0", "--memory-interval", "8")
        assert p.wait(timeout=60) == 0
        got = {s.name: s.value for fam in m.registry.collect() for s in fam.samples}
        assert got["trainguard_checkpoint_memory_interval_steps"] == 8
        assert got["trainguard_checkpoint_memory_bytes"] == 4096
    finally:
        m.close()
