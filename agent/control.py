"""The local control channel: a Unix socket between the agent, its workers and the ``trainguard`` CLI.

Why a Unix socket: it never leaves the node, its file mode (0600, in a 0700 directory) is the
authentication, and a connection that drops tells the agent the worker is gone. It is never a
network port. The messages and their codec are :mod:`trainguard.contract.protocol` (one module both
ends import); this module is the server and the CLI's one-shot client.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard.contract import protocol as proto
from trainguard.contract.configbase import ConfigError
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.control")
Handler = Callable[[proto.Message], proto.Reply | None]
PROBE_TIMEOUT_S = 2.0
"""How long a probe of an existing socket waits for an answer."""


class SocketInUse(ConfigError):
    """Another agent already serves this control socket."""


def socket_is_live(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts connections on the Unix socket ``path`` (a stale file: False)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            return False
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
                return False
            raise
        return True


def refuse_if_live(path: str, job_id: str = "") -> None:
    """Raise :class:`SocketInUse` when another agent listens on ``path``."""
    try:
        live = socket_is_live(path)
    except OSError as e:
        raise SocketInUse("agent.state_dir", f"cannot probe the control socket {path}: {e.strerror or e}",
                          "fix the permissions of the state directory or choose another one") from None
    if live:
        raise SocketInUse("agent.job_id", f"another agent is already running job {job_id!r} on this node "
                          f"(its control socket {path} answers)", "drain or stop that agent first "
                          f"(`trainguard drain --socket {path}`), or give this one its own agent.job_id or "
                          "agent.state_dir")


LOCK_SUFFIX = ".lock"
"""``<state_dir>/<job_id>.sock.lock``: held (``flock``) by the agent that serves ``<job_id>.sock``,
removed when it closes."""
LOCK_WAIT_S = 0.5
"""How long an agent starting tries for its lock (another agent's sweep holds it for an instant)."""


def lock_file(path: str, wait_s: float = 0.0) -> int | None:
    """Open ``path`` (created 0600) and take its exclusive lock, trying for up to ``wait_s`` seconds:
    the descriptor, or None when another process holds it. (An agent sweeping stale locks holds one
    for an instant; an agent starting waits that out, a live agent's lock it never gets.)

    The holder unlinks the file before it lets go (:func:`unlink_locked`), so a lock taken on a file
    that has meanwhile left ``path`` is worthless: it is dropped and ``path`` opened again, and of
    two agents only one can hold the file that ``path`` names."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
            continue
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def unlink_locked(path: str, fd: int) -> None:
    """Remove the lock file ``path`` while its lock ``fd`` is held, then let go of it."""
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(fd)


def remove_stale_locks(state_dir: str, keep: str) -> None:
    """Remove the ``*.sock.lock`` files in ``state_dir`` that no live agent holds (left by agents that
    died without closing, or by versions that kept them). A lock some agent holds is never touched."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return
    for name in names:
        path = os.path.join(state_dir, name)
        if not name.endswith(".sock" + LOCK_SUFFIX) or path == keep:
            continue
        try:
            fd = lock_file(path)
        except OSError:
            continue  # not ours to open (or gone): leave it
        if fd is not None:
            unlink_locked(path, fd)


class ControlServer:
    """Accepts connections on ``path``; one daemon thread per connection, every read with a timeout.

    A worker that says :class:`~trainguard.contract.protocol.Hello` is registered until its connection
    closes; :meth:`broadcast` sends it orders. Every other message goes to ``on_request``; a reply it
    returns is sent back. A malformed message is answered with an error reply and logged, never fatal.
    Each of :attr:`observers` sees every valid message first (on the connection's thread).
    """

    def __init__(self, path: str, on_request: Handler) -> None:
        self.path = path
        self._on_request = on_request
        self._lock = threading.Lock()
        self._workers: dict[socket.socket, proto.Hello] = {}
        self._closed = threading.Event()
        self._serving: set[threading.Thread] = set()
        """The threads serving a connection (one per worker or CLI client), until it closes."""
        self.status_extra: dict[str, Any] = {"pid": os.getpid(), "socket": path}
        """Merged into every successful status reply (the daemon adds e.g. ``metrics_url``); a callable value is
        called then (read on demand; left out when it fails or returns None)."""
        self.observers: list[Callable[[proto.Message], None]] = []
        """Called with every valid message before ``on_request`` (the daemon adds the drain costs,
        :class:`~trainguard.agent.lead.DrainCosts`); one that raises is logged and skipped."""
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        # One agent per socket: an exclusive lock held for the server's life decides between two agents
        # starting at once; a socket that still answers belongs to a live agent started otherwise.
        lock_fd = lock_file(path + LOCK_SUFFIX, wait_s=LOCK_WAIT_S)
        if lock_fd is None:
            raise SocketInUse("agent.job_id", f"another agent holds the control socket {path}",
                              "drain or stop that agent first, or give this one its own agent.job_id or "
                              "agent.state_dir")
        self._lock_fd = lock_fd
        try:
            remove_stale_locks(os.path.dirname(path) or ".", keep=path + LOCK_SUFFIX)
            refuse_if_live(path, os.path.basename(path).removesuffix(".sock"))
            if os.path.lexists(path):
                os.unlink(path)  # a stale socket from a previous agent on this node
        except BaseException:
            unlink_locked(path + LOCK_SUFFIX, self._lock_fd)
            raise
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
            t = threading.Thread(target=self._serve, args=(conn,), name="trainguard-control-conn", daemon=True)
            with self._lock:
                self._serving.add(t)
            t.start()

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
                    try:
                        self._handle_line(conn, line)
                    except Exception as e:  # noqa: BLE001 - even a failing log call must not end the connection
                        self._send(conn, proto.Reply(ok=False, error=f"internal error: {type(e).__name__}: {e}"))
                if len(buf) > proto.MAX_LINE:
                    self._send(conn, proto.Reply(ok=False, error=f"message longer than {proto.MAX_LINE} bytes"))
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._workers.pop(conn, None)
                self._serving.discard(threading.current_thread())
            try:
                conn.close()
            except OSError:
                pass

    def settle(self, timeout_s: float = 1.0) -> bool:
        """Wait (at most ``timeout_s``) until every connection's thread has handled what its peer sent and
        seen it close. A worker's last report (its emergency checkpoint's ``committed``, sent just before
        it exits) is otherwise lost when the agent closes the socket first: on a loaded machine the
        serving thread had not run yet, and a drained node's ``checkpoint_not_saved`` line and its exit
        record's error were missing. Call it once the workers are gone. True when all had ended."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                left = [t for t in self._serving if t.is_alive()]
            if not left:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            left[0].join(min(remaining, 0.05))

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
        for observe in list(self.observers):
            try:
                observe(msg)
            except Exception:  # noqa: BLE001 - an observer must not keep a message from the agent
                log.exception("control_observer_failed", op=msg.OP)
        if isinstance(msg, proto.Hello):
            with self._lock:
                self._workers[conn] = msg
            log.info("worker_registered", rank=msg.rank, local_rank=msg.local_rank, pid=msg.pid)
        try:
            reply = self._on_request(msg)
        except Exception as e:  # noqa: BLE001 - a handler bug must answer the client, not kill the thread
            log.exception("control_handler_failed", op=msg.OP)
            reply = proto.Reply(ok=False, error=f"internal error handling {msg.OP!r}: {type(e).__name__}: {e}")
        if reply is not None and reply.ok and isinstance(msg, proto.StatusRequest) and self.status_extra:
            reply = proto.Reply(ok=True, error=reply.error, data={**reply.data, **self._extra()})
        if reply is not None:
            self._send(conn, reply)

    def _extra(self) -> dict[str, Any]:
        """:attr:`status_extra` with its callables called (a value read on demand, e.g. the job's view from
        the store); one that fails or returns None is left out."""
        out: dict[str, Any] = {}
        for k, v in list(self.status_extra.items()):
            if callable(v):
                try:
                    v = v()
                except Exception:  # noqa: BLE001 - a status must answer
                    v = None
                if v is None:
                    continue
            out[k] = v
        return out

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
        unlink_locked(self.path + LOCK_SUFFIX, self._lock_fd)


def request(path: str, message: proto.Message, timeout: float = 5.0) -> proto.Reply:
    """One request/reply exchange with a running agent (used by the CLI), within ``timeout`` seconds
    in total. Raises ``OSError`` (``TimeoutError``, ``PermissionError``, ...) or
    :class:`~trainguard.contract.protocol.ProtocolError`."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(proto.encode(message))
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from {path} within {timeout:g}s")
            s.settimeout(left)
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > proto.MAX_LINE:
                raise proto.ProtocolError(f"reply from {path} longer than {proto.MAX_LINE} bytes")
    if not buf:
        raise ConnectionError(f"agent at {path} closed the connection without a reply")
    reply = proto.decode(buf.split(b"\n", 1)[0])
    if not isinstance(reply, proto.Reply):
        raise proto.ProtocolError(f"agent at {path} answered with {reply.OP!r}, not a reply")
    return reply
