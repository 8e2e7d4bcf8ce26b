"""A tiny, abortable HTTP client for cloud metadata servers (standard library only).

Why not ``urllib.request``: it honours ``http_proxy`` from the environment (a proxied request to
169.254.169.254 is wrong and can leak a token), it raises on every non-2xx status (404 is a normal
"no notice" answer here), and a request blocked in ``recv`` cannot be interrupted from another
thread. :class:`HttpClient` talks ``http.client`` directly, never uses a proxy, bounds every request
by one *absolute* deadline, caps the body size, and :meth:`HttpClient.abort` unblocks an in-flight
request from another thread (used by ``Watcher.stop``).

The deadline covers connect, send, the status line, the headers and the body alike: the socket
itself (:class:`_DeadlineSocket`) re-arms its timeout with the time *left* before every send and
receive, so a server that trickles its headers one byte at a time cannot hold a watcher past
``timeout_s`` (a per-``recv`` timeout would restart with every byte). ``https://`` endpoints get the
same bound for connect and send, and per-phase timeouts after the TLS wrap.

Every failure is a :class:`MetadataError` carrying the URL, the status (``None`` when no answer came)
and a short body excerpt, which is exactly what a ``watcher_error`` log line needs.
"""

from __future__ import annotations

import functools
import http.client
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

MAX_BODY_BYTES = 1 << 20
"""Metadata answers are small; a larger body is a misbehaving server, not a notice."""

EXCERPT_CHARS = 200
"""How much of a bad body goes into a log line."""


class WatcherError(Exception):
    """Base of the watcher exception tree."""


class MetadataError(WatcherError):
    """A metadata request failed or answered something we cannot use.

    ``status`` is the HTTP status, or ``None`` when no answer came (timeout, refused, reset).
    ``body`` is the raw body (possibly empty); :attr:`excerpt` is safe to log.
    """

    def __init__(self, message: str, *, url: str, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        self.status = status
        self.body = body

    @property
    def excerpt(self) -> str:
        return excerpt(self.body)

    def log_fields(self) -> dict[str, object]:
        """Fields for a ``watcher_error`` log line."""
        return {"url": self.url, "status": self.status, "body": self.excerpt, "error": self.message}


def excerpt(body: bytes, limit: int = EXCERPT_CHARS) -> str:
    """A printable, bounded excerpt of ``body`` (undecodable bytes shown as escapes)."""
    text = body[: limit * 4].decode("utf-8", errors="backslashreplace")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """One complete answer. Header names are lower-cased."""

    url: str
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def text(self) -> str:
        """The body as strict UTF-8; :class:`MetadataError` if it is not."""
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise MetadataError(f"body is not UTF-8 ({e.reason})", url=self.url, status=self.status,
                                body=self.body) from None

    def error(self, message: str) -> MetadataError:
        return MetadataError(message, url=self.url, status=self.status, body=self.body)


class _DeadlineSocket(socket.socket):
    """A socket whose every send/receive waits at most until ``deadline`` (monotonic seconds)."""

    deadline: float = 0.0

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self.settimeout(left)

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        self._arm()
        return super().recv(*args, **kwargs)

    def recv_into(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().recv_into(*args, **kwargs)

    def send(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().send(*args, **kwargs)

    def sendall(self, *args: Any, **kwargs: Any) -> None:
        self._arm()
        return super().sendall(*args, **kwargs)


def _connect_by(deadline: float, address: tuple[str, int], timeout: Any = None,
                source_address: Any = None, **_: Any) -> socket.socket:
    """``socket.create_connection`` bounded by ``deadline``, returning a :class:`_DeadlineSocket`."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("request deadline passed")
    raw = socket.create_connection(address, left, source_address)
    sock = _DeadlineSocket(raw.family, raw.type, raw.proto, fileno=raw.detach())
    sock.deadline = deadline
    return sock


class HttpClient:
    """Sequential HTTP requests with a total deadline each; abortable from another thread.

    Threading: one request at a time per client (a watcher owns one); :meth:`abort` may be called
    from any thread and makes the in-flight request (and every later one) fail at once.
    A new connection per request: metadata servers are local and this keeps state trivial.
    """

    def __init__(self, timeout_s: float, *, max_body: int = MAX_BODY_BYTES) -> None:
        if timeout_s <= 0:
            raise ValueError(f"HttpClient timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.max_body = max_body
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False

    def abort(self) -> None:
        """Fail the in-flight request now and refuse new ones (idempotent)."""
        with self._lock:
            self._aborted = True
            conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # unblocks a recv() in the other thread
            except OSError:
                pass

    def request(
        self,
        method: str,
        url: str,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        *,
        timeout_s: float | None = None,
    ) -> HttpResponse:
        """Send one request and read the whole answer within ``timeout_s`` seconds (total).

        Any status is returned (the caller decides what 404 or 401 means); transport failures,
        timeouts and oversize bodies raise :class:`MetadataError` with ``status=None`` (or the
        status, for an oversize/truncated body).
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MetadataError("unsupported URL (need http://host[:port]/...)", url=url)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
        conn._create_connection = functools.partial(_connect_by, deadline)  # type: ignore[attr-defined]
        status: int | None = None
        try:
            if self._aborted:
                raise MetadataError("aborted (watcher stopping)", url=url)
            conn.connect()
            # Register the connected socket under the lock: abort() either sees it (and shuts it
            # down) or has already set the flag we check here. No window in between.
            with self._lock:
                if self._aborted:
                    raise MetadataError("aborted (watcher stopping)", url=url)
                self._conn = conn
            conn.request(method, target, body=body, headers=headers or {})
            resp = conn.getresponse()
            status = resp.status
            chunks: list[bytes] = []
            size = 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MetadataError(f"timed out after {timeout:g}s reading the body", url=url,
                                        status=status, body=b"".join(chunks))
                if conn.sock is not None and not isinstance(conn.sock, _DeadlineSocket):
                    conn.sock.settimeout(left)  # https: the TLS socket is not ours to arm
                try:
                    chunk = resp.read1(65536)
                except (TimeoutError, socket.timeout):
                    raise MetadataError(f"timed out after {timeout:g}s reading the body", url=url,
                                        status=status, body=b"".join(chunks)) from None
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > self.max_body:
                    raise MetadataError(f"body larger than {self.max_body} bytes", url=url, status=status,
                                        body=b"".join(chunks))
            return HttpResponse(url=url, status=status,
                                headers={k.lower(): v for k, v in resp.getheaders()},
                                body=b"".join(chunks))
        except MetadataError:
            raise
        except (TimeoutError, socket.timeout):
            phase = "no answer" if status is None else "no complete answer"
            raise MetadataError(f"{phase} within {timeout:g}s (status line and headers included)", url=url,
                                status=status) from None
        except (OSError, http.client.HTTPException) as e:
            aborted = self._aborted
            msg = "aborted (watcher stopping)" if aborted else f"{type(e).__name__}: {e}"
            raise MetadataError(msg, url=url, status=status) from None
        finally:
            with self._lock:
                self._conn = None
            conn.close()
