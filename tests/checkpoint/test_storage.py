"""Storage wrapper: DCP-over-fsspec bugs on the real emulators, transient classification, retries,
storage server dying mid-save, the CLI."""

from __future__ import annotations

import argparse
import io
import json
import os
import uuid

import pytest
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from tests.fixtures.storage import Backend, Server, make_bucket, s3_options
from trainguard.checkpoint import cli
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import StorageError
from trainguard.checkpoint.discovery import scan_run
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manifest import MANIFEST_NAME, step_dir
from trainguard.checkpoint.state import ModelOptimizerState
from trainguard.checkpoint.storage import Storage, is_transient

pytestmark = pytest.mark.timeout(90)


def _state(seed: int = 0, width: int = 256) -> tuple[dict, torch.nn.Module]:
    torch.manual_seed(seed)
    m = torch.nn.Linear(width, width)
    return {"model": ModelOptimizerState(m)}, m


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_remote_writes_are_flushed_and_never_call_fileno_or_os_sync(backend: str, request: pytest.FixtureRequest,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    b: Backend = request.getfixturevalue(f"{backend}_backend")
    storage = Storage(b.url, b.storage_options)
    # pytorch#142396's precondition: the backend's file object has fileno, and calling it fails.
    f = storage.fs.open(storage.path("probe"), "wb")
    with pytest.raises((io.UnsupportedOperation, AttributeError, OSError)):
        f.fileno()
    f.discard() if hasattr(f, "discard") else f.close()

    def no_sync() -> None:
        raise AssertionError("os.sync() called: pytorch#142396/#183878 fallback reached")

    monkeypatch.setattr(os, "sync", no_sync)
    state, m = _state()
    with CheckpointManager(CheckpointConfig(url=b.url, storage_options=b.storage_options), "run", rank=0,
                           world_size=1) as mgr:
        mgr.save(1, state, block=True)
        man = scan_run(mgr.storage, "run").manifests()[0]
        for fe in man.files:  # pytorch#183878: every byte reached the server
            assert mgr.storage.size(f"run/{step_dir(1, 1)}/{fe.path}") == fe.size
            assert mgr.storage.crc32(f"run/{step_dir(1, 1)}/{fe.path}") == (fe.size, fe.crc32)
        expected = m.weight.detach().clone()
        with torch.no_grad():
            m.weight.zero_()
        assert mgr.restore(state) == 1
    assert torch.equal(m.weight, expected)


class _LossyFile(MemoryFile):
    """Simulates pytorch#183878: the last buffered bytes never reach the store on close."""

    def close(self) -> None:
        self.truncate(max(0, len(self.getvalue()) - 100))


class _LossyFS(MemoryFileSystem):
    protocol = ("lossymem",)
    store: dict = {}
    pseudo_dirs = [""]

    def _open(self, path: str, mode: str = "rb", **kw: object) -> object:
        if "w" in mode and path.endswith(".distcp"):
            f = _LossyFile(self, self._strip_protocol(path))
            f.commit()
            return f
        return super()._open(path, mode, **kw)


def test_dropped_buffer_is_detected_and_nothing_is_committed() -> None:
    import fsspec

    fsspec.register_implementation("lossymem", _LossyFS, clobber=True)
    url = f"lossymem://tg-{uuid.uuid4().hex[:8]}"
    storage = Storage(url, retry_attempts=2, retry_deadline_s=5, backoff_base_s=0.01)
    state, _ = _state()
    cfg = CheckpointConfig(url="memory://unused", retry_attempts=2, retry_deadline_s=5)
    with CheckpointManager(cfg, "run", rank=0,
                           world_size=1, storage=storage) as mgr:
        with pytest.raises(StorageError, match="183878"):
            mgr.save(1, state, block=True)
        assert mgr.latest() is None
        assert not storage.exists(f"run/{step_dir(1, 1)}/{MANIFEST_NAME}")


class _Code(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@pytest.mark.parametrize(("exc", "transient"), [
    (ConnectionResetError(), True), (TimeoutError(), True), (OSError("connection reset"), True),
    (_Code(503), True), (_Code(429), True), (_Code(404), False), (_Code(403), False),
    (FileNotFoundError("x"), False), (PermissionError("x"), False), (ValueError("x"), False),
    (StorageError("x", transient=True), True), (StorageError("x"), False),
    (type("ServerDisconnectedError", (Exception,), {})(), True),
])
def test_is_transient(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


def test_retry_backs_off_logs_and_gives_up(capsys: pytest.CaptureFixture[str]) -> None:
    s = Storage("memory://x", retry_attempts=3, retry_deadline_s=10, backoff_base_s=0.001)
    calls = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return 7

    assert s.retry("read", "a/b", flaky) == 7 and len(calls) == 3
    with pytest.raises(StorageError, match=r"read memory://x/a/b failed after 3 attempt\(s\).*Fix:"):
        s.retry("read", "a/b", lambda: (_ for _ in ()).throw(ConnectionResetError("down")))
    with pytest.raises(FileNotFoundError):  # permanent: one attempt, re-raised as is
        s.retry("read", "a/b", lambda: (_ for _ in ()).throw(FileNotFoundError("gone")))
    out = capsys.readouterr().out
    assert out.count("storage_retry") == 5 and "secret" not in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_s3_server_dies_mid_save(moto_server: Server, s3_env: None, chaos_proxy_factory) -> None:
    proxy = chaos_proxy_factory(moto_server.port)
    opts = s3_options(proxy.endpoint)
    bucket = make_bucket("s3", s3_options(moto_server.endpoint))
    url = f"s3://{bucket}/ckpt"
    cfg = CheckpointConfig(url=url, storage_options=opts, retry_attempts=2, retry_deadline_s=4)
    state, m = _state(width=512)  # ~1 MiB shard
    with CheckpointManager(cfg, "run", rank=0, world_size=1) as mgr:
        mgr.save(1, state)
        assert mgr.wait(60) == 1
        step1 = m.weight.detach().clone()
        with torch.no_grad():
            m.weight.add_(1)
        proxy.die_after(200_000)  # the server goes away in the middle of the shard upload, for good
        mgr.save(2, state)
        with pytest.raises(StorageError, match=r"step 2.*untouched"):
            mgr.wait(60)
        assert proxy.kills >= 1
        proxy.revive()
        assert mgr.latest() == 1 and [i.step for i in mgr.list()] == [1]
        with torch.no_grad():
            m.weight.zero_()
        assert mgr.restore(state) == 1 and torch.equal(m.weight, step1)
        proxy.die_after(200_000, once=True)  # a transient reset: retried, then committed
        mgr.save(3, state)
        assert mgr.wait(60) == 3
        assert [i.step for i in mgr.list()] == [1, 3]


def test_cli_ls_shows_epochs_and_lineage_and_show(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "ck")
    state, _ = _state(width=8)
    with CheckpointManager(CheckpointConfig(url=url), "myrun", rank=0, world_size=1, rdzv_id="job",
                           rdzv_round=4) as mgr:
        mgr.save(10, state, block=True)
        mgr.save(20, state, kind="emergency", block=True)
    with CheckpointManager(CheckpointConfig(url=url), "myrun", rank=0, world_size=1, rdzv_id="job",
                           rdzv_round=0) as mgr:  # a fresh rendezvous store: round 0, epoch 2
        assert mgr.restore(state, step=10) == 10  # branches away from 20
        mgr.save(15, state, block=True)
    (tmp_path / "ck" / "myrun" / step_dir(30, 2)).mkdir()  # half-written
    (tmp_path / "ck" / "myrun" / "step-²").mkdir()  # stray names: ignored, never touched
    (tmp_path / "ck" / "myrun" / "notes.txt").write_text("x")
    parser = argparse.ArgumentParser(prog="trainguard")
    cli.register(parser.add_subparsers(dest="cmd"))
    capsys.readouterr()  # drop the manager's log lines

    def run(*argv: str) -> tuple[int, str]:
        args = parser.parse_args(list(argv))
        rc = args.func(args)
        cap = capsys.readouterr()
        return rc, cap.out + cap.err

    rc, out = run("checkpoints", "ls", url)
    assert rc == 0 and "Traceback" not in out
    out = out[out.index("run myrun at"):]  # (an unconfigured logger prints to stdout too)
    assert "restore lineage (epoch 2): 10@e1 -> 15@e2" in out
    lines = out.splitlines()
    epochs = [ln.split() for ln in lines if ln.split()[:1] in (["1"], ["2"]) and ("owner" in ln or "fenced" in ln)]
    assert [e[:4] for e in epochs] == [["2", "owner", "10@e1", "1"], ["1", "fenced", "scratch", "2"]]
    assert "job round 0" in out and "job round 4" in out
    steps = {(ln.split()[0], ln.split()[1]): ln.split()[3] for ln in lines if " committed " in ln}
    assert steps == {("10", "1"): "restore", ("15", "2"): "restore", ("20", "1"): "branch"}
    assert "uncommitted" not in out and "step-²" not in out
    rc, out = run("checkpoints", "ls", url, "--all", "--json")
    doc = json.loads(out[out.index('{\n "'):])
    assert rc == 0 and [(s["step"], s["epoch"], s["status"]) for s in doc["steps"]] == [
        (10, 1, "committed"), (15, 2, "committed"), (20, 1, "committed"), (30, 2, "uncommitted")]
    assert doc["lineage"] == [{"step": 10, "epoch": 1}, {"step": 15, "epoch": 2}] and doc["newest_epoch"] == 2
    assert doc["ignored"] == ["notes.txt", "step-²"]
    assert [(e["epoch"], e["rdzv_round"], e["base_step"]) for e in doc["epochs"]] == [(2, 0, 10), (1, 4, -1)]
    rc, out = run("checkpoints", "show", url, "20", "--run-id", "myrun")
    assert rc == 0 and "__0_0.distcp" in out and "epoch       1" in out
    rc, out = run("checkpoints", "show", url, "20", "--json")
    assert rc == 0 and json.loads(out)["kind"] == "emergency"
    rc, out = run("checkpoints", "show", url, "30")
    assert rc == 1 and "error:" in out and "does not exist" in out and "Traceback" not in out
    rc, out = run("checkpoints", "show", url, "99")
    assert rc == 1 and "step 99 does not exist" in out
