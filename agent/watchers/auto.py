"""``auto``: find out which cloud this node runs on, with short probes, and pick its watchers.

Each probe asks for something only that cloud's metadata server answers, with the header it
demands, and checks the answer's shape (not just a 200: AWS and Azure share 169.254.169.254):

* AWS: ``PUT /latest/api/token`` (IMDSv2) -> 200 with a token.
* GCP: ``GET /computeMetadata/v1/`` with ``Metadata-Flavor: Google`` -> 200 carrying the
  ``Metadata-Flavor: Google`` response header.
* Azure: ``GET /metadata/instance?api-version=2021-02-01`` with ``Metadata: true`` -> 200 with a JSON
  object holding ``compute``.

The three run in parallel, each bounded by ``preemption.probe_timeout_s``; off-cloud they fail fast.
The result is logged once (``preemption_cloud_detected`` / ``preemption_cloud_not_detected``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from trainguard.agent.watchers.aws import TOKEN_PATH, TTL_HEADER, AwsWatcher
from trainguard.agent.watchers.azure import AzureWatcher
from trainguard.agent.watchers.base import Watcher
from trainguard.agent.watchers.config import PreemptionConfig
from trainguard.agent.watchers.gcp import KEYS, GcpWatcher
from trainguard.agent.watchers.http import HttpClient, MetadataError
from trainguard.contract.log import get_logger

CLOUDS = ("aws", "gcp", "azure")
"""Probe order, which is also the preference if (in a test rig) more than one answers."""

log = get_logger("trainguard.watchers.auto")


def probe_aws(endpoint: str, timeout_s: float) -> bool:
    resp = HttpClient(timeout_s).request("PUT", endpoint.rstrip("/") + TOKEN_PATH, {TTL_HEADER: "60"})
    return resp.status == 200 and bool(resp.body.strip())


def probe_gcp(endpoint: str, timeout_s: float) -> bool:
    resp = HttpClient(timeout_s).request("GET", endpoint.rstrip("/") + "/computeMetadata/v1/",
                                         {"Metadata-Flavor": "Google"})
    return resp.status == 200 and resp.header("Metadata-Flavor") == "Google"


def probe_azure(endpoint: str, timeout_s: float) -> bool:
    resp = HttpClient(timeout_s).request("GET", endpoint.rstrip("/") + "/metadata/instance?api-version=2021-02-01",
                                         {"Metadata": "true"})
    if resp.status != 200:
        return False
    try:
        doc = json.loads(resp.body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("compute"), dict)


PROBES: dict[str, Callable[[str, float], bool]] = {"aws": probe_aws, "gcp": probe_gcp, "azure": probe_azure}


def _endpoint(cfg: PreemptionConfig, cloud: str) -> str:
    return {"aws": cfg.aws_endpoint, "gcp": cfg.gcp_endpoint, "azure": cfg.azure_endpoint}[cloud]


def detect_cloud(cfg: PreemptionConfig) -> str | None:
    """Probe all clouds in parallel; the first of :data:`CLOUDS` that answers, or None.

    Blocks at most about ``cfg.probe_timeout_s`` (x2 for a probe that connects then stalls in
    the body); leaves no thread behind.
    """
    results: dict[str, bool | str] = {}

    def run(cloud: str) -> None:
        try:
            results[cloud] = PROBES[cloud](_endpoint(cfg, cloud), cfg.probe_timeout_s)
        except MetadataError as e:
            results[cloud] = e.message
        except Exception as e:  # a probe bug must not stop the agent from starting
            results[cloud] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(c,), name=f"trainguard-probe-{c}", daemon=True) for c in CLOUDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(cfg.probe_timeout_s * 2 + 1)
    found = [c for c in CLOUDS if results.get(c) is True]
    if found:
        log.info("preemption_cloud_detected", cloud=found[0], also_answered=found[1:])
        return found[0]
    log.info("preemption_cloud_not_detected", probes={c: results.get(c, "no answer") for c in CLOUDS},
             fix="watching signals only; set preemption.sources to [aws|gcp|azure, signal] to force a cloud")
    return None


def cloud_watchers(cfg: PreemptionConfig, cloud: str, **kw: Any) -> list[Watcher]:
    """The watchers for one cloud (GCP: one per metadata key)."""
    if cloud == "aws":
        return [AwsWatcher.from_config(cfg, **kw)]
    if cloud == "gcp":
        return [GcpWatcher.from_config(cfg, key, **kw) for key in KEYS]
    if cloud == "azure":
        return [AzureWatcher.from_config(cfg, **kw)]
    raise ValueError(f"unknown cloud {cloud!r}; expected one of {list(CLOUDS)}")


def auto_watchers(cfg: PreemptionConfig, **kw: Any) -> list[Watcher]:
    """Detect the cloud and return its watchers; ``[]`` off-cloud (signals are added by the caller)."""
    cloud = detect_cloud(cfg)
    return cloud_watchers(cfg, cloud, **kw) if cloud else []
