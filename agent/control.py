"""The local control channel: a Unix socket between the agent, its workers and the ``trainguard`` CLI.

Why a Unix socket: it never leaves the node, its file mode (0600, in a 0700 directory) is the
authentication, and a connection that drops tells the agent the worker is gone. It is never a
network port.

Protocol: newline-delimited JSON objects.

* worker -> agent ``{"op": "hello", "rank": r, "local_rank": l, "pid": p}``: the worker uses the worker
  API and will honour drain/resize requests. The connection stays open; the agent pushes
  ``{"op": "drain", "deadline": <epoch s>, "reason": ...}`` or ``{"op": "resize", "reason": ...}``.
* worker -> agent ``{"op": "committed", "step": s, "kind": k, "seconds": t}``: a checkpoint committed.
* CLI -> agent ``{"op": "drain", "deadline_s": 30, "reason": "manual"}`` and ``{"op": "status"}``:
  one request, one JSON reply, then the CLI closes.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from trainguard.agent.log import get_logger

log = get_logger("trainguard.agent.control")
Handler = Callable[[dict[str, Any]], dict[str, Any] | None]


class ControlServer:
    """Accepts connections on ``path``; one daemon thread per connection, every read with a timeout."""

    def __init__(self, path: str, on_request: Handler) -> None:
        self.path = path
        self._on_request = on_request
        self._lock = threading.Lock()
        self._workers: dict[socket.socket, dict[str, Any]] = {}
        self._closed = threading.Event()
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)  # a stale socket from a previous agent on this node
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self._sock.listen(64)
        self._sock.settimeout(0.5)
        self._thread = threading.Thread(target=self._accept_loop, name="trainguard-control", daemon=True)
        self._thread.start()

    # -- worker registry -------------------------------------------------------------------------
    def api_workers(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._workers.values())

    def forget_workers(self) -> None:
        """Drop the registrations of a worker group that has ended (connections close on their own)."""
        with self._lock:
            for conn in list(self._workers):
                try:
                    conn.close()
                except OSError:
                    pass
            self._workers.clear()

    def broadcast(self, message: dict[str, Any]) -> int:
        """Send ``message`` to every registered worker; returns how many got it."""
        data = (json.dumps(message) + "\n").encode()
        sent = 0
        with self._lock:
            for conn in list(self._workers):
                try:
                    conn.sendall(data)
                    sent += 1
                except OSError:
                    self._workers.pop(conn, None)
        return sent

    # -- server loop -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="trainguard-control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)
        buf = b""
        try:
            while not self._closed.is_set():
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._handle_line(conn, line)
        except OSError:
            return
        finally:
            with self._lock:
                self._workers.pop(conn, None)
            try:
                conn.close()
            except OSError:
                pass

    def _handle_line(self, conn: socket.socket, line: bytes) -> None:
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError("not an object")
        except ValueError as e:
            log.warning("control_bad_message", error=str(e), excerpt=line[:80].decode(errors="replace"))
            return
        if msg.get("op") == "hello":
            with self._lock:
                self._workers[conn] = {k: msg.get(k) for k in ("rank", "local_rank", "pid")}
            log.info("worker_registered", rank=msg.get("rank"), local_rank=msg.get("local_rank"), pid=msg.get("pid"))
        reply = self._on_request(msg)
        if reply is not None:
            try:
                conn.sendall((json.dumps(reply) + "\n").encode())
            except OSError:
                pass

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass
        self.forget_workers()
        self._thread.join(timeout=2)
        try:
            os.unlink(self.path)
        except OSError:
            pass


def request(path: str, message: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """One request/reply exchange with a running agent (used by the CLI)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall((json.dumps(message) + "\n").encode())
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    if not buf:
        raise ConnectionError(f"agent at {path} closed the connection without a reply")
    return json.loads(buf.split(b"\n", 1)[0])
