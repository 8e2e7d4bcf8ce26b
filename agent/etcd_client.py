"""A small etcd v3 client: etcd's own JSON gateway over HTTPS, on the Python standard library.

Why this client, and not another:

* etcd serves its v3 API as JSON over HTTP/1.1 on the same client port as gRPC (the gRPC gateway:
  ``POST /v3/kv/range``, ``/v3/kv/txn``, ``/v3/auth/authenticate``, ``/v3/watch``...), with the
  same TLS, client-certificate and RBAC checks. ``/v3/`` is served by etcd 3.4 (Debian bookworm's
  3.4.23 also answers ``/v3beta/``) and is the only prefix of 3.5 and 3.6, so one path covers every
  etcd still supported. Keys and values travel base64-encoded, 64-bit integers as JSON strings.
* The rendezvous needs six calls (range, put, txn, delete-range, lease grant, authenticate) and one
  stream (watch). Written against :mod:`http.client` and :mod:`ssl`, they add no dependency, and we
  see the raw ``ssl`` failure (unknown CA, wrong host name, refused client certificate) that
  :mod:`trainguard.agent.etcd_rendezvous` turns into an error naming the setting to fix.
* The alternatives, as of this writing: ``etcd3`` (PyPI, gRPC) had its last release in 2020 and pins
  old ``grpcio``/``protobuf``; ``aetcd`` is asyncio-only while the agent is threaded; ``etcd3gw``
  (maintained, also the JSON gateway) brings ``requests``, ``futurist`` and ``pbr`` for the same six
  calls and hides the ``ssl`` detail behind ``requests`` exceptions.

Semantics kept deliberately small:

* **Failover.** ``endpoints`` lists etcd members; a request that cannot reach one (refused, timed
  out, 5xx, "no leader") moves on to the next and, after a round, backs off and retries until
  ``retry_s`` has passed. A failure that retrying cannot fix (TLS, credentials, permissions) raises
  at once.
* **Writes that must not run twice** (:meth:`EtcdClient.txn` with ``idempotent=False``, used by the
  store's atomic ``add``) are retried only when the request cannot have reached etcd (the connection
  failed to open, or a kept-alive connection was found closed).
* **Auth.** With a ``username`` the client authenticates on first use and again when etcd answers
  "invalid auth token" (simple tokens expire after ``--auth-token-ttl``, 300 s by default, and on a
  member restart). The password and the token are never logged and never in ``repr``.
* **Threads.** One keep-alive connection per (thread, member); the rendezvous handler calls from
  its heartbeat timer, the supervisor thread and the main thread. A watch uses a connection of its own.

Errors are :class:`EtcdError` with an :class:`EtcdFailure` value; :func:`failure_of_answer` and
:func:`failure_of_exception` are the pure classifiers (table-tested). Those and the wire format (base64,
operations, comparisons) live in :mod:`trainguard.agent.etcd_wire`, re-exported here.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

API = "/v3"
"""The gateway's path prefix (etcd >= 3.4)."""

LEASE_TTL_S = 7200
"""TTL of the lease the client attaches to keys it writes with ``lease=True``: torch's ``etcd-v2``
backend gives its rendezvous state the same two hours."""

from trainguard.agent.etcd_wire import (  # noqa: F401 (re-exported: the client's names)
    CN_REFUSED_MARKER,
    EtcdError,
    EtcdFailure,
    KeyValue,
    TxnResult,
    b64,
    cmp_absent,
    cmp_mod_revision,
    cmp_never,
    cmp_value,
    failure_of_answer,
    failure_of_exception,
    op_delete,
    op_put,
    op_range,
    prefix_range_end,
    split_host_port,
    unb64,
)


# ----------------------------------------------------------------------------------- settings
@dataclass(frozen=True, slots=True)
class EtcdSettings:
    """Where etcd is and how to prove who we are. Paths are read when the client is built."""

    endpoints: tuple[str, ...]
    """``host:port`` of each etcd member (IPv6 as ``[addr]:port``)."""
    ca_file: str = ""
    """CA bundle that signed etcd's server certificate; empty = plain HTTP."""
    cert_file: str = ""
    """Client certificate (PEM) for etcd's ``--client-cert-auth``."""
    key_file: str = ""
    """Private key of ``cert_file``."""
    server_name: str = ""
    """Name to verify etcd's certificate against (and send as SNI) instead of the endpoint host."""
    username: str = ""
    """etcd user; empty = no authentication."""
    password: str = field(default="", repr=False)
    """The user's password (never logged)."""
    timeout_s: float = 5.0
    """Connect/read timeout of one request to one member."""
    retry_s: float = 10.0
    """How long one call keeps retrying members that are unavailable."""

    @property
    def tls(self) -> bool:
        return bool(self.ca_file)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context (raises ``ssl.SSLError``/``OSError`` on unreadable files)."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file or None)
        return ctx


# ----------------------------------------------------------------------------------- transport
class _Connection(http.client.HTTPSConnection):
    """HTTPS that verifies (and sends as SNI) ``server_name`` instead of the host it connects to."""

    def __init__(self, host: str, port: int, *, timeout: float, context: ssl.SSLContext, server_name: str) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._server_name = server_name or host

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name)  # type: ignore[attr-defined]


class EtcdClient:
    """Thread-safe etcd v3 client over the JSON gateway. See the module docstring; :meth:`close` is
    idempotent."""

    def __init__(self, settings: EtcdSettings) -> None:
        if not settings.endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self.settings = settings
        self._ctx = settings.ssl_context()
        self._scheme = "https" if self._ctx is not None else "http"
        self._local = threading.local()
        self._conns: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._preferred = 0
        self._token: str | None = None
        self._lease: tuple[int, float] | None = None  # (id, monotonic time granted)

    def __repr__(self) -> str:
        s = self.settings
        return f"EtcdClient({self._scheme}://{','.join(s.endpoints)}, user={s.username or None!r})"

    @property
    def url(self) -> str:
        """``scheme://first-endpoint`` (for logs)."""
        return f"{self._scheme}://{self.settings.endpoints[0]}"

    # ---- connections ---------------------------------------------------------------------------
    def _new_connection(self, endpoint: str, timeout: float) -> http.client.HTTPConnection:
        host, port = split_host_port(endpoint)
        if self._ctx is None:
            return http.client.HTTPConnection(host, port, timeout=timeout)
        return _Connection(host, port, timeout=timeout, context=self._ctx, server_name=self.settings.server_name)

    def _pooled(self, endpoint: str) -> http.client.HTTPConnection:
        conns: dict[str, http.client.HTTPConnection] | None = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(endpoint)
        if conn is None:
            conn = conns[endpoint] = self._new_connection(endpoint, self.settings.timeout_s)
            with self._lock:
                self._conns.append(conn)
        return conn

    def _drop(self, endpoint: str) -> None:
        conns = getattr(self._local, "conns", {})
        conn = conns.pop(endpoint, None)
        if conn is not None:
            conn.close()
            with self._lock:
                with contextlib.suppress(ValueError):
                    self._conns.remove(conn)

    def close(self) -> None:
        """Close every pooled connection. Safe to call twice and from any thread."""
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(Exception):
                c.close()

    def _headers(self, auth: bool) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if auth and self.settings.username:
            headers["Authorization"] = self._ensure_token()
        return headers

    def _once(self, endpoint: str, path: str, payload: bytes, headers: dict[str, str],
              idempotent: bool) -> tuple[int, bytes]:
        """One request to one member over the pooled connection. Raises ``EtcdError``."""
        conn = self._pooled(endpoint)
        reused = conn.sock is not None
        sent = False
        try:
            if conn.sock is None:
                conn.connect()
            sent = True
            conn.request("POST", path, body=payload, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self._drop(endpoint)
            failure = failure_of_exception(exc)
            if failure is EtcdFailure.UNAVAILABLE and sent and not idempotent:
                stale = reused and isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError))
                if not stale:  # it may have been applied: the caller must not blindly run it again
                    raise EtcdError(EtcdFailure.REQUEST, f"outcome unknown, connection lost: {exc}", endpoint=endpoint) from exc
            raise EtcdError(failure, f"{type(exc).__name__}: {exc}", endpoint=endpoint) from exc

    def call(self, method: str, body: dict[str, Any], *, auth: bool = True, idempotent: bool = True) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<method>`` and return the decoded answer; raises :class:`EtcdError`."""
        try:
            return self._call(method, body, auth, idempotent)
        except EtcdError as e:
            if e.failure is not EtcdFailure.TOKEN_EXPIRED or not auth or not self.settings.username:
                raise
            self._token = None  # expired or invalidated (member restart, auth change): once more, anew
            return self._call(method, body, auth, idempotent)

    def _call(self, method: str, body: dict[str, Any], auth: bool, idempotent: bool) -> dict[str, Any]:
        payload = json.dumps(body).encode()
        path = f"{API}/{method}"
        deadline = time.monotonic() + self.settings.retry_s
        delay = 0.05
        last: EtcdError | None = None
        while True:
            headers = self._headers(auth)  # authenticates first when needed; its errors are its own
            n = len(self.settings.endpoints)
            for i in range(n):
                idx = (self._preferred + i) % n
                endpoint = self.settings.endpoints[idx]
                try:
                    status, raw = self._once(endpoint, path, payload, headers, idempotent)
                except EtcdError as e:
                    if not e.failure.retryable:
                        raise
                    last = e
                    continue
                answer = _decode(raw)
                if status == 200 and isinstance(answer, dict):
                    self._preferred = idx
                    return answer
                failure = failure_of_answer(status, answer)
                message = answer.get("message") if isinstance(answer, dict) else str(answer)[:200]
                err = EtcdError(failure, f"HTTP {status}: {message}", endpoint=endpoint)
                if not failure.retryable:
                    raise err
                last = err
            if time.monotonic() + delay > deadline:
                assert last is not None
                raise EtcdError(EtcdFailure.UNAVAILABLE, f"no etcd member answered within {self.settings.retry_s:g} s; "
                                f"last error: {last.detail}", endpoint=last.endpoint) from last
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 1.0)

    # ---- auth ----------------------------------------------------------------------------------
    def _ensure_token(self) -> str:
        token = self._token
        if token is None:
            answer = self.call("auth/authenticate", {"name": self.settings.username, "password": self.settings.password},
                               auth=False)
            token = self._token = str(answer.get("token", ""))
        return token

    def auth_token(self) -> str | None:
        """The current auth token, authenticating first when needed (None without a username): for the
        gRPC lease stream (:mod:`trainguard.agent.etcd_lease`), which sends it as ``token`` metadata."""
        return self._ensure_token() if self.settings.username else None

    def authenticate(self) -> None:
        """Authenticate now (no-op without a username); raises :class:`EtcdError`."""
        if self.settings.username:
            self._token = None
            self._ensure_token()

    # ---- kv --------------------------------------------------------------------------------------
    def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """``(the key or None, the store revision of the read)``."""
        answer = self.call("kv/range", {"key": b64(key)})
        kvs = answer.get("kvs", [])
        return (KeyValue.from_json(kvs[0]) if kvs else None), _revision(answer)

    def count(self, prefix: bytes) -> int:
        """Number of keys under ``prefix``."""
        answer = self.call("kv/range", {"key": b64(prefix), "range_end": b64(prefix_range_end(prefix)), "count_only": True})
        return int(answer.get("count", 0))

    def put(self, key: bytes, value: bytes, *, lease: bool = False) -> int:
        """Write ``key``; returns the new revision. ``lease``: attach the client's lease (see
        :data:`LEASE_TTL_S`)."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            return self._with_lease(lambda lid: _revision(self.call("kv/put", {**body, "lease": str(lid)})))
        return _revision(self.call("kv/put", body))

    def delete(self, key: bytes, *, range_end: bytes | None = None) -> int:
        """Delete ``key`` (or ``[key, range_end)``); returns how many keys were deleted."""
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        return int(self.call("kv/deleterange", body).get("deleted", 0))

    def txn(self, compare: Sequence[dict[str, Any]], success: Sequence[dict[str, Any]],
            failure: Sequence[dict[str, Any]] = (), *, idempotent: bool = True) -> TxnResult:
        """One etcd transaction: if every ``compare`` holds run ``success``, else ``failure``."""
        answer = self.call("kv/txn", {"compare": list(compare), "success": list(success), "failure": list(failure)},
                           idempotent=idempotent)
        responses = answer.get("responses", [])
        return TxnResult(bool(answer.get("succeeded", False)), _revision(answer), responses)

    # ---- leases ----------------------------------------------------------------------------------
    def lease_id(self) -> int:
        """The client's current lease, granted on first use and replaced once a quarter of its TTL
        has passed: a key written with it lives at least 3/4 of :data:`LEASE_TTL_S` after the write.
        Old leases are never revoked (that would delete the keys still attached to them); they
        expire on their own."""
        with self._lock:
            lease = self._lease
        if lease is not None and time.monotonic() - lease[1] < LEASE_TTL_S / 4:
            return lease[0]
        answer = self.call("lease/grant", {"TTL": str(LEASE_TTL_S)})
        lid = int(answer["ID"])
        with self._lock:
            self._lease = (lid, time.monotonic())
        return lid

    def _with_lease(self, fn: Any) -> Any:
        try:
            return fn(self.lease_id())
        except EtcdError as e:
            if e.failure is not EtcdFailure.LEASE_NOT_FOUND:
                raise
            with self._lock:
                self._lease = None  # expired while we were away (e.g. partitioned for hours)
            return fn(self.lease_id())

    def txn_with_lease(self, build: Any, *, idempotent: bool = True) -> TxnResult:
        """``build(lease_id) -> (compare, success, failure)``, run as :meth:`txn` with a fresh lease
        when the current one has expired."""
        return self._with_lease(lambda lid: self.txn(*build(lid), idempotent=idempotent))

    # ---- watch -----------------------------------------------------------------------------------
    def wait_for_change(self, prefix: bytes, after_revision: int, timeout_s: float) -> bool:
        """Block until a key under ``prefix`` changes after ``after_revision`` (True) or
        ``timeout_s`` passes (False). One watch on a connection of its own, closed on return."""
        body = {"key": b64(prefix), "range_end": b64(prefix_range_end(prefix)), "start_revision": str(after_revision + 1)}
        return self._watch(body, timeout_s) is not None

    def watch_key(self, key: bytes, after_revision: int, timeout_s: float) -> KeyValue | None:
        """Block until ``key`` is written after ``after_revision``: the key as written (the watch event
        carries it: no read after it), or None when ``timeout_s`` passed, it was deleted or etcd compacted
        the history (the caller reads again)."""
        body = {"key": b64(key), "start_revision": str(after_revision + 1)}
        result = self._watch(body, timeout_s)
        for event in (result or {}).get("events", []):
            if event.get("type", "PUT") == "PUT" and event.get("kv"):
                return KeyValue.from_json(event["kv"])
        return None

    def _watch(self, create: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The first watch result with events (or a compaction) for ``create``; None on timeout."""
        if timeout_s <= 0:
            return None
        body = {"create_request": create}
        endpoint = self.settings.endpoints[self._preferred % len(self.settings.endpoints)]
        deadline = time.monotonic() + timeout_s
        for attempt in (1, 2):
            conn = self._new_connection(endpoint, min(self.settings.timeout_s, timeout_s))
            try:
                try:
                    conn.request("POST", f"{API}/watch", body=json.dumps(body).encode(), headers=self._headers(True))
                    resp = conn.getresponse()
                    if resp.status != 200:
                        answer = _decode(resp.read())
                        raise EtcdError(failure_of_answer(resp.status, answer), f"watch: HTTP {resp.status}: {answer}",
                                        endpoint=endpoint)
                    for result in _stream(resp, conn, deadline):
                        if result.get("canceled"):
                            reason = str(result.get("cancel_reason", ""))
                            failure = failure_of_answer(400, reason)
                            if failure is EtcdFailure.TOKEN_EXPIRED and attempt == 1 and self.settings.username:
                                self._token = None
                                break
                            if result.get("compact_revision"):
                                return result  # history compacted: the caller re-reads
                            raise EtcdError(failure, f"watch canceled: {reason}", endpoint=endpoint)
                        if result.get("events") or result.get("compact_revision"):
                            return result
                    else:
                        return None
                except (OSError, http.client.HTTPException) as exc:
                    failure = failure_of_exception(exc)
                    if isinstance(exc, (socket.timeout, TimeoutError)) or failure.retryable:
                        return None  # the caller re-reads; a real outage shows there
                    raise EtcdError(failure, f"watch: {type(exc).__name__}: {exc}", endpoint=endpoint) from exc
            finally:
                conn.close()
        return None


def _stream(resp: http.client.HTTPResponse, conn: http.client.HTTPConnection, deadline: float) -> Iterator[dict[str, Any]]:
    """The ``result`` objects of a gateway stream (one JSON object per line) until ``deadline``."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        if conn.sock is not None:
            conn.sock.settimeout(left)
        try:
            line = resp.readline()
        except (socket.timeout, TimeoutError):
            return
        if not line:
            return
        msg = _decode(line)
        if isinstance(msg, dict):
            if "error" in msg and "result" not in msg:
                err = msg["error"]
                raise EtcdError(failure_of_answer(int(err.get("http_code", 400)), err), f"watch: {err.get('message')}")
            yield msg.get("result", {})


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip()


def _revision(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


__all__ = ["API", "LEASE_TTL_S", "EtcdClient", "EtcdError", "EtcdFailure", "EtcdSettings", "KeyValue", "TxnResult",
           "cmp_absent", "cmp_mod_revision", "cmp_never", "cmp_value", "failure_of_answer", "failure_of_exception",
           "op_delete", "op_put", "op_range", "prefix_range_end", "split_host_port"]
