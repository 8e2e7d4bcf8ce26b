"""AWS EC2 instance metadata service, IMDSv2 (``HttpTokens=required``), as the AWS docs describe it.

* ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: 1..21600`` -> 200, the token
  as text and the TTL echoed in the same header; a missing/non-integer/out-of-range TTL -> 400;
  another method on that path -> 405; any request carrying ``X-Forwarded-For`` -> 403.
* Every other request needs ``X-aws-ec2-metadata-token`` with a live token, else 401 (missing, unknown
  or expired). With ``require_token=False`` a missing token is accepted (IMDSv1), a bad one still 401s.
* ``/latest/meta-data/spot/instance-action`` and ``/latest/meta-data/events/recommendations/rebalance``:
  404 (HTML body, like IMDS) until a notice is issued, then 200 JSON.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from .base import EmulatorServer, RecordedRequest, Reply

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "x-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "x-aws-ec2-metadata-token"
NOT_FOUND = (b'<?xml version="1.0" encoding="iso-8859-1"?>\n<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 '
             b'Transitional//EN"\n\t"http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">\n'
             b'<html xmlns="http://www.w3.org/1999/xhtml" xml:lang="en" lang="en">\n <head>\n  '
             b"<title>404 - Not Found</title>\n </head>\n <body>\n  <h1>404 - Not Found</h1>\n </body>\n</html>\n")
HTML = {"Content-Type": "text/html"}


def iso_z(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


class AwsImdsEmulator(EmulatorServer):
    server_header = "EC2ws"

    def __init__(self, *, require_token: bool = True, instance_id: str = "i-0123456789abcdef0", **kw: Any) -> None:
        self.require_token = require_token
        self.instance_id = instance_id
        self._tokens: dict[str, float] = {}  # token -> expiry (monotonic)
        self.token_ttls: list[int] = []
        """TTL of every token issued, in order."""
        self._instance_action: bytes | None = None
        self._rebalance: bytes | None = None
        super().__init__(**kw)

    # ------------------------------------------------------------------ commands
    def schedule_termination(self, in_s: float = 120.0, action: str = "terminate", *, time_str: str | None = None) -> str:
        """Issue a spot interruption ``in_s`` seconds from now; returns the ``time`` string served.

        ``time_str`` serves that raw value instead (for malformed-time tests). Note AWS times have
        whole seconds: the deadline is the floor of now + in_s.
        """
        t = time_str if time_str is not None else iso_z(time.time() + in_s)
        with self.lock:
            self._instance_action = json.dumps({"action": action, "time": t}).encode()
        return t

    def set_instance_action_body(self, body: bytes) -> None:
        with self.lock:
            self._instance_action = body

    def rebalance(self, notice_time: str | None = None) -> str:
        t = notice_time if notice_time is not None else iso_z(time.time())
        with self.lock:
            self._rebalance = json.dumps({"noticeTime": t}).encode()
        return t

    def clear(self) -> None:
        with self.lock:
            self._instance_action = None
            self._rebalance = None

    def expire_tokens(self) -> None:
        """Make every issued token invalid now (as if its TTL had passed)."""
        with self.lock:
            self._tokens.clear()

    @property
    def tokens_issued(self) -> int:
        return len(self.token_ttls)

    # ------------------------------------------------------------------ API
    def api_headers(self) -> dict[str, str]:
        return {}

    def handle(self, req: RecordedRequest) -> Reply:
        if "x-forwarded-for" in req.headers:
            return Reply(403, b"Forbidden", HTML)
        if req.path == TOKEN_PATH:
            return self._token(req)
        if req.method not in ("GET", "HEAD"):
            return Reply(405, b"Method Not Allowed", HTML)
        token = req.headers.get(TOKEN_HEADER)
        with self.lock:
            expiry = self._tokens.get(token) if token is not None else None
            if token is not None and (expiry is None or time.monotonic() >= expiry):
                self._tokens.pop(token, None)
                return Reply(401, b"", HTML)
            if token is None and self.require_token:
                return Reply(401, b"", HTML)
            action, rebalance = self._instance_action, self._rebalance
        if req.path == "/latest/meta-data/spot/instance-action":
            return Reply(200, action, {"Content-Type": "text/plain"}) if action else Reply(404, NOT_FOUND, HTML)
        if req.path == "/latest/meta-data/events/recommendations/rebalance":
            return Reply(200, rebalance, {"Content-Type": "text/plain"}) if rebalance else Reply(404, NOT_FOUND, HTML)
        if req.path == "/latest/meta-data/instance-id":
            return Reply(200, self.instance_id.encode(), {"Content-Type": "text/plain"})
        if req.path in ("/latest/meta-data", "/latest/meta-data/"):
            return Reply(200, b"ami-id\nevents/\ninstance-id\nspot/\n", {"Content-Type": "text/plain"})
        return Reply(404, NOT_FOUND, HTML)

    def _token(self, req: RecordedRequest) -> Reply:
        if req.method != "PUT":
            return Reply(405, b"Method Not Allowed", HTML)
        raw = req.headers.get(TTL_HEADER)
        try:
            ttl = int(raw) if raw is not None and raw.strip().isdigit() else -1
        except ValueError:
            ttl = -1
        if not 1 <= ttl <= 21600:
            return Reply(400, b"Bad Request", HTML)
        token = secrets.token_urlsafe(42)
        with self.lock:
            self._tokens[token] = time.monotonic() + ttl
            self.token_ttls.append(ttl)
        return Reply(200, token.encode(), {"Content-Type": "text/plain", "X-Aws-Ec2-Metadata-Token-Ttl-Seconds": str(ttl)})
