"""One-shot watches on etcd's gRPC ``Watch`` stream (:mod:`trainguard.agent.etcd_watch`): the hand-encoded protobuf
messages and the decisions on them (table-tested), then watches against a real etcd (plain and TLS, and with RBAC):
the value written after the watch's revision, a timeout, a delete, a failed member, 200 watches at once on one
channel; and the keyed rendezvous's choice between the stream and the gateway (:class:`EtcdKv`)."""

from __future__ import annotations

import threading
import time

import pytest

from trainguard.agent import etcd_watch
from trainguard.agent.etcd_client import EtcdClient, EtcdSettings
from trainguard.agent.etcd_lease import _the_loop
from trainguard.agent.etcd_watch import (
    DELETE,
    PUT,
    Event,
    WatchResponse,
    decode_watch_response,
    encode_watch_create,
    failure_of_status,
    settle,
    watch_key,
)
from trainguard.agent.etcd_wire import EtcdError, EtcdFailure, KeyValue, op_put
from tests.fixtures.etcd_grpc import client, etcd, FakeClient, need_etcd_grpc, secure, user_client  # noqa: F401 - fixtures

KV_K = b"\x0a\x01k\x10\x05\x18\x06\x20\x02\x2a\x02v1\x30\x07"  # key k, create 5, mod 6, version 2, value v1, lease 7
PUT_K = b"\x12\x0f" + KV_K                                      # Event{type PUT (zero: left out), kv}
DEL_K = b"\x08\x01\x12\x03\x0a\x01k"                            # Event{type DELETE, kv{key k}}


@pytest.mark.parametrize(("args", "raw"), [
    ((b"k", 5), b"\x0a\x05\x0a\x01k\x18\x05"),
    ((b"a/b", 0), b"\x0a\x05\x0a\x03a/b"),                              # start_revision 0 ("now") left out
    ((b"a", 1, b"b"), b"\x0a\x08\x0a\x01a\x12\x01b\x18\x01"),           # with a range_end
    ((b"k", 300), b"\x0a\x06\x0a\x01k\x18\xac\x02"),
])
def test_encode_watch_create(args, raw):
    assert encode_watch_create(*args) == raw


@pytest.mark.parametrize(("raw", "expected"), [
    (b"", WatchResponse()),
    (b"\x0a\x04\x08\x01\x10\x02\x10\x07\x18\x01", WatchResponse(watch_id=7, created=True)),  # header skipped
    (b"\x10\x07\x5a\x11" + PUT_K, WatchResponse(7, events=(Event(PUT, KeyValue(b"k", b"v1", 5, 6)),))),
    (b"\x5a\x07" + DEL_K, WatchResponse(events=(Event(DELETE, KeyValue(b"k", b"", 0, 0)),))),
    (b"\x5a\x07" + DEL_K + b"\x5a\x11" + PUT_K,
     WatchResponse(events=(Event(DELETE, KeyValue(b"k", b"", 0, 0)), Event(PUT, KeyValue(b"k", b"v1", 5, 6))))),
    (b"\x5a\x02\x08\x00", WatchResponse(events=(Event(PUT, None),))),                       # an event without kv
    (b"\x20\x01\x28\x0a\x32\x04gone", WatchResponse(canceled=True, compact_revision=10, cancel_reason="gone")),
    (b"\x10\x01\x38\x01\x49" + b"\x00" * 8 + b"\x55" + b"\x00" * 4 + b"\x18\x01",           # unknown fields skipped
     WatchResponse(watch_id=1, created=True)),
    (b"\x10" + b"\xff" * 9 + b"\x01", WatchResponse(watch_id=-1)),                          # int64 -1
])
def test_decode_watch_response(raw, expected):
    assert decode_watch_response(raw) == expected


@pytest.mark.parametrize("raw", [
    b"\x10",                      # truncated varint
    b"\x10\x80",                  # truncated varint
    b"\x5a\x05\x12",              # a length past the end
    b"\x12\x01\x00",              # watch_id (a varint) sent as bytes
    b"\x5a\x02\x12\x05",          # an event whose kv is longer than the event
    b"\x5a\x03\x12\x01\x08",      # a kv whose key (field 1, bytes) came as a varint
    b"\x00\x01",                  # field number 0
    b"\x13",                      # wire type 3 (groups: not proto3)
    b"\x49\x00\x00",              # a truncated fixed64
])
def test_decode_watch_response_refuses_a_malformed_message(raw):
    with pytest.raises(ValueError):
        decode_watch_response(raw)


_KV = KeyValue(b"k", b"v1", 5, 6)


@pytest.mark.parametrize(("resp", "expected"), [
    (WatchResponse(watch_id=0, created=True), (False, None)),                     # created: wait on
    (WatchResponse(), (False, None)),                                             # a progress notice: wait on
    (WatchResponse(events=(Event(PUT, _KV),)), (True, _KV)),
    (WatchResponse(events=(Event(DELETE, _KV),)), (True, None)),                  # deleted: the caller re-reads
    (WatchResponse(events=(Event(DELETE, _KV), Event(PUT, _KV))), (True, _KV)),   # the first PUT, as the gateway
    (WatchResponse(events=(Event(PUT, None),)), (True, None)),
    (WatchResponse(canceled=True, compact_revision=10), (True, None)),            # compacted: the caller re-reads
    (WatchResponse(compact_revision=10), (True, None)),
])
def test_settle(resp, expected):
    assert settle(resp) == expected


@pytest.mark.parametrize(("reason", "failure"), [
    ("etcdserver: permission denied", EtcdFailure.PERMISSION_DENIED),
    ("etcdserver: invalid auth token", EtcdFailure.TOKEN_EXPIRED),
    ("etcdserver: no leader", EtcdFailure.UNAVAILABLE),
    ("", EtcdFailure.REQUEST),
])
def test_settle_raises_on_a_cancel_without_compaction(reason, failure):
    with pytest.raises(EtcdError) as e:
        settle(WatchResponse(canceled=True, cancel_reason=reason))
    assert e.value.failure is failure


@pytest.mark.parametrize(("code", "details", "failure"), [
    ("UNAVAILABLE", "failed to connect to all addresses", EtcdFailure.UNAVAILABLE),
    ("DEADLINE_EXCEEDED", "", EtcdFailure.UNAVAILABLE),
    ("CANCELLED", "", EtcdFailure.UNAVAILABLE),
    ("RESOURCE_EXHAUSTED", "etcdserver: too many requests", EtcdFailure.UNAVAILABLE),
    ("UNAVAILABLE", "etcdserver: no leader", EtcdFailure.UNAVAILABLE),
    ("UNAUTHENTICATED", "etcdserver: invalid auth token", EtcdFailure.TOKEN_EXPIRED),
    ("UNAUTHENTICATED", "", EtcdFailure.TOKEN_EXPIRED),
    ("PERMISSION_DENIED", "etcdserver: permission denied", EtcdFailure.PERMISSION_DENIED),
    ("INVALID_ARGUMENT", "etcdserver: user name is empty", EtcdFailure.AUTH_REQUIRED),
    ("INVALID_ARGUMENT", "etcdserver: key is not provided", EtcdFailure.REQUEST),
])
def test_failure_of_status(code, details, failure):
    assert failure_of_status(code, details) is failure


# ----------------------------------------------------------------------------------- a real etcd


def _later(fn, *args):
    out: dict[str, object] = {}

    def run():
        t0 = time.monotonic()
        out["result"] = fn(*args)
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_watch_returns_the_value_written_after_it_started(etcd, client):
    _, rev = client.get(b"w/a")
    t, out = _later(watch_key, etcd, client.auth_token, b"w/a", rev, 10.0)
    time.sleep(0.3)
    written = client.put(b"w/a", b"published")
    t.join(10)
    assert out["result"] == KeyValue(b"w/a", b"published", written, written)
    assert out["seconds"] < 5  # the event ended it, not the timeout


def test_a_value_written_since_after_revision_is_returned_at_once_and_one_before_it_is_not(etcd, client):
    _, before = client.get(b"w/b")
    written = client.put(b"w/b", b"early")  # after `before`, before the watch starts
    kv = watch_key(etcd, client.auth_token, b"w/b", before, 10.0)
    assert kv is not None and kv.value == b"early" and kv.mod_revision == written
    assert watch_key(etcd, client.auth_token, b"w/b", written, 0.5) is None  # nothing after it: times out


def test_a_timeout_returns_none_after_about_the_timeout(etcd, client):
    _, rev = client.get(b"w/c")
    t0 = time.monotonic()
    assert watch_key(etcd, client.auth_token, b"w/c", rev, 0.8) is None
    assert 0.7 <= time.monotonic() - t0 < 0.8 + etcd_watch.GRACE_S
    assert watch_key(etcd, client.auth_token, b"w/c", rev, 0) is None


def test_a_delete_returns_none(etcd, client):
    rev = client.put(b"w/d", b"x")
    t, out = _later(watch_key, etcd, client.auth_token, b"w/d", rev, 10.0)
    time.sleep(0.3)
    client.delete(b"w/d")
    t.join(10)
    assert "result" in out and out["result"] is None
    assert out["seconds"] < 5  # the delete event ended it, not the timeout


def test_200_concurrent_watches_on_one_channel_all_get_their_event(etcd, client):
    _, rev = client.get(b"w/many/")
    threads = [_later(watch_key, etcd, client.auth_token, f"w/many/{i}".encode(), rev, 30.0) for i in range(200)]
    time.sleep(0.5)
    for i in range(0, 200, 100):
        client.txn([], [op_put(f"w/many/{j}".encode(), f"v{j}".encode()) for j in range(i, i + 100)])
    for t, _ in threads:
        t.join(30)
    assert [out.get("result") and out["result"].value for _, out in threads] == [f"v{j}".encode() for j in range(200)]
    endpoint = etcd.endpoints[0]
    assert sum(1 for key in _the_loop().channels if key[0] == endpoint) == 1  # one channel carried them all


def test_a_failed_member_gives_none_and_the_next_watch_goes_to_the_next(etcd, client):
    from tests.fixtures.etcd import free_port

    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    settings = EtcdSettings(endpoints=(dead, *etcd.endpoints), ca_file=etcd.ca_file, cert_file=etcd.cert_file,
                            key_file=etcd.key_file)
    _, rev = client.get(b"w/e")
    t0 = time.monotonic()
    assert watch_key(settings, client.auth_token, b"w/e", rev, 10.0) is None  # refused: the caller re-reads
    assert time.monotonic() - t0 < 5
    written = client.put(b"w/e", b"there")
    kv = watch_key(settings, client.auth_token, b"w/e", rev, 10.0)
    assert kv is not None and kv.mod_revision == written


# ----------------------------------------------------------------------------------- RBAC


def test_the_token_travels_and_a_watch_outside_the_users_prefix_is_refused(secure):
    job = user_client(secure, secure.job_user, secure.job_password_file)
    outsider = user_client(secure, secure.outsider_user, secure.outsider_password_file)
    try:
        key = (secure.job_prefix + "w/f").encode()
        _, rev = job.get(key)
        written = job.put(key, b"mine")
        kv = watch_key(job.settings, job.auth_token, key, rev, 10.0)
        assert kv is not None and kv.value == b"mine" and kv.mod_revision == written
        with pytest.raises(EtcdError) as e:
            watch_key(outsider.settings, outsider.auth_token, key, rev, 10.0)
        assert e.value.failure is EtcdFailure.PERMISSION_DENIED
        with pytest.raises(EtcdError) as e:  # no token at all
            watch_key(job.settings, lambda: None, key, rev, 10.0)
        assert e.value.failure is EtcdFailure.PERMISSION_DENIED
    finally:
        job.close()
        outsider.close()


# ----------------------------------------------------------------------------------- EtcdKv's choice


def test_etcdkv_watches_on_grpc_reauthenticates_once_and_uses_the_gateway_without_grpcio(monkeypatch):
    from trainguard.agent.membership_kv import EtcdKv

    outcomes: list[object] = [EtcdError(EtcdFailure.TOKEN_EXPIRED, "old token"), _KV,
                              EtcdError(EtcdFailure.TOKEN_EXPIRED, "old"), EtcdError(EtcdFailure.TOKEN_EXPIRED, "still")]

    def fake(settings, token_fn, key, after, timeout_s):
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(etcd_watch, "watch_key", fake)
    client = FakeClient(watch_answer=_KV)
    kv = EtcdKv(client, "/p/", 2.0, 3)
    kv._grpc = True
    assert kv._watch_key(b"/p/k", 1, 5.0) == _KV  # expired token: re-authenticated, watched again
    assert client.calls == ["authenticate"]
    with pytest.raises(EtcdError):  # expired twice in a row: raised (the caller's read re-authenticates)
        kv._watch_key(b"/p/k", 1, 5.0)
    kv._grpc = False
    client.calls.clear()
    assert kv._watch_key(b"/p/k", 1, 5.0) == _KV
    assert client.calls == ["gateway watch"]
