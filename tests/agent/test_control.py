"""The control socket: bad messages get an error reply (the handler thread survives), one agent per
socket, the not-saved report, and finding the live agents of this node."""

from __future__ import annotations

import os
import socket

import pytest
import structlog

from trainguard.agent import control, discover
from trainguard.contract import protocol as proto
from trainguard.contract.configbase import ConfigError


def status_handler(job: str):
    seen: list[proto.Message] = []

    def handle(msg: proto.Message) -> proto.Reply | None:
        seen.append(msg)
        if isinstance(msg, proto.StatusRequest):
            return proto.Reply(ok=True, data={"job_id": job, "node": "n1", "state": "running"})
        if isinstance(msg, proto.DrainRequest):
            return proto.Reply(ok=True, data={"deadline_s": msg.deadline_s})
        return None

    handle.seen = seen  # type: ignore[attr-defined]
    return handle


@pytest.fixture
def server(tmp_path):
    servers: list[control.ControlServer] = []

    def start(job: str = "job", state_dir: str | None = None) -> control.ControlServer:
        d = state_dir or str(tmp_path)
        s = control.ControlServer(proto.control_socket_path(d, job), status_handler(job))
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


def exchange(path: str, lines: list[bytes]) -> list[proto.Reply]:
    """Send raw lines on one connection; read one reply per line."""
    out = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        buf = b""
        for line in lines:
            s.sendall(line + b"\n")
            while b"\n" not in buf:
                chunk = s.recv(65536)
                assert chunk, "the server closed the connection without a reply"
                buf += chunk
            first, buf = buf.split(b"\n", 1)
            reply = proto.decode(first)
            assert isinstance(reply, proto.Reply)
            out.append(reply)
    return out


@pytest.mark.parametrize("raw,fragment", [
    (b'{"op": "drain", "deadline_s": "abc"}', "`deadline_s` must be a number"),
    (b'{"op": "drain", "deadline_s": -100}', "`deadline_s` must be > 0"),
    (b'{"op": "drain", "deadline_s": NaN}', "`deadline_s` must be finite"),
    (b'{"op": "drain", "deadline_s": Infinity}', "`deadline_s` must be finite"),
    (b'{"op": "drain", "deadline_s": 1e12}', "at most 604800"),
    (b'{"op": "drain", "deadline_s": true}', "`deadline_s` must be a number"),
    (b'{"op": "committed", "step": -1, "kind": "periodic", "rank": 0}', "`step` must be >= 0"),
    (b'{"op": "launch"}', "unknown op"),
    (b'not json', "not JSON"),
])
def test_bad_message_gets_an_error_reply_and_the_connection_goes_on(server, raw, fragment):
    s = server()
    bad, good = exchange(s.path, [raw, proto.encode(proto.DrainRequest(deadline_s=30)).strip()])
    assert not bad.ok and fragment in bad.error, bad.error
    assert good.ok and good.data == {"deadline_s": 30.0}


def test_status_reply_carries_pid_socket_and_extras(server):
    s = server()
    s.status_extra["metrics_url"] = "http://127.0.0.1:1"
    r = control.request(s.path, proto.StatusRequest())
    assert r.data["job_id"] == "job" and r.data["pid"] == os.getpid() and r.data["socket"] == s.path
    assert r.data["metrics_url"] == "http://127.0.0.1:1"
    # a callable is read at the request (the job's view from the store), left out when it fails or has none
    calls = []
    s.status_extra["job"] = lambda: calls.append(1) or {"members": [], "n": len(calls)}
    s.status_extra["broken"] = lambda: 1 / 0
    s.status_extra["none"] = lambda: None
    for n in (1, 2):
        r = control.request(s.path, proto.StatusRequest())
        assert r.ok and r.data["job"] == {"members": [], "n": n}
        assert "broken" not in r.data and "none" not in r.data


def test_one_agent_per_socket(server, tmp_path):
    first = server("job1")
    with pytest.raises(control.SocketInUse) as ei:
        control.ControlServer(first.path, status_handler("job1"))
    assert isinstance(ei.value, ConfigError) and ei.value.key == "agent.job_id"
    assert control.request(first.path, proto.StatusRequest()).ok  # the first one keeps its socket
    first.close()
    again = server("job1")  # after a clean stop the name is free again
    assert control.request(again.path, proto.StatusRequest()).ok


def test_stale_socket_file_is_replaced(tmp_path, server):
    path = proto.control_socket_path(str(tmp_path), "stale")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(path)  # bound, never listening, then closed: what a SIGKILLed agent leaves
    assert os.path.exists(path) and not control.socket_is_live(path)
    s = server("stale")
    assert control.request(s.path, proto.StatusRequest()).data["job_id"] == "stale"


def test_a_live_socket_without_our_lock_is_refused(tmp_path):
    """An agent started by another means (another state dir lock file, an older version) still answers."""
    path = str(tmp_path / "other.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    try:
        with pytest.raises(control.SocketInUse, match="another agent is already running job 'other'"):
            control.ControlServer(path, status_handler("other"))
    finally:
        srv.close()


def test_discovery_one_several_none(tmp_path, server):
    d = str(tmp_path / "state")
    os.makedirs(d)
    with pytest.raises(ConfigError, match="no live agent on this node"):
        discover.find_one({}, state_dir=d)
    a = server("alpha", d)
    found = discover.find_one({}, state_dir=d)
    assert (found.job_id, found.socket) == ("alpha", a.path)
    assert "job alpha (node n1, state running" in found.describe()
    server("beta", d)
    with pytest.raises(ConfigError) as ei:
        discover.find_one({}, state_dir=d)
    assert "2 live agents" in str(ei.value) and "alpha" in str(ei.value) and "beta" in str(ei.value)
    assert "--job-id" in str(ei.value)
    assert discover.find_one({}, state_dir=d, job_id="beta").job_id == "beta"
    with pytest.raises(ConfigError, match="no live agent for job 'gamma'"):
        discover.find_one({}, state_dir=d, job_id="gamma")
    # a stale socket next to the live ones is ignored
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(os.path.join(d, "dead.sock"))
    assert {x.job_id for x in discover.live_agents([d])} == {"alpha", "beta"}


def test_discovery_looks_in_the_default_state_dir(tmp_path, server, monkeypatch):
    d = str(tmp_path / "rt")
    os.makedirs(d)
    monkeypatch.setattr(discover.rundir, "candidate_state_dirs", lambda env: [d])
    server("solo", d)
    assert discover.find_one({}).job_id == "solo"


def test_lock_file_is_removed_on_close_and_stale_ones_at_start_but_never_a_held_one(tmp_path, server):
    """One ``<job>.sock.lock`` per run used to pile up in the state folder (issue 43, cosmetic)."""
    import fcntl

    stale = tmp_path / "dead-run.sock.lock"
    stale.write_text("")  # what an agent killed with -9 leaves: a lock file nobody holds
    held = tmp_path / "live-run.sock.lock"
    fd = os.open(held, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live agent's
    try:
        s = server("job1")
        assert os.path.exists(s.path + ".lock") and not stale.exists() and held.exists()
        s.close()
        assert not os.path.exists(s.path + ".lock") and held.exists()
    finally:
        os.close(fd)



def test_settle_waits_until_a_departed_workers_last_reports_are_handled(tmp_path):
    """A worker sends its last report (the emergency checkpoint's ``committed``) and exits at once; the
    agent must handle it before it reads its outcome and closes the socket. ``settle`` returns once every
    connection's thread has handled what its peer sent and seen it close (here each report takes 0.3 s to
    handle, so the second is still unhandled when the client has gone)."""
    import threading
    import time

    handled: list[proto.Message] = []
    arrived = threading.Event()

    def slow(msg: proto.Message) -> proto.Reply | None:
        arrived.set()
        time.sleep(0.3)
        handled.append(msg)
        return None

    s = control.ControlServer(proto.control_socket_path(str(tmp_path), "job"), slow)
    try:
        reports = [proto.Committed(step=s_, kind=proto.CheckpointKind.EMERGENCY, rank=0, saved=False) for s_ in (7, 8)]
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(s.path)
            c.sendall(b"".join(proto.encode(m) for m in reports))
        assert arrived.wait(10)
        assert len(handled) < 2  # the client is gone, its reports not all handled yet
        assert s.settle(10.0) is True
        assert [m.step for m in handled] == [7, 8]
        assert s.settle(0.0) is True  # nothing left to wait for
    finally:
        s.close()
