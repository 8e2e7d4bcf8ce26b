"""GCP preemption and host-maintenance notices from the metadata server.

Protocol (GCP docs, "Detect if a VM was preempted" and "Wait for changes"): every request carries
``Metadata-Flavor: Google`` and every genuine answer carries it back (we reject answers without
it: that is not a GCP metadata server, or a proxy in the way).

* ``/computeMetadata/v1/instance/preempted``: ``TRUE`` / ``FALSE``. GCP flips it to ``TRUE`` when it
  starts a 30-second preemption; the deadline is ``detection + default_deadline_s`` (30 by default).
* ``/computeMetadata/v1/instance/maintenance-event``: ``NONE``, ``MIGRATE_ON_HOST_MAINTENANCE`` (live
  migration; the VM keeps running: an early warning) or ``TERMINATE_ON_HOST_MAINTENANCE`` (the VM
  stops). It changes 60 s before the event.

Both are watched with ``?wait_for_change=true&timeout_sec=T&last_etag=E``: the server answers at once
when the value's ETag differs from ``E``, else holds the request until the value changes or ``T``
seconds pass. One long-poll blocks one thread, so each key has its own watcher
(:func:`gcp_watchers`). The first request of a watcher (and the first after any failure) is a plain
GET, so a preemption that started before the agent did is seen at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlencode

from trainguard.agent.watchers.base import Notice, Watcher
from trainguard.agent.watchers.config import PreemptionConfig
from trainguard.agent.watchers.http import HttpResponse

GCP_PREEMPT_NOTICE_S = 30.0
"""GCP gives a preemptible/spot VM 30 s between the notice and the stop."""
GCP_MAINTENANCE_NOTICE_S = 60.0
"""``maintenance-event`` changes 60 s before a host maintenance event."""

BASE_PATH = "/computeMetadata/v1/instance/"
FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR = "Google"
KEYS = ("preempted", "maintenance-event")
MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")


def parse_value(key: str, text: str, etag: str, received_at: float, default_deadline_s: float) -> Notice | None:
    """Pure: the value of ``instance/<key>`` -> Notice or None. ``ValueError`` on an unknown value."""
    value = text.strip()
    if key == "preempted":
        if value == "FALSE":
            return None
        if value == "TRUE":
            # Preemption is one-way for the life of the VM: one event, whatever the ETag.
            return Notice(source="gcp", kind="preempt", deadline=received_at + default_deadline_s,
                          received_at=received_at, detail={"key": key, "value": value}, event_id="preempted")
        raise ValueError(f"`preempted` must be TRUE or FALSE, got {value[:40]!r}")
    if key == "maintenance-event":
        if value == "NONE":
            return None
        if value not in MAINTENANCE_VALUES:
            raise ValueError(f"`maintenance-event` must be one of {list(MAINTENANCE_VALUES)}, got {value[:60]!r}")
        kind = "termination" if value == "TERMINATE_ON_HOST_MAINTENANCE" else "maintenance"
        return Notice(source="gcp", kind=kind, deadline=received_at + GCP_MAINTENANCE_NOTICE_S,
                      received_at=received_at, detail={"key": key, "value": value},
                      event_id=f"maintenance-event:{value}:{etag}")
    raise ValueError(f"unknown GCP metadata key {key!r}; expected one of {list(KEYS)}")


class GcpWatcher(Watcher):
    """Long-polls one GCP metadata key (``preempted`` or ``maintenance-event``)."""

    source = "gcp"

    def __init__(self, *, endpoint: str, key: str = "preempted", request_timeout_s: float = 2.0,
                 poll_interval_s: float = 2.0, wait_timeout_s: int = 60, default_deadline_s: float = GCP_PREEMPT_NOTICE_S,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        if key not in KEYS:
            raise ValueError(f"GcpWatcher key must be one of {list(KEYS)}, got {key!r}")
        super().__init__(name=f"gcp-{key}", poll_interval_s=poll_interval_s, clock=clock)
        self.endpoint = endpoint.rstrip("/")
        self.key = key
        self.request_timeout_s = request_timeout_s
        self.wait_timeout_s = int(wait_timeout_s)
        self.default_deadline_s = default_deadline_s
        self.monotonic = monotonic
        self._http = self.make_client(request_timeout_s)
        self._etag: str | None = None
        self._quick_unchanged = False

    @classmethod
    def from_config(cls, cfg: PreemptionConfig, key: str, **kw: Any) -> GcpWatcher:
        return cls(endpoint=cfg.gcp_endpoint, key=key, request_timeout_s=cfg.request_timeout_s,
                   poll_interval_s=cfg.poll_interval_s, wait_timeout_s=cfg.gcp_wait_timeout_s,
                   default_deadline_s=cfg.default_deadline_s, **kw)

    @property
    def url(self) -> str:
        return self.endpoint + BASE_PATH + self.key

    def _fetch(self) -> HttpResponse:
        if self._etag is None:
            return self._http.request("GET", self.url, {FLAVOR_HEADER: FLAVOR})
        query = urlencode({"wait_for_change": "true", "timeout_sec": self.wait_timeout_s, "last_etag": self._etag})
        # The server may legitimately hold the request for timeout_sec: allow that plus the usual timeout.
        return self._http.request("GET", f"{self.url}?{query}", {FLAVOR_HEADER: FLAVOR},
                                  timeout_s=self.wait_timeout_s + self.request_timeout_s)

    def poll(self) -> Iterable[Notice]:
        """See base class. One plain GET or one long-poll."""
        started = self.monotonic()
        previous = self._etag
        resp = self._fetch()
        if resp.status != 200:
            raise resp.error(f"unexpected status {resp.status}")
        if resp.header(FLAVOR_HEADER) != FLAVOR:
            raise resp.error(f"answer lacks the `{FLAVOR_HEADER}: {FLAVOR}` response header; "
                             "not a GCP metadata server (check preemption.gcp_endpoint)")
        etag = resp.header("etag") or ""
        try:
            notice = parse_value(self.key, resp.text(), etag, self.clock(), self.default_deadline_s)
        except ValueError as e:
            raise resp.error(str(e)) from None
        # Without an ETag we cannot long-poll: fall back to plain polling every poll_interval_s.
        self._etag = etag or None
        # A server that answers a long-poll at once with an unchanged value is not honouring
        # wait_for_change; pace it instead of spinning.
        self._quick_unchanged = (previous is not None and etag == previous
                                 and self.monotonic() - started < min(0.5, self.wait_timeout_s / 2))
        return [notice] if notice is not None else []

    def delay_after(self, ok: bool) -> float:
        """See base class. Long-polls chain with no pause; plain GETs and failures are paced."""
        if not ok or self._etag is None or self._quick_unchanged:
            return self.poll_interval_s
        return 0.0

    def on_poll_error(self, exc: BaseException) -> None:
        """See base class. Resynchronise with a plain GET after any failure."""
        self._etag = None
