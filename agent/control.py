"""The local control channel: a Unix socket between the agent, its workers and the ``trainguard`` CLI.

Why a Unix socket: it never leaves the node, its file mode (0600, in a 0700 directory) is the
authentication, and a connection that drops tells the agent the worker is gone. It is never a
network port. The messages and their codec are :mod:`trainguard.runtime.protocol` (one module both
ends import); this module is the server and the CLI's one-shot client.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

from trainguard.runtime import protocol as proto
from trainguard.runtime.log import get_logger

log = get_logger("trainguard.agent.control")
Handler = Callable[[proto.Message], proto.Reply | None]


class ControlServer:
    """Accepts connections on ``path``; one daemon thread per connection, every read with a timeout.

    A worker that says :class:`~trainguard.runtime.protocol.Hello` is registered until its connection
    closes; :meth:`broadcast` sends it orders. Every other message goes to ``on_request``; a reply it
    returns is sent back. A malformed message is answered with an error reply and logged, never fatal.
    """

    def __init__(self, path: str, on_request: Handler) -> None:
        self.path = path
        self._on_request = on_request
        self._lock = threading.Lock()
        self._workers: dict[socket.socket, proto.Hello] = {}
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
    def api_workers(self) -> list[proto.Hello]:
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

    def broadcast(self, message: proto.Message) -> int:
        """Send ``message`` to every registered worker; returns how many got it."""
        data = proto.encode(message)
        sent = 0
        with self._lock:
            for conn in list(self._workers):
                try:
                    conn.sendall(data)
                    sent += 1
                except OSError:
                    self._workers.pop(conn, None)
        return sent

    def send_to(self, local_rank: int, message: proto.Message) -> bool:
        """Send ``message`` to the registered worker of ``local_rank``; whether it got it."""
        data = proto.encode(message)
        with self._lock:
            for conn, hello in list(self._workers.items()):
                if hello.local_rank == local_rank:
                    try:
                        conn.sendall(data)
                        return True
                    except OSError:
                        self._workers.pop(conn, None)
        return False

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
                if len(buf) > proto.MAX_LINE:
                    self._send(conn, proto.Reply(ok=False, error=f"message longer than {proto.MAX_LINE} bytes"))
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._workers.pop(conn, None)
            try:
                conn.close()
            except OSError:
                pass

    @staticmethod
    def _send(conn: socket.socket, reply: proto.Reply) -> None:
        try:
            conn.sendall(proto.encode(reply))
        except OSError:
            pass

    def _handle_line(self, conn: socket.socket, line: bytes) -> None:
        try:
            msg = proto.decode(line)
        except proto.ProtocolError as e:
            log.warning("control_bad_message", error=str(e), excerpt=line[:80].decode(errors="replace"))
            self._send(conn, proto.Reply(ok=False, error=f"bad request: {e}"))
            return
        if isinstance(msg, proto.Hello):
            with self._lock:
                self._workers[conn] = msg
            log.info("worker_registered", rank=msg.rank, local_rank=msg.local_rank, pid=msg.pid)
        try:
            reply = self._on_request(msg)
        except Exception as e:  # noqa: BLE001 - a handler bug must answer the client, not kill the thread
            log.exception("control_handler_failed", op=msg.OP)
            reply = proto.Reply(ok=False, error=f"internal error handling {msg.OP!r}: {type(e).__name__}: {e}")
        if reply is not None:
            self._send(conn, reply)

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


def request(path: str, message: proto.Message, timeout: float = 5.0) -> proto.Reply:
    """One request/reply exchange with a running agent (used by the CLI)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(proto.encode(message))
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    if not buf:
        raise ConnectionError(f"agent at {path} closed the connection without a reply")
    reply = proto.decode(buf.split(b"\n", 1)[0])
    if not isinstance(reply, proto.Reply):
        raise proto.ProtocolError(f"agent at {path} answered with {reply.OP!r}, not a reply")
    return reply
