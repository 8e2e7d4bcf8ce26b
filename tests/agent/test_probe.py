"""The direct liveness probe (agent/probe.py): what a real agent process answers alive, stopped and dead, over
real loopback sockets; the address codec as a table; the background prober with a fake question."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from trainguard.agent.probe import Answer, Prober, ProbeServer, format_addr, parse_addr, probe_once
from trainguard.agent.procstat import read_stat

SERVE = """
import sys, time
from trainguard.agent.probe import ProbeServer
s = ProbeServer()
print(s.port, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("text,want", [
    ("10.0.0.7:4711", ("10.0.0.7", 4711)),
    ("node-b.example:80", ("node-b.example", 80)),
    ("[fe80::1]:9000", ("fe80::1", 9000)),
    ("", None),
    ("10.0.0.7", None),
    (":4711", None),
    ("host:0", None),
    ("host:65536", None),
    ("host:port", None),
])
def test_parse_addr(text, want):
    assert parse_addr(text) == want


def test_format_addr_round_trips():
    for host, port in (("10.0.0.7", 1), ("fe80::1", 65535), ("node-b", 4711)):
        assert parse_addr(format_addr(host, port)) == (host, port)


def test_a_running_server_answers_and_a_closed_one_refuses():
    s = ProbeServer()
    try:
        assert probe_once("127.0.0.1", s.port, 2.0) is Answer.ALIVE
        assert probe_once("127.0.0.1", s.port, 2.0) is Answer.ALIVE  # again, on a new connection
    finally:
        s.close()
    assert probe_once("127.0.0.1", s.port, 2.0) is Answer.GONE


def test_an_agent_process_answers_alive_stopped_and_dead():
    """The three states of a real agent process: running (answers), SIGSTOPped (the kernel still accepts the
    connection, nobody answers: SILENT within the timeout), SIGKILLed (the port refuses: GONE)."""
    p = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        assert probe_once("127.0.0.1", port, 5.0) is Answer.ALIVE
        os.kill(p.pid, signal.SIGSTOP)
        assert _wait(lambda: (st := read_stat(p.pid)) is not None and st.state == "T")  # the stop is asynchronous
        t0 = time.monotonic()
        assert probe_once("127.0.0.1", port, 0.3) is Answer.SILENT
        assert time.monotonic() - t0 < 2.0  # bounded by the timeout, not by the kernel's
        os.kill(p.pid, signal.SIGCONT)
        assert probe_once("127.0.0.1", port, 5.0) is Answer.ALIVE
        p.kill()
        p.wait(timeout=10)
        assert probe_once("127.0.0.1", port, 5.0) is Answer.GONE
    finally:
        p.kill()
        p.wait(timeout=10)


def test_an_unroutable_or_unresolvable_address_is_no_evidence():
    assert probe_once("name-that-does-not-resolve.invalid", 4711, 1.0) in (Answer.UNKNOWN, Answer.SILENT)
    assert probe_once("name-that-does-not-resolve.invalid", 4711, 1.0) is not Answer.GONE


class FakeProbe:
    """A question that blocks until released, answering what the test says."""

    def __init__(self, answer):
        self.answer = answer
        self.release = threading.Event()
        self.asked: list[tuple[str, int, float]] = []

    def __call__(self, host, port, timeout_s):
        self.asked.append((host, port, timeout_s))
        self.release.wait(10)
        return self.answer


def _wait(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return False


def test_prober_one_question_per_node_in_flight_answers_keyed_by_address_and_wakes_on_bad_news():
    fake = FakeProbe(Answer.SILENT)
    woken = []
    clock = iter(range(100, 10**6)).__next__
    pr = Prober(0.25, probe=fake, clock=clock, on_answer=lambda: woken.append(1))
    assert pr.ask("b", "10.0.0.7:4711")
    assert not pr.ask("b", "10.0.0.7:4711")  # in flight: no second question
    assert not pr.ask("c", "no-port")  # malformed address: nothing asked
    assert pr.answer("b", "10.0.0.7:4711") is None
    fake.release.set()
    assert _wait(lambda: pr.answer("b", "10.0.0.7:4711") is not None)
    got, asked, answered = pr.answer("b", "10.0.0.7:4711")
    assert got is Answer.SILENT and asked < answered
    assert fake.asked == [("10.0.0.7", 4711, 0.25)]
    assert woken == [1]
    assert pr.answer("b", "10.0.0.7:4712") is None  # an answer about another address (a restarted agent) is none
    assert pr.ask("b", "10.0.0.7:4711")  # done: a new question may start


def test_prober_does_not_wake_on_alive():
    fake = FakeProbe(Answer.ALIVE)
    fake.release.set()
    woken = []
    pr = Prober(0.25, probe=fake, on_answer=lambda: woken.append(1))
    pr.ask("b", "127.0.0.1:9")
    assert _wait(lambda: pr.answer("b", "127.0.0.1:9") is not None)
    assert pr.answer("b", "127.0.0.1:9")[0] is Answer.ALIVE and woken == []
