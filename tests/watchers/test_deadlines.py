"""Every metadata request has one absolute deadline (headers included), and cloud deadlines are
clamped to what the provider documents (issue 15: a server trickling headers held a watcher 6 s with
``timeout_s=1``; an AWS time of 2000-01-01 meant "kill now"; 2999 meant "never")."""

from __future__ import annotations

import time

import pytest

from tests.emulators.azure import rfc1123
from tests.watchers.conftest import events
from trainguard.agent.watchers.aws import AwsWatcher
from trainguard.agent.watchers.azure import AzureWatcher
from trainguard.agent.watchers.base import Notice
from trainguard.agent.watchers.deadline import (AWS_NOTICE_S, AZURE_MAX_NOTICE_S, DEADLINE_FLOOR_S, GCP_PREEMPT_NOTICE_S,
                                                clamp_deadline)
from trainguard.agent.watchers.gcp import GcpWatcher
from trainguard.agent.watchers.http import HttpClient, MetadataError

pytestmark = pytest.mark.timeout(60)
NOW = 1_000_000.0

CLAMPS = [
    # (source, kind, deadline - received, expected deadline - received, reason)
    ("aws", "termination", -848_000_000.0, DEADLINE_FLOOR_S, "in_the_past"),
    ("aws", "termination", 1.0, DEADLINE_FLOOR_S, "below_floor"),
    ("aws", "termination", 119.0, 119.0, None),
    ("aws", "termination", 30_000_000_000.0, AWS_NOTICE_S, "beyond_documented_notice"),
    ("aws", "rebalance", 120.0, 120.0, None),
    ("gcp", "preempt", 300.0, GCP_PREEMPT_NOTICE_S, "beyond_documented_notice"),
    ("gcp", "maintenance", 60.0, 60.0, None),
    ("azure", "preempt", -3600.0, DEADLINE_FLOOR_S, "in_the_past"),
    ("azure", "maintenance", 600.0, 600.0, None),
    ("azure", "termination", 86400.0, AZURE_MAX_NOTICE_S, "beyond_documented_notice"),
    ("signal", "stop", 1000.0, 1000.0, None),  # configured deadlines are not clamped
    ("manual", "drain", 0.5, 0.5, None),
]


@pytest.mark.parametrize("source,kind,given,expected,reason", CLAMPS)
def test_clamp_table(source, kind, given, expected, reason):
    n, why = clamp_deadline(Notice(source=source, kind=kind, deadline=NOW + given, received_at=NOW))
    assert why == reason
    assert n.deadline - NOW == pytest.approx(expected)
    if reason:
        assert n.detail["deadline_given"] == NOW + given and n.detail["deadline_clamped"] == reason


def test_trickled_headers_cannot_outlast_the_deadline(aws_imds):
    """The emulator sends its status line and headers one byte every 0.1 s (~12 s in all): a 1 s
    request fails after ~1 s, not after the last header byte."""
    client = HttpClient(1.0)
    aws_imds.misbehave("trickle", count=1, path="/latest/api/token", delay_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(MetadataError) as ei:
        client.request("PUT", aws_imds.url + "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    took = time.monotonic() - t0
    assert took < 1.8, f"the request took {took:.2f}s with timeout_s=1"
    assert ei.value.status is None and "headers included" in ei.value.message


def test_trickle_mode_really_serves_within_a_long_deadline(aws_imds):
    """Guard against a vacuous pass: the same trickle, fast enough, yields a complete answer."""
    aws_imds.misbehave("trickle", count=1, path="/latest/api/token", delay_s=0.002)
    resp = HttpClient(20.0).request("PUT", aws_imds.url + "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    assert resp.status == 200 and resp.body


def test_deadline_passed_before_connect_fails_at_once(aws_imds):
    client = HttpClient(1.0)
    t0 = time.monotonic()
    with pytest.raises(MetadataError):
        client.request("GET", aws_imds.url + "/latest/meta-data/spot/instance-action", timeout_s=1e-9)
    assert time.monotonic() - t0 < 0.5
    assert aws_imds.count("instance-action") == 0


@pytest.mark.parametrize("time_str,expected,reason", [
    ("2000-01-01T00:00:00Z", DEADLINE_FLOOR_S, "in_the_past"),
    ("2999-01-01T00:00:00Z", AWS_NOTICE_S, "beyond_documented_notice"),
])
def test_aws_instance_action_time_is_clamped(aws_imds, run, collector, logs, time_str, expected, reason):
    aws_imds.schedule_termination(time_str=time_str)
    run(AwsWatcher(endpoint=aws_imds.url, poll_interval_s=0.05, request_timeout_s=1.0, rebalance=False), collector)
    [n] = collector.wait(1)
    assert n.deadline - n.received_at == pytest.approx(expected)
    [clamped] = events(logs, "notice_deadline_clamped")
    assert clamped["reason"] == reason and clamped["source"] == "aws"


@pytest.mark.parametrize("offset_s,expected,reason", [
    (-3600.0, DEADLINE_FLOOR_S, "in_the_past"),
    (10 * 86400.0, AZURE_MAX_NOTICE_S, "beyond_documented_notice"),
])
def test_azure_not_before_is_clamped(azure_events, run, collector, logs, offset_s, expected, reason):
    azure_events.preempt(not_before=rfc1123(time.time() + offset_s))
    run(AzureWatcher(endpoint=azure_events.url, vm_name=azure_events.vm_name, poll_interval_s=0.05,
                     request_timeout_s=1.0), collector)
    [n] = collector.wait(1)
    assert n.deadline - n.received_at == pytest.approx(expected, abs=1.0)
    assert events(logs, "notice_deadline_clamped")[0]["reason"] == reason


def test_gcp_preemption_never_longer_than_30s(gcp_metadata, run, collector):
    gcp_metadata.preempt()
    run(GcpWatcher(endpoint=gcp_metadata.url, poll_interval_s=0.05, request_timeout_s=1.0, default_deadline_s=300.0),
        collector)
    [n] = collector.wait(1)
    assert n.deadline - n.received_at == pytest.approx(GCP_PREEMPT_NOTICE_S)
