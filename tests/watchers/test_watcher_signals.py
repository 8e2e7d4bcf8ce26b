"""SignalWatcher and ManualWatcher."""

from __future__ import annotations

import signal
import threading

import pytest

from tests.watchers.conftest import Collector, events
from trainguard.agent.watchers.manual import ManualWatcher
from trainguard.agent.watchers.signals import SignalWatcher

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def prior_handlers():
    """Test-owned handlers installed before the watcher, recording calls; restored afterwards."""
    calls: list[int] = []
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    saved = {s: signal.signal(s, lambda signum, frame: calls.append(signum)) for s in sigs}
    mine = {s: signal.getsignal(s) for s in sigs}
    yield calls, mine
    for s, h in saved.items():
        signal.signal(s, h)


def test_sigterm_is_a_stop_notice_and_handlers_are_restored(prior_handlers, run, collector, logs):
    calls, mine = prior_handlers
    w = run(SignalWatcher(signal_deadline_s=25.0, clock=lambda: 500.0), collector)
    assert signal.getsignal(signal.SIGTERM) != mine[signal.SIGTERM]
    signal.raise_signal(signal.SIGTERM)
    [n] = collector.wait(1)
    assert (n.source, n.kind, n.received_at, n.deadline) == ("signal", "stop", 500.0, 525.0)
    assert n.detail["signal"] == "SIGTERM" and calls == []
    assert w.stop()
    assert all(signal.getsignal(s) == h for s, h in mine.items())
    assert events(logs, "preemption_notice", source="signal")


def test_sigint_then_escalation_then_previous_handler(prior_handlers, run, collector):
    calls, mine = prior_handlers
    run(SignalWatcher(signal_deadline_s=25.0, clock=lambda: 500.0), collector)
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGTERM)
    first, second = collector.wait(2)
    assert first.deadline == 525.0 and not first.detail.get("escalated")
    assert second.deadline == 500.0 and second.detail["escalated"] is True
    signal.raise_signal(signal.SIGINT)  # third: old handlers back, signal re-delivered to them
    assert calls == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) == mine[signal.SIGINT]
    assert len(collector.wait(3, timeout=0.3)) == 2


def test_no_escalation_reports_each_signal(prior_handlers, run, collector):
    calls, _ = prior_handlers
    run(SignalWatcher(signal_deadline_s=5.0, escalate=False, clock=lambda: 0.0), collector)
    for _ in range(3):
        signal.raise_signal(signal.SIGTERM)
    notices = collector.wait(3)
    assert [n.deadline for n in notices] == [5.0, 5.0, 5.0] and calls == []
    assert len({n.event_id for n in notices}) == 3


def test_sigusr1_only_when_enabled(prior_handlers, run, collector):
    calls, mine = prior_handlers
    w = run(SignalWatcher(sigusr1=False), collector)
    assert signal.getsignal(signal.SIGUSR1) == mine[signal.SIGUSR1]
    w.stop()
    c2 = Collector()
    run(SignalWatcher(sigusr1=True, signal_deadline_s=60.0, clock=lambda: 1.0), c2)
    signal.raise_signal(signal.SIGUSR1)
    [n] = c2.wait(1)
    assert (n.kind, n.deadline, n.detail["signal"]) == ("preempt", 61.0, "SIGUSR1")


def test_start_outside_main_thread_is_refused(collector):
    w = SignalWatcher()
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _capture(errors, lambda: w.start(collector)))
    t.start()
    t.join()
    assert isinstance(errors[0], RuntimeError) and "main thread" in str(errors[0])
    assert w.stop()


def _capture(errors, fn):
    try:
        fn()
    except BaseException as e:
        errors.append(e)


def test_manual_trigger(run, collector):
    w = ManualWatcher(default_deadline_s=30.0, clock=lambda: 10.0)
    queued = w.trigger(reason="before start")  # queued until the thread runs
    run(w, collector)
    second = w.trigger(5, "cli")
    notices = collector.wait(2)
    assert notices == [queued, second]
    assert (second.source, second.kind, second.deadline, second.detail["reason"]) == ("manual", "drain", 15.0, "cli")
    assert queued.deadline == 40.0 and queued.event_id != second.event_id


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_manual_trigger_rejects_bad_deadline(bad):
    with pytest.raises(ValueError, match="deadline"):
        ManualWatcher().trigger(bad)
