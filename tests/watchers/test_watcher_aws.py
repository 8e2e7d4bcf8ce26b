"""AwsWatcher against the IMDSv2 emulator."""

from __future__ import annotations

import calendar
import time

import pytest

from tests.emulators import AwsImdsEmulator
from tests.watchers.conftest import events, wait_until
from trainguard.agent.watchers.aws import AWS_SPOT_NOTICE_S, AwsWatcher, parse_instance_action

pytestmark = pytest.mark.timeout(30)

FAST = dict(poll_interval_s=0.05, request_timeout_s=0.3)


def epoch(iso: str) -> float:
    return float(calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")))


def watcher(emu: AwsImdsEmulator, **kw) -> AwsWatcher:
    return AwsWatcher(endpoint=emu.url, **{**FAST, **kw})


def test_termination_detected_once_with_deadline_from_time(aws_imds, run, collector, logs):
    w = run(watcher(aws_imds), collector)
    assert aws_imds.wait_for_requests(4, "instance-action")
    assert collector.notices == []
    t = aws_imds.schedule_termination(in_s=120)
    [n] = collector.wait(1)
    assert (n.source, n.kind, n.detail["action"]) == ("aws", "termination", "terminate")
    assert n.deadline == epoch(t)
    assert 100 <= n.deadline - n.received_at <= 121
    # keeps polling, but reports the same event once
    seen = aws_imds.count("instance-action")
    assert aws_imds.wait_for_requests(seen + 5, "instance-action")
    assert len(collector.notices) == 1
    assert len(events(logs, "preemption_notice", source="aws")) == 1
    assert events(logs, "watcher_error") == []
    assert w.running


@pytest.mark.parametrize("action", ["stop", "hibernate"])
def test_stop_and_hibernate_actions(aws_imds, run, collector, action):
    aws_imds.schedule_termination(in_s=120, action=action)
    run(watcher(aws_imds), collector)
    [n] = collector.wait(1)
    assert n.kind == "termination" and n.detail["action"] == action


def test_every_get_carries_a_token_and_ttl_header_is_sent(aws_imds, run, collector):
    run(watcher(aws_imds, token_ttl_s=300), collector)
    assert aws_imds.wait_for_requests(6, "/latest/meta-data/")
    gets = [r for r in aws_imds.requests if r.method == "GET"]
    assert gets and all(r.headers.get("x-aws-ec2-metadata-token") for r in gets)
    assert all(r.status != 401 for r in gets)
    assert aws_imds.token_ttls == [300]  # one token reused while it is fresh


def test_token_refreshed_before_ttl_expiry(aws_imds, run, collector, logs):
    w = run(watcher(aws_imds, token_ttl_s=1), collector)
    # The watcher counts a fetch once it has read the response, after the emulator counted it issued.
    assert wait_until(lambda: aws_imds.tokens_issued >= 3 and w.token_fetches >= 3, timeout=5)
    assert [r for r in aws_imds.requests if r.status == 401] == []  # refreshed early, never rejected
    aws_imds.schedule_termination()
    assert collector.wait(1)
    assert events(logs, "watcher_error") == []


def test_token_refreshed_on_401(aws_imds, run, collector, logs):
    run(watcher(aws_imds, token_ttl_s=21600), collector)
    assert aws_imds.wait_for_requests(2, "instance-action")
    aws_imds.expire_tokens()  # e.g. IMDS restarted: the cached token is now unknown
    assert wait_until(lambda: aws_imds.tokens_issued >= 2)
    assert any(r.status == 401 for r in aws_imds.requests)
    aws_imds.schedule_termination()
    assert collector.wait(1)
    assert events(logs, "watcher_error") == []


def test_rebalance_is_an_early_warning_then_termination_wins(aws_imds, run, collector):
    run(watcher(aws_imds), collector)
    aws_imds.rebalance()
    [r] = collector.wait(1)
    assert r.kind == "rebalance" and r.is_early_warning
    assert r.deadline == pytest.approx(r.received_at + AWS_SPOT_NOTICE_S)
    aws_imds.schedule_termination()
    notices = collector.wait(2)
    assert [n.kind for n in notices] == ["rebalance", "termination"]
    assert notices[1].priority > notices[0].priority


def test_rebalance_can_be_disabled(aws_imds, run, collector):
    aws_imds.rebalance()
    run(watcher(aws_imds, rebalance=False), collector)
    assert aws_imds.wait_for_requests(5, "instance-action")
    assert collector.notices == [] and aws_imds.count("rebalance") == 0


@pytest.mark.parametrize("mode,status", [("garbage", 200), ("500", 500), ("hang", None), ("slow", None)])
def test_bad_answers_are_logged_and_watcher_survives(aws_imds, run, collector, logs, mode, status):
    aws_imds.misbehave(mode, count=2, path="instance-action", delay_s=1.0 if mode == "slow" else None)
    w = run(watcher(aws_imds), collector)
    assert wait_until(lambda: len(events(logs, "watcher_error")) >= 2)
    errs = events(logs, "watcher_error")
    assert all("instance-action" in e["url"] and e["status"] == status for e in errs[:2])
    if mode == "garbage":
        assert "garbage" in errs[0]["body"] and "not JSON" in errs[0]["error"]
    if mode in ("hang", "slow"):
        assert "within 0.3s" in errs[0]["error"]
    aws_imds.schedule_termination()
    [n] = collector.wait(1)
    assert n.kind == "termination" and w.running
    assert wait_until(lambda: events(logs, "watcher_recovered") != [])


def test_token_endpoint_failure_is_logged_and_recovers(aws_imds, run, collector, logs):
    aws_imds.misbehave("500", count=1, path="/latest/api/token")
    aws_imds.misbehave("garbage", count=1, path="/latest/api/token")
    run(watcher(aws_imds), collector)
    aws_imds.schedule_termination()
    assert collector.wait(1)
    errs = events(logs, "watcher_error")
    assert [e["status"] for e in errs[:2]] == [500, 200]
    assert all(e["url"].endswith("/latest/api/token") for e in errs[:2])


def test_malformed_time_falls_back_to_default_deadline(aws_imds, run, collector, logs):
    aws_imds.schedule_termination(time_str="2026-13-45 25:00")
    run(watcher(aws_imds, default_deadline_s=42.0, clock=lambda: 1000.0), collector)
    [n] = collector.wait(1)
    assert n.deadline == 1042.0 and n.detail["deadline_fallback"]
    assert events(logs, "notice_time_invalid")[0]["value"] == "2026-13-45 25:00"


@pytest.mark.parametrize("body", [b'{"action": "explode", "time": "2026-11-22T12:00:00Z"}', b"[1, 2]", b"{}"])
def test_parse_instance_action_rejects_bad_shapes(body):
    with pytest.raises(ValueError):
        parse_instance_action(body, 0.0, 30.0)


def test_parse_instance_action_strict_time():
    n = parse_instance_action(b'{"action": "terminate", "time": "2026-11-22T12:00:00Z"}', 0.0, 30.0)
    assert n.deadline == epoch("2026-11-22T12:00:00Z") and "deadline_fallback" not in n.detail
