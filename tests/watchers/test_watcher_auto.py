"""Cloud auto-detection and build_watchers against the emulators."""

from __future__ import annotations

import time

import pytest

from tests.emulators import closed_port_url
from tests.watchers.conftest import Collector, events
from trainguard.agent.watchers import (PreemptionConfig, acknowledge, build_watchers, detect_cloud,
                                       manual_watcher, start_all, stop_all)

pytestmark = pytest.mark.timeout(30)


def cfg(probe_timeout_s: float = 5.0, **endpoints) -> PreemptionConfig:
    """Probes that must succeed get 5 s (an emulator answers in milliseconds, but a loaded CI machine
    once took over 0.5 s); the tests of a bound pass their own short timeout."""
    dead = closed_port_url()
    base = {"aws_endpoint": dead, "gcp_endpoint": dead, "azure_endpoint": dead}
    return PreemptionConfig(**{**base, **endpoints}, poll_interval_s=0.05, request_timeout_s=0.3,
                            probe_timeout_s=probe_timeout_s, gcp_wait_timeout_s=2)


def test_detects_aws(aws_imds):
    assert detect_cloud(cfg(aws_endpoint=aws_imds.url)) == "aws"
    assert aws_imds.count("/latest/api/token", method="PUT") == 1


def test_detects_gcp(gcp_metadata):
    assert detect_cloud(cfg(gcp_endpoint=gcp_metadata.url)) == "gcp"


def test_detects_azure(azure_events):
    assert detect_cloud(cfg(azure_endpoint=azure_events.url)) == "azure"


def test_aws_probe_against_azure_endpoint_is_not_aws(azure_events):
    """AWS and Azure share 169.254.169.254: a 200 is not enough, the answer's shape decides."""
    assert detect_cloud(cfg(aws_endpoint=azure_events.url, azure_endpoint=azure_events.url)) == "azure"


def test_off_cloud_is_fast_logged_once_and_runs_signals_only(logs):
    c = cfg(probe_timeout_s=0.5)
    t0 = time.monotonic()
    ws = build_watchers(PreemptionConfig(**{**_fields(c), "sources": ["auto"]}))
    assert time.monotonic() - t0 < 2.0
    assert [w.name for w in ws] == ["signal", "manual"]
    assert len(events(logs, "preemption_cloud_not_detected")) == 1


def test_hanging_probe_is_bounded(aws_imds):
    aws_imds.misbehave("hang", count=1)
    t0 = time.monotonic()
    assert detect_cloud(cfg(probe_timeout_s=0.5, aws_endpoint=aws_imds.url)) is None
    assert time.monotonic() - t0 < 1.5


def _fields(c: PreemptionConfig) -> dict:
    return {f: getattr(c, f) for f in c.__slots__}


@pytest.mark.parametrize("cloud,names", [("aws", ["aws"]), ("gcp", ["gcp-preempted", "gcp-maintenance-event"]),
                                         ("azure", ["azure"])])
def test_build_watchers_auto(cloud, names, aws_imds, gcp_metadata, azure_events):
    url = {"aws": aws_imds.url, "gcp": gcp_metadata.url, "azure": azure_events.url}[cloud]
    ws = build_watchers(cfg(**{f"{cloud}_endpoint": url}))
    assert [w.name for w in ws] == names + ["signal", "manual"]


def test_build_watchers_none_and_explicit():
    assert [w.name for w in build_watchers(PreemptionConfig(sources=["none"]))] == ["manual"]
    ws = build_watchers(PreemptionConfig(sources=["azure", "aws", "aws"], sigusr1=True))
    assert [w.name for w in ws] == ["azure", "aws", "manual"]


def test_end_to_end_azure_notice_ack_and_manual_drain(azure_events):
    c = PreemptionConfig(**{**_fields(cfg(azure_endpoint=azure_events.url)), "sources": ["auto", "signal"]})
    ws = build_watchers(c)
    got = Collector()
    start_all(ws, got)
    try:
        eid = azure_events.preempt(in_s=30)
        [n] = got.wait(1)
        assert acknowledge(ws, n) is True and azure_events.acknowledged == [eid]
        d = manual_watcher(ws).trigger(10, "cli")
        assert got.wait(2)[1] == d
    finally:
        assert stop_all(ws)
