"""GCP Compute Engine metadata server, as the GCP docs describe it.

* Every request needs ``Metadata-Flavor: Google`` (else 403, HTML body); ``X-Forwarded-For`` -> 403.
* Every answer carries ``Metadata-Flavor: Google``, ``Server: Metadata Server for VM`` and, for values,
  an ``ETag`` (a hash of the content: equal values have equal ETags).
* ``?wait_for_change=true``: with ``last_etag`` different from the current ETag -> answer at once;
  otherwise hold the request until the value changes or ``timeout_sec`` passes (then answer the
  unchanged value). ``timeout_sec`` must be a positive integer (else 400).
* ``/computeMetadata/v1/instance/preempted`` (``FALSE``/``TRUE``) and ``.../maintenance-event``
  (``NONE``/``MIGRATE_ON_HOST_MAINTENANCE``/``TERMINATE_ON_HOST_MAINTENANCE``); unknown keys 404.

``omit_flavor_header=True`` makes every answer lack ``Metadata-Flavor`` (an impostor/proxy).
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

from .base import EmulatorServer, RecordedRequest, Reply

PREFIX = "/computeMetadata/v1/"
FORBIDDEN = (b"<!DOCTYPE html>\n<html lang=en>\n  <meta charset=utf-8>\n  <title>Error 403 (Forbidden)!!1</title>\n"
             b"  <p><b>403.</b> <ins>That\xe2\x80\x99s an error.</ins>\n  <p>Your client does not have permission "
             b"to get URL <code>/computeMetadata/v1/instance/</code> from this server. Missing "
             b"Metadata-Flavor:Google header. <ins>That\xe2\x80\x99s all we know.</ins>\n")


def etag_of(value: str) -> str:
    return hashlib.sha1(value.encode()).hexdigest()[:16]


class GcpMetadataEmulator(EmulatorServer):
    server_header = "Metadata Server for VM"

    def __init__(self, *, omit_flavor_header: bool = False, **kw: Any) -> None:
        self.omit_flavor_header = omit_flavor_header
        self._values: dict[str, str] = {"preempted": "FALSE", "maintenance-event": "NONE",
                                        "id": "4520031799277581759", "name": "tg-node-0"}
        self._cond = threading.Condition()
        super().__init__(**kw)

    # ------------------------------------------------------------------ commands
    def set_value(self, key: str, value: str) -> None:
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def preempt(self) -> None:
        self.set_value("preempted", "TRUE")

    def maintenance(self, value: str = "TERMINATE_ON_HOST_MAINTENANCE") -> None:
        self.set_value("maintenance-event", value)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ API
    def api_headers(self) -> dict[str, str]:
        return {} if self.omit_flavor_header else {"Metadata-Flavor": "Google"}

    def _reply(self, status: int, body: bytes, extra: dict[str, str] | None = None) -> Reply:
        return Reply(status, body, {**self.api_headers(), "Content-Type": "application/text", **(extra or {})})

    def handle(self, req: RecordedRequest) -> Reply:
        if "x-forwarded-for" in req.headers or req.headers.get("metadata-flavor") != "Google":
            return Reply(403, FORBIDDEN, {"Content-Type": "text/html; charset=UTF-8"})
        if req.method not in ("GET", "HEAD"):
            return self._reply(405, b"Method Not Allowed")
        if req.path == PREFIX:
            return self._reply(200, b"instance/\nproject/\n")
        if req.path == PREFIX + "instance/":
            return self._reply(200, "".join(f"{k}\n" for k in sorted(self._values)).encode())
        key = req.path[len(PREFIX + "instance/"):] if req.path.startswith(PREFIX + "instance/") else None
        with self._cond:
            if key not in self._values:
                return self._reply(404, b"Not Found")
            if req.q("wait_for_change") == "true":
                raw_timeout = req.q("timeout_sec")
                if raw_timeout is not None and not (raw_timeout.isdigit() and int(raw_timeout) > 0):
                    return self._reply(400, b"Invalid timeout_sec")
                timeout = float(raw_timeout) if raw_timeout is not None else 3600.0
                start_tag = req.q("last_etag") or etag_of(self._values[key])
                end = time.monotonic() + timeout
                while etag_of(self._values[key]) == start_tag and not self.closing.is_set():
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            value = self._values[key]
        return self._reply(200, value.encode(), {"ETag": etag_of(value)})
