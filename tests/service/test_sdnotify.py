"""sd_notify against a fake ``NOTIFY_SOCKET``: a bound AF_UNIX datagram socket, as systemd has."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from trainguard.agent.sdnotify import Notifier, WatchdogThread, watchdog_interval


class FakeSystemd:
    """Receives sd_notify datagrams like PID 1 does: a reader thread drains the socket at once.

    Draining matters: the kernel queue of an AF_UNIX datagram socket is short
    (``net.unix.max_dgram_qlen``, 10 in some containers) and a full queue blocks the sender.
    """

    def __init__(self, address: str) -> None:
        self.address = address  # the NOTIFY_SOCKET value
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + address[1:].encode() if address.startswith("@") else address)
        self.sock.settimeout(0.05)
        self._messages: list[dict[str, str]] = []
        self._taken = 0
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="fake-systemd", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            msg = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
            with self._cond:
                self._messages.append(msg)
                self._cond.notify_all()

    def env(self, **extra: str) -> dict[str, str]:
        """An environment mapping as systemd would pass it."""
        return {"NOTIFY_SOCKET": self.address, **extra}

    def recv(self, timeout: float = 5.0) -> dict[str, str]:
        """The next message not yet returned by :meth:`recv`/:meth:`drain`; fails after ``timeout`` s."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._messages) > self._taken, timeout):
                raise AssertionError(f"no sd_notify datagram within {timeout} s")
            self._taken += 1
            return self._messages[self._taken - 1]

    def drain(self, settle_s: float = 0.1) -> list[dict[str, str]]:
        """All messages not yet returned, after letting in-flight datagrams arrive for ``settle_s``."""
        time.sleep(settle_s)
        with self._cond:
            out = self._messages[self._taken :]
            self._taken = len(self._messages)
            return out

    def close(self) -> None:
        """Stop the reader thread and close the socket; idempotent."""
        self._closed.set()
        self._reader.join(5)
        self.sock.close()


@pytest.fixture
def fake_systemd() -> Iterator[FakeSystemd]:
    """A filesystem-path notify socket (short temp dir: AF_UNIX paths are limited to 107 bytes)."""
    d = tempfile.mkdtemp(prefix="tg-notify-")
    fake = FakeSystemd(os.path.join(d, "notify.sock"))
    yield fake
    fake.close()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fake_systemd_abstract() -> Iterator[FakeSystemd]:
    """An abstract-namespace notify socket (``@name``), as systemd uses in containers."""
    fake = FakeSystemd(f"@trainguard-test-{uuid.uuid4().hex}")
    yield fake
    fake.close()


def test_noop_without_notify_socket() -> None:
    n = Notifier.from_env({})
    assert not n.enabled
    assert n.ready() is False
    assert n.status("x") is False
    assert n.watchdog() is False
    assert n.stopping() is False
    n.close()


def test_ready_status_watchdog_stopping_in_order(fake_systemd: FakeSystemd) -> None:
    """The lifecycle the agent goes through, with a periodic watchdog at half of WATCHDOG_USEC."""
    env = fake_systemd.env(WATCHDOG_USEC="100000", WATCHDOG_PID=str(os.getpid()))
    n = Notifier.from_env(env)
    interval = watchdog_interval(env)
    assert interval == pytest.approx(0.05)

    assert n.ready()
    assert n.status("RUNNING world_size=2 step=10")
    wd = WatchdogThread(n, interval).start()
    time.sleep(0.4)  # ~8 pings
    wd.stop()
    assert n.stopping(status="DRAINING")
    n.close()

    msgs = fake_systemd.drain()
    assert msgs[0] == {"READY": "1"}
    assert msgs[1] == {"STATUS": "RUNNING world_size=2 step=10"}
    watchdogs = msgs[2:-1]
    assert len(watchdogs) >= 3, msgs
    assert all(m == {"WATCHDOG": "1"} for m in watchdogs), msgs
    assert msgs[-1] == {"STOPPING": "1", "STATUS": "DRAINING"}


def test_abstract_socket(fake_systemd_abstract: FakeSystemd) -> None:
    n = Notifier.from_env(fake_systemd_abstract.env())
    assert n.ready(status="rendezvous")
    assert fake_systemd_abstract.recv() == {"READY": "1", "STATUS": "rendezvous"}
    n.reloading()
    assert fake_systemd_abstract.recv() == {"RELOADING": "1"}
    n.extend_timeout(90)
    assert fake_systemd_abstract.recv() == {"EXTEND_TIMEOUT_USEC": "90000000"}
    n.close()


def test_status_is_one_line(fake_systemd: FakeSystemd) -> None:
    n = Notifier.from_env(fake_systemd.env())
    n.status("a\nb")
    assert fake_systemd.recv() == {"STATUS": "a b"}
    n.close()


def test_send_failure_is_swallowed() -> None:
    """systemd gone (socket path missing): no exception, False, a warning logged once."""
    n = Notifier("/nonexistent/trainguard/notify.sock")
    assert n.enabled
    assert n.ready() is False
    assert n.watchdog() is False
    n.close()
    n.close()  # idempotent


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": ""}, None),
        ({"WATCHDOG_USEC": "abc"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "60000000"}, 30.0),
        ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "MYPID"}, 30.0),
        ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "x"}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    env = {k: (str(os.getpid()) if v == "MYPID" else v) for k, v in env.items()}
    assert watchdog_interval(env) == expected


def test_watchdog_withheld_while_unhealthy(fake_systemd: FakeSystemd) -> None:
    """A hung main loop stops feeding the watchdog, so systemd restarts the agent."""
    healthy = threading.Event()
    n = Notifier.from_env(fake_systemd.env())
    wd = WatchdogThread(n, 0.03, healthy.is_set).start()
    time.sleep(0.2)
    assert fake_systemd.drain() == []
    healthy.set()
    time.sleep(0.2)
    wd.stop()
    assert len(fake_systemd.drain()) >= 2
    n.close()


def test_watchdog_survives_failing_health_check(fake_systemd: FakeSystemd) -> None:
    calls = {"n": 0}

    def flaky() -> bool:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("boom")
        return True

    n = Notifier.from_env(fake_systemd.env())
    with WatchdogThread(n, 0.02, flaky) as wd:
        time.sleep(0.2)
    assert calls["n"] > 3
    assert len(fake_systemd.drain()) >= 1
    assert not wd._thread.is_alive()  # type: ignore[union-attr]
    n.close()


def test_watchdog_stop_is_idempotent_and_safe_unstarted() -> None:
    wd = WatchdogThread(Notifier(None), 1.0)
    wd.stop()
    wd.start()
    wd.stop()
    wd.stop()
    with pytest.raises(ValueError, match="positive"):
        WatchdogThread(Notifier(None), 0)


def test_send_never_hangs_on_a_full_receiver_queue() -> None:
    """A receiver that never reads fills its short queue; sends then time out instead of blocking."""
    d = tempfile.mkdtemp(prefix="tg-notify-")
    path = os.path.join(d, "stuck.sock")
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stuck.bind(path)
    try:
        n = Notifier(path, send_timeout=0.05)
        start = time.monotonic()
        assert n.watchdog() is True
        sent = 1
        while sent < 100_000 and n.watchdog():  # fills max_dgram_qlen / the send buffer
            sent += 1
        assert sent < 100_000, "sends never timed out"
        assert time.monotonic() - start < 30
        n.close()
    finally:
        stuck.close()
        shutil.rmtree(d, ignore_errors=True)
