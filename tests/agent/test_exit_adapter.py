"""The exit barrier through the elastic adapter, on torch's real c10d rendezvous handler (a ``trainguard store``
process on loopback, two adapters in this process, no workers): what the rendezvous state and the marks
look like to it when a member leaves to rejoin, joins again, or the job closes."""

from __future__ import annotations

import threading

import pytest
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

import torch.distributed as dist

from tests.e2e.test_checkpoint_epochs import Store
from trainguard.agent.config import RendezvousConfig
from trainguard.agent.elastic import ElasticAdapter
from trainguard.agent.exitbarrier import EXITED_KEY, REJOINING_KEY, ExitReason
from trainguard.agent.rendezvous import build_handler

pytestmark = [pytest.mark.timeout(120)]


def adapter(endpoint: str, tmp_path, name: str) -> ElasticAdapter:
    cfg = RendezvousConfig(backend="c10d", endpoint=endpoint, is_host=False, min_nodes=2, max_nodes=2,
                           last_call_timeout_s=1, keep_alive_interval_s=1)
    spec = WorkerSpec(role="default", local_world_size=1, rdzv_handler=build_handler(cfg, "job"),
                      entrypoint="/bin/true", args=())
    return ElasticAdapter(spec, DefaultLogsSpecs(log_dir=str(tmp_path / name)), exit_barrier_timeout=60,
                          worker_env=dict, abort_rendezvous=lambda: False)


def join_all(*adapters: ElasticAdapter) -> dict[str, object]:
    """Each adapter's next round (the join as its agent runs it), side by side; an exception is returned."""
    out: dict[str, object] = {}

    def one(ad: ElasticAdapter) -> None:
        try:
            out[ad.node_id] = ad._next_rendezvous()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out[ad.node_id] = e

    threads = [threading.Thread(target=one, args=(ad,), daemon=True) for ad in adapters]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def mark(store: Store, key: str) -> bytes | None:
    client = dist.PrefixStore("trainguard.exit.job", dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                                                    multi_tenant=True))
    return client.get(key) if client.check([key]) else None


def test_a_member_that_left_to_rejoin_is_not_waited_for_and_learns_the_job_is_over(tmp_path):
    store = Store(str(tmp_path), "s")
    a, b = adapter(store.endpoint, tmp_path, "a"), adapter(store.endpoint, tmp_path, "b")
    try:
        assert not any(isinstance(v, Exception) for v in join_all(a, b).values())
        assert a._joined == b._joined == (0, frozenset({a.node_id, b.node_id}))

        # b's workers failed after a's finished: b leaves to rejoin warm (its mark up), a's barrier lets a go.
        assert b.leave(timeout_s=10, rejoin=True)
        assert mark(store, REJOINING_KEY + b.node_id) == b"1"
        out = a.exit_barrier()
        assert out is not None and out.reason is ExitReason.MEMBERS_DONE
        assert out.left == (b.node_id,) and out.finished == () and out.seconds < 30

        # b comes back (waiting for a round that never forms: a is still the round's participant), a ends
        # the job: b's join fails closed (its agent then exits 0, not_needed).
        result: dict[str, object] = {}
        t = threading.Thread(target=lambda: result.update(join_all(b)), daemon=True)
        t.start()
        a.close()
        t.join(60)
        assert isinstance(result[b.node_id], RendezvousClosedError), result
        assert mark(store, EXITED_KEY + a.node_id) == b"1"
        b.close()
        assert mark(store, EXITED_KEY + b.node_id) == b"1"
    finally:
        for ad in (a, b):
            ad.handler.shutdown()
        store.stop()


def test_the_rejoin_mark_goes_down_once_the_node_is_back_in_a_round_or_leaves_for_good(tmp_path):
    store = Store(str(tmp_path), "s")
    a, b = adapter(store.endpoint, tmp_path, "a"), adapter(store.endpoint, tmp_path, "b")
    try:
        assert not any(isinstance(v, Exception) for v in join_all(a, b).values())
        assert b.leave(timeout_s=10, rejoin=True)
        assert mark(store, REJOINING_KEY + b.node_id) == b"1"
        assert a.leave(timeout_s=10)  # the round is empty: the next one forms with both
        assert mark(store, REJOINING_KEY + a.node_id) is None  # a plain leave marks nothing
        assert not any(isinstance(v, Exception) for v in join_all(a, b).values())
        assert a._joined == b._joined and a._joined[0] == 1
        assert mark(store, REJOINING_KEY + b.node_id) == b"0"  # back in round 1

        assert b.leave(timeout_s=10, rejoin=True)
        assert mark(store, REJOINING_KEY + b.node_id) == b"1"
        assert b.leave(timeout_s=10)  # drained while out (a leave for good): the mark goes down
        assert mark(store, REJOINING_KEY + b.node_id) == b"0"
    finally:
        for ad in (a, b):
            ad.handler.shutdown()
        store.stop()
