"""What travels between the etcd client (:mod:`trainguard.agent.etcd_client`) and etcd's JSON gateway,
and what a failure is: the :class:`EtcdFailure` classes with the pure classifiers
:func:`failure_of_answer` and :func:`failure_of_exception` (table-tested), base64 keys and values, the
range/put/delete operations and the transaction comparisons, :class:`KeyValue` and :class:`TxnResult`."""

from __future__ import annotations

import base64
import enum
import http.client
import ssl
from dataclasses import dataclass
from typing import Any

CN_REFUSED_MARKER = "CommonName of client sending a request against gateway"
"""etcd's answer (HTTP 400) to a client certificate with a Common Name when client-cert auth and
RBAC are both on: the gateway cannot pass a CN-derived identity on, so it refuses the request."""


class EtcdFailure(str, enum.Enum):
    """Why an etcd call failed; decides whether to retry and which setting the error names."""

    UNAVAILABLE = "unavailable"
    """No member answered in time (refused, timed out, 5xx, no leader): retried, then raised."""
    SERVER_UNTRUSTED = "server_untrusted"
    """etcd's certificate does not verify against ``ca_file``."""
    NAME_MISMATCH = "name_mismatch"
    """etcd's certificate is valid but names another host than the one connected to."""
    CLIENT_CERT_REJECTED = "client_cert_rejected"
    """etcd ended the TLS handshake: it wants a client certificate signed by a CA it trusts."""
    CLIENT_CERT_HAS_CN = "client_cert_has_cn"
    """etcd's gateway refuses client certificates with a Common Name (client-cert auth + RBAC on)."""
    TLS_MISMATCH = "tls_mismatch"
    """One side speaks TLS and the other plain HTTP."""
    BAD_CREDENTIALS = "bad_credentials"
    """Unknown user or wrong password."""
    AUTH_REQUIRED = "auth_required"
    """etcd has authentication on and the request carried no user."""
    AUTH_DISABLED = "auth_disabled"
    """A user was configured but etcd's authentication is off (anyone may write)."""
    TOKEN_EXPIRED = "token_expired"
    """The auth token is no longer valid (expired, member restarted): re-authenticate."""
    PERMISSION_DENIED = "permission_denied"
    """The user's roles do not cover the key."""
    LEASE_NOT_FOUND = "lease_not_found"
    """The lease attached to a write has expired: grant a new one."""
    REQUEST = "request"
    """Any other error answer."""

    @property
    def retryable(self) -> bool:
        return self is EtcdFailure.UNAVAILABLE


class EtcdError(Exception):
    """An etcd call failed: ``failure`` says why, ``endpoint`` where (``host:port``, may be empty)."""

    def __init__(self, failure: EtcdFailure, message: str, *, endpoint: str = "") -> None:
        where = f" ({endpoint})" if endpoint else ""
        super().__init__(f"{message}{where}")
        self.failure = failure
        self.detail = message
        self.endpoint = endpoint


# ----------------------------------------------------------------------------------- classification
_GRPC_UNAVAILABLE = {4, 8, 14}  # DeadlineExceeded, ResourceExhausted ("too many requests"), Unavailable


def failure_of_answer(status: int, body: Any) -> EtcdFailure:
    """Classify a non-200 gateway answer. ``body`` is the decoded JSON object, or the raw text."""
    if isinstance(body, dict):
        text = str(body.get("message") or body.get("error") or "")
        code = body.get("code")
    else:
        text, code = str(body), None
    low = text.lower()
    if CN_REFUSED_MARKER.lower() in low:
        return EtcdFailure.CLIENT_CERT_HAS_CN
    if "http request to an https server" in low:
        return EtcdFailure.TLS_MISMATCH
    if "invalid user id or password" in low or "authentication failed" in low:
        return EtcdFailure.BAD_CREDENTIALS
    if "user name is empty" in low or "user name not found" in low:
        return EtcdFailure.AUTH_REQUIRED
    if "authentication is not enabled" in low:
        return EtcdFailure.AUTH_DISABLED
    if "invalid auth token" in low or "revision of auth store is old" in low or code == 16:
        return EtcdFailure.TOKEN_EXPIRED
    if "permission denied" in low or code == 7 or status == 403:
        return EtcdFailure.PERMISSION_DENIED
    if "requested lease not found" in low:
        return EtcdFailure.LEASE_NOT_FOUND
    if status >= 500 or code in _GRPC_UNAVAILABLE or status in (408, 429) or "leader" in low:
        return EtcdFailure.UNAVAILABLE
    return EtcdFailure.REQUEST


def failure_of_exception(exc: BaseException) -> EtcdFailure:
    """Classify an exception raised while connecting, sending or reading."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        reason = f"{getattr(exc, 'verify_message', '')} {exc}".lower()
        return EtcdFailure.NAME_MISMATCH if "hostname mismatch" in reason or "ip address mismatch" in reason \
            else EtcdFailure.SERVER_UNTRUSTED
    if isinstance(exc, ssl.SSLError):
        reason = f"{getattr(exc, 'reason', '') or ''} {exc}".lower()
        if "wrong version number" in reason or "record layer failure" in reason or "http request" in reason:
            return EtcdFailure.TLS_MISMATCH
        if "alert" in reason or "certificate required" in reason or "bad certificate" in reason \
                or "unknown ca" in reason:
            return EtcdFailure.CLIENT_CERT_REJECTED
        if "eof" in reason:
            # The server hung up mid-handshake; etcd does so when it rejects the client's certificate
            # under TLS 1.2. A member that is merely down refuses the connection instead.
            return EtcdFailure.CLIENT_CERT_REJECTED
        return EtcdFailure.UNAVAILABLE
    if isinstance(exc, http.client.BadStatusLine) and not isinstance(exc, http.client.RemoteDisconnected):
        return EtcdFailure.TLS_MISMATCH  # a TLS server's bytes read as HTTP
    return EtcdFailure.UNAVAILABLE


# ----------------------------------------------------------------------------------- wire
def split_host_port(endpoint: str) -> tuple[str, int]:
    """``"10.0.0.5:2379"`` -> ``("10.0.0.5", 2379)``; ``"[::1]:2379"`` -> ``("::1", 2379)``."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix`` (etcd's ``--prefix``)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # all keys


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd returns it (revisions are etcd's store revisions)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KeyValue:
        return cls(unb64(d.get("key")), unb64(d.get("value")), int(d.get("create_revision", 0)),
                   int(d.get("mod_revision", 0)))


@dataclass(frozen=True, slots=True)
class TxnResult:
    """Outcome of a transaction: whether the compares held, the store revision after it, and the
    decoded responses of the branch that ran (one per request, in order)."""

    succeeded: bool
    revision: int
    responses: list[dict[str, Any]]

    def kvs(self, i: int) -> list[KeyValue]:
        """The keys returned by the ``i``-th request when it was a range."""
        body = self.responses[i].get("response_range", {})
        return [KeyValue.from_json(kv) for kv in body.get("kvs", [])]

    def count(self, i: int) -> int:
        return int(self.responses[i].get("response_range", {}).get("count", 0))


# Request builders for txn(): plain dicts in the gateway's JSON shape.
def op_range(key: bytes, *, range_end: bytes | None = None, count_only: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key)}
    if range_end is not None:
        body["range_end"] = b64(range_end)
    if count_only:
        body["count_only"] = True
    return {"request_range": body}


def op_put(key: bytes, value: bytes, *, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def op_delete(key: bytes, *, range_end: bytes | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key)}
    if range_end is not None:
        body["range_end"] = b64(range_end)
    return {"request_delete_range": body}


def cmp_mod_revision(key: bytes, revision: int) -> dict[str, Any]:
    """Holds when ``key`` was last modified at ``revision`` (0: the key does not exist)."""
    return {"target": "MOD", "key": b64(key), "result": "EQUAL", "mod_revision": str(revision)}


def cmp_absent(key: bytes) -> dict[str, Any]:
    """Holds when ``key`` does not exist (its create revision is 0)."""
    return {"target": "CREATE", "key": b64(key), "result": "EQUAL", "create_revision": "0"}


def cmp_value(key: bytes, value: bytes) -> dict[str, Any]:
    """Holds when ``key`` exists with exactly ``value``."""
    return {"target": "VALUE", "key": b64(key), "result": "EQUAL", "value": b64(value)}


def cmp_never(key: bytes) -> dict[str, Any]:
    """Never holds (no key is created before revision 0): a txn whose write branch etcd checks for
    permission but never runs."""
    return {"target": "CREATE", "key": b64(key), "result": "LESS", "create_revision": "0"}
