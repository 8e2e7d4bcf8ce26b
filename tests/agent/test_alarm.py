"""The process's alarms (:mod:`trainguard.agent.alarm`): fired in deadline order, disarmed ones never, a
failing callback does not stop the others."""

from __future__ import annotations

import threading
import time

from trainguard.agent.alarm import Alarms


def test_alarms_fire_in_deadline_order_and_disarmed_ones_never():
    alarms = Alarms()
    fired: list[str] = []
    done = threading.Event()
    lock = threading.Lock()

    def note(name: str) -> None:
        with lock:
            fired.append(name)
        if name == "last":
            done.set()

    alarms.arm(0.3, lambda: note("c"))
    alarms.arm(0.1, lambda: note("a"))
    gone = alarms.arm(0.2, lambda: note("never"))
    alarms.arm(0.2, lambda: note("b"))
    alarms.arm(0.5, lambda: note("last"))
    assert alarms.disarm(gone) is True
    assert done.wait(5)
    assert fired == ["a", "b", "c", "last"]
    assert alarms.pending() == 0


def test_disarming_a_fired_alarm_says_so():
    alarms = Alarms()
    ran = threading.Event()
    ticket = alarms.arm(0.0, ran.set)
    assert ran.wait(5)
    assert alarms.disarm(ticket) is False


def test_a_failing_callback_does_not_stop_the_others():
    alarms = Alarms()
    ran = threading.Event()

    def boom() -> None:
        raise RuntimeError("store gone")

    alarms.arm(0.0, boom)
    alarms.arm(0.05, ran.set)
    assert ran.wait(5)


def test_many_alarms_share_one_thread():
    alarms = Alarms()
    n = 300
    count = [0]
    lock = threading.Lock()
    done = threading.Event()

    def tick() -> None:
        with lock:
            count[0] += 1
            if count[0] == n:
                done.set()

    before = threading.active_count()
    for i in range(n):
        alarms.arm(0.01 * (i % 10), tick)
    assert done.wait(10)
    time.sleep(0.05)
    assert threading.active_count() - before <= 1 + 4  # the timer thread and its runners, not one per alarm
