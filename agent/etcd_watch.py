"""One-shot watches of one key on etcd's gRPC ``Watch`` stream: how a keyed-rendezvous node on etcd waits for
its round's publication (issue 40).

Why not the JSON gateway (:meth:`~trainguard.agent.etcd_client.EtcdClient.watch_key`) for this one call: the
gateway serves a watch only on an HTTP/1.1 request of its own, so every wait opened a new connection (with TLS,
a new TLS handshake) and closed it after the event. In ``bench/control_plane.py`` at 1,024 nodes on etcd with
TLS, one planned leave made 1,023 such connections at once: it took 4.8-6.3 s, with 6.6 CPU-s of the simulating
clients and 2.8 CPU-s of etcd on a 2-core machine (target: 2 s). Here a watch is one HTTP/2 stream on the
channel the process already holds to that member for its lease keep-alives (:mod:`trainguard.agent.etcd_lease`:
one asyncio loop thread, one ``grpc.aio`` channel per member): no connection, no handshake, a few small
protobuf messages (the create request; etcd's ``created`` answer; the event, which carries the key's value, so
no read follows).

The contract is the gateway's: :func:`watch_key` returns the key as written after ``after_revision``, or None
when ``timeout_s`` passed, it was deleted, etcd compacted past it or the stream failed (the caller reads again; a
failed member makes the next watch go to the next one). A failure that reading again cannot fix (permission,
an expired token) raises :class:`~trainguard.agent.etcd_wire.EtcdError`. ``grpcio`` is optional: without it
(:func:`~trainguard.agent.etcd_lease.available` false) the gateway watches. The messages are encoded by hand
(:func:`encode_watch_create`, :func:`decode_watch_response`, :func:`settle`: pure, table-tested), as in
etcd's ``rpc.proto`` and ``kv.proto``: ``WatchRequest{create_request = 1}``, ``WatchCreateRequest{bytes key = 1;
bytes range_end = 2; int64 start_revision = 3}``, ``WatchResponse{header = 1; int64 watch_id = 2; bool created
= 3; bool canceled = 4; int64 compact_revision = 5; string cancel_reason = 6; repeated Event events = 11}``,
``Event{type = 1 (PUT 0, DELETE 1); KeyValue kv = 2}``, ``KeyValue{key = 1; create_revision = 2; mod_revision =
3; value = 5}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from trainguard.agent.etcd_lease import _read_varint, _signed, _the_loop, _varint
from trainguard.agent.etcd_wire import EtcdError, EtcdFailure, KeyValue, failure_of_answer

METHOD = "/etcdserverpb.Watch/Watch"
"""etcd's gRPC method (``etcdserverpb.Watch`` in ``rpc.proto``, the same since 3.0)."""

PUT, DELETE = 0, 1
"""``mvccpb.Event.EventType``."""

GRACE_S = 2.0
"""How much longer than ``timeout_s`` the caller's thread waits for the loop to end a watch (a loop thread
starved by the process's other threads) before it gives up on it."""


@dataclass(frozen=True, slots=True)
class Event:
    type: int
    kv: KeyValue | None


@dataclass(frozen=True, slots=True)
class WatchResponse:
    """The fields of a ``WatchResponse`` this client reads (the header and ``fragment`` are skipped)."""

    watch_id: int = 0
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    events: tuple[Event, ...] = ()


def _field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def encode_watch_create(key: bytes, start_revision: int, range_end: bytes = b"") -> bytes:
    """Pure: ``WatchRequest{create_request: {key, range_end, start_revision}}`` in protobuf (proto3: zero
    values are left out)."""
    inner = _field(1, key) + (_field(2, range_end) if range_end else b"")
    if start_revision:
        inner += b"\x18" + _varint(start_revision)
    return _field(1, inner)


def _fields(raw: bytes, expect: dict[int, int]) -> Iterator[tuple[int, Any]]:
    """``(field, value)`` of a protobuf message: an int for a varint, bytes for a length-delimited field; fixed
    fields skipped. ``expect``: field -> the wire type a known field must have. Raises ``ValueError``."""
    i = 0
    while i < len(raw):
        tag, i = _read_varint(raw, i)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise ValueError("field number 0")
        if field in expect and expect[field] != wire:
            raise ValueError(f"field {field}: wire type {wire}, expected {expect[field]}")
        if wire == 0:
            value, i = _read_varint(raw, i)
            yield field, value
        elif wire == 2:
            size, i = _read_varint(raw, i)
            if i + size > len(raw):
                raise ValueError("truncated field")
            yield field, raw[i:i + size]
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
            if i > len(raw):
                raise ValueError("truncated field")
        else:
            raise ValueError(f"unsupported wire type {wire}")


def decode_kv(raw: bytes) -> KeyValue:
    """Pure: an ``mvccpb.KeyValue`` (``version`` and ``lease`` skipped)."""
    f = dict(_fields(raw, {1: 2, 2: 0, 3: 0, 4: 0, 5: 2, 6: 0}))
    return KeyValue(bytes(f.get(1, b"")), bytes(f.get(5, b"")), _signed(f.get(2, 0)), _signed(f.get(3, 0)))


def decode_watch_response(raw: bytes) -> WatchResponse:
    """Pure: a ``WatchResponse``; unknown fields are skipped; raises ``ValueError`` on a malformed message."""
    watch_id = compact = 0
    created = canceled = False
    reason = ""
    events: list[Event] = []
    for field, value in _fields(raw, {1: 2, 2: 0, 3: 0, 4: 0, 5: 0, 6: 2, 11: 2}):
        if field == 2:
            watch_id = _signed(value)
        elif field == 3:
            created = bool(value)
        elif field == 4:
            canceled = bool(value)
        elif field == 5:
            compact = _signed(value)
        elif field == 6:
            reason = value.decode(errors="replace")
        elif field == 11:
            kind, kv = PUT, None
            for f, v in _fields(value, {1: 0, 2: 2, 3: 2}):
                if f == 1:
                    kind = v
                elif f == 2:
                    kv = decode_kv(v)
            events.append(Event(kind, kv))
    return WatchResponse(watch_id, created, canceled, compact, reason, tuple(events))


def settle(resp: WatchResponse) -> tuple[bool, KeyValue | None]:
    """Pure: ``(done, the key as written)`` after one response, as the gateway watch decides: not done on
    ``created`` or a progress notice; done with the first PUT's key; done with None on a delete or a compaction
    (the caller re-reads). A cancel for another reason raises :class:`EtcdError` classed by its reason."""
    if resp.compact_revision:
        return True, None
    if resp.canceled:
        failure = failure_of_answer(400, resp.cancel_reason)
        raise EtcdError(failure, f"watch canceled: {resp.cancel_reason or 'no reason given'}")
    if not resp.events:
        return False, None
    return True, next((e.kv for e in resp.events if e.type == PUT and e.kv is not None), None)


def failure_of_status(code: str, details: str) -> EtcdFailure:
    """Pure: the failure class of a gRPC status (``code``: the ``grpc.StatusCode`` name). etcd's own reason in
    ``details`` first (``etcdserver: permission denied`` ...), then the code; every transport failure
    (unavailable, deadline, cancelled, reset...) is ``UNAVAILABLE``: the caller re-reads."""
    failure = failure_of_answer(400, details or "")
    if failure is not EtcdFailure.REQUEST:
        return failure
    return {"UNAUTHENTICATED": EtcdFailure.TOKEN_EXPIRED, "PERMISSION_DENIED": EtcdFailure.PERMISSION_DENIED,
            "INVALID_ARGUMENT": EtcdFailure.REQUEST, "FAILED_PRECONDITION": EtcdFailure.REQUEST,
            "OUT_OF_RANGE": EtcdFailure.REQUEST, "UNIMPLEMENTED": EtcdFailure.REQUEST}.get(code, EtcdFailure.UNAVAILABLE)


def _same(b: bytes) -> bytes:
    return b


_stubs: dict[int, Any] = {}
"""id of a channel of the loop -> its ``Watch`` multi-callable (channels live as long as the process)."""


async def _watch(settings: Any, endpoint: str, metadata: Any, request: bytes, timeout_s: float) -> KeyValue | None:
    import grpc

    channel = _the_loop().channel(settings, endpoint)
    stub = _stubs.get(id(channel))
    if stub is None:
        stub = _stubs[id(channel)] = channel.stream_stream(METHOD, request_serializer=_same, response_deserializer=_same)
    call = stub(metadata=metadata)
    try:
        async with asyncio.timeout(timeout_s):  # (not wait_for: no task of its own per watch)
            await call.write(request)
            while True:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    raise EtcdError(EtcdFailure.UNAVAILABLE, "watch stream ended", endpoint=endpoint)
                try:
                    done, kv = settle(decode_watch_response(bytes(raw)))
                except ValueError as e:
                    raise EtcdError(EtcdFailure.REQUEST, f"watch: malformed answer: {e}", endpoint=endpoint) from e
                if done:
                    return kv
    except TimeoutError:
        return None
    except grpc.aio.AioRpcError as e:
        raise EtcdError(failure_of_status(e.code().name, e.details() or ""),
                        f"watch: {e.code().name}: {(e.details() or '')[:200]}", endpoint=endpoint) from e
    finally:
        call.cancel()  # (ends the stream: etcd drops its watcher with it)


_preferred: dict[tuple[str, ...], int] = {}
_preferred_lock = threading.Lock()


def _fail_over(endpoints: tuple[str, ...], failed: int) -> None:
    with _preferred_lock:
        if _preferred.get(endpoints, 0) == failed:
            _preferred[endpoints] = failed + 1


def watch_key(settings: Any, token_fn: Callable[[], str | None], key: bytes, after_revision: int,
              timeout_s: float) -> KeyValue | None:
    """Block until ``key`` is written after ``after_revision``: the key as written (the event carries it), or None
    when ``timeout_s`` passed, it was deleted, etcd compacted past it or the stream failed (the next watch of the
    process goes to the next member). Raises :class:`EtcdError` on a failure re-reading cannot fix (permission,
    ``TOKEN_EXPIRED``: re-authenticate). ``token_fn()``: the auth token (None without auth), sent as ``token``."""
    if timeout_s <= 0:
        return None
    endpoints = tuple(settings.endpoints)
    index = _preferred.get(endpoints, 0)
    endpoint = endpoints[index % len(endpoints)]
    token = token_fn()
    metadata = (("token", token),) if token else None
    fut = asyncio.run_coroutine_threadsafe(
        _watch(settings, endpoint, metadata, encode_watch_create(key, after_revision + 1), timeout_s), _the_loop().loop)
    try:
        return fut.result(timeout_s + GRACE_S)
    except concurrent.futures.TimeoutError:
        fut.cancel()  # (the loop was too busy to end it in time: cancelled there, the caller re-reads)
        return None
    except EtcdError as e:
        if not e.failure.retryable:
            raise
    except Exception:  # noqa: BLE001 - anything else on the stream (the channel closed...): re-read
        pass
    _fail_over(endpoints, index)
    return None


__all__ = ["DELETE", "METHOD", "PUT", "Event", "WatchResponse", "decode_kv", "decode_watch_response",
           "encode_watch_create", "failure_of_status", "settle", "watch_key"]
