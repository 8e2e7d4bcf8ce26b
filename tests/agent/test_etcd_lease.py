"""The gRPC lease keep-alive stream (:mod:`trainguard.agent.etcd_lease`): the hand-encoded protobuf messages
(table-tested), and renewals against a real etcd (plain and TLS) keeping a key alive past its TTL."""

from __future__ import annotations

import shutil
import time

import pytest

from trainguard.agent.etcd_client import EtcdClient, EtcdSettings, b64
from trainguard.agent.etcd_lease import LeaseStream, available, decode_keepalive, encode_keepalive


@pytest.mark.parametrize(("lease_id", "raw"), [
    (0, b"\x08\x00"),
    (1, b"\x08\x01"),
    (300, b"\x08\xac\x02"),
    (2**63 - 1, b"\x08" + b"\xff" * 8 + b"\x7f"),
])
def test_encode_keepalive(lease_id, raw):
    assert encode_keepalive(lease_id) == raw


@pytest.mark.parametrize(("raw", "expected"), [
    (b"", (0, 0)),
    (b"\x10\x05\x18\x06", (5, 6)),                                   # ID 5, TTL 6
    (b"\n\x04\x08\x01\x10\x02\x10\x05\x18\x3c", (5, 60)),            # a header first (skipped)
    (b"\x10\x05\x18" + b"\xff" * 9 + b"\x01", (5, -1)),              # TTL -1: the lease is gone
    (b"\x10\x05\x20\x07\x18\x02", (5, 2)),                           # an unknown varint field is skipped
    (b"\x10\x05\x29" + b"\x00" * 8 + b"\x18\x03", (5, 3)),          # an unknown fixed64 field is skipped
])
def test_decode_keepalive(raw, expected):
    assert decode_keepalive(raw) == expected


@pytest.mark.parametrize("raw", [b"\x10", b"\x10\x80", b"\n\x09\x08", b"\x13"])
def test_decode_keepalive_refuses_a_malformed_message(raw):
    with pytest.raises(ValueError):
        decode_keepalive(raw)


@pytest.fixture(params=["plain", "tls"])
def etcd(request, tmp_path):
    if shutil.which("etcd") is None:
        pytest.skip("etcd not installed (Debian package etcd-server)")
    if not available():
        pytest.skip("grpcio not installed")
    from tests.fixtures.etcd import make_pki, start_etcd

    pki = make_pki(tmp_path / "pki") if request.param == "tls" else None
    with start_etcd(tmp_path / "etcd", pki=pki) as server:
        kw = {} if pki is None else {"ca_file": pki.ca_file, "cert_file": pki.client_cert, "key_file": pki.client_key}
        yield EtcdSettings(endpoints=(server.endpoint,), **kw)


def test_renewals_on_the_stream_keep_a_key_alive_past_its_ttl(etcd):
    client = EtcdClient(etcd)
    stream = LeaseStream(etcd, client.auth_token)
    try:
        lease = int(client.call("lease/grant", {"TTL": "2"})["ID"])
        client.call("kv/put", {"key": b64(b"hb/a"), "value": b64(b"1"), "lease": str(lease)})
        deadline = time.monotonic() + 4.5  # past two TTLs
        while time.monotonic() < deadline:
            assert stream.renew(lease, 5.0) == 2
            time.sleep(0.5)
        assert client.get(b"hb/a")[0] is not None
        client.call("lease/revoke", {"ID": str(lease)})
        assert stream.renew(lease, 5.0) <= 0  # gone: the caller grants a new one
    finally:
        stream.close()
        stream.close()
        client.close()


class _Client:
    def __init__(self):
        self.calls = []

    def call(self, method, body, **kw):
        self.calls.append(method)
        return {"result": {"TTL": "6"}} if method == "lease/keepalive" else {"ID": "7"}


class _Stream:
    def __init__(self, outcomes):
        self.outcomes = list(outcomes)

    def renew(self, lease_id, timeout_s):
        out = self.outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out


def test_a_first_stream_failure_is_a_missed_beat_a_second_goes_through_the_gateway():
    from trainguard.agent.etcd_wire import EtcdError, EtcdFailure
    from trainguard.agent.membership_kv import EtcdKv

    down = EtcdError(EtcdFailure.UNAVAILABLE, "slow")
    client = _Client()
    kv = EtcdKv(client, "/p/", 2.0, 3)
    kv._lease, kv._stream = 7, _Stream([6, down, down, 6, down])
    kv.beat("n")  # on the stream
    with pytest.raises(EtcdError):
        kv.beat("n")  # a missed beat: the TTL covers it, no gateway request on top
    assert client.calls == []
    kv.beat("n")  # the second failure in a row: through the gateway
    assert client.calls == ["lease/keepalive"]
    kv.beat("n")  # the stream answers again
    with pytest.raises(EtcdError):
        kv.beat("n")
    assert client.calls == ["lease/keepalive"]
