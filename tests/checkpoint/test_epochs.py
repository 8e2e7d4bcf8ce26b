"""Epochs claimed in the store, on the real backends: file://, s3:// (moto), gs:// (emulator), memory://.

* which backends really refuse a second create (moto 5.2.5 honours ``If-None-Match: *``; the GCS
  emulator ignores ``ifGenerationMatch=0``, so gs:// is probed and falls back to write + read back);
* simultaneous claims never share an epoch on a native backend; on the read-back fallback the race is
  *measured*, and whenever two claimers both think they won, the commit-time check refuses one;
* the relaunch story of the issue: a job re-forms (round 1), is killed, relaunched on a fresh store
  (round 0 again) with the same id: it restores the newest step and commits; nothing is deleted.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import torch

from tests.fixtures.storage import Backend
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.discovery import scan_run
from trainguard.checkpoint.epochs import check_owner, claim_epoch, new_record, read_record
from trainguard.checkpoint.errors import FencedError
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.state import ModelOptimizerState
from trainguard.checkpoint.storage import Storage

pytestmark = pytest.mark.timeout(120)
EXPECTED_MODE = {"file": "native", "s3": "native", "gs": "readback", "memory": "native"}


@pytest.fixture(params=["file", "s3", "gs", "memory"])
def any_backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "memory":
        return Backend("memory", f"memory://tg-{uuid.uuid4().hex[:8]}", {})
    return request.getfixturevalue(f"{request.param}_backend")


def _storage(b: Backend) -> Storage:
    return Storage(b.url, b.storage_options, retry_attempts=3, retry_deadline_s=20)


def test_conditional_create_per_backend(any_backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    s = _storage(any_backend)
    mode = s.conditional_create_mode("run/epochs")
    assert mode == EXPECTED_MODE[any_backend.scheme]
    out = capsys.readouterr().out
    assert "storage_conditional_create" in out and (mode == "native") == ("consequence" not in out)
    assert s.create_exclusive("run/epochs/x.json", b"first") is True
    assert s.create_exclusive("run/epochs/x.json", b"second") is False
    assert s.read_bytes("run/epochs/x.json") == b"first"
    assert s.create_exclusive("run/epochs/x.json", b"first") is True  # a retried create of our own record
    assert not any(n.startswith(".probe") for n in s.listdir("run/epochs"))  # the probe cleaned up


def _claim(s: Storage, world: int) -> tuple[Any, int]:
    return claim_epoch(s, "run", lambda n, mode: new_record(n, mode, base_step=-1, base_epoch=-1, world_size=1,
                                                            rdzv_id=f"world{world}", rdzv_round=0))


@pytest.mark.parametrize("scheme", ["file", "s3", "memory"])
def test_simultaneous_claims_never_share_an_epoch(scheme: str, request: pytest.FixtureRequest) -> None:
    b = (Backend("memory", f"memory://tg-{uuid.uuid4().hex[:8]}", {}) if scheme == "memory"
         else request.getfixturevalue(f"{scheme}_backend"))
    n = 6
    stores = [_storage(b) for _ in range(n)]  # one client per "host"
    for s in stores:
        s.conditional_create_mode("run/epochs")  # probe before the race
    got: list[Any] = []
    lost = 0
    for _ in range(3):  # rounds of n claimers released together
        gate = threading.Barrier(n)
        this: list[Any] = [None] * n

        def go(i: int, this: list[Any] = this, gate: threading.Barrier = gate) -> None:
            gate.wait(10)
            this[i] = _claim(stores[i], i)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        got += [rec for rec, _ in this]
        lost += sum(conflicts for _, conflicts in this)
    assert sorted(rec.epoch for rec in got) == list(range(1, 3 * n + 1))  # all distinct, no gap
    if scheme != "memory":  # (memory claims take microseconds under one lock: they rarely overlap)
        assert lost >= 1  # they really raced
    for rec in got:
        assert read_record(stores[0], "run", rec.epoch).world_id == rec.world_id
        if rec.epoch < 3 * n:
            with pytest.raises(FencedError):
                check_owner(stores[0], "run", rec)
    check_owner(stores[0], "run", max(got, key=lambda r: r.epoch))


def test_readback_fallback_race_is_measured_and_the_loser_cannot_commit(gs_backend: Backend) -> None:
    """The GCS emulator ignores ifGenerationMatch=0: claims use write, wait, read back. Two claimers
    released together both win the same number in some rounds; the commit-time check (the record
    must still name this world) then refuses all but one of them."""
    rounds, double_wins = 8, 0
    for r in range(rounds):
        run = f"run{r}"
        stores = [_storage(gs_backend), _storage(gs_backend)]
        for s in stores:
            assert s.conditional_create_mode(f"{run}/epochs") == "readback"
        gate = threading.Barrier(2)
        got: list[Any] = [None, None]

        def go(i: int, run: str = run) -> None:
            gate.wait(10)
            got[i] = claim_epoch(stores[i], run, lambda n, mode: new_record(
                n, mode, base_step=-1, base_epoch=-1, world_size=1, rdzv_id=f"w{i}", rdzv_round=0))[0]

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        a, b = got
        double_wins += a.epoch == b.epoch
        may_commit = []
        for rec in (a, b):
            try:
                check_owner(stores[0], run, rec)
                may_commit.append(rec.world_id)
            except FencedError:
                pass
        assert len(may_commit) == 1, (a, b)  # never two writers past the commit-time check
    print(f"gcs emulator read-back fallback: {double_wins}/{rounds} rounds had both claimers read back their own "
          f"record for the same epoch (a double win); in all {rounds} rounds exactly one writer passed the "
          f"commit-time check")
    # The double win forced: B's write lands after A read its record back. A is refused at commit.
    s = _storage(gs_backend)
    a = _claim(s, 0)[0]
    b = new_record(a.epoch, "readback", base_step=-1, base_epoch=-1, world_size=1, rdzv_id="late", rdzv_round=0)
    s.write_bytes_atomic(f"run/epochs/epoch-{a.epoch:012d}.json", b.to_json())
    with pytest.raises(FencedError, match=f"record of epoch {a.epoch} now names world {b.world_id}"):
        check_owner(s, "run", a)
    check_owner(s, "run", b)


def _save(mgr: CheckpointManager, step: int, model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.weight.fill_(float(step))
    mgr.save(step, {"model": ModelOptimizerState(model)}, block=True)


def test_relaunch_after_reformation_on_a_fresh_store(storage_backend: Backend) -> None:
    """Issue 10, bug 1: round 1 before the relaunch, round 0 after it. No crash loop, nothing lost."""
    cfg = CheckpointConfig(url=storage_backend.url, storage_options=storage_backend.storage_options, keep_last=10)
    model = torch.nn.Linear(4, 4)

    def world(rdzv_round: int) -> CheckpointManager:
        return CheckpointManager(cfg, "job", rank=0, world_size=1, rdzv_id="job", rdzv_round=rdzv_round)

    first = world(0)
    _save(first, 1, model)
    _save(first, 2, model)
    reformed = world(1)  # a node left: the world re-forms at round 1 (new worker processes)
    assert reformed.restore({"model": ModelOptimizerState(model)}) == 2
    _save(reformed, 3, model)
    _save(reformed, 4, model)
    committed_before = [(i.step, i.epoch) for i in reformed.list()]
    # Every node is preempted; the job is relaunched with the same id on a fresh rendezvous store.
    relaunched = world(0)
    with torch.no_grad():
        model.weight.zero_()
    assert relaunched.restore({"model": ModelOptimizerState(model)}) == 4 and float(model.weight[0, 0]) == 4.0
    _save(relaunched, 5, model)
    _save(relaunched, 6, model)
    assert not relaunched.fenced and relaunched.wait() == 6
    infos = [(i.step, i.epoch) for i in relaunched.list()]
    assert infos == committed_before + [(5, 3), (6, 3)]  # nothing deleted, new checkpoints committed
    scan = scan_run(relaunched.storage, "job")
    epochs = [(e, r.rdzv_round, r.base_step) for e, r in sorted(scan.epochs.items())]
    assert epochs == [(1, 0, -1), (2, 1, 2), (3, 0, 4)]  # rounds went back to 0; epochs only grew
    with pytest.raises(FencedError, match="epoch 2 is older than epoch 3"):  # the dead world cannot come back
        _save(reformed, 7, model)
    for m in (first, reformed, relaunched):
        m.close()
