"""Waiting for the previous background save is bounded (issue 19): a persist stuck in a collective
with a vanished peer, or in a storage call that never returns, makes the next save raise
:class:`InflightTimeout` after ``inflight_timeout_s`` instead of hanging; ``close()`` gives up on it
too; the last committed step stands."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import CheckpointError, InflightTimeout
from trainguard.checkpoint.manager import CheckpointManager


def test_stuck_background_save_is_bounded(tmp_path):
    m = CheckpointManager(CheckpointConfig(url=str(tmp_path / "ckpt"), async_save=True), "run", rank=0,
                          world_size=1, inflight_timeout_s=0.5)
    state = {"w": {"t": torch.ones(4)}}
    m.save(1, state)
    assert m.wait() == 1
    release = threading.Event()
    real = m._persist

    def stuck(*a):  # a persist that hangs (until the test releases it)
        release.wait(60)
        return real(*a)

    m._persist = stuck
    try:
        m.save(2, state)
        t0 = time.monotonic()
        with pytest.raises(InflightTimeout, match="step 2 .* still running after 0.5s.*last committed step stands") as e:
            m.save(3, state)
        assert isinstance(e.value, CheckpointError)
        assert 0.4 <= time.monotonic() - t0 < 10
        assert m.pending is not None  # still in flight: it may yet finish
        t0 = time.monotonic()
        m.close()  # gives up on it, no hang
        assert time.monotonic() - t0 < 10
    finally:
        release.set()
    assert [d.name for d in sorted((tmp_path / "ckpt" / "run").glob("step-*"))
            if (d / "manifest.json").exists()][0].startswith("step-000000000001")
