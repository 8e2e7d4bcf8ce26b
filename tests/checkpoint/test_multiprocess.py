"""Save at 2 ranks, restore at 1 and 3 ranks, on file://, s3:// (moto) and gs:// (emulator).

Checks (in ``_mp_worker.py``): model and optimizer state bit-identical to the state at save time
although training kept mutating it while the save persisted; per-rank RNG streams identical (rank 2
of 3, which did not exist, reseeds deterministically); next-step loss and parameters identical.
"""

from __future__ import annotations

import pytest

from tests.checkpoint._launch import opts_arg, run_world
from tests.fixtures.storage import Backend
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager


def _check(results: list[tuple[int, str]], what: str) -> None:
    bad = [(r, rc, out[-3000:]) for r, (rc, out) in enumerate(results) if rc != 0]
    assert not bad, f"{what}: " + "\n".join(f"--- rank {r} rc={rc}\n{out}" for r, rc, out in bad)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_save_2_restore_1_and_3(storage_backend: Backend, tmp_path) -> None:
    args = ["--url", storage_backend.url, "--opts", opts_arg(storage_backend.storage_options), "--out", str(tmp_path)]
    _check(run_world("_mp_worker.py", 2, ["--phase", "save", *args], env=storage_backend.env), "save at 2 ranks")
    mgr = CheckpointManager(CheckpointConfig(url=storage_backend.url, storage_options=storage_backend.storage_options),
                            "run", rank=0, world_size=1)
    try:
        infos = mgr.list()
        assert [(i.step, i.world_size, i.num_files) for i in infos] == [(3, 2, 3)]  # 2 shards + .metadata
    finally:
        mgr.close()
    _check(run_world("_mp_worker.py", 1, ["--phase", "restore", *args], env=storage_backend.env), "restore at 1 rank")
    _check(run_world("_mp_worker.py", 3, ["--phase", "restore", *args], env=storage_backend.env), "restore at 3 ranks")
