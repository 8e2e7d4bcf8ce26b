"""The worker's local compute measure (runtime/pace.py) and its report on the wire, with a fake clock."""

from __future__ import annotations

import pytest

from trainguard.contract import protocol as proto
from trainguard.runtime.pace import REPORT_EVERY_S, PaceMeter


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_blocked_time_is_taken_out_of_the_step():
    m = PaceMeter(Clock())
    m.blocked(0.3)
    m.blocked(0.2)
    assert m.step_done(1, 1.5) == pytest.approx(1.0)
    assert m.step_done(2, 0.7) == pytest.approx(0.7)  # the next step starts from zero
    m.blocked(2.0)
    assert m.step_done(3, 1.0) == 0.0  # never negative


def test_a_rolled_back_step_leaves_no_blocked_time_behind():
    m = PaceMeter(Clock())
    m.blocked(5.0)
    m.discard_step()
    assert m.step_done(1, 1.0) == pytest.approx(1.0)


def test_reports_batch_steps_at_most_every_interval():
    clock = Clock()
    m = PaceMeter(clock)
    assert m.report(0, 0) is None  # nothing measured yet
    for s in range(1, 4):
        m.step_done(s, 0.1 * s)
    r = m.report(3, 1)
    assert r == proto.Pace(rank=3, local_rank=1, step=3, compute_s=(0.1, 0.2, pytest.approx(0.3)),
                           step_s=(0.1, 0.2, pytest.approx(0.3)))
    m.step_done(4, 0.4)
    clock.t += REPORT_EVERY_S / 2
    assert m.report(3, 1) is None  # too soon: kept for the next one
    clock.t += REPORT_EVERY_S
    assert m.report(3, 1).compute_s == (0.4,)


def test_an_unread_backlog_keeps_the_newest():
    m = PaceMeter(Clock())
    for s in range(1, proto.Pace.MAX_PACE + 11):
        m.step_done(s, float(s))
    r = m.report(0, 0)
    assert len(r.compute_s) == proto.Pace.MAX_PACE and r.compute_s[-1] == float(proto.Pace.MAX_PACE + 10)


def test_checkpoints_go_with_the_next_report():
    """The drain lead's inputs (agent/lead.py): each step's whole time and the checkpoints committed since
    the last report (the persist thread adds them), once each."""
    clock = Clock()
    m = PaceMeter(clock)
    m.checkpoint_done(4.0)
    assert m.report(0, 0) is None  # no step yet: the checkpoint waits for the next report
    m.blocked(0.5)
    m.step_done(1, 1.5)
    m.checkpoint_done(6.5)
    r = m.report(0, 0)
    assert r.compute_s == (1.0,) and r.step_s == (1.5,) and r.checkpoint_s == (4.0, 6.5)
    clock.t += REPORT_EVERY_S
    m.step_done(2, 0.5)
    assert m.report(0, 0).checkpoint_s == ()


def test_pace_message_round_trip_and_validation():
    msg = proto.Pace(rank=2, local_rank=0, step=9, compute_s=(0.25, 0.5))
    assert proto.decode(proto.encode(msg)) == msg
    full = proto.Pace(rank=2, local_rank=0, step=9, compute_s=(0.25, 0.5), step_s=(0.5, 0.75), checkpoint_s=(3.0,))
    assert proto.decode(proto.encode(full)) == full
    for name in ("step_s", "checkpoint_s"):
        with pytest.raises(proto.ProtocolError, match=name):
            proto.decode('{"op":"pace","rank":0,"local_rank":0,"step":1,"%s":[-1]}' % name)
    for bad in ('{"op":"pace","rank":0,"local_rank":0,"step":1,"compute_s":[-1]}',
                '{"op":"pace","rank":0,"local_rank":0,"step":1,"compute_s":"x"}',
                '{"op":"pace","rank":0,"local_rank":0,"step":1,"compute_s":[' + ",".join(["1"] * 65) + "]}",
                '{"op":"pace","rank":0,"local_rank":0,"step":1,"compute_s":[NaN]}'):
        with pytest.raises(proto.ProtocolError):
            proto.decode(bad)


def test_runtime_reports_compute_without_the_synchronising_backward(tmp_path, monkeypatch):
    """The wiring in Runtime: the accumulating backward counts, the synchronising one (where DDP waits for
    the peers) does not, the optimizer step does; the value reaches the agent as a Pace report at the
    step's boundary. The runtime's clock is a fake advanced by each phase."""
    import signal
    import types

    import torch

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.runtime import runtime as runtime_mod
    from trainguard.runtime import stepend

    clock = Clock()
    clock.t = 100.0
    fake_time = types.SimpleNamespace(monotonic=clock, time=lambda: 1e9, sleep=lambda s: None)
    for mod in (runtime_mod, stepend):  # the facade's step API and the end of a step (its part)
        monkeypatch.setattr(mod, "time", fake_time)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        rt = runtime_mod.Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_round=0, checkpoint=CheckpointConfig())
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = rt.setup(model, opt, dataset_size=32, global_batch=4, micro_batch=2, seed=1)
        rt._pace = PaceMeter(clock)  # the batching of reports on the same fake clock
        reports: list[object] = []
        monkeypatch.setattr(rt._session, "report", reports.append)
        backward = rt.strategy.backward

        def timed_backward(loss, cost={True: 3.0, False: 0.5}):
            clock.t += cost[rt._sync_micro]
            backward(loss)

        monkeypatch.setattr(rt.strategy, "backward", timed_backward)
        x = torch.randn(32, 4)
        for step in range(2):
            micro = rt.next_batches()
            assert len(micro) == 2
            for i, ids in enumerate(micro):
                with rt.accumulating(last=i == len(micro) - 1):
                    clock.t += 1.0  # forward
                    rt.backward(model(x[ids]).sum())
            clock.t += 0.2
            rt.optimizer_step(opt)
            opt.zero_grad()
            rt.end_step()
            clock.t += 10.0  # after the boundary (the script loads data, logs): the next step's own time
        paces = [r for r in reports if isinstance(r, proto.Pace)]
        assert len(paces) == 2 and [p.step for p in paces] == [1, 2]
        # forward 1 + accumulating backward 0.5 + forward 1 + optimizer 0.2; the synchronising 3.0 is out;
        # a slow data loader (the 10 s after the first boundary) is the rank's own time
        assert paces[0].compute_s == (pytest.approx(2.7),) and paces[1].compute_s == (pytest.approx(12.7),)
        assert paces[0].step_s == (pytest.approx(5.7),) and paces[1].step_s == (pytest.approx(15.7),)  # the whole steps
        rt.finish(barrier=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
