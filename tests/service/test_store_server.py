"""``trainguard store``: a standalone TCPStore that agents reach with ``is_host=false``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainguard.agent.store import DEFAULT_PORT, is_exposed, register
from tests.service.test_sdnotify import FakeSystemd

STOP_TIMEOUT_S = 15.0


@dataclass
class StoreProcess:
    """A running ``python -m trainguard.agent.store`` and what it logged."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0

    def events(self) -> list[dict[str, object]]:
        """The JSON log lines so far (stderr is not a TTY, so structlog writes JSON)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def wait_event(self, name: str, timeout: float = 60.0) -> dict[str, object]:
        """Block until the event ``name`` is logged; fail with the log if the process dies first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events():
                if e.get("event") == name:
                    return e
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {name!r} event (rc={self.proc.poll()}); log:\n{self.log_path.read_text()}")


def _spawn(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> StoreProcess:
    log_path = tmp_path / f"store-{time.monotonic_ns()}.log"
    full_env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.agent.store", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
        )
    return StoreProcess(proc, log_path)


@pytest.fixture
def spawned() -> Iterator[list[StoreProcess]]:
    """Collects spawned stores; kills any still running at teardown (no leaked processes)."""
    procs: list[StoreProcess] = []
    yield procs
    for sp in procs:
        if sp.proc.poll() is None:
            sp.proc.kill()
            sp.proc.wait(timeout=10)


@pytest.fixture
def notify_socket() -> Iterator[FakeSystemd]:
    d = tempfile.mkdtemp(prefix="tg-store-")
    fake = FakeSystemd(os.path.join(d, "notify.sock"))
    yield fake
    fake.close()
    shutil.rmtree(d, ignore_errors=True)


def test_no_watchdog_ping_follows_stopping_while_a_health_check_is_slow(monkeypatch, notify_socket) -> None:
    """SIGTERM while a watchdog tick sits in a slow health check (a round trip to the server under
    load): that tick's ping goes out before STOPPING, not after it. In process, to hold the check."""
    from trainguard.agent import store

    real = store.StoreServer.healthy
    slow = threading.Event()

    def healthy(self: store.StoreServer) -> bool:
        ok = real(self)
        if slow.is_set():
            time.sleep(0.5)
        return ok

    monkeypatch.setattr(store.StoreServer, "healthy", healthy)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["store", "--host", "127.0.0.1", "--port", "0"])

    def terminate_mid_check() -> None:
        assert notify_socket.recv(timeout=30)["READY"] == "1"
        time.sleep(0.3)  # watchdog pings every 0.1 s
        slow.set()
        time.sleep(0.15)  # the next tick is in its health check now
        os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=terminate_mid_check, daemon=True)
    t.start()
    assert store.main(args, {"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "200000"}) == 0
    t.join(5)
    msgs = notify_socket.drain()
    assert sum(1 for m in msgs if m.get("WATCHDOG") == "1") >= 2, msgs
    assert msgs[-1].get("STOPPING") == "1", msgs


def _client(port: int) -> object:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


def test_register_defaults() -> None:
    parser = argparse.ArgumentParser(prog="trainguard")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["store"])
    assert (args.host, args.port, args.timeout, args.firewalled) == ("127.0.0.1", DEFAULT_PORT, 300.0, False)
    assert DEFAULT_PORT == 29400
    assert callable(args.func)


@pytest.mark.parametrize("host,exposed", [("127.0.0.1", False), ("127.0.1.1", False), ("::1", False), ("[::1]", False),
                                          ("localhost", False), ("0.0.0.0", True), ("::", True), ("", True),
                                          ("10.0.0.5", True), ("fd00::5", True), ("coordinator.internal", True)])
def test_is_exposed(host: str, exposed: bool) -> None:
    assert is_exposed(host) is exposed


def test_store_beyond_loopback_warns_unless_firewalled(tmp_path: Path, spawned: list[StoreProcess]) -> None:
    """The store is unauthenticated: listening on every interface is said loudly, unless the operator
    states the port is firewalled to the cluster."""
    loud = _spawn(tmp_path, "--host", "0.0.0.0", "--port", "0")
    quiet = _spawn(tmp_path, "--host", "0.0.0.0", "--port", "0", "--firewalled")
    spawned += [loud, quiet]
    ready = loud.wait_event("store_ready")
    assert ready["exposed"] is True and ready["firewalled"] is False
    warning = next(e for e in loud.events() if e.get("event") == "store_exposed")
    assert warning["level"] == "warning" and "no authentication" in str(warning["risk"])
    assert "--firewalled" in str(warning["fix"]) and "etcd" in str(warning["fix"])
    ready = quiet.wait_event("store_ready")
    assert ready["exposed"] is True and ready["firewalled"] is True
    assert not [e for e in quiet.events() if e.get("event") == "store_exposed"]
    for sp in (loud, quiet):
        sp.proc.send_signal(signal.SIGTERM)
        assert sp.proc.wait(timeout=STOP_TIMEOUT_S) == 0


def test_store_serves_notifies_and_stops_cleanly_on_sigterm(
    tmp_path: Path, spawned: list[StoreProcess], notify_socket: FakeSystemd
) -> None:
    sp = _spawn(
        tmp_path, "--host", "127.0.0.1", "--port", "0",
        env={"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "200000"},
    )
    spawned.append(sp)
    ready = sp.wait_event("store_ready")
    assert ready["host"] == "127.0.0.1" and ready["pid"] == sp.proc.pid
    port = int(ready["port"])  # type: ignore[arg-type]
    assert port > 0

    assert notify_socket.recv(timeout=10)["READY"] == "1"

    a, b = _client(port), _client(port)
    a.set("trainguard/test/key", "value")  # type: ignore[attr-defined]
    assert b.get("trainguard/test/key") == b"value"  # type: ignore[attr-defined]
    assert b.add("trainguard/test/counter", 2) == 2  # type: ignore[attr-defined]
    del a, b

    time.sleep(0.5)  # a few watchdog periods (0.1 s)
    sp.proc.send_signal(signal.SIGTERM)
    rc = sp.proc.wait(timeout=STOP_TIMEOUT_S)
    assert rc == 0, sp.log_path.read_text()
    names = [e.get("event") for e in sp.events()]
    assert names.index("store_ready") < names.index("store_stopping") < names.index("store_stopped")
    stopping = next(e for e in sp.events() if e.get("event") == "store_stopping")
    assert stopping["signal"] == "SIGTERM"

    msgs = notify_socket.drain()
    assert sum(1 for m in msgs if m.get("WATCHDOG") == "1") >= 2, msgs
    assert msgs[-1].get("STOPPING") == "1", msgs

    # The port is released at once: a restarted store can take it again.
    sp2 = _spawn(tmp_path, "--host", "127.0.0.1", "--port", str(port))
    spawned.append(sp2)
    assert int(sp2.wait_event("store_ready")["port"]) == port  # type: ignore[arg-type]
    sp2.proc.send_signal(signal.SIGINT)
    assert sp2.proc.wait(timeout=STOP_TIMEOUT_S) == 0


def test_c10d_rendezvous_through_external_store(tmp_path: Path, spawned: list[StoreProcess]) -> None:
    """An agent-side c10d handler with ``is_host=false`` forms a world on the standalone store."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    sp = _spawn(tmp_path, "--host", "127.0.0.1", "--port", "0")
    spawned.append(sp)
    port = int(sp.wait_event("store_ready")["port"])  # type: ignore[arg-type]

    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{port}",
        run_id="store-test",
        min_nodes=1,
        max_nodes=1,
        is_host=False,
        join_timeout=30,
        last_call_timeout=1,
        local_addr="127.0.0.1",
    )
    handler = get_rendezvous_handler(params)
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("hello", "world")
        assert info.store.get("hello") == b"world"
        # The rendezvous state lives in the standalone store, not in this (agent) process.
        assert _client(port).check(["torch.rendezvous.store-test"])  # type: ignore[attr-defined]
    finally:
        handler.shutdown()
    sp.proc.send_signal(signal.SIGTERM)
    assert sp.proc.wait(timeout=STOP_TIMEOUT_S) == 0


def test_port_in_use_fails_with_store_failed(tmp_path: Path, spawned: list[StoreProcess]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        sp = _spawn(tmp_path, "--host", "127.0.0.1", "--port", str(port))
        spawned.append(sp)
        assert sp.proc.wait(timeout=60) == 1
    failed = next(e for e in sp.events() if e.get("event") == "store_failed")
    assert failed["port"] == port and "--port" in str(failed["fix"])


def test_cli_store_subcommand_notifies_systemd(
    tmp_path: Path, spawned: list[StoreProcess], notify_socket: FakeSystemd
) -> None:
    """``trainguard store`` through the real CLI must reach sd_notify (the unit is Type=notify).

    The CLI entry point has to hand the environment to :func:`trainguard.agent.store.main`
    (``main(args, os.environ)`` or ``args.environ = os.environ``); without it systemd never sees
    READY and stops the unit after TimeoutStartSec.
    """
    pytest.importorskip("trainguard.agent.cli")
    log_path = tmp_path / "cli-store.log"
    env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_USEC", "WATCHDOG_PID")}
    env["NOTIFY_SOCKET"] = notify_socket.address
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.agent.cli", "store", "--host", "127.0.0.1", "--port", "0"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )
    sp = StoreProcess(proc, log_path)
    spawned.append(sp)
    sp.wait_event("store_ready")
    assert notify_socket.recv(timeout=10).get("READY") == "1", log_path.read_text()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0


@pytest.mark.parametrize("flag", [True, False])
def test_a_store_started_with_exit_with_parent_stops_when_its_parent_is_killed(tmp_path: Path, flag: bool) -> None:
    """A batch script killed before its EXIT trap ran (SIGKILL: no trap runs) left its store listening after the
    job ended. With --exit-with-parent the store sees itself reparented and stops; without it, it stays."""
    log_path, pid_file = tmp_path / "store.log", tmp_path / "store.pid"
    args = " --exit-with-parent" if flag else ""
    script = (f"{sys.executable} -m trainguard.agent.store --host 127.0.0.1 --port 0{args} > {log_path} 2>&1 &\n"
              f"echo $! > {pid_file}\nwait\n")
    parent = subprocess.Popen(["bash", "-c", script], stdin=subprocess.DEVNULL)
    store = StoreProcess(subprocess.Popen(["true"]), log_path)  # (only its log is read)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    try:
        while not [e for e in store.events() if e.get("event") == "store_ready"]:
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        parent.kill()  # as slurmd's SIGKILL after KillWait: no EXIT trap runs
        parent.wait(10)

        def alive() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            with open(f"/proc/{pid}/stat") as fh:  # (an exited child of init not reaped yet is a zombie)
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"

        end = time.monotonic() + (STOP_TIMEOUT_S if flag else 3.0)  # (it looks every second)
        while alive() and time.monotonic() < end:
            time.sleep(0.1)
        if flag:
            assert not alive(), log_path.read_text()
            gone = next(e for e in store.events() if e.get("event") == "store_parent_gone")
            assert gone["level"] == "warning"
            assert next(e for e in store.events() if e.get("event") == "store_stopping")["signal"] == "parent_exited"
        else:
            assert alive()
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_close_that_never_returns_is_not_waited_for() -> None:
    """The stopping store gives the server's shutdown CLOSE_DEADLINE_S, then exits without it (a cancelled Slurm
    job's store hung in it for an hour)."""
    from trainguard.agent.store import _close_within

    class Hangs:
        def __init__(self) -> None:
            self.release = threading.Event()

        def close(self) -> None:
            self.release.wait(30)

    class Closes:
        closed = False

        def close(self) -> None:
            self.closed = True

    hung = Hangs()
    try:
        assert _close_within(hung, 0.3) is False
    finally:
        hung.release.set()
    fine = Closes()
    assert _close_within(fine, 5.0) is True and fine.closed
