"""The duty-cycle throttler (tests/fixtures/throttle.py): its schedule with fake signals and sleeps, and a
real process stopped and always continued at the end (no timing asserted)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.fixtures.throttle import DutyCycleThrottler
from tests.harness import wait_until


def test_schedule_stops_every_pid_then_continues_them():
    calls: list[tuple[str, object]] = []
    gone = {13}

    def kill(pid, sig):
        if pid in gone:
            raise ProcessLookupError(pid)
        calls.append(("kill", (pid, sig)))

    pids = iter([[11, 12, 13], [11, 14]])
    t = DutyCycleThrottler(lambda: next(pids), 0.3, 0.1, kill=kill, sleep=lambda s: calls.append(("sleep", round(s, 6))))
    t.cycle()
    t.cycle()
    S, C = signal.SIGSTOP, signal.SIGCONT
    assert calls == [("kill", (11, S)), ("kill", (12, S)), ("sleep", 0.03), ("kill", (11, C)), ("kill", (12, C)), ("sleep", 0.07),
                     ("kill", (11, S)), ("kill", (14, S)), ("sleep", 0.03), ("kill", (11, C)), ("kill", (14, C)), ("sleep", 0.07)]
    assert t.cycles == 2


def test_stop_continues_what_an_interrupted_cycle_left_stopped():
    sent: list[tuple[int, int]] = []

    def sleep(s):
        raise KeyboardInterrupt  # interrupted while the processes are stopped

    t = DutyCycleThrottler(lambda: [5], 0.5, kill=lambda p, s: sent.append((p, s)), sleep=sleep)
    with pytest.raises(KeyboardInterrupt):
        t.cycle()
    assert sent == [(5, signal.SIGSTOP), (5, signal.SIGCONT)]  # the finally of the cycle
    t.stop()
    assert sent[-1] == (5, signal.SIGCONT)


@pytest.mark.parametrize("fraction,period", [(0.0, 0.1), (1.0, 0.1), (0.5, 0.0)])
def test_bad_settings(fraction, period):
    with pytest.raises(ValueError):
        DutyCycleThrottler(lambda: [], fraction, period)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(60)
def test_a_real_process_is_stopped_and_left_running():
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with DutyCycleThrottler(lambda: [p.pid], 0.5, 0.1) as t:
            wait_until(lambda: _state(p.pid) == "T", 30, "the process seen stopped", interval=0.01)
            wait_until(lambda: t.cycles >= 3, 30, "three cycles")
        assert _state(p.pid) != "T" and p.poll() is None
    finally:
        p.kill()
        p.wait(10)
