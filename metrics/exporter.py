"""The agent's HTTP exporter: ``/metrics`` (Prometheus text format) and ``/healthz``.

A threading WSGI server (prometheus_client's) in one daemon thread, bound to
``metrics.bind_address:metrics.port`` (default 127.0.0.1:9400: binding anywhere else is an explicit
setting). Port 0 binds a free port; :attr:`MetricsExporter.port` tells which.

``/metrics`` honours prometheus_client's content negotiation (OpenMetrics on request, gzip);
``/healthz`` answers JSON, 200 when healthy and 503 otherwise; ``/`` lists both.

The exporter remembers when it was last scraped, so an exiting agent can wait for one more scrape
(:meth:`MetricsExporter.wait_for_next_scrape`): a drained node's final values (its drain duration,
the ``stopped`` state, its final cost) would otherwise leave with it unscraped.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from trainguard.contract.configbase import ConfigError
from trainguard.contract.log import get_logger

log = get_logger("trainguard.metrics.exporter")

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}

RECENT_SCRAPES = 4
"""Start times of this many recent ``/metrics`` requests are kept to estimate the scrape interval."""


class _Body:
    """A WSGI response body that reports when the server has written all of it (``close()``)."""

    def __init__(self, chunks: list[bytes], on_close: Callable[[], None]) -> None:
        self._chunks = chunks
        self._on_close = on_close

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._chunks)

    def __len__(self) -> int:  # one block: wsgiref then sets Content-Length, as for the plain list
        return len(self._chunks)

    def close(self) -> None:
        self._on_close()


class MetricsExporter:
    """Serve ``registry`` over HTTP until :meth:`close` (idempotent).

    ``health`` returns a dict with at least ``ok: bool``; it is called per ``/healthz`` request.
    Raises :class:`ConfigError` (naming ``metrics.bind_address``/``metrics.port``) when the address
    cannot be bound.
    """

    def __init__(self, registry: CollectorRegistry, bind_address: str = "127.0.0.1", port: int = 9400, *,
                 health: Callable[[], dict[str, Any]] | None = None) -> None:
        self._closed = False
        self._thread: threading.Thread | None = None
        self._httpd: Any = None
        self._scrapes = threading.Condition()
        self._scrape_starts: deque[float] = deque(maxlen=RECENT_SCRAPES)  # monotonic s
        self._started = 0  # /metrics requests begun
        self._answered = 0  # the highest request number fully answered
        metrics_app = make_wsgi_app(registry)
        health = health or (lambda: {"ok": True})

        def scrape(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            with self._scrapes:
                self._started += 1
                n = self._started
                self._scrape_starts.append(time.monotonic())

            def answered() -> None:
                with self._scrapes:
                    self._answered = max(self._answered, n)
                    self._scrapes.notify_all()

            try:
                body = metrics_app(environ, start_response)
            except BaseException:
                answered()
                raise
            return _Body(body, answered)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            path = environ.get("PATH_INFO", "/")
            if path == "/metrics":
                return scrape(environ, start_response)
            if path == "/healthz":
                try:
                    body = health()
                except Exception as e:  # a failing health probe is itself the answer
                    body = {"ok": False, "error": repr(e)}
                status = "200 OK" if body.get("ok") else "503 Service Unavailable"
                start_response(status, [("Content-Type", "application/json")])
                return [json.dumps(body).encode()]
            if path == "/":
                start_response("200 OK", [("Content-Type", "text/html")])
                return [b'<html><body><a href="/metrics">/metrics</a> <a href="/healthz">/healthz</a></body></html>']
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: try /metrics or /healthz\n"]

        try:
            infos = socket.getaddrinfo(bind_address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, _, _, _, sockaddr = infos[0]

            class _Server(ThreadingWSGIServer):
                address_family = family

            self._httpd = make_server(sockaddr[0], port, app, _Server, handler_class=_SilentHandler)
        except OSError as e:
            key = "metrics.port" if isinstance(e, OSError) and e.errno in (98, 13) else "metrics.bind_address"
            raise ConfigError(key, f"cannot serve metrics on {bind_address}:{port}: {e.strerror or e}",
                              "pick a free port (0 = any) or an address of this host",
                              value=port if key == "metrics.port" else bind_address) from e
        self.bind_address = bind_address
        self.port: int = self._httpd.server_address[1]
        host = f"[{bind_address}]" if ":" in bind_address else bind_address
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="trainguard-metrics-http", daemon=True)
        self._thread.start()
        log.info("metrics_exporter_started", url=self.url + "/metrics",
                 loopback_only=bind_address in _LOOPBACK)

    def scrape_interval_s(self) -> float | None:
        """The longest gap between the recent ``/metrics`` requests, while they keep coming: None
        after fewer than two, or when the last one is older than three such gaps (nobody scrapes
        periodically any more, e.g. two ``trainguard status`` calls long ago)."""
        with self._scrapes:
            starts = list(self._scrape_starts)
        if len(starts) < 2:
            return None
        gap = max(b - a for a, b in zip(starts, starts[1:]))
        return gap if time.monotonic() - starts[-1] <= 3 * gap else None

    def scrapes_begun(self) -> int:
        """How many ``/metrics`` requests have begun (a mark for :meth:`wait_for_next_scrape`)."""
        with self._scrapes:
            return self._started

    def wait_for_next_scrape(self, timeout_s: float, after: int | None = None) -> bool:
        """Block until a ``/metrics`` request that *begins after this call* (or after the mark
        ``after`` from :meth:`scrapes_begun`) has been answered, or ``timeout_s`` passed; True when
        one was. Any thread."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._scrapes:
            after = self._started if after is None else after
            while self._answered <= after:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._scrapes.wait(left)
            return True

    def close(self) -> None:
        """Stop serving and release the port. Idempotent; safe on a half-built object."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._httpd is not None:
            if self._thread is not None:
                self._httpd.shutdown()
                self._thread.join(timeout=5)
            self._httpd.server_close()

    def __enter__(self) -> "MetricsExporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
