"""A direct liveness probe between agents: one byte there, one byte back, over TCP.

A node's silence in the store (its agent published no record for a while) cannot tell a dead or frozen
node from a live one whose publish was late (a loaded machine, a slow store), so hang detection waits
``hang.frozen_s`` of it before it names a node frozen. A direct question can tell them apart in a
fraction of that:

* :attr:`Answer.ALIVE`: the agent answered within the timeout - it runs, whatever its record says.
* :attr:`Answer.GONE`: the connection was refused (or reset before the answer): the machine is up but no
  process listens on the agent's port any more - the agent is dead (``kill -9``, an OOM kill, a crash).
  The kernel says so at once, on a loaded machine too.
* :attr:`Answer.SILENT`: connected, or still connecting, but no answer within the timeout: the agent is
  stopped (SIGSTOP, a frozen container), its machine hangs (no TCP handshake at all) or the network
  between drops everything (a partition). A loaded machine can be that slow too, so this is evidence
  only together with the job's stall and the record's silence (:func:`~trainguard.agent.hang.decide_hang`).
* :attr:`Answer.UNKNOWN`: no evidence (no address, a name that does not resolve, an unreachable network).

:class:`ProbeServer` is the agent's side (one listening socket and one thread that answers every byte
with ``!``; the port goes in the agent's hang record), :func:`probe_once` one question, and :class:`Prober`
asks them in the background, at most one question per node at a time, so that the callers (the hang
watch's exchange, the re-formation's eviction poll) never block on one.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable
from enum import Enum

from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.probe")

PING, PONG = b"?", b"!"


class Answer(str, Enum):
    ALIVE = "alive"
    GONE = "gone"
    SILENT = "silent"
    UNKNOWN = "unknown"


def parse_addr(text: str) -> tuple[str, int] | None:
    """Pure: ``host:port`` (``[v6]:port`` for IPv6) -> (host, port), None when malformed or empty."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def probe_once(host: str, port: int, timeout_s: float) -> Answer:
    """Ask the agent at ``host:port`` once; the answer within ``timeout_s`` (see :class:`Answer`)."""
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return Answer.GONE
    except (socket.timeout, TimeoutError):
        return Answer.SILENT
    except OSError:  # unreachable network, no route, a name that does not resolve: no evidence
        return Answer.UNKNOWN
    with sock:
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(PING)
            got = sock.recv(1)
        except (socket.timeout, TimeoutError):
            return Answer.SILENT
        except (ConnectionResetError, BrokenPipeError):
            return Answer.GONE
        except OSError:
            return Answer.UNKNOWN
    return Answer.ALIVE if got == PONG else Answer.UNKNOWN  # b"": closed without answering (shutting down)


class ProbeServer:
    """The agent's listening side: answers every byte it reads with :data:`PONG`. One daemon thread, one
    selector; a connection is closed when its peer closes it (or after 64 unanswered bytes' worth of
    garbage: it answers everything). Binds every interface (dual-stack where the kernel has it)."""

    def __init__(self, port: int = 0) -> None:
        if socket.has_dualstack_ipv6():
            self._sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
        else:
            self._sock = socket.create_server(("", port), backlog=128)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="trainguard-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.5):
                try:
                    if key.fileobj is self._sock:
                        conn, _addr = self._sock.accept()
                        conn.setblocking(False)
                        self._sel.register(conn, selectors.EVENT_READ)
                        continue
                    conn = key.fileobj  # type: ignore[assignment]
                    data = conn.recv(64)  # type: ignore[union-attr]
                    if data:
                        conn.send(PONG)  # type: ignore[union-attr]
                        continue
                    self._sel.unregister(conn)
                    conn.close()  # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    if key.fileobj is not self._sock:
                        self._sel.unregister(key.fileobj)
                        key.fileobj.close()  # type: ignore[union-attr]

    def close(self) -> None:
        """Stop answering and close the port (idempotent): from here on a probe is refused."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2.0)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()


class Prober:
    """Background questions (:func:`probe_once`): :meth:`ask` starts one for a node unless one is in flight;
    :meth:`answer` is the last answer for that node at that address and when it came (the caller's
    clock). ``on_answer`` is called after each answer that is not :attr:`Answer.ALIVE` (the hang watch wakes
    the supervisor with it). Thread-safe."""

    def __init__(self, timeout_s: float, *, probe: Callable[[str, int, float], Answer] = probe_once,
                 clock: Callable[[], float] = time.monotonic, on_answer: Callable[[], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self._probe = probe
        self._clock = clock
        self._on_answer = on_answer
        self._lock = threading.Lock()
        self._flight: set[str] = set()
        self._answers: dict[str, tuple[str, Answer, float, float]] = {}
        """node -> (address asked, answer, when asked, when answered)."""

    def ask(self, node: str, addr: str) -> bool:
        """Start a question to ``node`` at ``addr`` (``host:port``) unless one is in flight. Whether it started."""
        where = parse_addr(addr)
        if where is None:
            return False
        with self._lock:
            if node in self._flight:
                return False
            self._flight.add(node)
        threading.Thread(target=self._run, args=(node, addr, where), name="trainguard-prober", daemon=True).start()
        return True

    def _run(self, node: str, addr: str, where: tuple[str, int]) -> None:
        asked = self._clock()
        try:
            got = self._probe(where[0], where[1], self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed question is no evidence
            log.debug("probe_failed", node=node, error=f"{type(e).__name__}: {e}"[:300])
            got = Answer.UNKNOWN
        with self._lock:
            self._flight.discard(node)
            last = self._answers.get(node)
            self._answers[node] = (addr, got, asked, self._clock())
        if last is None or last[1] is not got:
            log.debug("probe_answer", node=node, addr=addr, answer=got.value)
        if got is not Answer.ALIVE and self._on_answer is not None:
            self._on_answer()

    def answer(self, node: str, addr: str) -> tuple[Answer, float, float] | None:
        """(answer, when asked, when answered) of the last question to ``node`` at ``addr``; None: none yet."""
        with self._lock:
            got = self._answers.get(node)
        if got is None or got[0] != addr:
            return None
        return got[1], got[2], got[3]

    def forget(self) -> None:
        with self._lock:
            self._answers.clear()


__all__ = ["Answer", "PING", "PONG", "ProbeServer", "Prober", "format_addr", "parse_addr", "probe_once"]
