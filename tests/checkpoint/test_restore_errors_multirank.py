"""Bad input during a 2-rank restore ends as a clear error on *every* rank: no traceback, no rank left
waiting in a collective (the test timeout bounds it). Real moto S3 behind the fault-injecting proxy.

* ``stray``: ``step-²``, ``step-abc``, ``step-12`` next to real steps: ignored (logged), newest restored;
* ``dotdot``: the newest manifest lists ``../../escape``: proven corrupt, the previous step is restored;
* ``absolute``: the only manifest lists ``/etc/passwd``: ``CheckpointCorrupt`` naming it, with the fix;
* ``denied``: the newest shard answers 403 AccessDenied (s3fs: ``PermissionError``) — on rank 1 only,
  which verifies that file — ``StorageError`` with the credentials fix on both ranks, at once.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec
import pytest
import torch

from tests.checkpoint._launch import opts_arg, run_world
from tests.fixtures.http_faults import http_fault_proxy_factory  # noqa: F401
from tests.fixtures.storage import Server, make_bucket, s3_options
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manifest import MANIFEST_NAME, step_dir
from trainguard.checkpoint.state import ModelOptimizerState

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _prepare(url: str, opts: dict[str, Any], run: str, steps: int = 2) -> None:
    model = torch.nn.Linear(16, 16)
    with CheckpointManager(CheckpointConfig(url=url, storage_options=opts), run, rank=0, world_size=1) as mgr:
        for s in range(1, steps + 1):
            mgr.save(s, {"model": ModelOptimizerState(model)}, block=True)


def _rewrite_path(fs: Any, manifest: str, new_path: str) -> None:
    d = json.loads(fs.cat_file(manifest))
    d["files"][0]["path"] = new_path
    fs.pipe_file(manifest, json.dumps(d).encode())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_errors_reach_every_rank_clearly(moto_server: Server, s3_env: None,
                                         http_fault_proxy_factory: Any) -> None:  # noqa: F811
    direct = s3_options(moto_server.endpoint)
    bucket = make_bucket("s3", direct)
    url = f"s3://{bucket}/ckpt"
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **direct)
    for run in ("stray", "dotdot", "denied"):
        _prepare(url, direct, run)
    _prepare(url, direct, "absolute", steps=1)
    for junk in ("step-²", "step-abc", "step-12"):
        fs.pipe_file(f"{bucket}/ckpt/stray/{junk}/x", b"junk")
    _rewrite_path(fs, f"{bucket}/ckpt/dotdot/{step_dir(2, 1)}/{MANIFEST_NAME}", "../../escape")
    _rewrite_path(fs, f"{bucket}/ckpt/absolute/{step_dir(1, 1)}/{MANIFEST_NAME}", "/etc/passwd")
    proxy = http_fault_proxy_factory(moto_server.port)
    rule = proxy.fail(rf"GET /{bucket}/ckpt/denied/{step_dir(2, 1)}/__0_0\.distcp", status=403)
    opts = s3_options(proxy.endpoint)

    results = run_world("_mp_errors.py", 2, ["--url", url, "--opts", opts_arg(opts),
                                              "--runs", "stray,dotdot,absolute,denied"], env=ENV, timeout=150)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0 and "Traceback" not in out, f"rank {rank} rc={rc}\n{out[-4000:]}"
    got = {(r["run"], r["rank"]): r for _, out in results for line in out.splitlines() if line.startswith("RESULT ")
           for r in [json.loads(line[len("RESULT "):])]}
    assert set(got) == {(run, rank) for run in ("stray", "dotdot", "absolute", "denied") for rank in (0, 1)}
    for rank in (0, 1):
        assert got["stray", rank]["step"] == 2 and got["stray", rank]["error"] is None
        assert got["dotdot", rank]["step"] == 1 and got["dotdot", rank]["error"] is None
        absolute = got["absolute", rank]
        assert absolute["error"] == "CheckpointCorrupt"
        assert "'/etc/passwd' is absolute" in absolute["message"] and "Fix: delete those step directories" in \
            absolute["message"]
        denied = got["denied", rank]
        assert denied["error"] == "StorageError" and "permission denied" in denied["message"]
        assert "Fix: check that the credentials may read" in denied["message"]
    assert got["denied", 0]["message"] == got["denied", 1]["message"]  # rank 0 learnt rank 1's failure
    assert rule.hits >= 1
    logs = results[0][1]
    assert "checkpoint_names_ignored" in logs and "step-abc" in logs and "step-12" in logs
    assert "'..' component" in logs  # the dotdot manifest is named, with the reason
    assert fs.exists(f"{bucket}/ckpt/dotdot/{step_dir(2, 1)}/{MANIFEST_NAME}")  # nothing deleted by restores
