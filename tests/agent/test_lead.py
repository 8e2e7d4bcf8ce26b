"""The drain lead's inputs are the agent's own (agent/lead.py): :class:`DrainCosts` estimates a step and a
checkpoint from the reports the node's workers send over the control socket, never from the metrics
registry (DESIGN: metrics observe, never steer). The rule itself (:func:`auto_drain_lead`) has its table in
tests/agent/test_drain_policy.py."""

from __future__ import annotations

import socket
import time

import pytest

from trainguard.agent import control
from trainguard.agent.daemon import drain_lead
from trainguard.agent.lead import DrainCosts, LeadCosts
from trainguard.agent.watchers.config import PreemptionConfig
from trainguard.contract import protocol as proto

K = proto.CheckpointKind


def pace(*step_s: float, local_rank: int = 0, checkpoints: tuple[float, ...] = (), compute: float = 0.05) -> proto.Pace:
    return proto.Pace(rank=local_rank, local_rank=local_rank, step=len(step_s), compute_s=(compute,) * len(step_s),
                      step_s=tuple(step_s), checkpoint_s=checkpoints)


def committed(stage_s: float, persist_s: float, *, kind: K = K.RESIZE, saved: bool = True, rank: int = 0) -> proto.Committed:
    return proto.Committed(step=5, kind=kind, rank=rank, saved=saved, seconds=stage_s + persist_s + 0.5,
                           stage_s=stage_s, persist_s=persist_s)


@pytest.mark.parametrize(("reports", "expected"), [
    ([], LeadCosts()),                                                        # nothing reported: unmeasured
    ([pace(0.2)], LeadCosts(step_s=0.2)),
    ([pace(0.9, compute=0.1)], LeadCosts(step_s=0.9)),                        # the whole step, waits on peers included
    ([pace(*[0.1] * 99, 5.0)], LeadCosts(step_s=0.1)),                        # one slow (compiling) step of 100: not the p99
    ([pace(*[0.1] * 98, 5.0, 6.0)], LeadCosts(step_s=5.0)),                   # two of 100: the p99 is a slow one
    ([pace(0.1, 0.3, local_rank=0), pace(0.2, local_rank=1)], LeadCosts(step_s=0.3)),  # all local ranks together
    ([committed(0.5, 2.0)], LeadCosts(checkpoint_s=2.5)),                     # stage + persist
    ([committed(0.5, 2.0), committed(1.0, 9.0, kind=K.EMERGENCY, rank=1), committed(0.1, 0.1, kind=K.FINAL)],
     LeadCosts(checkpoint_s=10.0)),                                           # the longest, any kind, any rank
    ([committed(30.0, 30.0, saved=False)], LeadCosts()),                      # not saved: no cost measured
    ([pace(0.2, checkpoints=(4.0, 60.0)), pace(0.2, checkpoints=(5.0,))],
     LeadCosts(step_s=0.2, checkpoint_s=60.0)),                               # periodic saves, reported with the steps
    ([pace(0.2, checkpoints=(7.0,)), committed(1.0, 2.0)], LeadCosts(step_s=0.2, checkpoint_s=7.0)),
    ([pace(0.4), committed(1.0, 3.0), proto.Progress(rank=0, local_rank=0, step=1, phase=proto.Phase.STEP, beat=1,
                                                      progress=1), proto.Hello(rank=0, local_rank=0, pid=1)],
     LeadCosts(step_s=0.4, checkpoint_s=4.0)),                                # other reports measure nothing
])
def test_drain_costs_from_the_workers_reports(reports, expected):
    costs = DrainCosts()
    for msg in reports:
        costs.observe(msg)
    assert costs.costs() == expected


def test_drain_costs_keep_the_newest_steps_and_add_the_agreement_wait():
    costs = DrainCosts(window=3)
    costs.observe(pace(9.0, 9.0))
    costs.observe(pace(0.1, 0.2, 0.3))  # the slow ones fell out of the window
    assert costs.costs(agreement_s=0.5) == LeadCosts(step_s=0.3, agreement_s=0.5)


def test_the_auto_lead_reads_the_agents_costs_and_the_metrics_only_export_it():
    class Exported:
        def __init__(self) -> None:
            self.leads: list[float] = []

        def set_drain_lead(self, seconds: float) -> None:
            self.leads.append(seconds)

        def __getattr__(self, name: str):  # anything else read from the metrics would steer: fail loudly
            raise AssertionError(f"the drain lead read metrics.{name}")

    costs, metrics = DrainCosts(), Exported()
    lead = drain_lead(PreemptionConfig(), costs, metrics, agreement_s=0.5)
    assert callable(lead)
    assert lead() == (30.0, "unmeasured")                                     # drain_lead_unmeasured_s
    costs.observe(pace(2.5))
    costs.observe(committed(2.0, 8.0))
    assert lead() == (pytest.approx(3.0 * (2.5 + 10.0) + 0.5), "measured")   # drain_lead_factor 3
    assert metrics.leads == [30.0, pytest.approx(38.0)]
    assert drain_lead(PreemptionConfig(drain_lead_s="12"), costs, metrics) == 12.0
    assert metrics.leads[-1] == 12.0


def test_the_control_socket_shows_every_report_to_its_observers(tmp_path):
    seen: list[proto.Message] = []
    costs = DrainCosts()
    server = control.ControlServer(proto.control_socket_path(str(tmp_path), "job"),
                                   lambda msg: proto.Reply(ok=True) if isinstance(msg, proto.StatusRequest) else None)
    try:
        server.observers.append(lambda msg: 1 / 0)  # a failing observer is logged and skipped
        server.observers += [seen.append, costs.observe]
        assert control.request(server.path, proto.StatusRequest()).ok
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a worker's reports: no reply
            s.connect(server.path)
            s.sendall(proto.encode(pace(0.7)) + proto.encode(committed(1.0, 2.0)))
            deadline = time.monotonic() + 5
            while len(seen) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert [type(m) for m in seen] == [proto.StatusRequest, proto.Pace, proto.Committed]
        assert costs.costs() == LeadCosts(step_s=0.7, checkpoint_s=3.0)
    finally:
        server.close()
