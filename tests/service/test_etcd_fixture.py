"""The etcd fixture: Debian's etcd with the v2 API, reachable through python-etcd."""

from __future__ import annotations

import etcd  # python-etcd, the client torch's etcd-v2 rendezvous backend uses

from tests.fixtures.etcd import EtcdServer


def test_python_etcd_set_get(etcd_server: EtcdServer) -> None:
    client = etcd.Client(host=etcd_server.host, port=etcd_server.client_port, protocol="http")
    client.write("/trainguard/test/key", "value")
    assert client.read("/trainguard/test/key").value == "value"
    assert etcd_server.process.poll() is None


def test_etcd_v2_rendezvous_backend_roundtrip(etcd_server: EtcdServer) -> None:
    """torch's ``etcd-v2`` backend keeps rendezvous state in this etcd (the agents' spot-safe option)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    params = RendezvousParameters(
        backend="etcd-v2", endpoint=etcd_server.endpoint, run_id="etcd-test", min_nodes=1, max_nodes=2
    )
    backend, store = create_backend(params)
    state, token, ok = backend.set_state(b"state-1")
    assert ok and state == b"state-1"
    got = backend.get_state()
    assert got is not None and got[0] == b"state-1"
    store.set("k", "v")
    assert store.get("k") == b"v"
