"""The notice policy as a table: notice kind x lead time x config -> action. Pure, no clocks."""

import pytest

from trainguard.agent.drain import DrainCoordinator, LeadCosts, NoticeAction, auto_drain_lead, decide_notice
from trainguard.agent.watchers.base import Notice

NOW = 1_000_000.0
D, C, I = NoticeAction.DRAIN, NoticeAction.CHECKPOINT, NoticeAction.IGNORE


def notice(source, kind, lead_s, **detail):
    return Notice(source=source, kind=kind, deadline=NOW + lead_s, received_at=NOW, detail=detail, event_id="e1")


CASES = [
    # (name, notice, on_early_warning, expected action, drains after (s) or None)
    ("aws spot interruption", notice("aws", "termination", 120), "checkpoint", D, None),
    ("aws spot interruption, ignore policy", notice("aws", "termination", 120), "ignore", D, None),
    ("gcp preempted", notice("gcp", "preempt", 30), "checkpoint", D, None),
    ("gcp terminate maintenance", notice("gcp", "termination", 60, value="TERMINATE_ON_HOST_MAINTENANCE"), "checkpoint", D, None),
    ("azure preempt", notice("azure", "preempt", 30, EventType="Preempt"), "checkpoint", D, None),
    ("azure terminate", notice("azure", "termination", 300, EventType="Terminate"), "checkpoint", D, None),
    ("sigterm", notice("signal", "stop", 30), "ignore", D, None),
    ("slurm sigusr1", notice("signal", "preempt", 30), "checkpoint", D, None),
    ("manual drain", notice("manual", "drain", 30), "checkpoint", D, None),
    ("aws rebalance -> checkpoint", notice("aws", "rebalance", 120), "checkpoint", C, None),
    ("aws rebalance -> drain", notice("aws", "rebalance", 120), "drain", D, None),
    ("aws rebalance -> ignore", notice("aws", "rebalance", 120), "ignore", I, None),
    ("gcp live migration -> checkpoint", notice("gcp", "maintenance", 60, value="MIGRATE_ON_HOST_MAINTENANCE"), "checkpoint", C, None),
    ("gcp live migration -> ignore", notice("gcp", "maintenance", 60, value="MIGRATE_ON_HOST_MAINTENANCE"), "ignore", I, None),
    ("azure freeze -> checkpoint", notice("azure", "maintenance", 900, EventType="Freeze"), "checkpoint", C, None),
    ("azure reboot, long lead -> checkpoint, drain later", notice("azure", "maintenance", 900, EventType="Reboot"), "checkpoint", C, 880.0),
    ("azure redeploy, long lead", notice("azure", "maintenance", 300, EventType="Redeploy"), "checkpoint", C, 280.0),
    ("azure reboot, short lead -> drain now", notice("azure", "maintenance", 15, EventType="Reboot"), "checkpoint", D, None),
    ("azure reboot, drain policy", notice("azure", "maintenance", 900, EventType="Reboot"), "drain", D, None),
    ("azure reboot, ignore policy", notice("azure", "maintenance", 900, EventType="Reboot"), "ignore", I, None),
]


THROUGH = [
    # train_through_notice: cloud terminations with a long lead train on, checkpoint now, drain 20 s before
    ("aws spot interruption trains through", notice("aws", "termination", 120), C, 100.0),
    ("gcp preempted: 30 s, trains 10 s", notice("gcp", "preempt", 30), C, 10.0),
    ("azure preempt: lead at the bound drains now", notice("azure", "preempt", 20, EventType="Preempt"), D, None),
    ("aws interruption already close drains now", notice("aws", "termination", 5), D, None),
    ("sigterm still drains now", notice("signal", "stop", 30), D, None),
    ("manual drain still drains now", notice("manual", "drain", 300), D, None),
    ("early warnings keep their policy", notice("aws", "rebalance", 120), C, None),
]


@pytest.mark.parametrize("name,n,action,drain_after", THROUGH, ids=[c[0] for c in THROUGH])
def test_train_through_notice(name, n, action, drain_after):
    d = decide_notice(n, on_early_warning="checkpoint", drain_lead_s=20.0, now=NOW, train_through=True)
    assert d.action is action, d
    assert (None if d.drain_at is None else d.drain_at - NOW) == drain_after
    assert d.reason == f"{n.source}_{n.kind}" or n.kind == "rebalance"
    off = decide_notice(n, on_early_warning="checkpoint", drain_lead_s=20.0, now=NOW)
    assert off.action is (C if n.kind == "rebalance" else D) and off.drain_at is None  # off: as before


@pytest.mark.parametrize("name,n,policy,action,drain_after", CASES, ids=[c[0] for c in CASES])
def test_policy_table(name, n, policy, action, drain_after):
    d = decide_notice(n, on_early_warning=policy, drain_lead_s=20.0, now=NOW)
    assert d.action is action, d
    assert (None if d.drain_at is None else d.drain_at - NOW) == drain_after
    assert d.reason


class Target:
    def __init__(self):
        self.drains, self.checkpoints = [], []

    def request_drain(self, source, kind, deadline, reason=""):
        self.drains.append((source, kind, deadline, reason))
        return True

    def request_checkpoint(self, reason):
        self.checkpoints.append(reason)
        return True


class Counter:
    def __init__(self):
        self.sources = []

    def notice(self, source):
        self.sources.append(source)


def test_coordinator_routes_counts_and_acknowledges_after_the_commit():
    target, counter, acked = Target(), Counter(), []
    c = DrainCoordinator(target, observer=counter, acknowledge=lambda n: acked.append(n.event_id) or True, clock=lambda: NOW)
    c.on_notice(notice("aws", "rebalance", 120))
    c.on_notice(notice("azure", "preempt", 30, EventType="Preempt"))
    assert target.checkpoints == ["aws_rebalance"]
    assert [d[:2] for d in target.drains] == [("azure", "preempt")]
    assert counter.sources == ["aws", "azure"]
    assert acked == []  # nothing is acknowledged before the emergency checkpoint commits
    c.on_emergency_commit()
    assert len(acked) == 2
    c.on_emergency_commit()
    assert len(acked) == 2  # once
    c.close()


def test_scheduled_drain_fires_and_close_cancels_it():
    import threading

    target = Target()
    fired = threading.Event()
    target.request_drain = lambda *a, **k: fired.set() or True
    t = [NOW]
    c = DrainCoordinator(target, drain_lead_s=20.0, clock=lambda: t[0])
    c.on_notice(notice("azure", "maintenance", 20.05, EventType="Reboot"))  # drain due in 0.05 s
    assert target.checkpoints and fired.wait(5)
    c2 = DrainCoordinator(Target(), drain_lead_s=20.0, clock=lambda: t[0])
    c2.on_notice(notice("azure", "maintenance", 21.0, EventType="Reboot"))
    c2.close()
    assert not c2._timers


def test_coordinator_trains_through_a_cloud_notice_then_drains_before_its_deadline():
    """train_through_notice: the AWS notice takes a checkpoint at once and the drain comes
    drain_lead_s before the deadline, not at the notice; a SIGTERM still drains at once."""
    import time

    target = Target()
    c = DrainCoordinator(target, drain_lead_s=20.0, train_through=True, clock=lambda: NOW)
    try:
        d = c.on_notice(notice("aws", "termination", 20.3))
        assert d.action is C and d.drain_at == pytest.approx(NOW + 0.3)
        assert target.checkpoints == ["aws_termination"] and target.drains == []
        t0 = time.monotonic()
        while not target.drains and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        assert [x[:2] for x in target.drains] == [("aws", "termination")]
        assert target.drains[0][2] == NOW + 20.3  # the provider's deadline stands
        c.on_notice(notice("signal", "stop", 30))
        assert [x[:2] for x in target.drains] == [("aws", "termination"), ("signal", "stop")]
    finally:
        c.close()


@pytest.mark.parametrize("costs, lead, basis", [
    (LeadCosts(), 30.0, "unmeasured"),                                    # nothing measured: the cautious default
    (LeadCosts(step_s=0.1, checkpoint_s=0.35), 10.0, "floor"),            # 3 x 0.45 s: the 10 s floor wins
    (LeadCosts(step_s=1.0, checkpoint_s=None), 10.0, "floor"),
    (LeadCosts(step_s=2.5, checkpoint_s=10.0), 37.5, "measured"),         # 3 x (a step + a checkpoint)
    (LeadCosts(step_s=None, checkpoint_s=60.0), 180.0, "measured"),       # longer than AWS's 2 minutes
    (LeadCosts(step_s=2.5, checkpoint_s=10.0, agreement_s=0.5), 38.0, "measured"),  # + the agreement wait, once
    (LeadCosts(step_s=0.1, checkpoint_s=0.35, agreement_s=0.5), 10.0, "floor"),
])
def test_auto_drain_lead(costs, lead, basis):
    assert auto_drain_lead(costs, min_s=10.0, factor=3.0, unmeasured_s=30.0) == (pytest.approx(lead), basis)


def test_coordinator_sizes_the_lead_at_each_notice():
    """``drain_lead_s: auto``: the provider is asked at each notice. A fast job trains through most
    of AWS's 2 minutes; one whose measured checkpoint needs 3 x 60 s drains at once (training on would
    miss the deadline); a provider that fails falls back to 30 s and the notice is still acted on."""
    costs = [LeadCosts(step_s=0.1, checkpoint_s=0.35)]

    def lead():
        return auto_drain_lead(costs[0], min_s=10.0, factor=3.0, unmeasured_s=30.0)

    target = Target()
    c = DrainCoordinator(target, drain_lead_s=lead, train_through=True, clock=lambda: NOW)
    try:
        d = c.on_notice(notice("aws", "termination", 120))
        assert d.action is C and d.drain_at == pytest.approx(NOW + 110)
        costs[0] = LeadCosts(step_s=1.0, checkpoint_s=60.0)
        assert c.on_notice(notice("aws", "termination", 120)).action is D
        assert c.describe()["drain_lead_s"] == "auto"

        def broken():
            raise OSError("metric file vanished")

        c.drain_lead_s = broken
        d = c.on_notice(notice("aws", "termination", 120))
        assert d.action is C and d.drain_at == pytest.approx(NOW + 90)
    finally:
        c.close()


def test_scripts_without_the_worker_api_drain_at_the_notice():
    """Training through bets on the insurance checkpoint: a node whose workers cannot take one (a plain
    torchrun script, tier 1) drains at the notice, as before; so does one whose support cannot be told."""
    class Tier1(Target):
        def checkpoint_supported(self):
            return False

    class Unknown(Target):
        def checkpoint_supported(self):
            raise RuntimeError("control socket gone")

    for target in (Tier1(), Unknown()):
        c = DrainCoordinator(target, drain_lead_s=10.0, train_through=True, clock=lambda: NOW)
        try:
            assert c.on_notice(notice("aws", "termination", 120)).action is D
            assert target.checkpoints == [] and [x[:2] for x in target.drains] == [("aws", "termination")]
            # early warnings are unchanged: a checkpoint request (which the agent logs as unsupported)
            assert c.on_notice(notice("aws", "rebalance", 120)).action is C
        finally:
            c.close()
    api = Target()
    api.checkpoint_supported = lambda: True
    c = DrainCoordinator(api, drain_lead_s=10.0, train_through=True, clock=lambda: NOW)
    try:
        assert c.on_notice(notice("aws", "termination", 120)).action is C and api.drains == []
    finally:
        c.close()
