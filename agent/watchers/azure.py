"""Azure Scheduled Events (IMDS) notices, with acknowledgement.

Protocol (Azure docs, "Azure Metadata Service: Scheduled Events for Linux VMs"):

* ``GET /metadata/scheduledevents?api-version=2020-07-01`` with header ``Metadata: true`` answers
  ``{"DocumentIncarnation": n, "Events": [{"EventId", "EventType", "ResourceType", "Resources",
  "EventStatus", "NotBefore", "Description", "EventSource", "DurationInSeconds"}]}``.
  ``EventType``: ``Preempt`` (spot eviction, at least 30 s notice), ``Terminate``, ``Reboot``,
  ``Redeploy``, ``Freeze``. ``NotBefore`` is an RFC 1123 time (``Mon, 19 Sep 2016 18:29:47 GMT``), empty
  once the event has ``Started``.
* The document lists events for every VM of the availability set / scale set: only events whose
  ``Resources`` name *this* VM count. The name comes from ``preemption.azure_vm_name`` or from
  ``GET /metadata/instance/compute/name?api-version=2021-02-01&format=text``.
* ``POST`` the same URL with ``{"StartRequests": [{"EventId": id}]}`` approves the event so it starts
  now rather than at ``NotBefore``: the node goes early once the checkpoint is committed
  (:meth:`AzureWatcher.acknowledge`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from trainguard.agent.watchers.base import Notice, Watcher, parse_rfc1123
from trainguard.agent.watchers.config import PreemptionConfig
from trainguard.agent.watchers.http import HttpClient, MetadataError
from trainguard.contract.configbase import env_var_for

AZURE_PREEMPT_MIN_NOTICE_S = 30.0
"""Azure gives a Spot VM at least 30 s between the Preempt event and the eviction."""

EVENTS_PATH = "/metadata/scheduledevents"
EVENTS_API_VERSION = "2020-07-01"
NAME_PATH = "/metadata/instance/compute/name"
NAME_API_VERSION = "2021-02-01"
EVENT_KINDS = {
    "Preempt": "preempt",
    "Terminate": "termination",
    "Reboot": "maintenance",
    "Redeploy": "maintenance",
    "Freeze": "maintenance",
}


def parse_events(body: bytes, vm_name: str, received_at: float, default_deadline_s: float
                 ) -> tuple[int, list[Notice], list[str]]:
    """Pure: a Scheduled Events document -> (DocumentIncarnation, notices for ``vm_name``, problems).

    ``ValueError`` when the document itself is malformed; a malformed *event* is skipped and
    described in ``problems`` (one bad entry must not hide a Preempt next to it). A malformed or
    empty ``NotBefore`` on a Scheduled event falls back to ``received_at + default_deadline_s``;
    a Started event's deadline is now.
    """
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"body is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    inc = doc.get("DocumentIncarnation")
    events = doc.get("Events")
    if not isinstance(inc, int) or isinstance(inc, bool) or not isinstance(events, list):
        raise ValueError("expected {\"DocumentIncarnation\": int, \"Events\": [...]}")
    notices: list[Notice] = []
    problems: list[str] = []
    for ev in events:
        if not isinstance(ev, dict) or not isinstance(ev.get("EventId"), str) or not ev.get("EventId"):
            problems.append(f"event without a string EventId: {str(ev)[:120]}")
            continue
        resources = ev.get("Resources")
        if not isinstance(resources, list):
            problems.append(f"event {ev['EventId']}: Resources is not a list")
            continue
        if ev.get("ResourceType", "VirtualMachine") != "VirtualMachine" or vm_name not in resources:
            continue  # another VM's event
        etype = ev.get("EventType")
        kind = EVENT_KINDS.get(etype) if isinstance(etype, str) else None
        if kind is None:
            problems.append(f"event {ev['EventId']}: unknown EventType {etype!r}")
            continue
        status = ev.get("EventStatus")
        raw = ev.get("NotBefore")
        detail: dict[str, Any] = {k: ev.get(k) for k in ("EventType", "EventStatus", "NotBefore", "Description",
                                                           "EventSource", "DurationInSeconds")}
        detail["DocumentIncarnation"] = inc
        if status == "Started":
            deadline = received_at
        else:
            try:
                deadline = parse_rfc1123(raw)
            except ValueError:
                deadline = received_at + default_deadline_s
                detail["deadline_fallback"] = True
        notices.append(Notice(source="azure", kind=kind, deadline=deadline, received_at=received_at,
                              detail=detail, event_id=ev["EventId"]))
    return inc, notices, problems


class AzureWatcher(Watcher):
    """Polls Scheduled Events every ``poll_interval_s``; :meth:`acknowledge` approves an event."""

    source = "azure"

    def __init__(self, *, endpoint: str, vm_name: str = "", request_timeout_s: float = 2.0,
                 poll_interval_s: float = 2.0, acknowledge: bool = True, default_deadline_s: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="azure", poll_interval_s=poll_interval_s, clock=clock)
        self.endpoint = endpoint.rstrip("/")
        self.vm_name = vm_name
        self.ack_enabled = acknowledge
        self.default_deadline_s = default_deadline_s
        self._http = self.make_client(request_timeout_s)
        # Not aborted by stop(): the owner may stop watching, commit, and only then acknowledge.
        self._ack_http = HttpClient(request_timeout_s)
        self.incarnation: int | None = None
        """Last DocumentIncarnation seen (observability and tests)."""

    @classmethod
    def from_config(cls, cfg: PreemptionConfig, **kw: Any) -> AzureWatcher:
        return cls(endpoint=cfg.azure_endpoint, vm_name=cfg.azure_vm_name, request_timeout_s=cfg.request_timeout_s,
                   poll_interval_s=cfg.poll_interval_s, acknowledge=cfg.azure_acknowledge,
                   default_deadline_s=cfg.default_deadline_s, **kw)

    @property
    def events_url(self) -> str:
        return f"{self.endpoint}{EVENTS_PATH}?api-version={EVENTS_API_VERSION}"

    def _resolve_vm_name(self) -> str:
        url = f"{self.endpoint}{NAME_PATH}?api-version={NAME_API_VERSION}&format=text"
        resp = self._http.request("GET", url, {"Metadata": "true"})
        if resp.status != 200:
            raise resp.error(f"cannot read this VM's name (status {resp.status}); set preemption.azure_vm_name "
                             f"(env {env_var_for('preemption.azure_vm_name')})")
        name = resp.text().strip()
        if not name or not name.isprintable() or len(name) > 256:
            raise resp.error("IMDS returned an unusable VM name; set preemption.azure_vm_name")
        self.vm_name = name
        self.log.info("azure_vm_name_resolved", source=self.source, vm_name=name)
        return name

    def poll(self) -> Iterable[Notice]:
        """See base class."""
        vm = self.vm_name or self._resolve_vm_name()
        resp = self._http.request("GET", self.events_url, {"Metadata": "true"})
        if resp.status != 200:
            raise resp.error(f"unexpected status {resp.status}")
        try:
            inc, notices, problems = parse_events(resp.body, vm, self.clock(), self.default_deadline_s)
        except ValueError as e:
            raise resp.error(str(e)) from None
        for p in problems:
            self.log.warning("watcher_error", source=self.source, watcher=self.name, url=resp.url,
                             status=resp.status, error=p)
        for n in notices:
            if n.detail.get("deadline_fallback") and not self.seen(n):
                self.log.warning("notice_time_invalid", source=self.source, url=resp.url,
                                 value=n.detail.get("NotBefore"), fallback_deadline_s=self.default_deadline_s,
                                 fix="none needed; the watcher assumed preemption.default_deadline_s")
        self.incarnation = inc
        return notices

    def acknowledge(self, notice: Notice) -> bool:
        """See base class. POSTs ``StartRequests`` for ``notice.event_id``; thread-safe w.r.t. polling.

        Returns False (and logs) when acknowledgement is disabled (``preemption.azure_acknowledge``),
        the notice is not an Azure event, or the POST fails.
        """
        if notice.source != self.source or not notice.event_id:
            return False
        if not self.ack_enabled:
            self.log.info("azure_ack_skipped", event_id=notice.event_id,
                          reason="preemption.azure_acknowledge is false")
            return False
        body = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        try:
            resp = self._ack_http.request("POST", self.events_url,
                                          {"Metadata": "true", "Content-Type": "application/json"}, body)
            if resp.status != 200:
                raise resp.error(f"StartRequests answered {resp.status}")
        except MetadataError as e:
            self.log.warning("watcher_error", source=self.source, watcher=self.name, action="acknowledge",
                             event_id=notice.event_id, **e.log_fields())
            return False
        self.log.info("azure_event_acknowledged", event_id=notice.event_id, event_type=notice.detail.get("EventType"))
        return True
