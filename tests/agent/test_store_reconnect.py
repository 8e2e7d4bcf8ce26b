"""A restarted ``trainguard store``: the agents' TCPStore clients never reconnect by themselves (every
call fails with a broken pipe), so the agent rebuilds its client and republishes the round it is in.
Real store processes on loopback, a real c10d rendezvous handler, no workers."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.agent.server.api import WorkerSpec

from tests.e2e.test_checkpoint_epochs import Store
from tests.harness import wait_until
from trainguard.agent.config import RendezvousConfig
from trainguard.agent.elastic import ElasticAdapter
from trainguard.agent.rendezvous import build_handler


def adapter_for(endpoint: str, tmp_path, name: str) -> ElasticAdapter:
    cfg = RendezvousConfig(backend="c10d", endpoint=endpoint, is_host=False, min_nodes=1, max_nodes=2,
                           last_call_timeout_s=1, keep_alive_interval_s=1)
    spec = WorkerSpec(role="default", local_world_size=1, rdzv_handler=build_handler(cfg, "job"),
                      entrypoint="/bin/true", args=())
    return ElasticAdapter(spec, DefaultLogsSpecs(log_dir=str(tmp_path / name)), exit_barrier_timeout=5,
                          worker_env=dict, abort_rendezvous=lambda: False)


@pytest.mark.parametrize("bounded", [False, True], ids=["torch_backend", "bounded_store_calls"])
def test_an_agent_reconnects_to_a_restarted_store_and_republishes_its_round(tmp_path, bounded):
    store = Store(str(tmp_path), "first")
    a = adapter_for(store.endpoint, tmp_path, "a")
    if bounded:  # as the supervisor does for c10d (issue 37)
        assert a.bound_store_calls(1, 3) is True
    joiner = None
    try:
        info = a.handler.next_rendezvous()  # round 0, this node alone
        a.group.store = info.store
        if bounded:  # the supervisor's view of the round store: same keys as the group's, bounded
            a.store.set("seen", "1")
            assert info.store.get("seen") == b"1"
        before = a.peek()
        assert before.round == 0 and before.this_node_participates
        a.group.store.set("mark", "1")

        store.stop()
        store = Store(str(tmp_path), "restarted", port=store.port)
        with pytest.raises(Exception):  # the old client is dead for good
            a.peek()
        wait_until(a.reconnect_store, 20, "a reconnection to the restarted store")

        after = a.peek()
        assert after.round == 0 and after.this_node_participates and after.participants == before.participants
        a.group.store.set("mark", "2")  # the running world's round store works again (keys are new)
        assert a.group.store.get("mark") == b"2"
        assert a.nodes_waiting() == 0
        if bounded:
            assert a.store.get("mark") == b"2"
            from trainguard.agent.storecall import BoundedC10dBackend
            assert isinstance(a.handler._state_holder._backend, BoundedC10dBackend)  # the bound survived

        # A node that starts against the restarted store sees the republished round, not an empty one.
        joiner = adapter_for(store.endpoint, tmp_path, "b")
        seen = joiner.peek()
        assert seen.round == 0 and seen.participants == before.participants and not seen.this_node_participates
    finally:
        for ad in (a, joiner):
            if ad is not None:
                ad.handler.shutdown()
        store.stop()


def static_adapter(tmp_path) -> ElasticAdapter:
    cfg = RendezvousConfig(backend="static", endpoint="127.0.0.1:1", min_nodes=1, max_nodes=1)
    spec = WorkerSpec(role="default", local_world_size=1, rdzv_handler=build_handler(cfg, "job"),
                      entrypoint="/bin/true", args=())
    return ElasticAdapter(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "s")), exit_barrier_timeout=5,
                          worker_env=dict, abort_rendezvous=lambda: False)


def test_other_backends_do_not_reconnect(tmp_path):
    assert static_adapter(tmp_path).reconnect_store() is False


def test_endpoint_store_is_the_c10d_store_and_none_elsewhere(tmp_path):
    """The census and the straggler records live in the endpoint store: with torch's real c10d handler it
    must be found (the handler keeps only the backend's name; the backend is its state holder's)."""
    store = Store(str(tmp_path), "first")
    a = adapter_for(store.endpoint, tmp_path, "a")
    try:
        s = a.endpoint_store()
        assert s is not None
        s.set("trainguard/probe", b"1")
        assert bytes(s.get("trainguard/probe")) == b"1"
    finally:
        a.handler.shutdown()
        store.stop()
    assert static_adapter(tmp_path).endpoint_store() is None


def test_bounding_the_store_calls_at_start_waits_for_a_slow_store_not_only_one_call_bound(tmp_path):
    """The agent's start (Supervisor.start -> bound_store_calls) opens a connection of its own to the
    endpoint. Each call on it is bounded by interval x attempts (3 s here), but not its opening: a store
    that answers only after 12 s (restarted; at load 15 one that was merely slow) must not end the agent
    with DistNetworkError, as a connect with the calls' 3 s timeout did (torch gives up after ~8 s: a
    3 s try, a ~2.5 s delay, a second 3 s try)."""
    import threading
    import time

    store = Store(str(tmp_path), "first")
    a = adapter_for(store.endpoint, tmp_path, "a")
    port = store.port
    store.stop()
    back: list[Store] = []
    t = threading.Thread(target=lambda: (time.sleep(12), back.append(Store(str(tmp_path), "again", port=port))))
    t.start()
    try:
        t0 = time.monotonic()
        assert a.bound_store_calls(1, 3) is True
        assert time.monotonic() - t0 >= 11.0  # it did wait for the store, past one call's bound
        t.join(30)
        assert a.handler._state_holder._backend.get_state() is None  # a call answers: no round there yet
    finally:
        t.join(30)
        for s in back:
            s.stop()
