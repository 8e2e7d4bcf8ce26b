"""AzureWatcher against the Scheduled Events emulator."""

from __future__ import annotations

import pytest

from tests.emulators import AzureEventsEmulator
from tests.emulators.azure import rfc1123
from tests.watchers.conftest import events, wait_until
from trainguard.agent.watchers.azure import AzureWatcher, parse_events
from trainguard.agent.watchers.base import parse_rfc1123

pytestmark = pytest.mark.timeout(30)

FAST = dict(poll_interval_s=0.05, request_timeout_s=0.3)


def watcher(emu: AzureEventsEmulator, **kw) -> AzureWatcher:
    return AzureWatcher(endpoint=emu.url, **{**FAST, **kw})


def event_gets(emu: AzureEventsEmulator):
    return [r for r in emu.requests if r.path == "/metadata/scheduledevents" and r.method == "GET"]


def test_preempt_for_this_vm_detected_with_not_before_deadline(azure_events, run, collector, logs):
    w = run(watcher(azure_events), collector)
    assert wait_until(lambda: len(event_gets(azure_events)) >= 2)
    eid = azure_events.preempt(in_s=30)
    [n] = collector.wait(1)
    ev = azure_events.events[0]
    assert (n.source, n.kind, n.event_id) == ("azure", "preempt", eid)
    assert n.deadline == parse_rfc1123(ev["NotBefore"])
    assert 28 <= n.deadline - n.received_at <= 31
    assert n.detail["EventStatus"] == "Scheduled"
    # the VM name came from IMDS, as text
    [name_req] = [r for r in azure_events.requests if r.path == "/metadata/instance/compute/name"]
    assert name_req.q("format") == "text" and name_req.q("api-version") == "2021-02-01"
    assert w.vm_name == "tg-node-0"
    gets = event_gets(azure_events)
    assert all(r.q("api-version") == "2020-07-01" and r.headers.get("metadata") == "true" for r in gets)
    assert events(logs, "watcher_error") == []


def test_only_this_vms_events_count(azure_events, run, collector):
    azure_events.preempt(in_s=30, resources=["other-vm"])
    azure_events.schedule("Reboot", resources=["other-vm", "third-vm"])
    run(watcher(azure_events), collector)
    assert wait_until(lambda: len(event_gets(azure_events)) >= 5)
    assert collector.notices == []
    azure_events.preempt(in_s=30, resources=["other-vm", "tg-node-0"])
    assert [n.kind for n in collector.wait(1)] == ["preempt"]


def test_vm_name_from_config_skips_the_lookup(run, collector):
    with AzureEventsEmulator(vm_name="from-imds") as emu:
        emu.preempt(resources=["configured"])
        w = run(watcher(emu, vm_name="configured"), collector)
        assert collector.wait(1)
        assert emu.count("/metadata/instance") == 0
        w.stop()


@pytest.mark.parametrize("on_ack", ["start", "remove"])
def test_acknowledge_starts_or_removes_the_event_and_is_not_renotified(run, collector, logs, on_ack):
    with AzureEventsEmulator(on_ack=on_ack) as emu:
        w = run(watcher(emu), collector)
        eid = emu.preempt(in_s=30)
        [n] = collector.wait(1)
        inc = emu.incarnation
        assert w.acknowledge(n) is True
        [post] = [r for r in emu.requests if r.method == "POST"]
        assert post.headers.get("metadata") == "true" and post.q("api-version") == "2020-07-01"
        assert emu.acknowledged == [eid]
        assert emu.incarnation == inc + 1
        if on_ack == "remove":
            assert emu.events == []
        else:
            assert emu.events[0]["EventStatus"] == "Started" and emu.events[0]["NotBefore"] == ""
        assert wait_until(lambda: w.incarnation == inc + 1)
        assert len(collector.notices) == 1  # same EventId: not a new notice
        assert events(logs, "azure_event_acknowledged", event_id=eid)
        w.stop()


def test_acknowledge_disabled_or_foreign_notice_posts_nothing(azure_events, run, collector):
    w = run(watcher(azure_events, acknowledge=False), collector)
    azure_events.preempt()
    [n] = collector.wait(1)
    assert w.acknowledge(n) is False
    assert azure_events.count("scheduledevents", method="POST") == 0


def test_acknowledge_failure_is_logged_not_raised(azure_events, run, collector, logs):
    w = run(watcher(azure_events), collector)
    azure_events.preempt()
    [n] = collector.wait(1)
    azure_events.misbehave("500", path="scheduledevents")
    assert w.acknowledge(n) is False
    assert events(logs, "watcher_error", action="acknowledge")[0]["status"] == 500


def test_acknowledge_works_after_stop(azure_events, collector):
    """The owner may stop watching, commit the checkpoint, and only then acknowledge."""
    w = watcher(azure_events)
    w.start(collector)
    azure_events.preempt()
    [n] = collector.wait(1)
    assert w.stop()
    assert w.acknowledge(n) is True


@pytest.mark.parametrize("etype,kind", [("Terminate", "termination"), ("Reboot", "maintenance"),
                                        ("Redeploy", "maintenance"), ("Freeze", "maintenance")])
def test_event_types(azure_events, run, collector, etype, kind):
    run(watcher(azure_events), collector)
    azure_events.schedule(etype, in_s=300)
    [n] = collector.wait(1)
    assert n.kind == kind and n.detail["EventType"] == etype


@pytest.mark.parametrize("mode,status", [("garbage", 200), ("500", 500), ("hang", None)])
def test_bad_answers_are_logged_and_watcher_survives(azure_events, run, collector, logs, mode, status):
    azure_events.misbehave(mode, count=2, path="scheduledevents")
    w = run(watcher(azure_events), collector)
    assert wait_until(lambda: len(events(logs, "watcher_error")) >= 2)
    errs = events(logs, "watcher_error")
    assert all(e["status"] == status and "scheduledevents?api-version=2020-07-01" in e["url"] for e in errs)
    azure_events.preempt()
    assert collector.wait(1)[0].kind == "preempt" and w.running


def test_malformed_not_before_falls_back(azure_events, run, collector, logs):
    azure_events.preempt(not_before="19/09/2016 18:29")
    run(watcher(azure_events, default_deadline_s=33.0, clock=lambda: 100.0), collector)
    [n] = collector.wait(1)
    assert n.deadline == 133.0 and n.detail["deadline_fallback"]
    assert events(logs, "notice_time_invalid")[0]["value"] == "19/09/2016 18:29"


def test_started_event_deadline_is_now_plus_the_floor(azure_events, run, collector):
    """A Started event is happening now: the drain still gets the floor to try a checkpoint."""
    from trainguard.agent.watchers.deadline import DEADLINE_FLOOR_S

    azure_events.schedule("Preempt", status="Started")
    run(watcher(azure_events, clock=lambda: 7.0), collector)
    n = collector.wait(1)[0]
    assert n.deadline == 7.0 + DEADLINE_FLOOR_S and n.detail["deadline_clamped"] == "below_floor"


def test_bad_event_entry_does_not_hide_a_good_one():
    body = (b'{"DocumentIncarnation": 3, "Events": [{"EventType": "Preempt"}, {"EventId": "B", '
            b'"EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": ["vm"], '
            b'"EventStatus": "Scheduled", "NotBefore": "' + rfc1123(1000).encode() + b'"}]}')
    inc, notices, problems = parse_events(body, "vm", 0.0, 30.0)
    assert inc == 3 and [n.event_id for n in notices] == ["B"] and notices[0].deadline == 1000.0
    assert len(problems) == 1


@pytest.mark.parametrize("body", [b"[]", b'{"Events": []}', b'{"DocumentIncarnation": 1}', b"\xff"])
def test_parse_events_rejects_bad_documents(body):
    with pytest.raises(ValueError):
        parse_events(body, "vm", 0.0, 30.0)
