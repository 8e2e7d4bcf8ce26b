"""GPU tier (issue 19): the device-owning runtime, NCCL resizes with bf16, checkpoint bytes from a
non-zero GPU verified against a CPU reload, NVML readings per GPU. Skipped without 2+ GPUs (see
conftest.py); run by ``bench/gpu_smoke.sh``."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from tests.strategies._world import E2E_SIZE, continuity, losses, run_segment
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.state import ModelOptimizerState
from trainguard.runtime import Runtime
from trainguard.runtime import device as dev

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def keep_sigterm_handler():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_runtime_selects_and_binds_local_rank_gpu():
    rt = Runtime.from_env({"RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    assert rt.device == torch.device("cuda", 1)
    assert torch.cuda.current_device() == 1


@pytest.mark.parametrize("strategy,extra", [("ddp", []), ("fsdp", []), ("fsdp", ["--meta-init"])],
                         ids=["ddp", "fsdp", "fsdp-meta-init"])
def test_resize_2_1_2_on_nccl_bf16(tmp_path, strategy, extra):
    """Two ranks (cuda:0, cuda:1), one, two again, restoring from the committed checkpoints; the loss
    after each resize equals the loss of the step recomputed at the old size (bf16 tolerance)."""
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "loss.jsonl")
    precision = ["--precision", "bf16-mixed"]
    args = [*E2E_SIZE, *precision, *extra]
    run_segment(2, strategy, ckpt, steps=4, interval=2, fence=1, loss_log=log, extra=args, timeout=300)
    run_segment(1, strategy, ckpt, steps=8, interval=2, fence=2, loss_log=log, extra=args, timeout=300)
    run_segment(2, strategy, ckpt, steps=12, interval=2, fence=3, loss_log=log, extra=args, timeout=300)
    logged = losses(log)
    assert sorted(logged) == list(range(1, 13)) and all(math.isfinite(v) for v in logged.values())
    if "--meta-init" not in extra:  # a meta-built model's initial weights depend on the world size
        assert continuity(str(tmp_path), ckpt, strategy, 4, 2, logged, extra=precision) < 5e-2
        assert continuity(str(tmp_path), ckpt, strategy, 8, 1, logged, extra=precision) < 5e-2


def test_checkpoint_from_cuda1_verified_against_cpu_reload(tmp_path):
    """Staged on cuda:1 (not the default device: a synchronize on the wrong device would let the
    persist thread write before the copies landed), verified by CRC, reloaded on the CPU bit for bit."""
    device = torch.device("cuda", 1)
    dev.bind(torch.device("cuda", 0))  # the current device is NOT the one the state lives on
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(device)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(64, 1024, device=device)).sum().backward()
    opt.step()
    url = str(tmp_path / "ckpt")
    with CheckpointManager(CheckpointConfig(url=url, async_save=True), "run", rank=0, world_size=1) as mgr:
        mgr.save(1, {"model": ModelOptimizerState(model, opt)})
        with torch.no_grad():  # updates queued right after save() must not leak into the checkpoint
            for p in model.parameters():
                p.add_(1.0)
        assert mgr.wait(120) == 1
        assert mgr._stager._arena is not None and mgr._stager._arena.pinned
    expected = {k: v.detach().cpu() - 1.0 for k, v in model.state_dict().items()}
    cpu_model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    cpu_opt = torch.optim.Adam(cpu_model.parameters())
    with CheckpointManager(CheckpointConfig(url=url, verify=True), "run", rank=0, world_size=1) as mgr:
        assert mgr.restore({"model": ModelOptimizerState(cpu_model, cpu_opt)}) == 1
    for k, v in cpu_model.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-6)


def test_nvml_reading_per_gpu_labelled_as_the_workers():
    from trainguard.metrics.gpu import GpuSampler

    sampler = GpuSampler()
    try:
        readings = sampler.read()
        assert len(readings) >= torch.cuda.device_count() >= 2
        assert all(r.total_bytes > 0 and r.label.startswith(("GPU-", "MIG-")) for r in readings)
        visible = {dev.gpu_label(torch.device("cuda", i)) for i in range(torch.cuda.device_count())}
        assert visible <= {r.label for r in readings}
    finally:
        sampler.close()
