"""The worker runtime feeds what the checkpoint manager measured — real bytes, a stage time distinct
from the blocked time, the persist time — into its metrics and into the ``Committed`` report to the
agent; a fenced world's periodic saves are counted as failures and never crash the training loop."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import pytest
import torch

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.contract import protocol as proto
from trainguard.runtime.runtime import Runtime

pytestmark = pytest.mark.timeout(60)


class Recorder:
    def __init__(self) -> None:
        self.checkpoints: list[tuple[Any, ...]] = []

    def observe_checkpoint(self, *args: Any) -> None:
        self.checkpoints.append(args)

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


class Link:
    request = proto.StopReason.NONE
    deadline = None

    def __init__(self) -> None:
        self.reports: list[proto.Committed] = []

    def report(self, msg: proto.Committed) -> None:
        self.reports.append(msg)

    def close(self) -> None:
        pass


@pytest.fixture
def rt(tmp_path: Any) -> Iterator[Runtime]:
    old = signal.getsignal(signal.SIGTERM)
    r = Runtime(rank=0, world_size=1, local_rank=0, job_id="job", rdzv_id="job", rdzv_round=3,
                checkpoint=CheckpointConfig(url=str(tmp_path / "ck"), interval_steps=1))
    m = torch.nn.Linear(16, 16)
    r.setup(m, torch.optim.SGD(m.parameters(), lr=0.1), dataset_size=64, global_batch=4, micro_batch=4)
    r._metrics = Recorder()
    try:
        yield r
    finally:
        r.finish(barrier=False)
        signal.signal(signal.SIGTERM, old)


def test_periodic_save_metrics_carry_real_bytes_and_stage_time(rt: Runtime) -> None:
    rt.end_step()
    assert rt._tiers.manager is not None and rt._tiers.manager.wait(30) == 1
    (kind, stage_s, persist_s, blocked_s, nbytes, step, ok), = rt._metrics.checkpoints
    files = rt._tiers.manager.list()
    assert (kind, step, ok) == ("periodic", 1, True)
    assert nbytes == files[0].total_bytes > 16 * 16 * 4  # what this (only) rank wrote: shard + metadata
    assert 0 < stage_s <= blocked_s and persist_s > 0
    assert rt._tiers.manager.epoch_record.rdzv_round == 3  # the rendezvous round is information in the epoch record


def test_fenced_periodic_saves_count_as_failures_and_training_goes_on(rt: Runtime, tmp_path: Any) -> None:
    rt.end_step()
    assert rt._tiers.manager is not None
    rt._tiers.manager.wait(30)
    newer = CheckpointManager(CheckpointConfig(url=str(tmp_path / "ck")), "job", rank=0, world_size=1)
    assert newer.restore(rt._state()) == 1  # another world restores the step: it claims epoch 2
    for _ in range(3):
        rt.end_step()  # no exception: the stale world keeps training
        f = rt._tiers.manager.pending
        if f is not None:  # settle each refused save before the next step (else that one is deferred)
            futures.wait([f], timeout=30)
    assert rt._tiers.manager.wait(30) == 1  # its last commit; the refusals are not raised into training
    oks = [c[-1] for c in rt._metrics.checkpoints]
    assert oks == [True, False, False, False] and rt._tiers.manager.fenced
    newer.close()


def test_emergency_stop_reports_bytes_stage_and_persist_to_the_agent(rt: Runtime,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    link = Link()
    rt._session.link = link  # type: ignore[assignment]

    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    rt.step = 7
    with pytest.raises(Exited, match=str(proto.EXIT_RESIZE)):
        rt._stop(proto.StopReason.DRAIN)
    rt._tiers.manager = None  # closed by _stop
    rt._session.link = None
    (report,) = link.reports
    (kind, stage_s, persist_s, blocked_s, nbytes, step, ok), = rt._metrics.checkpoints
    assert report.saved and report.step == 7 and report.kind is proto.CheckpointKind.EMERGENCY
    assert report.nbytes == nbytes > 0 and report.last_committed == 7
    assert report.stage_s == round(stage_s, 6) > 0 and report.persist_s == round(persist_s, 6) > 0
    assert (kind, ok) == ("emergency", True) and stage_s <= blocked_s
