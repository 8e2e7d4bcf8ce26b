"""Watcher base machinery, Notice, time parsing and config checks (no network)."""

from __future__ import annotations

import threading

import pytest

from tests.watchers.conftest import events, wait_until
from trainguard.agent.watchers import PreemptionConfig
from trainguard.agent.watchers.base import Notice, Watcher, most_urgent, parse_iso8601_utc, parse_rfc1123
from trainguard.contract.configbase import FieldError

pytestmark = pytest.mark.timeout(20)


@pytest.mark.parametrize("text,expected", [
    ("2026-11-22T12:00:00Z", 1795348800.0),
    ("1970-01-01T00:00:00Z", 0.0),
    ("1970-01-01T00:00:01.5Z", 1.5),
])
def test_iso8601_valid(text, expected):
    assert parse_iso8601_utc(text) == expected


@pytest.mark.parametrize("text", ["2026-11-22T12:00:00", "2026-11-22 12:00:00Z", "2026-13-01T00:00:00Z",
                                  "2026-02-30T00:00:00Z", "2026-11-22T24:00:00Z", "", "garbage", None, 1234])
def test_iso8601_invalid(text):
    with pytest.raises(ValueError):
        parse_iso8601_utc(text)


def test_rfc1123():
    assert parse_rfc1123("Mon, 19 Sep 2016 18:29:47 GMT") == 1474309787.0
    for bad in ["Mon, 19 Sep 2016 18:29:47", "19 Sep 2016 18:29:47 GMT", "Mon, 31 Feb 2016 18:29:47 GMT",
                "Mon, 19 Sept 2016 18:29:47 GMT", "", None]:
        with pytest.raises(ValueError):
            parse_rfc1123(bad)


def n(kind: str, deadline: float = 100.0, received: float = 0.0, **kw) -> Notice:
    return Notice(source="test", kind=kind, deadline=deadline, received_at=received, **kw)


def test_priority_and_most_urgent():
    assert n("termination").priority > n("maintenance").priority > n("rebalance").priority
    assert n("preempt").priority > n("drain").priority and not n("stop").is_early_warning
    assert n("rebalance").is_early_warning and n("maintenance").is_early_warning
    assert n("weird").priority == 0 and n("rebalance", priority=200).priority == 200
    cases = [
        ([n("rebalance", 10), n("termination", 100)], "termination"),   # kind beats an earlier deadline
        ([n("preempt", 50), n("preempt", 40)], 40.0),                     # same priority: earliest deadline
        ([], None),
    ]
    for notices, want in cases:
        got = most_urgent(notices)
        assert (got is None and want is None) or want in (got.kind, got.deadline)


class Scripted(Watcher):
    """A watcher whose poll() plays a script: exceptions are raised, lists are returned."""

    source = "test"

    def __init__(self, script):
        super().__init__(poll_interval_s=0.01)
        self.script = list(script)
        self.done = threading.Event()

    def poll(self):
        if not self.script:
            self.done.set()
            return []
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step


def test_poll_errors_logged_notices_deduped_callback_errors_survived(run, logs):
    a, b = n("preempt", event_id="A"), n("preempt", event_id="B")
    got: list[Notice] = []

    def cb(x: Notice) -> None:
        got.append(x)
        if x.event_id == "A":
            raise RuntimeError("owner bug")

    w = Scripted([[a], KeyError("boom"), [a, a], [b], [a]])
    w.start(cb)
    assert w.done.wait(5)
    assert got == [a, b]
    [err] = events(logs, "watcher_error")
    assert "KeyError" in err["error"] and err["consecutive_errors"] == 1
    assert events(logs, "watcher_callback_error")[0]["error"] == "RuntimeError: owner bug"
    assert events(logs, "watcher_recovered")
    assert w.stop() and w.stop()  # idempotent


def test_error_logging_is_rate_limited_for_long_outages(logs):
    w = Scripted([RuntimeError(str(i)) for i in range(65)])
    w.start(lambda _: None)
    assert w.done.wait(10)
    w.stop()
    counts = [e["consecutive_errors"] for e in events(logs, "watcher_error")]
    assert counts == [1, 2, 3, 30, 60]


def test_stop_before_start_and_double_start():
    w = Scripted([])
    assert w.stop()
    w2 = Scripted([])
    w2.start(lambda _: None)
    with pytest.raises(RuntimeError, match="already started"):
        w2.start(lambda _: None)
    assert w2.stop()
    assert wait_until(lambda: not w2.running)


@pytest.mark.parametrize("kw,field", [
    ({"sources": ["none", "aws"]}, "sources"),
    ({"sources": []}, "sources"),
    ({"sources": ["aws", "ibm"]}, "sources"),
    ({"aws_token_ttl_s": 0}, "aws_token_ttl_s"),
    ({"aws_token_ttl_s": 21601}, "aws_token_ttl_s"),
    ({"gcp_wait_timeout_s": 0}, "gcp_wait_timeout_s"),
    ({"default_deadline_s": 0}, "default_deadline_s"),
    ({"probe_timeout_s": -1}, "probe_timeout_s"),
])
def test_config_errors_name_the_field_and_fix(kw, field):
    with pytest.raises(FieldError) as ei:
        PreemptionConfig(**kw)
    assert ei.value.field == field and "Fix:" in str(ei.value)
