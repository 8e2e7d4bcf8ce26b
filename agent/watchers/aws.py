"""AWS EC2 spot interruption notices through IMDSv2.

Protocol (AWS docs, "Instance metadata service version 2" and "Spot Instance interruption notices"):

* ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: 1..21600`` returns a session
  token; every ``GET`` carries it as ``X-aws-ec2-metadata-token``. An expired or missing token gets
  401; we refresh the token before its TTL runs out and once more on a 401.
* ``GET /latest/meta-data/spot/instance-action``: 404 while there is no interruption; 200 with
  ``{"action": "terminate"|"stop"|"hibernate", "time": "2026-11-22T12:00:00Z"}`` two minutes before
  it. ``time`` is the deadline.
* ``GET /latest/meta-data/events/recommendations/rebalance``: 404, or 200 with
  ``{"noticeTime": "..."}`` when the instance is at elevated risk. It is an early warning with no
  deadline of its own; AWS still sends the two-minute ``instance-action`` before reclaiming, so the
  notice carries ``deadline = detection + 120 s`` (the earliest the node can be gone).

Threading: one daemon thread (see :class:`~trainguard.agent.watchers.base.Watcher`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from trainguard.agent.watchers.base import Notice, PartialPoll, Watcher, parse_iso8601_utc
from trainguard.agent.watchers.config import PreemptionConfig
from trainguard.agent.watchers.http import HttpResponse, MetadataError

AWS_SPOT_NOTICE_S = 120.0
"""AWS gives a spot instance two minutes between the interruption notice and the action."""

TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
ACTIONS = ("terminate", "stop", "hibernate")


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"body is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    return doc


def _deadline(raw: Any, received_at: float, fallback_s: float) -> tuple[float, bool]:
    """(deadline, fell_back): parse ``raw`` strictly, else ``received_at + fallback_s``."""
    try:
        return parse_iso8601_utc(raw), False
    except ValueError:
        return received_at + fallback_s, True


def parse_instance_action(body: bytes, received_at: float, default_deadline_s: float) -> Notice:
    """Pure: a 200 ``spot/instance-action`` body -> Notice. ``ValueError`` on a malformed body.

    A present but malformed ``time`` does not fail: the notice falls back to
    ``received_at + default_deadline_s`` and says so in ``detail["deadline_fallback"]``.
    """
    doc = _json_object(body)
    action = doc.get("action")
    if action not in ACTIONS:
        raise ValueError(f"`action` must be one of {list(ACTIONS)}, got {action!r}")
    raw_time = doc.get("time")
    deadline, fell_back = _deadline(raw_time, received_at, default_deadline_s)
    detail: dict[str, Any] = {"action": action, "time": raw_time}
    if fell_back:
        detail["deadline_fallback"] = True
    return Notice(source="aws", kind="termination", deadline=deadline, received_at=received_at,
                  detail=detail, event_id=f"instance-action:{action}:{raw_time}")


def parse_rebalance(body: bytes, received_at: float) -> Notice:
    """Pure: a 200 ``recommendations/rebalance`` body -> early-warning Notice."""
    doc = _json_object(body)
    raw_time = doc.get("noticeTime")
    try:
        parse_iso8601_utc(raw_time)
        valid = True
    except ValueError:
        valid = False
    detail: dict[str, Any] = {"noticeTime": raw_time}
    if not valid:
        detail["notice_time_invalid"] = True
    return Notice(source="aws", kind="rebalance", deadline=received_at + AWS_SPOT_NOTICE_S,
                  received_at=received_at, detail=detail, event_id=f"rebalance:{raw_time}")


class AwsWatcher(Watcher):
    """Polls IMDSv2 every ``poll_interval_s`` for the spot ``instance-action`` (and rebalance)."""

    source = "aws"

    def __init__(self, *, endpoint: str, request_timeout_s: float = 2.0, poll_interval_s: float = 2.0,
                 rebalance: bool = True, token_ttl_s: int = 21600, default_deadline_s: float = 30.0,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name="aws", poll_interval_s=poll_interval_s, clock=clock)
        if not 1 <= token_ttl_s <= 21600:
            raise ValueError(f"preemption.aws_token_ttl_s must be within 1..21600, got {token_ttl_s}")
        self.endpoint = endpoint.rstrip("/")
        self.rebalance = rebalance
        self.token_ttl_s = int(token_ttl_s)
        self.default_deadline_s = default_deadline_s
        self.monotonic = monotonic
        self._http = self.make_client(request_timeout_s)
        self._token: str | None = None
        self._token_refresh_at = 0.0
        self.token_fetches = 0
        """How many tokens this watcher has fetched (observability and tests)."""

    @classmethod
    def from_config(cls, cfg: PreemptionConfig, **kw: Any) -> AwsWatcher:
        return cls(endpoint=cfg.aws_endpoint, request_timeout_s=cfg.request_timeout_s,
                   poll_interval_s=cfg.poll_interval_s, rebalance=cfg.aws_rebalance,
                   token_ttl_s=cfg.aws_token_ttl_s, default_deadline_s=cfg.default_deadline_s, **kw)

    # ------------------------------------------------------------------ IMDSv2
    def _refresh_margin(self) -> float:
        # Refresh at half the TTL or a minute before expiry, whichever is later: long TTLs refresh
        # a minute early, short ones (tests) halfway, never on the expiry edge.
        return max(self.token_ttl_s * 0.5, self.token_ttl_s - 60.0)

    def _fetch_token(self) -> str:
        url = self.endpoint + TOKEN_PATH
        resp = self._http.request("PUT", url, {TTL_HEADER: str(self.token_ttl_s)})
        if resp.status != 200:
            raise resp.error(f"IMDSv2 token request answered {resp.status}")
        token = resp.text().strip()
        if not token or not token.isprintable() or len(token) > 4096:
            raise MetadataError("IMDSv2 token request returned an unusable token", url=url, status=resp.status)
        self._token = token
        self._token_refresh_at = self.monotonic() + self._refresh_margin()
        self.token_fetches += 1
        self.log.debug("imds_token_refreshed", source=self.source, ttl_s=self.token_ttl_s)
        return token

    def _get(self, path: str) -> HttpResponse:
        """GET with a valid token; one token refresh and retry on 401."""
        url = self.endpoint + path
        token = self._token
        if token is None or self.monotonic() >= self._token_refresh_at:
            token = self._fetch_token()
        resp = self._http.request("GET", url, {TOKEN_HEADER: token})
        if resp.status == 401:
            self._token = None
            resp = self._http.request("GET", url, {TOKEN_HEADER: self._fetch_token()})
        return resp

    # ------------------------------------------------------------------ polling
    def poll(self) -> Iterable[Notice]:
        """See base class. Each endpoint is checked independently: a failing rebalance check does
        not hide a termination notice (and vice versa)."""
        out: list[Notice] = []
        errors: list[Exception] = []
        for check in ((self._check_action, self._check_rebalance) if self.rebalance else (self._check_action,)):
            try:
                n = check()
            except Exception as e:
                errors.append(e)
                continue
            if n is not None:
                out.append(n)
        if errors:
            raise PartialPoll(out, errors)  # the base delivers `out`, then logs the errors in order
        return out

    def _check_action(self) -> Notice | None:
        resp = self._get(INSTANCE_ACTION_PATH)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise resp.error(f"unexpected status {resp.status}")
        try:
            n = parse_instance_action(resp.body, self.clock(), self.default_deadline_s)
        except ValueError as e:
            raise resp.error(str(e)) from None
        if n.detail.get("deadline_fallback"):
            self.log.warning("notice_time_invalid", source=self.source, url=resp.url, value=n.detail.get("time"),
                             fallback_deadline_s=self.default_deadline_s,
                             fix="none needed; the watcher assumed preemption.default_deadline_s")
        return n

    def _check_rebalance(self) -> Notice | None:
        resp = self._get(REBALANCE_PATH)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise resp.error(f"unexpected status {resp.status}")
        try:
            return parse_rebalance(resp.body, self.clock())
        except ValueError as e:
            raise resp.error(str(e)) from None

    def on_poll_error(self, exc: BaseException) -> None:
        """See base class. A timed-out or garbled exchange may have left a bad token: refetch."""
        if isinstance(exc, MetadataError) and exc.url.endswith(TOKEN_PATH):
            self._token = None
