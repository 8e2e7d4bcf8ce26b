"""GcpWatcher against the GCP metadata emulator."""

from __future__ import annotations

import time

import pytest

from tests.emulators import GcpMetadataEmulator
from tests.watchers.conftest import events, wait_until
from trainguard.agent.watchers.gcp import GcpWatcher, parse_value

pytestmark = pytest.mark.timeout(30)

FAST = dict(poll_interval_s=0.05, request_timeout_s=0.3, wait_timeout_s=5)


def watcher(emu: GcpMetadataEmulator, key: str = "preempted", **kw) -> GcpWatcher:
    return GcpWatcher(endpoint=emu.url, key=key, **{**FAST, **kw})


def long_polls(emu: GcpMetadataEmulator, key: str = "preempted"):
    return [r for r in emu.requests if r.path.endswith(key) and r.q("wait_for_change") == "true"]


def test_preemption_detected_via_wait_for_change(gcp_metadata, run, collector, logs):
    # poll_interval_s is long: only a long-poll can see the change within a second
    run(watcher(gcp_metadata, poll_interval_s=10.0, clock=lambda: 1000.0), collector)
    assert wait_until(lambda: len(long_polls(gcp_metadata)) >= 1)
    time.sleep(0.1)
    t0 = time.monotonic()
    gcp_metadata.preempt()
    [n] = collector.wait(1, timeout=3)
    assert time.monotonic() - t0 < 1.0
    assert (n.source, n.kind, n.received_at, n.deadline) == ("gcp", "preempt", 1000.0, 1030.0)
    first, lp = gcp_metadata.requests[0], long_polls(gcp_metadata)[0]
    assert first.q("wait_for_change") is None  # initial plain GET sees a preemption already under way
    assert lp.q("timeout_sec") == "5" and lp.q("last_etag")
    assert all(r.headers.get("metadata-flavor") == "Google" for r in gcp_metadata.requests)
    assert events(logs, "watcher_error") == []


def test_default_deadline_is_configurable(gcp_metadata, run, collector):
    gcp_metadata.preempt()
    run(watcher(gcp_metadata, default_deadline_s=20.0, clock=lambda: 50.0), collector)
    [n] = collector.wait(1)
    assert n.deadline == 70.0


def test_preemption_reported_once_across_long_polls(gcp_metadata, run, collector):
    gcp_metadata.preempt()
    run(watcher(gcp_metadata, wait_timeout_s=1), collector)
    collector.wait(1)
    assert wait_until(lambda: len(long_polls(gcp_metadata)) >= 2, timeout=4)  # timeout_sec elapsed, re-polled
    assert len(collector.notices) == 1


def test_long_poll_timeout_re_polls_without_errors(gcp_metadata, run, collector, logs):
    run(watcher(gcp_metadata, wait_timeout_s=1), collector)
    assert wait_until(lambda: len(long_polls(gcp_metadata)) >= 3, timeout=5)
    assert events(logs, "watcher_error") == [] and collector.notices == []
    # paced by the server, not spinning: 3 long-polls took >= ~2 s
    lps = long_polls(gcp_metadata)
    assert lps[2].at - lps[0].at >= 1.8


@pytest.mark.parametrize("value,kind", [("MIGRATE_ON_HOST_MAINTENANCE", "maintenance"),
                                        ("TERMINATE_ON_HOST_MAINTENANCE", "termination")])
def test_maintenance_event(gcp_metadata, run, collector, value, kind):
    run(watcher(gcp_metadata, key="maintenance-event", clock=lambda: 10.0), collector)
    assert wait_until(lambda: len(long_polls(gcp_metadata, "maintenance-event")) >= 1)
    gcp_metadata.maintenance(value)
    [n] = collector.wait(1)
    assert (n.kind, n.detail["value"], n.deadline) == (kind, value, 70.0)
    assert n.is_early_warning == (kind == "maintenance")


def test_maintenance_event_recurring_is_a_new_notice(gcp_metadata, run, collector):
    run(watcher(gcp_metadata, key="maintenance-event"), collector)
    gcp_metadata.maintenance("MIGRATE_ON_HOST_MAINTENANCE")
    collector.wait(1)
    gcp_metadata.maintenance("NONE")
    gcp_metadata.maintenance("TERMINATE_ON_HOST_MAINTENANCE")
    assert [n.detail["value"] for n in collector.wait(2)] == ["MIGRATE_ON_HOST_MAINTENANCE",
                                                             "TERMINATE_ON_HOST_MAINTENANCE"]


def test_answer_without_flavor_header_is_rejected(run, collector, logs):
    with GcpMetadataEmulator(omit_flavor_header=True) as emu:
        emu.preempt()
        w = run(watcher(emu), collector)
        assert wait_until(lambda: len(events(logs, "watcher_error")) >= 2)
        assert "Metadata-Flavor" in events(logs, "watcher_error")[0]["error"]
        assert collector.notices == []
        w.stop()


@pytest.mark.parametrize("mode,status", [("garbage", 200), ("500", 500), ("hang", None)])
def test_bad_answers_are_logged_and_watcher_survives(gcp_metadata, run, collector, logs, mode, status):
    gcp_metadata.misbehave(mode, count=2)
    w = run(watcher(gcp_metadata), collector)
    assert wait_until(lambda: len(events(logs, "watcher_error")) >= 2)
    errs = events(logs, "watcher_error")
    assert all(e["status"] == status and "/instance/preempted" in e["url"] for e in errs)
    if mode == "garbage":
        assert "garbage" in errs[0]["body"]
    assert wait_until(lambda: len(long_polls(gcp_metadata)) >= 1)
    gcp_metadata.preempt()
    [n] = collector.wait(1)
    assert n.kind == "preempt" and w.running


def test_hang_during_long_poll_does_not_block_stop(gcp_metadata, collector):
    w = watcher(gcp_metadata, wait_timeout_s=60)
    w.start(collector)
    assert wait_until(lambda: len(long_polls(gcp_metadata)) >= 1)
    t0 = time.monotonic()
    assert w.stop(5.0)
    assert time.monotonic() - t0 < 1.0  # the in-flight long-poll was aborted, not waited out


@pytest.mark.parametrize("key,text", [("preempted", "maybe"), ("maintenance-event", "EXPLODE"), ("zone", "x")])
def test_parse_value_rejects_unknown_values(key, text):
    with pytest.raises(ValueError):
        parse_value(key, text, "e", 0.0, 30.0)
