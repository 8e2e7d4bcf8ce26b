"""etcd transactions on the unary gRPC ``KV/Txn`` call: how a keyed-rendezvous node on etcd enters a round (its look
with its announcement in one transaction) and how the decider publishes one (issue 40).

Why not the JSON gateway (:meth:`~trainguard.agent.etcd_client.EtcdClient.txn`) for these calls: there each
transaction is an HTTP/1.1 request of JSON with base64 keys, which etcd's gateway turns into a gRPC call to etcd
itself. In ``bench/control_plane.py`` at 1,024 nodes on etcd with TLS a planned leave (1,023 enter transactions
at once) took 2.84 s (target: 2 s; 1.57 s on plain etcd): the transaction waited 1.6 s on average, the simulating
clients spent 3.8 CPU-s and etcd 1.7 CPU-s on this 2-core machine. Here a transaction is one HTTP/2 stream on the
channel the process already holds to that member for its lease keep-alives and watches
(:mod:`trainguard.agent.etcd_lease`: one asyncio loop thread, one ``grpc.aio`` channel per member) carrying one
small protobuf message each way: no JSON, no base64, no gateway hop inside etcd.

The contract is the gateway's: the same operation and comparison dicts (:func:`~.etcd_wire.op_range`,
:func:`~.etcd_wire.op_put`, :func:`~.etcd_wire.op_delete`, ``cmp_*``; other fields or kinds are refused with
``ValueError``), the same :class:`~.etcd_wire.TxnResult` (its responses in the gateway's JSON shape), the same
failover and retries (a retryable failure moves on to the next member, then backs off until ``retry_s``; a write
that must not run twice is retried only when it cannot have reached etcd) and the same :class:`EtcdError` classes
(:func:`~.etcd_watch.failure_of_status`). Re-authentication on an expired token is the caller's, as for watches
(:meth:`~.membership_kv.EtcdKv._txn`). The messages are encoded by hand (:func:`encode_txn`, :func:`decode_txn`:
pure, table-tested), as in etcd's ``rpc.proto`` and ``kv.proto``: ``TxnRequest{repeated Compare compare = 1;
repeated RequestOp success = 2; repeated RequestOp failure = 3}``, ``Compare{CompareResult result = 1 (EQUAL 0,
GREATER 1, LESS 2, NOT_EQUAL 3); CompareTarget target = 2 (VERSION 0, CREATE 1, MOD 2, VALUE 3, LEASE 4); bytes key
= 3; oneof target_union {int64 version = 4; int64 create_revision = 5; int64 mod_revision = 6; bytes value = 7}}``,
``RequestOp{RangeRequest request_range = 1; PutRequest request_put = 2; DeleteRangeRequest request_delete_range =
3}``, ``RangeRequest{key = 1; range_end = 2; count_only = 9}``, ``PutRequest{key = 1; value = 2; int64 lease = 3}``,
``DeleteRangeRequest{key = 1; range_end = 2}``, ``TxnResponse{ResponseHeader header = 1 {int64 revision = 3};
bool succeeded = 2; repeated ResponseOp responses = 3}``, ``ResponseOp{response_range = 1 {header = 1; repeated
KeyValue kvs = 2; bool more = 3; int64 count = 4}; response_put = 2; response_delete_range = 3 {header = 1; int64
deleted = 2}}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from trainguard.agent.etcd_lease import _signed, _the_loop, _varint
from trainguard.agent.etcd_watch import GRACE_S, _fields, decode_kv, failure_of_status
from trainguard.agent.etcd_wire import EtcdError, EtcdFailure, TxnResult, b64, unb64

METHOD = "/etcdserverpb.KV/Txn"
"""etcd's gRPC method (``etcdserverpb.KV`` in ``rpc.proto``, the same since 3.0)."""

RESULTS = {"EQUAL": 0, "GREATER": 1, "LESS": 2, "NOT_EQUAL": 3}
"""``Compare.CompareResult``."""

TARGETS = {"VERSION": (0, 4), "CREATE": (1, 5), "MOD": (2, 6), "VALUE": (3, 7)}
"""``Compare.CompareTarget`` -> (its number, the ``target_union`` field that holds what it is compared with)."""

_TARGET_FIELDS = {"VERSION": "version", "CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value"}
_OPS = {"request_range": (1, {"key": 1, "range_end": 2, "count_only": 9}),
        "request_put": (2, {"key": 1, "value": 2, "lease": 3}),
        "request_delete_range": (3, {"key": 1, "range_end": 2})}
"""The operations the ``op_*`` builders make: their ``RequestOp`` field and their fields' numbers."""
_BYTES = {"key", "range_end", "value"}


def _field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def encode_compare(c: dict[str, Any]) -> bytes:
    """Pure: a ``Compare`` from a ``cmp_*`` dict. The ``target_union`` member is always written, zero or empty
    included (a oneof has presence). Raises ``ValueError`` on any other shape."""
    target, result = c.get("target", "VERSION"), c.get("result", "EQUAL")
    if target not in TARGETS or result not in RESULTS:
        raise ValueError(f"compare: unsupported target {target!r} or result {result!r}")
    name = _TARGET_FIELDS[target]
    extra = set(c) - {"target", "result", "key", name}
    if extra:
        raise ValueError(f"compare: unsupported fields {sorted(extra)}")
    number, union = TARGETS[target]
    out = (_int(1, RESULTS[result]) if RESULTS[result] else b"") + (_int(2, number) if number else b"")
    out += _field(3, unb64(c.get("key")))
    value = c.get(name, "" if target == "VALUE" else "0")
    return out + (_field(union, unb64(value)) if target == "VALUE" else _int(union, int(value)))


def encode_op(op: dict[str, Any]) -> bytes:
    """Pure: a ``RequestOp`` from an ``op_*`` dict (proto3: zero values left out). Raises ``ValueError`` on any
    other kind or field."""
    if len(op) != 1 or next(iter(op)) not in _OPS:
        raise ValueError(f"operation: unsupported kind {sorted(op)}")
    kind, body = next(iter(op.items()))
    number, fields = _OPS[kind]
    extra = set(body) - set(fields)
    if extra:
        raise ValueError(f"{kind}: unsupported fields {sorted(extra)}")
    out = b""
    for name, f in fields.items():  # (in field order)
        if name not in body:
            continue
        if name in _BYTES:
            raw = unb64(body[name])
            out += _field(f, raw) if raw else b""
        elif int(body[name]):
            out += _int(f, int(body[name]))
    return _field(number, out)


def encode_txn(compare: Sequence[dict[str, Any]], success: Sequence[dict[str, Any]],
               failure: Sequence[dict[str, Any]] = ()) -> bytes:
    """Pure: a ``TxnRequest``. Raises ``ValueError`` on a comparison or operation this module does not know."""
    return (b"".join(_field(1, encode_compare(c)) for c in compare) + b"".join(_field(2, encode_op(o)) for o in success)
            + b"".join(_field(3, encode_op(o)) for o in failure))


def _revision(header: bytes) -> int:
    return next((_signed(v) for f, v in _fields(header, {1: 0, 2: 0, 3: 0, 4: 0}) if f == 3), 0)


def _response(raw: bytes) -> dict[str, Any]:
    """A ``ResponseOp`` in the gateway's JSON shape (what :class:`TxnResult` reads)."""
    for kind, value in _fields(raw, {1: 2, 2: 2, 3: 2, 4: 2}):
        if kind == 1:
            kvs, count = [], 0
            for f, v in _fields(value, {1: 2, 2: 2, 3: 0, 4: 0}):
                if f == 2:
                    kv = decode_kv(v)
                    kvs.append({"key": b64(kv.key), "value": b64(kv.value), "create_revision": str(kv.create_revision),
                                "mod_revision": str(kv.mod_revision)})
                elif f == 4:
                    count = _signed(v)
            return {"response_range": {"kvs": kvs, "count": str(count)}}
        if kind == 2:
            return {"response_put": {}}
        if kind == 3:
            deleted = next((_signed(v) for f, v in _fields(value, {1: 2, 2: 0, 3: 2}) if f == 2), 0)
            return {"response_delete_range": {"deleted": str(deleted)}}
        raise ValueError("a nested transaction's response (no request here makes one)")
    return {}


def decode_txn(raw: bytes) -> TxnResult:
    """Pure: a ``TxnResponse`` as :class:`TxnResult`; unknown fields are skipped; raises ``ValueError`` on a
    malformed message."""
    revision, succeeded, responses = 0, False, []
    for field, value in _fields(raw, {1: 2, 2: 0, 3: 2}):
        if field == 1:
            revision = _revision(value)
        elif field == 2:
            succeeded = bool(value)
        elif field == 3:
            responses.append(_response(value))
    return TxnResult(succeeded, revision, responses)


def _same(b: bytes) -> bytes:
    return b


_stubs: dict[int, Any] = {}
"""id of a channel of the loop -> its ``Txn`` multi-callable (channels live as long as the process)."""


async def _call(settings: Any, endpoint: str, metadata: Any, request: bytes, timeout_s: float) -> bytes:
    channel = _the_loop().channel(settings, endpoint)
    stub = _stubs.get(id(channel))
    if stub is None:
        stub = _stubs[id(channel)] = channel.unary_unary(METHOD, request_serializer=_same, response_deserializer=_same)
    return bytes(await stub(request, metadata=metadata, timeout=timeout_s))


def failure_of_call(code: str, details: str, idempotent: bool) -> EtcdFailure:
    """Pure: the failure class of a failed call (``code``: the ``grpc.StatusCode`` name), as the gateway path
    decides: :func:`~.etcd_watch.failure_of_status`, except that a write that must not run twice and may have
    been applied (a transport failure after gRPC had a connection to send it on; not an answer of etcd's own,
    ``etcdserver: ...``) is ``REQUEST``: the caller must not blindly run it again."""
    failure = failure_of_status(code, details)
    if not failure.retryable or idempotent or details.startswith("etcdserver:"):
        return failure
    not_sent = code == "UNAVAILABLE" and "failed to connect" in details.lower()
    return failure if not_sent else EtcdFailure.REQUEST


def _attempt(settings: Any, endpoint: str, metadata: Any, request: bytes, timeout_s: float,
             idempotent: bool) -> TxnResult:
    """One call to one member; raises :class:`EtcdError` (a write that may have been applied: ``REQUEST``)."""
    import grpc

    fut = asyncio.run_coroutine_threadsafe(_call(settings, endpoint, metadata, request, timeout_s), _the_loop().loop)
    try:
        raw = fut.result(timeout_s + GRACE_S)
    except concurrent.futures.TimeoutError as e:
        fut.cancel()
        code, details = "DEADLINE_EXCEEDED", f"no answer within {timeout_s:g} s"
        cause: BaseException = e
    except grpc.aio.AioRpcError as e:
        code, details, cause = e.code().name, e.details() or "", e
    except Exception as e:  # noqa: BLE001 - anything else on the channel (closed...): the member is unavailable
        code, details, cause = "UNAVAILABLE", f"{type(e).__name__}: {e}", e
    else:
        try:
            return decode_txn(raw)
        except ValueError as e:
            raise EtcdError(EtcdFailure.REQUEST, f"txn: malformed answer: {e}", endpoint=endpoint) from e
    failure = failure_of_call(code, details, idempotent)
    unknown = "outcome unknown: " if failure is not failure_of_status(code, details) else ""
    raise EtcdError(failure, f"txn: {unknown}{code}: {details[:200]}", endpoint=endpoint) from cause


_preferred: dict[tuple[str, ...], int] = {}
_preferred_lock = threading.Lock()


def txn(settings: Any, token_fn: Callable[[], str | None], compare: Sequence[dict[str, Any]],
        success: Sequence[dict[str, Any]], failure: Sequence[dict[str, Any]] = (), *, idempotent: bool = True,
        timeout_s: float | None = None) -> TxnResult:
    """One etcd transaction: if every ``compare`` holds run ``success``, else ``failure`` (the dicts of
    :mod:`~.etcd_wire`'s builders). Each member gets ``timeout_s`` (default ``settings.timeout_s``); unavailable
    members are tried in turn, then again with backoff, until ``settings.retry_s`` passed. Blocks the calling thread
    (the call runs on the process's loop). Raises :class:`EtcdError` (``TOKEN_EXPIRED``: re-authenticate and call
    again) and ``ValueError`` on an operation this module does not encode. ``token_fn()``: the auth token or None."""
    request = encode_txn(compare, success, failure)
    per_call = settings.timeout_s if timeout_s is None else timeout_s
    endpoints = tuple(settings.endpoints)
    token = token_fn()
    metadata = (("token", token),) if token else None
    deadline = time.monotonic() + settings.retry_s
    delay, last = 0.05, None
    while True:
        first = _preferred.get(endpoints, 0)
        for i in range(len(endpoints)):
            idx = (first + i) % len(endpoints)
            try:
                result = _attempt(settings, endpoints[idx], metadata, request, per_call, idempotent)
            except EtcdError as e:
                if not e.failure.retryable:
                    raise
                last = e
                continue
            if idx != first:
                with _preferred_lock:
                    _preferred[endpoints] = idx
            return result
        if time.monotonic() + delay > deadline:
            assert last is not None
            raise EtcdError(EtcdFailure.UNAVAILABLE, f"no etcd member answered within {settings.retry_s:g} s; "
                            f"last error: {last.detail}", endpoint=last.endpoint) from last
        time.sleep(delay * random.uniform(0.5, 1.0))
        delay = min(delay * 2, 1.0)


__all__ = ["METHOD", "RESULTS", "TARGETS", "decode_txn", "encode_compare", "encode_op", "encode_txn", "failure_of_call",
           "txn"]
