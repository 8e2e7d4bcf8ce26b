"""The supervisor's straggler wiring with a scripted adapter (no processes): worker Pace reports reach the
monitor, an eviction in the store drains this node through the planned path, and a quarantined node never
enters the rendezvous."""

from __future__ import annotations

import time

from tests.agent.test_straggler import FakeStore
from tests.agent.test_supervisor_scripted import HEALTHY, FakeAdapter
from trainguard.agent.configload import load_config
from trainguard.agent.straggler import Eviction
from trainguard.agent.supervisor import Supervisor
from trainguard.contract import protocol as proto
from trainguard.contract.protocol import AgentState


class StoreAdapter(FakeAdapter):
    def __init__(self, script, endpoint):
        super().__init__(script)
        self.endpoint = endpoint

    def endpoint_store(self):
        return self.endpoint


def make(tmp_path, endpoint, **sets):
    cfg = load_config(None, {}, {"agent.state_dir": str(tmp_path / "s"), "agent.log_dir": str(tmp_path / "l"),
                                 "agent.node_name": "slow", "workers.entrypoint": "train.py",
                                 "workers.monitor_interval_s": "0.001", "rendezvous.backend": "static",
                                 "preemption.term_grace_s": "1", **sets})
    fake = StoreAdapter([HEALTHY] * 5, endpoint)
    return Supervisor(cfg, handler=object(), adapter=lambda spec, logs, s: fake), fake


def test_pace_reports_feed_the_monitor_and_an_eviction_drains_this_node(tmp_path):
    store = FakeStore()
    sup, fake = make(tmp_path, store)
    try:
        assert sup._on_control(proto.Pace(rank=0, local_rank=0, step=9, compute_s=(0.2,) * 6)) is None
        assert sup.straggler.window.node_value(5) == (0.2, 6)
        store.append("trainguard/straggler/trainguard/evictions", Eviction("other", time.time() + 1).to_line())
        store.append("trainguard/straggler/trainguard/evictions", Eviction("slow", time.time() + 1, score=2.0).to_line())
        result = sup._loop()
        assert result.state.value == "SUCCEEDED"  # elastic's view of a planned leave
        assert sup.drain is not None and sup.drain.source == "straggler" and "straggler" in sup.drain.reason
        assert sup.sm.state is AgentState.STOPPED and "leave" in fake.calls
        assert b"slow\n" in store.d["trainguard/straggler/trainguard/nodes"]  # it published itself
    finally:
        sup.control.close()


def test_an_old_eviction_does_not_drain_a_restarted_agent(tmp_path):
    store = FakeStore()
    store.append("trainguard/straggler/trainguard/evictions", Eviction("slow", time.time() - 3600).to_line())
    sup, fake = make(tmp_path, store)
    try:
        sup._current = fake.world()
        sup.straggler.tick(store, round_=0, nodes=1, decides=True)
        assert sup.drain is None
    finally:
        sup.control.close()


def test_a_quarantined_node_never_enters_the_rendezvous(tmp_path):
    store = FakeStore()
    for t in (100.0, 200.0, 300.0):
        store.append("trainguard/straggler/trainguard/evictions", Eviction("slow", time.time() - t).to_line())
    sup, fake = make(tmp_path, store, **{"straggler.action": "evict"})
    try:
        sup._loop()
        assert fake.calls == [] and sup.sm.state is AgentState.STOPPED
        assert sup._finish() == 3  # drained: systemd does not restart it
    finally:
        sup.control.close()
