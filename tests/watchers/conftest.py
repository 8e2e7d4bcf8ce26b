"""Fixtures for the watcher tests: emulators, structlog capture, notice collection, leak checks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import structlog

from tests.emulators.fixtures import aws_imds, azure_events, gcp_metadata  # noqa: F401  (fixtures)
from trainguard.agent.watchers.base import Notice, Watcher


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a thread behind (watchers, emulator handlers, probes)."""
    before = set(threading.enumerate())
    yield
    end = time.monotonic() + 3.0
    while True:
        leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not leaked or time.monotonic() > end:
            break
        time.sleep(0.02)
    assert not leaked, f"test leaked threads: {[t.name for t in leaked]}"


@pytest.fixture
def logs() -> Iterator[list[dict]]:
    """Every structlog event emitted during the test (from any thread), as dicts."""
    with structlog.testing.capture_logs() as entries:
        yield entries


def events(logs: list[dict], name: str, **match: object) -> list[dict]:
    return [e for e in list(logs) if e.get("event") == name and all(e.get(k) == v for k, v in match.items())]


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()


class Collector:
    """A thread-safe ``on_notice`` that tests can wait on."""

    def __init__(self) -> None:
        self.notices: list[Notice] = []
        self._cond = threading.Condition()

    def __call__(self, n: Notice) -> None:
        with self._cond:
            self.notices.append(n)
            self._cond.notify_all()

    def wait(self, count: int = 1, timeout: float = 5.0) -> list[Notice]:
        with self._cond:
            self._cond.wait_for(lambda: len(self.notices) >= count, timeout)
            return list(self.notices)


@pytest.fixture
def collector() -> Collector:
    return Collector()


@pytest.fixture
def run() -> Iterator[Callable[[Watcher, Collector], Watcher]]:
    """``run(watcher, collector)`` starts it; every started watcher is stopped at teardown."""
    started: list[Watcher] = []

    def _run(w: Watcher, c: Collector) -> Watcher:
        w.start(c)
        started.append(w)
        return w

    yield _run
    for w in started:
        assert w.stop(5.0), f"watcher {w.name} did not stop within 5 s"
