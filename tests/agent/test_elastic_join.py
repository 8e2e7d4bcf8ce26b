"""The dynamic rendezvous's join as the agents run it (:func:`trainguard.agent.elastic_join.next_round`): real
torch handlers on a real ``TCPStore``, one thread per node."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from trainguard.agent.config import RendezvousConfig
from trainguard.agent.elastic_join import fresh_reads, next_round
from trainguard.agent.elastic_types import Plan
from trainguard.agent.rendezvous import build_handler

pytestmark = pytest.mark.timeout(120)


def _nodes(n: int) -> tuple[Any, list[Any]]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    cfg = {"backend": "c10d", "endpoint": f"127.0.0.1:{server.port}", "is_host": False, "min_nodes": 1,
           "max_nodes": n, "keep_alive_interval_s": 1.0, "keep_alive_max_attempts": 10,
           "last_call_timeout_s": 30.0, "join_timeout_s": 60.0}
    handlers = []
    for i in range(n):
        h = build_handler(RendezvousConfig(local_addr=f"node{i}", **cfg), "job")
        fresh_reads(h)
        handlers.append(h)
    return server, handlers


def _world(info: Any) -> tuple[int, int]:
    return info.rank, info.world_size


def _join(h: Any, plan: Plan | None, out: dict[int, Any], i: int) -> threading.Thread:
    def run() -> None:
        try:
            out[i] = _world(next_round(h, lambda: False, plan))
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[i] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_survivor_late_to_the_round_after_a_loss_is_waited_for_not_left_out():
    """After a loss the round completes when the members alive in the state have joined. A survivor's exit
    from the old round must not make it look dead there: here survivor c leaves the old round at once
    (next_round's exit) but reaches the join 2 s later (a busy machine); survivor b must wait for it
    instead of forming a world alone. (The last call is 30 s: torch's rule is not what closes the round.)"""
    server, (a, b, c) = _nodes(3)
    try:
        out: dict[int, Any] = {}
        for t in [_join(h, None, out, i) for i, h in enumerate((a, b, c))]:
            t.join(60)
        assert sorted(out.values()) == [(0, 3), (1, 3), (2, 3)], out
        members = frozenset(str(h._this_node) for h in (a, b, c))
        dead = str(a._this_node)
        a._stop_heartbeats()  # node a vanishes
        plan = Plan(members=members, lost=True, evict=lambda: frozenset([dead]), round=0)
        # c leaves the old round (next_round's exit) and is then slow to go on: its first look at abort()
        # in the join takes 2 s
        slow = threading.Event()

        def slow_abort() -> bool:
            if not slow.is_set():
                slow.set()
                time.sleep(2.0)
            return False

        out.clear()
        tc = threading.Thread(target=lambda: out.__setitem__(2, _world(next_round(c, slow_abort, plan))), daemon=True)
        tc.start()
        assert slow.wait(10)  # c is out of round 0
        tb = _join(b, plan, out, 1)
        tb.join(1.5)
        assert 1 not in out, f"b formed a round without c, which had only left the old one: {out}"
        tb.join(30)
        tc.join(30)
        assert sorted(out.values()) == [(0, 2), (1, 2)], out
    finally:
        for h in (a, b, c):
            h._stop_heartbeats()
        del server
