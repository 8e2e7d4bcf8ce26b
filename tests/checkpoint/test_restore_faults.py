""""Unreadable now" is not "proven corrupt": restore against moto S3 behind a fault-injecting HTTP proxy.

The storage answers 503, stalls, or refuses (403) requests for the newest step. Restore retries what is
unreadable now until ``restore_deadline_s`` and then either restores the newest step (reads recovered)
or fails with a clear error (or falls back, if configured, without marking anything); in no case is a
step deleted, and a failed restore leaves the bucket exactly as it was.
"""

from __future__ import annotations

import threading
from typing import Any

import fsspec
import pytest
import torch

from tests.fixtures.http_faults import HttpFaultProxy, http_fault_proxy_factory  # noqa: F401
from tests.fixtures.storage import Server, make_bucket, s3_options
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import StorageError
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.state import ModelOptimizerState

pytestmark = pytest.mark.timeout(90)
NEWEST_SHARD = r"GET /tg-[0-9a-f]+/ckpt/run/step-000000000002-e000000000001/__0_0\.distcp"


def _opts(endpoint: str, read_timeout: float = 5) -> dict[str, Any]:
    o = s3_options(endpoint)
    o["config_kwargs"] = {"connect_timeout": 2, "read_timeout": read_timeout, "retries": {"max_attempts": 1}}
    return o


def _objects(bucket: str, direct: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Every object in the bucket with its size and ETag (what "exactly as it was" compares)."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **direct)
    return {p: (int(i["size"]), str(i.get("ETag"))) for p, i in fs.find(bucket, detail=True).items()}


@pytest.fixture
def run(moto_server: Server, s3_env: None, http_fault_proxy_factory: Any) -> dict[str, Any]:  # noqa: F811
    """Steps 1 and 2 committed (epoch 1) through the direct endpoint; a proxy to restore through."""
    direct = s3_options(moto_server.endpoint)
    bucket = make_bucket("s3", direct)
    url = f"s3://{bucket}/ckpt"
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with CheckpointManager(CheckpointConfig(url=url, storage_options=direct, keep_last=10), "run", rank=0,
                           world_size=1) as mgr:
        mgr.save(1, {"model": ModelOptimizerState(model)}, block=True)
        with torch.no_grad():
            model.weight.add_(1)
        mgr.save(2, {"model": ModelOptimizerState(model)}, block=True)
    proxy: HttpFaultProxy = http_fault_proxy_factory(moto_server.port)
    return {"url": url, "bucket": bucket, "direct": direct, "proxy": proxy, "step2": model.weight.detach().clone()}


def _manager(run: dict[str, Any], **cfg: Any) -> CheckpointManager:
    read_timeout = cfg.pop("read_timeout", 5)
    c = CheckpointConfig(url=run["url"], storage_options=_opts(run["proxy"].endpoint, read_timeout), keep_last=10,
                         retry_attempts=2, retry_deadline_s=2, **cfg)
    return CheckpointManager(c, "run", rank=0, world_size=1)


def _fresh() -> tuple[dict[str, Any], torch.nn.Module]:
    m = torch.nn.Linear(64, 64)
    with torch.no_grad():
        m.weight.zero_()
    return {"model": ModelOptimizerState(m)}, m


def _steps(objects: dict[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
    return {k: v for k, v in objects.items() if "/step-" in k}


def test_503_on_the_newest_step_is_retried_until_reads_recover(run: dict[str, Any],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    before = _objects(run["bucket"], run["direct"])
    rule = run["proxy"].fail(NEWEST_SHARD, status=503)
    recover = threading.Timer(3.0, run["proxy"].clear)
    recover.daemon = True
    recover.start()
    state, m = _fresh()
    try:
        with _manager(run, restore_deadline_s=60) as mgr:
            assert mgr.restore(state) == 2  # the newest step, not a fallback
    finally:
        recover.cancel()
    assert rule.hits >= 2 and torch.equal(m.weight, run["step2"])
    out = capsys.readouterr().out
    assert "checkpoint_restore_unreadable" in out and "checkpoint_restore_fallback" not in out
    after = _objects(run["bucket"], run["direct"])
    assert _steps(after) == _steps(before)  # nothing deleted or rewritten; only an epoch record added
    assert sorted(set(after) - set(before)) == [f"{run['bucket']}/ckpt/run/epochs/epoch-000000000002.json"]


def test_a_stalling_newest_step_is_restored_once_it_answers(run: dict[str, Any]) -> None:
    rule = run["proxy"].stall(NEWEST_SHARD, 2.5, times=3)  # longer than the client's 1 s read timeout
    state, m = _fresh()
    with _manager(run, restore_deadline_s=60, read_timeout=1) as mgr:
        assert mgr.restore(state) == 2
    assert rule.hits == 3 and torch.equal(m.weight, run["step2"])


def test_outage_during_restore_fails_clearly_and_leaves_the_bucket_as_it_was(run: dict[str, Any]) -> None:
    before = _objects(run["bucket"], run["direct"])
    run["proxy"].fail(NEWEST_SHARD, status=503)  # the newest step never comes back within the deadline
    with _manager(run, restore_deadline_s=3) as mgr, pytest.raises(
            StorageError, match=r"restore failed: step 2 .* unreadable now.*Nothing in storage was changed.*Fix:"):
        mgr.restore(_fresh()[0])
    run["proxy"].fail(r".", status=503)  # a full outage: even the listing fails
    with _manager(run, restore_deadline_s=2) as mgr, pytest.raises(StorageError, match=r"list .* failed.*Fix:"):
        mgr.restore(_fresh()[0])
    assert _objects(run["bucket"], run["direct"]) == before  # exactly as it was: not even an epoch record


def test_fallback_when_configured_marks_and_deletes_nothing(run: dict[str, Any]) -> None:
    run["proxy"].fail(NEWEST_SHARD, status=503)
    state, m = _fresh()
    with _manager(run, restore_deadline_s=2, on_unreadable="fallback") as mgr:
        assert mgr.restore(state) == 1
        run["proxy"].clear()
        mgr.save(3, state, block=True)
        infos = {(i.step, i.epoch): i.in_lineage for i in mgr.list()}
    assert infos == {(1, 1): True, (2, 1): False, (3, 2): True}  # step 2 kept (a branch), not stale-deleted


def test_permission_denied_fails_at_once_with_the_fix_or_falls_back(run: dict[str, Any]) -> None:
    before = _objects(run["bucket"], run["direct"])
    rule = run["proxy"].fail(NEWEST_SHARD, status=403)
    # restore_deadline_s is far beyond the test timeout: a permission error is not waited on.
    with _manager(run, restore_deadline_s=600) as mgr, pytest.raises(
            StorageError, match=r"step 2 .* unreadable: .*permission denied.*Fix: check that the credentials"):
        mgr.restore(_fresh()[0])
    assert rule.hits >= 1 and _objects(run["bucket"], run["direct"]) == before
    with _manager(run, restore_deadline_s=600, on_unreadable="fallback") as mgr:
        assert mgr.restore(_fresh()[0]) == 1
