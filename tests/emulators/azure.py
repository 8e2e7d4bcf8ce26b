"""Azure Instance Metadata Service: Scheduled Events and the instance name, as the Azure docs describe.

* Every request needs ``Metadata: true`` (else 400 ``{"error": "Bad request. Required metadata header
  not specified"}``) and an ``api-version`` query parameter (missing -> 400 naming it; unknown -> 400
  with ``newest-versions``). Requests carrying ``X-Forwarded-For`` -> 400.
* ``GET /metadata/scheduledevents`` -> ``{"DocumentIncarnation": n, "Events": [...]}``; ``n`` increments on
  every change of the document (event added, started, removed).
* ``POST /metadata/scheduledevents`` with ``{"StartRequests": [{"EventId": id}]}`` approves events: with
  ``on_ack="start"`` (default) the event becomes ``Started`` with an empty ``NotBefore``; with
  ``on_ack="remove"`` it disappears. A body that is not that shape -> 400.
* ``GET /metadata/instance`` (JSON with ``compute.name``) and ``/metadata/instance/compute/name`` with
  ``format=text``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .base import EmulatorServer, RecordedRequest, Reply

API_VERSIONS = ("2017-03-01", "2017-08-01", "2017-11-01", "2018-10-01", "2019-01-01", "2019-08-01",
                "2020-06-01", "2020-07-01", "2020-09-01", "2021-01-01", "2021-02-01", "2021-12-13",
                "2023-07-01")
JSON = {"Content-Type": "application/json; charset=utf-8"}


def rfc1123(epoch: float) -> str:
    days = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
    months = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
    t = time.gmtime(epoch)
    return f"{days[t.tm_wday]}, {t.tm_mday:02d} {months[t.tm_mon - 1]} {t.tm_year} " \
           f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT"


class AzureEventsEmulator(EmulatorServer):
    server_header = "Microsoft-IIS/10.0"

    def __init__(self, *, vm_name: str = "tg-node-0", on_ack: str = "start", **kw: Any) -> None:
        if on_ack not in ("start", "remove"):
            raise ValueError("on_ack must be 'start' or 'remove'")
        self.vm_name = vm_name
        self.on_ack = on_ack
        self.incarnation = 1
        self._events: list[dict[str, Any]] = []
        self.acknowledged: list[str] = []
        """EventIds approved through StartRequests, in order."""
        super().__init__(**kw)

    # ------------------------------------------------------------------ commands
    def schedule(self, event_type: str, *, in_s: float = 30.0, resources: list[str] | None = None,
                 event_id: str | None = None, not_before: str | None = None, status: str = "Scheduled",
                 duration_s: int = -1, description: str = "", source: str = "Platform") -> str:
        """Add an event for ``resources`` (default: this VM); returns its EventId."""
        eid = event_id or str(uuid.uuid4()).upper()
        ev = {"EventId": eid, "EventStatus": status, "EventType": event_type, "ResourceType": "VirtualMachine",
              "Resources": list(resources) if resources is not None else [self.vm_name],
              "NotBefore": not_before if not_before is not None else ("" if status == "Started"
                                                                      else rfc1123(time.time() + in_s)),
              "Description": description or f"{event_type} scheduled by the emulator",
              "EventSource": source, "DurationInSeconds": duration_s}
        with self.lock:
            self._events.append(ev)
            self.incarnation += 1
        return eid

    def preempt(self, in_s: float = 30.0, **kw: Any) -> str:
        return self.schedule("Preempt", in_s=in_s, source="Platform", **kw)

    def start_event(self, event_id: str) -> None:
        with self.lock:
            for ev in self._events:
                if ev["EventId"] == event_id and ev["EventStatus"] != "Started":
                    ev["EventStatus"], ev["NotBefore"] = "Started", ""
                    self.incarnation += 1

    def finish(self, event_id: str) -> None:
        with self.lock:
            before = len(self._events)
            self._events = [e for e in self._events if e["EventId"] != event_id]
            if len(self._events) != before:
                self.incarnation += 1

    @property
    def events(self) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(e) for e in self._events]

    # ------------------------------------------------------------------ API
    def api_headers(self) -> dict[str, str]:
        return {}

    def _error(self, msg: str, **extra: Any) -> Reply:
        return Reply(400, json.dumps({"error": msg, **extra}).encode(), JSON)

    def handle(self, req: RecordedRequest) -> Reply:
        if "x-forwarded-for" in req.headers:
            return self._error("Bad request. Request with X-Forwarded-For header is not allowed")
        if req.headers.get("metadata", "").lower() != "true":
            return self._error("Bad request. Required metadata header not specified")
        api = req.q("api-version")
        if not api:
            return self._error("Bad request. api-version was not specified in the request. "
                               "For more information refer to aka.ms/azureimds",
                               **{"newest-versions": list(API_VERSIONS[-3:])[::-1]})
        if api not in API_VERSIONS:
            return self._error("Bad request. api-version is invalid or was not specified in the request. "
                               "For more information refer to aka.ms/azureimds",
                               **{"newest-versions": list(API_VERSIONS[-3:])[::-1]})
        if req.path == "/metadata/scheduledevents":
            if req.method == "GET":
                with self.lock:
                    doc = {"DocumentIncarnation": self.incarnation, "Events": [dict(e) for e in self._events]}
                return Reply(200, json.dumps(doc).encode(), JSON)
            if req.method == "POST":
                return self._start_requests(req)
            return Reply(405, b"", JSON)
        if req.path == "/metadata/instance" and req.method == "GET":
            doc = {"compute": {"name": self.vm_name, "location": "westeurope", "priority": "Spot",
                               "vmId": "02aab8a4-74ef-476e-8182-f6d2ba4166a6"}, "network": {"interface": []}}
            return Reply(200, json.dumps(doc).encode(), JSON)
        if req.path == "/metadata/instance/compute/name" and req.method == "GET":
            if req.q("format") == "text":
                return Reply(200, self.vm_name.encode(), {"Content-Type": "text/plain; charset=utf-8"})
            return Reply(200, json.dumps(self.vm_name).encode(), JSON)
        return Reply(404, json.dumps({"error": "Not found"}).encode(), JSON)

    def _start_requests(self, req: RecordedRequest) -> Reply:
        try:
            doc = json.loads(req.body.decode("utf-8"))
            ids = [r["EventId"] for r in doc["StartRequests"]]
            if not all(isinstance(i, str) for i in ids):
                raise TypeError("EventId must be a string")
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            return self._error(f"Bad request. Invalid StartRequests body ({type(e).__name__})")
        for eid in ids:
            self.acknowledged.append(eid)
            if self.on_ack == "remove":
                self.finish(eid)
            else:
                self.start_event(eid)
        return Reply(200, b"", JSON)
