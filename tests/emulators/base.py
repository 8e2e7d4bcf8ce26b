"""Shared machinery of the cloud metadata emulators: a ThreadingHTTPServer on a free 127.0.0.1
port, a request log, and misbehaviour on command.

Misbehaviour modes (``misbehave(mode, count=n, path=...)``, applied to the next ``n`` requests whose
path contains ``path``, before the emulated API sees them):

* ``garbage``: 200 with the API's usual headers and an unparsable body (invalid UTF-8, half JSON);
* ``500``: ``500 Internal Server Error``;
* ``hang``: accept the request and never answer (until ``close()`` or ``delay_s``), then drop it;
* ``slow``: answer correctly, but after ``delay_s`` seconds (default ``slow_s``);
* ``trickle``: answer correctly, but send the status line and headers one byte every ``delay_s``
  seconds (default 0.2), so that no single ``recv`` waits long while the whole answer takes long.

``close()`` wakes every hanging/long-polling handler and joins all server threads, so a test that
uses an emulator leaves no thread behind.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

GARBAGE_BODY = b"\x00\xff\xfe<html>{\"action\": garbage \x81 not json"
MODES = ("garbage", "500", "hang", "slow", "trickle")


@dataclass
class RecordedRequest:
    """One request as the emulator saw it (header names lower-cased)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    at: float
    status: int | None = None
    """Status answered; None when the request was hung/dropped."""
    misbehaviour: str | None = None

    def q(self, name: str) -> str | None:
        v = self.query.get(name)
        return v[0] if v else None


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class _Misbehaviour:
    mode: str
    remaining: int
    path: str | None
    delay_s: float | None


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # handler threads are joined by server_close()
    block_on_close = True
    allow_reuse_address = True
    emulator: EmulatorServer


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # silence stderr; the request log has it
        pass

    def version_string(self) -> str:
        return self.server.emulator.server_header

    def _dispatch(self) -> None:
        self.server.emulator._dispatch(self)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _dispatch


class EmulatorServer:
    """Base of the emulators. Subclasses implement :meth:`handle` (and may block in it on
    :attr:`closing`); they set :attr:`server_header` and :meth:`api_headers`."""

    server_header = "emulator"

    def __init__(self, *, hang_s: float = 60.0, slow_s: float = 3.0) -> None:
        self.hang_s = hang_s
        self.slow_s = slow_s
        self.closing = threading.Event()
        self.lock = threading.RLock()
        self._requests: list[RecordedRequest] = []
        self._misbehaviours: list[_Misbehaviour] = []
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.emulator = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"emulator-{type(self).__name__}", daemon=True)
        self._thread.start()
        self._closed = False

    # ------------------------------------------------------------------ public
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def misbehave(self, mode: str, count: int = 1, *, path: str | None = None, delay_s: float | None = None) -> None:
        """Misbehave on the next ``count`` requests whose path contains ``path`` (any path if None)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        with self.lock:
            self._misbehaviours.append(_Misbehaviour(mode, count, path, delay_s))

    @property
    def requests(self) -> list[RecordedRequest]:
        with self.lock:
            return list(self._requests)

    def count(self, path_contains: str = "", method: str | None = None) -> int:
        return sum(1 for r in self.requests if path_contains in r.path and (method is None or r.method == method))

    def wait_for_requests(self, n: int, path_contains: str = "", timeout: float = 5.0) -> bool:
        """Block until at least ``n`` matching requests were *answered or dropped*."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if sum(1 for r in self.requests if path_contains in r.path and (r.status is not None
                                                                             or r.misbehaviour == "hang")) >= n:
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Stop serving, wake blocked handlers and join every thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.closing.set()
        self.wake()
        self._server.shutdown()
        self._server.server_close()  # joins handler threads (daemon_threads=False)
        self._thread.join(5)

    def __enter__(self) -> EmulatorServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ subclass hooks
    def handle(self, req: RecordedRequest) -> Reply:
        raise NotImplementedError

    def api_headers(self) -> dict[str, str]:
        """Headers every genuine answer of this API carries (kept on ``garbage`` answers)."""
        return {}

    def wake(self) -> None:
        """Wake handlers blocked in :meth:`handle` (long-polls); called on state changes and close."""

    # ------------------------------------------------------------------ machinery
    def _take(self, path: str) -> _Misbehaviour | None:
        with self.lock:
            for m in self._misbehaviours:
                if m.remaining > 0 and (m.path is None or m.path in path):
                    m.remaining -= 1
                    return m
        return None

    def _dispatch(self, h: _Handler) -> None:
        parts = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(min(length, 1 << 20)) if length > 0 else b""
        req = RecordedRequest(method=h.command, path=parts.path, query=parse_qs(parts.query, keep_blank_values=True),
                              headers={k.lower(): v for k, v in h.headers.items()}, body=body, at=time.monotonic())
        with self.lock:
            self._requests.append(req)
        m = self._take(parts.path)
        if m is not None:
            req.misbehaviour = m.mode
        if m is not None and m.mode == "hang":
            self.closing.wait(m.delay_s if m.delay_s is not None else self.hang_s)
            h.close_connection = True
            return
        if m is not None and m.mode == "slow":
            self.closing.wait(m.delay_s if m.delay_s is not None else self.slow_s)
        if m is not None and m.mode == "500":
            reply = Reply(500, b"Internal Server Error", {"Content-Type": "text/plain"})
        elif m is not None and m.mode == "garbage":
            reply = Reply(200, GARBAGE_BODY, {**self.api_headers(), "Content-Type": "application/json"})
        else:
            reply = self.handle(req)
        req.status = reply.status
        if m is not None and m.mode == "trickle":
            self._trickle(h, reply, m.delay_s if m.delay_s is not None else 0.2)
            return
        try:
            h.send_response(reply.status)
            for k, v in reply.headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(reply.body)))
            h.send_header("Connection", "close")
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(reply.body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout); that is its business

    def _trickle(self, h: _Handler, reply: Reply, delay_s: float) -> None:
        head = f"HTTP/1.0 {reply.status} OK\r\n" + "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
        head += f"Content-Length: {len(reply.body)}\r\nConnection: close\r\n\r\n"
        h.close_connection = True
        try:
            for b in head.encode():
                if self.closing.wait(delay_s):
                    return
                h.wfile.write(bytes([b]))
                h.wfile.flush()
            h.wfile.write(reply.body)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the client gave up (its deadline): that is the point
