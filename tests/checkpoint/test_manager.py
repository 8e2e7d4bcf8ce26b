"""Single-process manager tests: async correctness, in-flight rule, retention, epochs and fencing,
faults, SaveResult figures."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.checkpoint._launch import ROOT, child_env
from trainguard.checkpoint import storage as storage_mod
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.discovery import StepRef, scan_run
from trainguard.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    FencedError,
    SaveCancelled,
)
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manifest import step_dir
from trainguard.checkpoint.state import ModelOptimizerState, TrainerState

pytestmark = pytest.mark.timeout(60)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    return m, opt


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, n: int = 1) -> None:
    for _ in range(n):
        opt.zero_grad()
        m(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()


def _snapshot(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    import copy

    return copy.deepcopy({"m": m.state_dict(), "o": opt.state_dict()})


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not isinstance(y, dict) or not _same(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _mgr(url: str, *, hook=None, **cfg: object) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(url=url, **cfg), "run", rank=0, world_size=1, fault_hook=hook)


def _restore_fresh(mgr: CheckpointManager, step: int | None = None) -> tuple[int | None, dict]:
    m, opt = _model()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    got = mgr.restore({"model": ModelOptimizerState(m, opt)}, step)
    return got, _snapshot(m, opt)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return str(tmp_path / "ckpt")


class _Gate:
    """Blocks the background writer at its first write until released (no sleeps)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        orig = storage_mod._DigestWriter.write

        def write(w: storage_mod._DigestWriter, b: object) -> int:
            if threading.current_thread() is not threading.main_thread():
                self.entered.set()
                assert self.release.wait(30), "gate never released"
            return orig(w, b)

        monkeypatch.setattr(storage_mod._DigestWriter, "write", write)


def test_async_save_is_the_state_at_save_time(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    m, opt = _model()
    _train(m, opt)
    gate = _Gate(monkeypatch)
    with _mgr(url) as mgr:
        expected = _snapshot(m, opt)
        mgr.save(1, {"model": ModelOptimizerState(m, opt)})
        assert gate.entered.wait(30)
        assert mgr.in_flight == 1  # persisting is under way ...
        _train(m, opt, 3)  # ... while training mutates parameters and optimizer state in place
        assert not _same(expected, _snapshot(m, opt))
        gate.release.set()
        assert mgr.wait(30) == 1
        got, restored = _restore_fresh(mgr)
    assert got == 1 and _same(expected, restored)


def test_new_save_waits_for_inflight_and_buffers_are_reused(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    m, opt = _model()
    _train(m, opt)
    gate = _Gate(monkeypatch)
    with _mgr(url) as mgr:
        state = {"model": ModelOptimizerState(m, opt)}
        mgr.save(1, state)
        assert gate.entered.wait(30)
        returned = threading.Event()
        t = threading.Thread(target=lambda: (mgr.save(2, state, kind="emergency"), returned.set()))
        t.start()
        assert not returned.wait(0.5), "second save returned while the first was still in flight"
        gate.release.set()
        t.join(30)
        assert returned.is_set()
        assert mgr.wait(30) == 2
        mgr.save(3, state)
        mgr.wait(30)
        assert [(i.step, i.kind) for i in mgr.list()] == [(1, "periodic"), (2, "emergency"), (3, "periodic")]
        params = sum(p.numel() * 4 for p in m.parameters())
        assert mgr.staging_rebuilds == 1  # one allocation, reused by saves 2 and 3
        assert params * 3 <= mgr.staging_bytes <= params * 3 + 64  # params + exp_avg + exp_avg_sq + steps


def test_a_cancelled_save_stops_writing_commits_nothing_and_the_next_save_commits(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A world that lost a peer gives up its in-flight save (it could never commit) instead of waiting
    for its upload: the writes stop at the next slice, the half-written step holds no shard, the
    committed step stands, and the manager's next save is not cancelled."""
    m, opt = _model()
    _train(m, opt)
    state = {"model": ModelOptimizerState(m, opt)}
    with _mgr(url) as mgr:
        mgr.save(1, state)
        assert mgr.wait(30) == 1
        assert not mgr.cancel_inflight("nothing in flight")
        gate = _Gate(monkeypatch)
        mgr.save(2, state)
        assert gate.entered.wait(30)  # the background thread is about to write its first slice
        assert mgr.cancel_inflight("a peer of this world is gone")
        gate.release.set()
        with pytest.raises(SaveCancelled, match="a peer of this world is gone"):
            mgr.wait(30)
        assert [i.step for i in mgr.list()] == [1]
        step2 = Path(url) / "run" / step_dir(2, mgr.epoch)
        assert not [f for f in step2.rglob("*") if f.is_file()] if step2.exists() else True
        _train(m, opt)
        mgr.save(3, state)
        assert mgr.wait(30) == 3
        assert [i.step for i in mgr.list()] == [1, 3]
        got, _ = _restore_fresh(mgr)
    assert got == 3


def test_retention_keeps_exactly_k(url: str) -> None:
    m, opt = _model()
    with _mgr(url, keep_last=3) as mgr:
        for s in range(1, 7):
            _train(m, opt)
            mgr.save(s, {"model": ModelOptimizerState(m, opt)})
        mgr.wait(30)
        assert [i.step for i in mgr.list()] == [4, 5, 6]
    assert sorted(p.name for p in Path(url, "run").glob("step-*")) == [step_dir(s, 1) for s in (4, 5, 6)]


def test_a_stop_save_leaves_its_collection_to_the_next_commit_or_to_close(url: str) -> None:
    """``save(collect=False)`` (an emergency or resize save, whose commit the world waits for): committed,
    but rank 0 collects nothing yet; the next commit's collection covers it, else ``close()`` runs it
    (``close(collect=False)``, a survivor that re-forms in place: the next world's first commit does)."""
    m, opt = _model()
    on_disk = lambda: sorted(p.name for p in Path(url, "run").glob("step-*"))  # noqa: E731
    mgr = _mgr(url, keep_last=2)
    for s, collect in ((1, True), (2, True), (3, False)):
        _train(m, opt)
        mgr.save(s, {"model": ModelOptimizerState(m, opt)}, block=True, collect=collect)
    assert [i.step for i in mgr.list()] == [1, 2, 3]  # step 1 is past keep_last, still there
    _train(m, opt)
    mgr.save(4, {"model": ModelOptimizerState(m, opt)}, collect=True)  # a later commit collects it all
    mgr.wait(30)
    assert on_disk() == [step_dir(s, 1) for s in (3, 4)]
    _train(m, opt)
    mgr.save(5, {"model": ModelOptimizerState(m, opt)}, kind="emergency", collect=False)
    assert mgr.wait(30) == 5
    assert on_disk() == [step_dir(s, 1) for s in (3, 4, 5)]
    mgr.close()  # the owed collection runs here
    assert on_disk() == [step_dir(s, 1) for s in (4, 5)]
    mgr.close()
    # A survivor's world (epoch 2, descending from step 5) and the next one (epoch 3), as re-formed in place.
    cfg = CheckpointConfig(url=url, keep_last=2)
    survivor = CheckpointManager(cfg, "run", rank=0, world_size=1, base=mgr.base)
    for s in (6, 7):
        _train(m, opt)
        survivor.save(s, {"model": ModelOptimizerState(m, opt)}, kind="emergency", collect=False)
        survivor.wait(30)
    survivor.close(collect=False)  # left to the next world's first commit
    assert on_disk() == [step_dir(4, 1), step_dir(5, 1), step_dir(6, 2), step_dir(7, 2)]
    nxt = CheckpointManager(cfg, "run", rank=0, world_size=1, base=survivor.base)
    _train(m, opt)
    nxt.save(8, {"model": ModelOptimizerState(m, opt)})
    nxt.close()
    assert on_disk() == [step_dir(7, 2), step_dir(8, 3)]


@pytest.mark.parametrize("verify", [True, False])  # caught by the size check, or by the load + a proof
def test_truncated_shard_falls_back_to_previous_step(url: str, verify: bool) -> None:
    m, opt = _model()
    with _mgr(url) as mgr:
        _train(m, opt)
        mgr.save(1, {"model": ModelOptimizerState(m, opt)}, block=True)
        step1 = _snapshot(m, opt)
        _train(m, opt)
        mgr.save(2, {"model": ModelOptimizerState(m, opt)}, block=True)
    shard = Path(url, "run", step_dir(2, 1), "__0_0.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with _mgr(url, verify=verify) as mgr:
        got, restored = _restore_fresh(mgr)
        assert got == 1 and _same(step1, restored)
        assert mgr.epoch == 2 and mgr.epoch_record.base_step == 1  # the new epoch branches from step 1
        assert mgr.latest() == 1
        assert shard.exists()  # restore never deletes evidence ...
        assert (mgr.last_restore_corrupt, mgr.last_restore_skipped) == (1, 2)  # what the worker's metrics count
        damaged = shard.read_bytes()
        mgr.save(3, {"model": ModelOptimizerState(m, opt)}, block=True)
    assert not shard.parent.exists()  # ... the next commit moves the proven-corrupt step aside, whole
    kept = Path(url, "run", "quarantine", step_dir(2, 1))
    assert (kept / "__0_0.distcp").read_bytes() == damaged and (kept / "manifest.json").exists()
    assert sorted(p.name for p in Path(url, "run").glob("step-*")) == [step_dir(1, 1), step_dir(3, 2)]
    scan = scan_run(storage_mod.Storage(url), "run")
    assert scan.quarantined == [StepRef(2, 1)] and not scan.ignored and sorted(scan.committed) == [StepRef(1, 1),
                                                                                                  StepRef(3, 2)]


def _corrupt_newest(url: str, opts: dict, step: int, epoch: int) -> None:
    from trainguard.checkpoint.storage import Storage

    st = Storage(url, opts)
    rel = f"run/{step_dir(step, epoch)}/__0_0.distcp"
    data = bytearray(st.read_bytes(rel))
    data[len(data) // 2] ^= 0xFF
    st.fs.pipe_file(st.path(rel), bytes(data))


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_corrupt_steps_are_quarantined_with_retention(url: str, backend: str, request: pytest.FixtureRequest) -> None:
    """Each corrupt newest step is moved to quarantine/ by the next commit, files and manifest intact
    (an object store copies, manifest last); quarantine_keep=2 keeps the newest two; committed steps
    are never touched."""
    from trainguard.checkpoint.storage import Storage

    if backend == "s3":
        b = request.getfixturevalue("s3_backend")
        url, opts = b.url, b.storage_options
    else:
        opts = {}
    m, opt = _model()
    epoch = 1
    for n in range(3):  # three rounds: commit a step, corrupt it, restore the older one, commit again
        with CheckpointManager(CheckpointConfig(url=url, storage_options=opts, quarantine_keep=2, keep_last=10), "run",
                               rank=0, world_size=1) as mgr:
            if n:
                got, _ = _restore_fresh(mgr)
                assert got == 10 * n - 5 and mgr.last_restore_corrupt == 1 and mgr.last_restore_skipped == 10 * n
                epoch = mgr.epoch
            mgr.save(10 * n + 5, {"model": ModelOptimizerState(m, opt)}, block=True)
            mgr.save(10 * n + 10, {"model": ModelOptimizerState(m, opt)}, block=True)
        _corrupt_newest(url, opts, 10 * n + 10, epoch)
    st = Storage(url, opts)
    scan = scan_run(st, "run")
    assert [r.step for r in scan.quarantined] == [10, 20]  # quarantine_keep=2: both kept
    assert [r.step for r in sorted(scan.committed)] == [5, 15, 25, 30]  # 30 is corrupt, not yet found
    for ref in scan.quarantined:
        names = st.listdir(f"run/quarantine/{ref.name}")
        assert "manifest.json" in names and "__0_0.distcp" in names
    with CheckpointManager(CheckpointConfig(url=url, storage_options=opts, quarantine_keep=2, keep_last=10), "run",
                           rank=0, world_size=1) as mgr:
        got, _ = _restore_fresh(mgr)
        assert got == 25
        mgr.save(35, {"model": ModelOptimizerState(m, opt)}, block=True)
    scan = scan_run(st, "run")
    assert [r.step for r in scan.quarantined] == [20, 30]  # the oldest (10) expired: quarantine_keep=2
    assert [r.step for r in sorted(scan.committed)] == [5, 15, 25, 35]


def test_flipped_byte_is_caught_by_checksum(url: str) -> None:
    m, opt = _model()
    with _mgr(url) as mgr:
        mgr.save(1, {"model": ModelOptimizerState(m, opt)}, block=True)
        _train(m, opt)
        mgr.save(2, {"model": ModelOptimizerState(m, opt)}, block=True)
    shard = Path(url, "run", step_dir(2, 1), "__0_0.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with _mgr(url) as mgr:
        assert _restore_fresh(mgr)[0] == 1
    Path(url, "run", step_dir(1, 1), "__0_0.distcp").unlink()
    before = sorted(str(p) for p in Path(url).rglob("*"))
    with _mgr(url) as mgr, pytest.raises(CheckpointCorrupt, match=r"step 1 \(epoch 1\).*missing.*Nothing was changed"):
        _restore_fresh(mgr)
    assert sorted(str(p) for p in Path(url).rglob("*")) == before  # a failed restore writes nothing


def test_intact_step_that_does_not_fit_the_model_fails_clearly(url: str) -> None:
    m, opt = _model()
    with _mgr(url) as mgr:
        mgr.save(1, {"model": ModelOptimizerState(m, opt)}, block=True)
    other = torch.nn.Linear(3, 3)  # another model: the checkpoint is fine, it just does not fit
    with _mgr(url) as mgr, pytest.raises(CheckpointError, match="is intact .* but loading it .* failed.*Fix:"):
        mgr.restore({"model": ModelOptimizerState(other)})
    assert [p.name for p in Path(url, "run").glob("step-*")] == [step_dir(1, 1)]  # not skipped, not marked


def test_restore_without_checkpoints_and_unknown_step(url: str) -> None:
    with _mgr(url) as mgr:
        assert _restore_fresh(mgr)[0] is None
        assert mgr.latest() is None and mgr.list() == []
        m, opt = _model()
        mgr.save(5, {"model": ModelOptimizerState(m, opt)}, block=True)
        with pytest.raises(CheckpointNotFound, match="step 4 has no committed checkpoint"):
            _restore_fresh(mgr, 4)
        assert _restore_fresh(mgr, 5)[0] == 5


def test_stale_epoch_cannot_commit_logs_once_and_its_slipped_commit_is_a_kept_branch(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    m, opt = _model()
    state = {"model": ModelOptimizerState(m, opt)}
    old = _mgr(url)
    old.save(1, state)
    old.save(2, state)
    assert old.wait(30) == 2 and old.epoch == 1
    new = _mgr(url)
    assert _restore_fresh(new)[0] == 2 and new.epoch == 2  # the new world claims epoch 2, based on step 2
    old.save(3, state)
    with pytest.raises(FencedError, match="epoch 1 is older than epoch 2"):
        old.wait(30)
    assert old.fenced and not list(Path(url, "run").glob("step-000000000003-*"))  # refused before writing
    refused = old.save(4, state)  # the stale world keeps being refused, without raising into training
    assert refused.done() and isinstance(refused.exception(), FencedError)
    with pytest.raises(FencedError):
        old.save(4, state, block=True)
    assert capsys.readouterr().out.count("checkpoint_fenced") == 1  # one clear error, not one per save
    new.save(3, state, block=True)
    assert new.latest() == 3

    # A stale commit racing past the commit-time check (a world claims right between the check and
    # the manifest write) lands outside the newest lineage: never restored, kept for keep_last commits.
    newer: list[CheckpointManager] = []

    def claim_in_between(point: str, step: int) -> None:
        if point == "before_manifest":
            newer.append(_mgr(url, keep_last=2))
            assert _restore_fresh(newer[0])[0] == 3

    racer = _mgr(url, hook=claim_in_between)
    assert _restore_fresh(racer)[0] == 3 and racer.epoch == 3
    racer.save(7, state, block=True)  # committed by epoch 3 after epoch 4 was claimed
    slipped = Path(url, "run", step_dir(7, 3), "manifest.json")
    assert slipped.exists() and newer[0].epoch == 4
    assert newer[0].latest() == 3 and [(i.step, i.in_lineage) for i in newer[0].list()][-1] == (7, False)
    newer[0].save(4, state, block=True)
    assert slipped.exists()  # kept: the new lineage has 1 commit newer than epoch 3, keep_last is 2
    newer[0].save(5, state, block=True)
    assert not slipped.exists()  # now it has 2 ("branch"), and retention keeps 4 and 5 of the lineage
    assert sorted(p.name for p in Path(url, "run").glob("step-*")) == [step_dir(4, 4), step_dir(5, 4)]
    for x in (old, new, racer, *newer):
        x.close()


def test_half_written_step_is_collected_once_its_epoch_commits_later(url: str) -> None:
    def fail(point: str, step: int) -> None:
        if point == "before_commit" and step == 2:
            raise ConnectionResetError("injected: died between shards and manifest")

    m, opt = _model()
    state = {"model": ModelOptimizerState(m, opt)}
    with _mgr(url, hook=fail) as mgr:
        mgr.save(1, state, block=True)
        with pytest.raises(CheckpointError, match="step 2"):
            mgr.save(2, state, block=True)
        assert scan_run(mgr.storage, "run").uncommitted == [StepRef(2, 1)]
        r = mgr.save(3, state, block=True).result()
    assert not Path(url, "run", step_dir(2, 1)).exists()
    assert r.step == 3 and r.epoch == 1 and r.nbytes == r.total_bytes > 0 and r.persist_s > 0
    assert 0 <= r.stage_s <= r.blocked_s


def test_same_step_twice_in_one_epoch_keeps_the_committed_copy(url: str) -> None:
    m, opt = _model()
    with _mgr(url) as mgr:
        first = mgr.save(5, {"model": ModelOptimizerState(m, opt)}, block=True).result()
        manifest = Path(url, "run", step_dir(5, 1), "manifest.json").read_bytes()
        again = mgr.save(5, {"model": ModelOptimizerState(m, opt)}, block=True).result()
    assert again.skipped and again.nbytes == 0 and again.total_bytes == first.total_bytes
    assert Path(url, "run", step_dir(5, 1), "manifest.json").read_bytes() == manifest


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_kill_between_shards_and_manifest(url: str) -> None:
    p = subprocess.run([sys.executable, str(ROOT / "tests/checkpoint/_kill_worker.py"), url], env=child_env(),
                       capture_output=True, timeout=100)
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    assert Path(url, "run", step_dir(2, 1), "__0_0.distcp").exists()
    assert not Path(url, "run", step_dir(2, 1), "manifest.json").exists()
    with _mgr(url) as mgr:
        assert mgr.latest() == 1 and [i.step for i in mgr.list()] == [1]
        assert scan_run(mgr.storage, "run").uncommitted == [StepRef(2, 1)]
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        assert mgr.restore({"model": ModelOptimizerState(model)}) == 1
        mgr.save(3, {"model": ModelOptimizerState(model)}, block=True)
    # Epoch 1 never committed after its half-written step 2, so that directory is not provably dead
    # (GC rule (b)): it stays, invisible to discovery, and `checkpoints ls --all` lists it.
    assert sorted(p.name for p in Path(url, "run").glob("step-*")) == [step_dir(1, 1), step_dir(2, 1), step_dir(3, 2)]


def test_trainer_state_round_trip_is_bit_identical(url: str) -> None:
    import random

    import numpy as np

    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    ts = TrainerState(step=42, cursor={"epoch": 1, "samples": 4200, "perm_seed": 9}, seed=11, config_fingerprint="f1")
    with _mgr(url) as mgr:
        mgr.save(42, {"trainer": ts}, block=True)
        want = [random.random(), float(np.random.rand()), torch.rand(3)]
        back = TrainerState()
        assert mgr.restore({"trainer": back}) == 42
        got = [random.random(), float(np.random.rand()), torch.rand(3)]
    assert (back.step, back.cursor, back.seed, back.config_fingerprint) == (42, ts.cursor, 11, "f1")
    assert back.rng_restored is True and want[:2] == got[:2] and torch.equal(want[2], got[2])


def test_close_is_idempotent_and_safe_half_built(url: str) -> None:
    mgr = _mgr(url)
    mgr.close()
    mgr.close()
    with pytest.raises(Exception, match="closed"):
        mgr.save(1, {})
    with pytest.raises(Exception, match="run_id"):
        CheckpointManager(CheckpointConfig(url=url), "a/b", rank=0, world_size=1)


def test_memory_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    url = f"memory://tg-{uuid.uuid4().hex[:8]}"
    m, opt = _model()
    with _mgr(url) as mgr:
        _train(m, opt)
        mgr.save(1, {"model": ModelOptimizerState(m, opt)})
        expected = _snapshot(m, opt)
        assert mgr.wait(30) == 1
        got, restored = _restore_fresh(mgr)
    assert got == 1 and _same(expected, restored)
    assert os.environ.get("AWS_SECRET_ACCESS_KEY") in (None, os.environ.get("AWS_SECRET_ACCESS_KEY"))
