"""Lease renewals on etcd's gRPC ``LeaseKeepAlive`` stream, the keyed rendezvous's keep-alive on etcd (issue 40).

Why not the JSON gateway (:mod:`trainguard.agent.etcd_client`) for this one call: every gateway request
costs etcd the same ~0.3 ms of CPU whatever it does (HTTP, JSON, and a gRPC stream the gateway opens to
etcd itself per request; measured on etcd 3.4.23: keep-alive 0.29 ms, range 0.36 ms, put 0.42 ms), so
1,024 nodes renewing every 2 s cost 15.9 % of a core. The gateway cannot keep one keep-alive stream open
either: etcd 3.4's gateway answers a streamed request body only once it has ended. On a gRPC stream that
stays open, a renewal is one small message: 0.105 ms of etcd CPU (same machine, same etcd), ~2.8x less.

Each node keeps its own stream and renews its own lease, as a real agent does. The streams of one process
share one asyncio loop thread and one gRPC channel per etcd member (:class:`_Loop`; HTTP/2 carries many
streams on one connection): an agent has one node, so this changes nothing for it, and a simulator of
1,024 nodes in 4 processes runs 4 loops, not 1,024 channels and 2,048 stream threads (with those, the
simulated nodes starved their own processes and formed no world within 120 s). ``grpcio`` is optional:
without it (:func:`available` false) the keyed handler renews through the gateway as before. The two
protobuf messages are encoded by hand (:func:`encode_keepalive`, :func:`decode_keepalive`, table-tested):
``LeaseKeepAliveRequest{int64 ID = 1}`` and ``LeaseKeepAliveResponse{header = 1; int64 ID = 2; int64 TTL = 3}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from trainguard.agent.etcd_wire import EtcdError, EtcdFailure, split_host_port

METHOD = "/etcdserverpb.Lease/LeaseKeepAlive"
"""etcd's gRPC method (``etcdserverpb.Lease`` in etcd's ``rpc.proto``, the same since 3.0)."""


def available() -> bool:
    """Whether ``grpcio`` can be imported (else the gateway renews)."""
    try:
        import grpc  # noqa: F401
    except ImportError:
        return False
    return True


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 on the wire: two's complement in 10 bytes when negative
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(raw: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(raw):
            raise ValueError("truncated varint")
        b = raw[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def encode_keepalive(lease_id: int) -> bytes:
    """Pure: ``LeaseKeepAliveRequest{ID: lease_id}`` in protobuf."""
    return b"\x08" + _varint(lease_id)


def decode_keepalive(raw: bytes) -> tuple[int, int]:
    """Pure: ``(ID, TTL)`` of a ``LeaseKeepAliveResponse``; TTL <= 0: the lease is gone. Unknown fields are
    skipped; raises ``ValueError`` on a malformed message."""
    lease_id = ttl = 0
    i = 0
    while i < len(raw):
        tag, i = _read_varint(raw, i)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            v, i = _read_varint(raw, i)
            if field == 2:
                lease_id = _signed(v)
            elif field == 3:
                ttl = _signed(v)
        elif wire == 2:
            size, i = _read_varint(raw, i)
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if i != len(raw):
        raise ValueError("truncated field")
    return lease_id, ttl


class _Loop:
    """The process's one asyncio loop (a daemon thread) that carries every :class:`LeaseStream` of the process
    and their gRPC channels (``grpc.aio``): a stream costs no thread of its own. (With grpcio's threaded
    streaming API each stream had two threads; 1,024 simulated nodes ran ~3,000 threads in 4 processes, the
    load average reached 300 and the nodes' own keep-alives starved, so no world formed.)"""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.channels: dict[tuple[Any, ...], Any] = {}
        threading.Thread(target=self.loop.run_forever, name="etcd-lease-loop", daemon=True).start()

    def channel(self, settings: Any, endpoint: str) -> Any:
        """The process's channel to ``endpoint`` with ``settings``' TLS (on the loop's thread only)."""
        import grpc

        key = (endpoint, settings.ca_file, settings.cert_file, settings.key_file, settings.server_name)
        channel = self.channels.get(key)
        if channel is not None:
            return channel
        host, port = split_host_port(endpoint)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        options: list[tuple[str, Any]] = []
        if settings.tls:
            def read(path: str) -> bytes | None:
                if not path:
                    return None
                with open(path, "rb") as fh:
                    return fh.read()
            creds = grpc.ssl_channel_credentials(read(settings.ca_file),
                                                 read(settings.key_file or settings.cert_file) if settings.cert_file else None,
                                                 read(settings.cert_file))
            if settings.server_name:
                options.append(("grpc.ssl_target_name_override", settings.server_name))
            channel = grpc.aio.secure_channel(target, creds, options=options)
        else:
            channel = grpc.aio.insecure_channel(target, options=options)
        self.channels[key] = channel
        return channel


_loop: _Loop | None = None
_loop_lock = threading.Lock()


def _the_loop() -> _Loop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = _Loop()
        return _loop


class LeaseStream:
    """One open ``LeaseKeepAlive`` stream to one etcd member. Not thread-safe (the node's heartbeat thread
    owns it); :meth:`close` is idempotent. ``token()``: the auth token to send (None without auth)."""

    def __init__(self, settings: Any, token: Callable[[], str | None] = lambda: None) -> None:
        self.settings = settings
        self._token = token
        self._endpoint = 0
        self._call: Any = None

    async def _exchange(self, msg: bytes, metadata: Any) -> bytes:
        import grpc

        if self._call is None:
            s = self.settings
            channel = _the_loop().channel(s, s.endpoints[self._endpoint % len(s.endpoints)])
            stub = channel.stream_stream(METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            self._call = stub(metadata=metadata)
        await self._call.write(msg)
        answer = await self._call.read()
        if answer is grpc.aio.EOF:
            raise EtcdError(EtcdFailure.UNAVAILABLE, "lease stream ended")
        return bytes(answer)

    def renew(self, lease_id: int, timeout_s: float) -> int:
        """Renew ``lease_id``: its new TTL in seconds (<= 0: the lease is gone). Raises :class:`EtcdError`
        (``UNAVAILABLE``) when the stream failed or no answer came within ``timeout_s``; the next call opens
        a new stream (to the next member)."""
        loop = _the_loop()
        token = self._token() if self._call is None else None
        metadata = (("token", token),) if token else None
        fut = asyncio.run_coroutine_threadsafe(self._exchange(encode_keepalive(lease_id), metadata), loop.loop)
        try:
            raw = fut.result(timeout_s)
        except concurrent.futures.TimeoutError as e:
            fut.cancel()
            self._reset()
            raise EtcdError(EtcdFailure.UNAVAILABLE, f"no lease keep-alive answer within {timeout_s:g} s") from e
        except EtcdError:
            self._reset()
            raise
        except Exception as e:  # noqa: BLE001 - grpc.aio.AioRpcError and the like: the stream is gone
            self._reset()
            raise EtcdError(EtcdFailure.UNAVAILABLE, f"lease stream: {type(e).__name__}: {str(e)[:200]}") from e
        try:
            _, ttl = decode_keepalive(raw)
        except ValueError as e:
            self._reset()
            raise EtcdError(EtcdFailure.REQUEST, f"lease stream: malformed answer: {e}") from e
        return ttl

    def _reset(self) -> None:
        self.close()
        self._endpoint += 1

    def close(self) -> None:
        """End this node's stream (the process's channel stays for the others)."""
        call, self._call = self._call, None
        if call is not None and _loop is not None:
            with contextlib.suppress(Exception):
                _loop.loop.call_soon_threadsafe(call.cancel)


__all__ = ["METHOD", "LeaseStream", "available", "decode_keepalive", "encode_keepalive"]
