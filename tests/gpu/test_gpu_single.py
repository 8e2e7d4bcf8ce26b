"""The single-GPU tier (issue 35): what one GPU - the only kind of GPU machine this project gets - can
verify. Run by ``bench/gpu_check.py`` (part ``pytest_1gpu``) or ``pytest -m gpu tests/gpu``; skipped with
the reason without a GPU."""

from __future__ import annotations

import math
import os
import shutil
import signal
import tempfile

import pytest
import torch

from tests.gpu.cycles import reform_cycles
from tests.strategies._world import E2E_SIZE, losses, run_segment
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.memory import MemoryTier
from trainguard.checkpoint.state import ModelOptimizerState

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]
DEVICE = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def keep_sigterm_handler():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _trained(device: torch.device, width: int = 512) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)).to(device)
    opt = torch.optim.AdamW(model.parameters())  # neither fused nor capturable: state["step"] stays on the CPU
    model(torch.randn(8, width, device=device)).sum().backward()
    opt.step()
    return model, opt


def test_save_of_a_real_adamw_state_from_the_gpu_reloads_equal(tmp_path):
    model, opt = _trained(DEVICE)
    assert any(st["step"].device.type == "cpu" for st in opt.state.values())  # the mixed state of fix 1
    url = str(tmp_path / "ckpt")
    with CheckpointManager(CheckpointConfig(url=url, async_save=True), "run", rank=0, world_size=1) as mgr:
        mgr.save(1, {"model": ModelOptimizerState(model, opt)})
        with torch.no_grad():  # changed right after save() returns: must not reach the checkpoint
            for p in model.parameters():
                p.add_(1.0)
        assert mgr.wait(120) == 1
        assert mgr._stager._arena is not None and mgr._stager._arena.pinned
    expected = {k: v.detach().cpu() - 1.0 for k, v in model.state_dict().items()}
    cpu_model, cpu_opt = _trained(torch.device("cpu"))
    with CheckpointManager(CheckpointConfig(url=url, verify=True), "run", rank=0, world_size=1) as mgr:
        assert mgr.restore({"model": ModelOptimizerState(cpu_model, cpu_opt)}) == 1
    for k, v in cpu_model.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-6)


def test_three_in_place_nccl_reformations_leak_nothing_and_build_a_mesh_each_time():
    res = reform_cycles(DEVICE, cycles=3)
    assert all(w["ok"] for w in res["worlds"]), res
    assert res["growth"] == {k: 0 for k in res["growth"]}, res


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="tg-gputest-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("where", ["shm", "disk"])
def test_tier0_snapshot_of_gpu_state_loads_back_equal_without_gpu_memory_growth(tmp_path, shm_dir, where):
    """A snapshot of GPU state copies into the slot, never into GPU memory: the next step's peak is that
    of the same step without a snapshot (foreach AdamW's temporaries and the activations are in both);
    the optimizer stepping right after does not reach the snapshot. On /dev/shm the slot is page-locked;
    on a disk folder it cannot be (the registration is not even tried: a failed one left a CUDA error
    that the next kernel raised), the copies go through pageable memory and CUDA keeps working."""
    model, opt = _trained(DEVICE, width=1024)
    folder = shm_dir if where == "shm" else str(tmp_path / "node")
    os.makedirs(folder, exist_ok=True)
    tier = MemoryTier(folder, rank=0, world_size=1, replicated=True)
    try:
        tier.guard(opt)
        state = {"model": ModelOptimizerState(model, opt)}

        def next_step_peak() -> int:
            torch.cuda.synchronize(DEVICE)
            before = torch.cuda.memory_allocated(DEVICE)
            torch.cuda.reset_peak_memory_stats(DEVICE)
            model(torch.randn(8, 1024, device=DEVICE)).sum().backward()
            opt.step()  # with a snapshot: waits for its copy (the guard), then changes the parameters
            torch.cuda.synchronize(DEVICE)
            return torch.cuda.max_memory_allocated(DEVICE) - before

        control = next_step_peak()
        tier.snapshot(7, state, world="w")
        if where == "shm":
            assert tier.pin_error is None, tier.pin_error
        else:
            assert "checkpoint.memory_dir" in tier.pin_error, tier.pin_error
            torch.zeros(4, device=DEVICE).add_(1.0)  # no CUDA error left behind
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        with_snapshot = next_step_peak()
        tier.settle()
        assert with_snapshot <= control + 2**20, (with_snapshot, control)  # no clone of the state
        fresh, fresh_opt = _trained(DEVICE, width=1024)
        tier.load(7, {"model": ModelOptimizerState(fresh, fresh_opt)}, world="w")
        for k, v in fresh.state_dict().items():
            torch.testing.assert_close(v.cpu(), expected[k], rtol=0, atol=0)
    finally:
        tier.close()


@pytest.mark.parametrize(("strategy", "extra", "tier0"), [
    ("ddp", [], False), ("fsdp", [], False), ("fsdp", [], True), ("fsdp", ["--precision", "bf16-mixed"], False),
], ids=["ddp", "fsdp", "fsdp-tier0", "fsdp-bf16"])
def test_bundled_example_on_cuda_saves_and_resumes_exactly(tmp_path, shm_dir, strategy, extra, tier0):
    """The bundled worker-API job on NCCL, world of 1: 6 steps committing every 2; then the same job
    restored from step 4 recomputes steps 5-6 with the losses of the uninterrupted run (bf16: within
    its rounding), and the checkpoint holds fp32 parameters whatever the compute precision."""
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "loss.jsonl")
    memory = shm_dir if tier0 else ""  # on a tmpfs, as the agent's default memory_dir
    run_segment(1, strategy, ckpt, steps=6, interval=2, fence=1, loss_log=log, extra=[*E2E_SIZE, *extra],
                timeout=240, memory_dir=memory)
    first = losses(log)
    assert sorted(first) == list(range(1, 7)) and all(math.isfinite(v) for v in first.values())
    log2 = str(tmp_path / "resumed.jsonl")
    run_segment(1, strategy, ckpt, steps=6, interval=0, fence=2, loss_log=log2,
                extra=[*E2E_SIZE, *extra, "--resume-step", "4"], timeout=240)
    again = losses(log2)
    tol = 2e-2 if extra else 1e-4
    for s in (5, 6):
        assert abs(again[s] - first[s]) <= tol * max(1.0, abs(first[s])), (s, again[s], first[s])
    from torch.distributed.checkpoint import FileSystemReader

    from trainguard.checkpoint.manifest import parse_step_dir

    step_dir = next(os.path.join(r, d) for r, ds, _ in os.walk(ckpt) for d in ds if (parse_step_dir(d) or (0,))[0] == 4)
    meta = FileSystemReader(step_dir).read_metadata()
    dtypes = {m.properties.dtype for k, m in meta.state_dict_metadata.items()
              if hasattr(m, "properties") and "weight" in k and "optim" not in k}
    assert dtypes == {torch.float32}, dtypes


def test_reshard_assign_writes_a_host_block_into_a_gpu_tensor_at_strided_positions():
    """A tier-0 reshard fills GPU shards from host blocks; index positions (non-contiguous, as a TP
    layout's) go through ``index_put_``, which needs the values on the tensor's device."""
    from trainguard.checkpoint.reshard import assign

    t = torch.zeros(4, 6, device=DEVICE)
    block = torch.arange(6.0).view(2, 3)  # on the host
    assign(t, [slice(1, 3), torch.tensor([0, 2, 4])], block)
    want = torch.zeros(4, 6)
    want[1:3, 0::2] = block
    assert torch.equal(t.cpu(), want)
