"""etcd transactions on the gRPC ``KV/Txn`` call (:mod:`trainguard.agent.etcd_txn`): the hand-encoded protobuf
messages and the failure decision (table-tested), then transactions against a real etcd (plain and TLS, and with
RBAC): reads of present and absent keys with the revision and a put in the same transaction, a compare that fails,
the same answer as the gateway's, a dead member, permission denied, an expired token; and the keyed rendezvous's
use of it (:class:`EtcdKv`: create-once, swap, enter; the gateway without grpcio)."""

from __future__ import annotations

import time

import pytest

from trainguard.agent import etcd_txn
from trainguard.agent.etcd_client import EtcdClient, EtcdSettings
from trainguard.agent.etcd_txn import decode_txn, encode_compare, encode_op, encode_txn, failure_of_call, txn
from trainguard.agent.etcd_wire import (
    EtcdError,
    EtcdFailure,
    KeyValue,
    TxnResult,
    cmp_absent,
    cmp_mod_revision,
    cmp_never,
    cmp_value,
    op_delete,
    op_put,
    op_range,
)
from tests.fixtures.etcd_grpc import client, etcd, FakeClient, need_etcd_grpc, secure, user_client  # noqa: F401 - fixtures

# ----------------------------------------------------------------------------------- codec
@pytest.mark.parametrize(("cmp", "raw"), [
    (cmp_absent(b"k"), b"\x10\x01\x1a\x01k\x28\x00"),              # CREATE (1), EQUAL (0: left out), create_revision 0 kept
    (cmp_value(b"k", b"v"), b"\x10\x03\x1a\x01k\x3a\x01v"),         # VALUE (3), value = 7
    (cmp_value(b"k", b""), b"\x10\x03\x1a\x01k\x3a\x00"),           # an empty value kept (oneof: present)
    (cmp_mod_revision(b"k", 300), b"\x10\x02\x1a\x01k\x30\xac\x02"),  # MOD (2), mod_revision = 6
    (cmp_never(b"k"), b"\x08\x02\x10\x01\x1a\x01k\x28\x00"),        # LESS (2)
])
def test_encode_compare(cmp, raw):
    assert encode_compare(cmp) == raw


@pytest.mark.parametrize(("op", "raw"), [
    (op_range(b"k"), b"\x0a\x03\x0a\x01k"),
    (op_range(b"a", range_end=b"b", count_only=True), b"\x0a\x08\x0a\x01a\x12\x01b\x48\x01"),  # count_only = 9
    (op_put(b"k", b"v"), b"\x12\x06\x0a\x01k\x12\x01v"),
    (op_put(b"k", b"v", lease=7), b"\x12\x08\x0a\x01k\x12\x01v\x18\x07"),
    (op_put(b"k", b""), b"\x12\x03\x0a\x01k"),                      # proto3: the empty value left out
    (op_delete(b"k"), b"\x1a\x03\x0a\x01k"),
    (op_delete(b"a", range_end=b"b"), b"\x1a\x06\x0a\x01a\x12\x01b"),
])
def test_encode_op(op, raw):
    assert encode_op(op) == raw


def test_encode_txn_puts_compares_success_and_failure_in_their_fields():
    raw = encode_txn([cmp_absent(b"k")], [op_put(b"k", b"v")], [op_range(b"k")])
    assert raw == (b"\x0a\x07\x10\x01\x1a\x01k\x28\x00" + b"\x12\x08\x12\x06\x0a\x01k\x12\x01v"
                   + b"\x1a\x05\x0a\x03\x0a\x01k")
    assert encode_txn([], []) == b""


@pytest.mark.parametrize(("args", "message"), [
    (([], [{"request_txn": {}}]), "unsupported kind"),
    (([], [{"request_range": {"key": "aw==", "limit": "1"}}]), "unsupported fields"),
    (([], [{"request_put": {"key": "aw==", "prev_kv": True}}]), "unsupported fields"),
    (([], [{"request_put": {"key": "aw=="}, "request_range": {"key": "aw=="}}]), "unsupported kind"),
    (([{"target": "LEASE", "key": "aw==", "result": "EQUAL", "lease": "1"}], []), "unsupported target"),
    (([{"target": "MOD", "key": "aw==", "result": "ABOUT", "mod_revision": "1"}], []), "unsupported target"),
    (([{"target": "MOD", "key": "aw==", "result": "EQUAL", "mod_revision": "1", "range_end": "bA=="}], []),
     "unsupported fields"),
    (([{"target": "MOD", "key": "aw==", "result": "EQUAL", "value": "dg=="}], []), "unsupported fields"),
])
def test_encode_txn_refuses_what_it_does_not_know(args, message):
    with pytest.raises(ValueError, match=message):
        encode_txn(*args)


KV_K = b"\x0a\x01k\x10\x05\x18\x06\x20\x02\x2a\x02v1\x30\x07"  # key k, create 5, mod 6, version 2, value v1, lease 7
RANGE_K = b"\x0a\x19\x0a\x04\x18\x09\x20\x02\x12\x0f" + KV_K + b"\x20\x01"  # ResponseOp{range{header, kvs [k], count 1}}


@pytest.mark.parametrize(("raw", "succeeded", "revision", "responses"), [
    (b"", False, 0, []),
    (b"\x0a\x02\x18\x09\x10\x01", True, 9, []),
    (b"\x0a\x08\x08\x01\x10\x02\x18\x09\x20\x03", False, 9, []),                  # cluster, member, raft term skipped
    (b"\x0a\x0b\x08" + b"\xff" * 9 + b"\x01", False, 0, []),                    # a uint64 cluster_id of 2^64-1
    (b"\x1a\x02\x0a\x00", False, 0, [{"response_range": {"kvs": [], "count": "0"}}]),   # an absent key
    (b"\x1a\x06\x12\x04\x0a\x02\x18\x09", False, 0, [{"response_put": {}}]),
    (b"\x1a\x04\x1a\x02\x10\x03", False, 0, [{"response_delete_range": {"deleted": "3"}}]),
    (b"\x38\x01\x1a\x02\x12\x00\x49" + b"\x00" * 8, False, 0, [{"response_put": {}}]),  # unknown fields skipped
])
def test_decode_txn(raw, succeeded, revision, responses):
    assert decode_txn(raw) == TxnResult(succeeded, revision, responses)


def test_decode_txn_gives_the_keys_as_the_gateways_result_does():
    result = decode_txn(b"\x0a\x02\x18\x0b\x10\x01\x1a" + bytes([len(RANGE_K)]) + RANGE_K + b"\x1a\x02\x12\x00")
    assert (result.succeeded, result.revision) == (True, 11)
    assert result.kvs(0) == [KeyValue(b"k", b"v1", 5, 6)] and result.count(0) == 1
    assert result.kvs(1) == [] and result.responses[1] == {"response_put": {}}


@pytest.mark.parametrize("raw", [
    b"\x10",                                # truncated varint
    b"\x1a\x05\x0a",                        # a length past the end
    b"\x12\x01\x00",                        # succeeded (a varint) sent as bytes
    b"\x0a\x02\x1a\x00",                    # the header's revision sent as bytes
    b"\x1a\x05\x0a\x03\x12\x01\x08",        # a kv that is a truncated varint
    b"\x1a\x02\x22\x00",                    # a nested transaction's response: nothing here asks for one
    b"\x00\x01",                            # field number 0
    b"\x1b",                                # wire type 3 (groups: not proto3)
])
def test_decode_txn_refuses_a_malformed_message(raw):
    with pytest.raises(ValueError):
        decode_txn(raw)


@pytest.mark.parametrize(("code", "details", "idempotent", "failure"), [
    ("UNAVAILABLE", "failed to connect to all addresses", True, EtcdFailure.UNAVAILABLE),
    ("UNAVAILABLE", "failed to connect to all addresses", False, EtcdFailure.UNAVAILABLE),  # never sent: retried
    ("UNAVAILABLE", "Socket closed", True, EtcdFailure.UNAVAILABLE),
    ("UNAVAILABLE", "Socket closed", False, EtcdFailure.REQUEST),               # may have been applied
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", False, EtcdFailure.REQUEST),
    ("UNAVAILABLE", "etcdserver: no leader", False, EtcdFailure.UNAVAILABLE),  # etcd's answer: not applied
    ("PERMISSION_DENIED", "etcdserver: permission denied", False, EtcdFailure.PERMISSION_DENIED),
    ("UNAUTHENTICATED", "etcdserver: invalid auth token", True, EtcdFailure.TOKEN_EXPIRED),
    ("INVALID_ARGUMENT", "etcdserver: duplicate key given in txn request", True, EtcdFailure.REQUEST),
])
def test_failure_of_call(code, details, idempotent, failure):
    assert failure_of_call(code, details, idempotent) is failure


# ----------------------------------------------------------------------------------- a real etcd


def test_reads_of_present_and_absent_keys_and_a_put_in_one_transaction(etcd, client):
    written = client.put(b"t/a", b"one")
    result = txn(etcd, client.auth_token, [], [op_range(b"t/a"), op_range(b"t/absent"), op_put(b"t/c", b"three")])
    assert result.succeeded
    assert result.kvs(0) == [KeyValue(b"t/a", b"one", written, written)]
    assert result.kvs(1) == []
    c, revision = client.get(b"t/c")
    assert c is not None and c.value == b"three" and result.revision == c.mod_revision == revision == written + 1


def test_a_compare_that_fails_runs_the_failure_branch(etcd, client):
    client.put(b"t/d", b"mine")
    result = txn(etcd, client.auth_token, [cmp_value(b"t/d", b"theirs")], [op_put(b"t/d", b"over")], [op_range(b"t/d")])
    assert not result.succeeded and [kv.value for kv in result.kvs(0)] == [b"mine"]
    assert client.get(b"t/d")[0].value == b"mine"
    result = txn(etcd, client.auth_token, [cmp_absent(b"t/e"), cmp_value(b"t/d", b"mine")],
                 [op_put(b"t/e", b"new"), op_delete(b"t/d")], [op_range(b"t/e")])
    assert result.succeeded and result.responses[1] == {"response_delete_range": {"deleted": "1"}}
    assert client.get(b"t/e")[0].value == b"new" and client.get(b"t/d")[0] is None


def test_the_answer_is_the_gateways(etcd, client):
    for i in range(3):
        client.put(f"t/g/{i}".encode(), f"v{i}".encode())
    ops = [op_range(b"t/g/0"), op_range(b"t/g/", range_end=b"t/g0"), op_range(b"t/g/", range_end=b"t/g0", count_only=True),
           op_range(b"t/g/none")]
    grpc_result, gateway_result = txn(etcd, client.auth_token, [], ops), client.txn([], ops)
    assert (grpc_result.succeeded, grpc_result.revision) == (gateway_result.succeeded, gateway_result.revision)
    assert [grpc_result.kvs(i) for i in range(4)] == [gateway_result.kvs(i) for i in range(4)]
    assert [grpc_result.count(i) for i in range(4)] == [gateway_result.count(i) for i in range(4)] == [1, 3, 3, 0]


def test_a_dead_member_is_skipped_and_the_next_call_starts_at_the_live_one(etcd, client):
    from tests.fixtures.etcd import free_port

    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    settings = EtcdSettings(endpoints=(dead, *etcd.endpoints), ca_file=etcd.ca_file, cert_file=etcd.cert_file,
                            key_file=etcd.key_file, timeout_s=2.0)
    result = txn(settings, client.auth_token, [], [op_put(b"t/f", b"x")], idempotent=False)  # never sent there
    assert result.succeeded and client.get(b"t/f")[0].value == b"x"
    assert etcd_txn._preferred[settings.endpoints] == 1
    gone = EtcdSettings(endpoints=(dead,), ca_file=etcd.ca_file, cert_file=etcd.cert_file, key_file=etcd.key_file,
                        timeout_s=0.5, retry_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(EtcdError) as e:
        txn(gone, client.auth_token, [], [op_range(b"t/f")])
    assert e.value.failure is EtcdFailure.UNAVAILABLE and time.monotonic() - t0 < 1.0 + 0.5 + etcd_txn.GRACE_S + 1


def test_etcdkv_creates_once_swaps_and_enters_on_grpc_not_the_gateway(etcd, client, monkeypatch):
    from trainguard.agent.membership import Entry
    from trainguard.agent.membership_kv import EtcdKv

    def no_gateway(*a, **kw):
        raise AssertionError("the gateway's txn was used")

    monkeypatch.setattr(client, "txn", no_gateway)
    kv = EtcdKv(client, "/tg/kv/", 2.0, 3)
    assert kv.create("once", b"first") == b"first"
    assert kv.create("once", b"second") == b"first"
    assert kv.swap("once", b"other", b"x") == b"first"
    assert kv.swap("once", b"first", b"next") == b"next" and kv.get("once") == b"next"
    kv.set_many([(f"m/{i}", f"{i}".encode()) for i in range(150)])  # two transactions
    assert kv.get_many(["m/0", "m/149", "m/150"]) == [b"0", b"149", None]
    assert kv._grpc is True
    entry = Entry(node="n1", kind="join", base=0)
    assert kv.enter(entry, ["once", "nothing"]) == [b"next", None]
    assert kv.get("j/join/n1") == entry.encode()


# ----------------------------------------------------------------------------------- RBAC


def test_the_token_travels_and_a_key_outside_the_users_prefix_is_refused(secure):
    job = user_client(secure, secure.job_user, secure.job_password_file)
    outsider = user_client(secure, secure.outsider_user, secure.outsider_password_file)
    try:
        key = (secure.job_prefix + "t/h").encode()
        result = txn(job.settings, job.auth_token, [cmp_absent(key)], [op_put(key, b"mine")], [op_range(key)])
        assert result.succeeded and job.get(key)[0].value == b"mine"
        with pytest.raises(EtcdError) as e:
            txn(outsider.settings, outsider.auth_token, [], [op_range(key)])
        assert e.value.failure is EtcdFailure.PERMISSION_DENIED
        with pytest.raises(EtcdError) as e:
            txn(job.settings, lambda: "not-a-token", [], [op_range(key)])
        assert e.value.failure is EtcdFailure.TOKEN_EXPIRED
    finally:
        job.close()
        outsider.close()


def test_etcdkv_reauthenticates_once_on_an_expired_token(secure):
    from trainguard.agent.membership_kv import EtcdKv

    job = user_client(secure, secure.job_user, secure.job_password_file)
    try:
        kv = EtcdKv(job, secure.job_prefix, 2.0, 3)
        assert kv.create("t/i", b"v") == b"v"
        job._token = "expired"  # as after --auth-token-ttl or a member's restart
        assert kv.create("t/i", b"w") == b"v"
        assert job._token != "expired"
    finally:
        job.close()


# ----------------------------------------------------------------------------------- EtcdKv's choice


def test_etcdkv_reauthenticates_once_and_uses_the_gateway_without_grpcio(monkeypatch):
    from trainguard.agent.membership_kv import EtcdKv

    ok = TxnResult(True, 3, [{"response_range": {"kvs": []}}])
    outcomes: list[object] = [EtcdError(EtcdFailure.TOKEN_EXPIRED, "old token"), ok,
                              EtcdError(EtcdFailure.TOKEN_EXPIRED, "old"), EtcdError(EtcdFailure.TOKEN_EXPIRED, "still")]

    def fake(settings, token_fn, compare, success, failure=(), **kw):
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(etcd_txn, "txn", fake)
    client = FakeClient(txn_answer=TxnResult(True, 3, [{"response_range": {"kvs": []}}]))
    kv = EtcdKv(client, "/p/", 2.0, 3)
    kv._grpc = True
    assert kv.get_many(["k"]) == [None]  # expired token: re-authenticated, sent again
    assert client.calls == ["authenticate"] and kv._absent_at == {b"/p/k": 3}
    with pytest.raises(EtcdError):  # expired twice in a row: raised
        kv.get_many(["k"])
    kv._grpc = False
    client.calls.clear()
    assert kv.get_many(["k"]) == [None]
    assert client.calls == ["gateway txn"]
