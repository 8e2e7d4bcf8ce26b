"""Checkpoint staging memory (issue 19): one exact-size host allocation per save plan, so the
staging-bytes figure is what was allocated; pinned in place (``cudaHostRegister``) and released;
GPU copies on a side stream ordered after the compute stream, the persist thread waiting on that
copy's event only. No GPU here: the CUDA entry points are strict fakes (tests/fixtures/strict_cuda.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401 - its lazy import sets TORCHINDUCTOR_CACHE_DIR; do it before the env-leak guard

from tests.fixtures.strict_cuda import StrictCuda, on_fake_gpu
from trainguard.checkpoint import pinned
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.staging import Stager
from trainguard.checkpoint.state import ModelOptimizerState


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))  # odd sizes: padding
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    m(torch.randn(2, 5)).sum().backward()
    opt.step()
    return m, opt


def test_staging_bytes_equal_the_one_allocation(tmp_path):
    m, opt = _trained()
    state = {"model": ModelOptimizerState(m, opt)}
    with CheckpointManager(CheckpointConfig(url=str(tmp_path / "c"), async_save=False), "run", rank=0, world_size=1) as mgr:
        assert mgr.prepare_staging(state) == mgr.staging_bytes > 0  # allocated before any save
        mgr.save(1, state)
        stager = mgr._stager
        arena = stager._arena
        assert stager.rebuilds == 1 and arena is not None and not arena.pinned  # CPU state: nothing to pin
        # The figure is the allocation, byte for byte: every staged tensor lies in the one arena ...
        assert mgr.staging_bytes == arena.nbytes == arena.buffer.untyped_storage().nbytes()
        lo = arena.buffer.data_ptr()
        for t in pinned._leaves(stager._buffers):
            assert lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= lo + arena.nbytes
            # ... with a storage of its own bytes: DCP's writer clones a tensor whose storage is larger and
            # holds the clones until the file is written (issue 44: a second copy of the state per save).
            assert t.untyped_storage().nbytes() == t.nbytes
        # ... and it is the state's size plus alignment padding only (< ALIGN per tensor).
        tensors = pinned._leaves(stager._materialise(state))
        raw = sum(t.numel() * t.element_size() for t in tensors)
        assert raw <= mgr.staging_bytes < raw + pinned.ALIGN * len(tensors)
        # The staged values are the state's.
        for src, dst in zip(tensors, pinned._leaves(stager._buffers)):
            assert torch.equal(src, dst)
        mgr.save(2, state)
        assert stager.rebuilds == 1 and stager._arena is arena  # reused


def test_layout_change_reallocates_exactly():
    s = Stager()
    s.prepare({"a": torch.ones(3)})
    first = s.staging_bytes
    s.prepare({"a": torch.ones(3), "b": torch.zeros(10, dtype=torch.float64)})
    assert s.rebuilds == 2 and s.staging_bytes == first + 80 == s._arena.nbytes


def test_arena_pins_once_exact_size_and_unpins():
    calls: list[tuple] = []
    arena = pinned.HostArena(1000, pin=True, register=lambda p, n: calls.append(("register", p, n)),
                             unregister=lambda p: calls.append(("unregister", p)))
    ptr = arena.buffer.data_ptr()
    assert calls == [("register", ptr, 1000)] and arena.pinned  # one registration, the exact size
    view = arena.take(torch.empty(3, 5, dtype=torch.float16))
    assert view.shape == (3, 5) and view.dtype == torch.float16 and view.data_ptr() == ptr
    nxt = arena.take(torch.empty((), dtype=torch.int64))
    assert nxt.data_ptr() == ptr + 32  # 30 bytes, aligned up to 16
    assert view.untyped_storage().nbytes() == 30 and nxt.untyped_storage().nbytes() == 8  # exact, not the arena's
    empty = arena.take(torch.empty(0, 4, dtype=torch.bfloat16))
    assert empty.shape == (0, 4) and empty.dtype == torch.bfloat16
    nxt.fill_(7)
    assert arena.buffer[32:40].view(torch.int64).item() == 7  # aliases the arena, no copy
    arena.release()
    arena.release()
    assert calls[1:] == [("unregister", ptr)] and not arena.pinned


@pytest.mark.parametrize("guarded", [False, True])
def test_copies_run_on_a_side_stream_after_the_compute_stream(guarded):
    """The rest first, the guarded optimizer's tensors last; the compute stream waits GPU-side for the
    rest, and for everything only when nothing guards the optimizer (then its step waits instead)."""
    cuda = StrictCuda()
    copier = pinned.CopyStream(torch.device("cuda", 3), cuda)
    buf, param = on_fake_gpu(torch.arange(4.0)), on_fake_gpu(torch.ones(2))
    dst_buf, dst_param = torch.zeros(4), torch.zeros(2)
    first, done = copier.copy_split([(buf, dst_buf)], [(param, dst_param)], guarded=guarded)
    assert torch.equal(dst_buf, torch.arange(4.0)) and torch.equal(dst_param, torch.ones(2))
    assert [s.label for s in buf.recorded] == ["side"] and [s.label for s in param.recorded] == ["side"]
    waits = ["compute.wait_event"] if guarded else ["compute.wait_event", "compute.wait_event"]
    assert cuda.log == ["current_stream(cuda:3)", "side.wait_stream(compute)", "event.record(side)",
                        "event.record(side)", *waits]
    assert "DEVICE_SYNCHRONIZE" not in cuda.log


def test_a_guarded_optimizer_waits_gpu_side_in_its_next_step():
    cuda = StrictCuda()
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    guard = pinned.StepGuard(cuda)
    guard.attach(opt)
    assert guard.ptrs == {p.data_ptr() for p in m.parameters()}
    guard.pending("event", torch.device("cuda", 1))
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.step()  # nothing pending any more
    assert cuda.log == ["current_stream(cuda:1)", "compute.wait_event"]
    guard.detach()
    guard.pending("event", torch.device("cuda", 1))
    opt.step()
    assert cuda.log == ["current_stream(cuda:1)", "compute.wait_event"]  # detached: no hook


def test_persist_waits_on_the_staging_event_before_writing(tmp_path, monkeypatch):
    order: list[str] = []

    class Event:
        def synchronize(self):
            order.append("event.synchronize")

    with CheckpointManager(CheckpointConfig(url=str(tmp_path / "c"), async_save=True), "run", rank=0, world_size=1) as mgr:
        real_copy, real_write = mgr._stager._copy, mgr._write_shards

        def copy(sd):
            out = real_copy(sd)
            mgr._stager.ready = Event()  # what a GPU staging copy leaves behind
            return out

        def write(step, staged):
            order.append("write")
            return real_write(step, staged)

        monkeypatch.setattr(mgr._stager, "_copy", copy)
        monkeypatch.setattr(mgr, "_write_shards", write)
        mgr.save(1, {"w": {"t": torch.ones(3)}})
        assert mgr.wait(30) == 1
    assert order == ["event.synchronize", "write"]


def test_the_persist_thread_binds_the_staging_device_before_it_waits(tmp_path, monkeypatch):
    """The current CUDA device is per thread (default 0): the persist thread sets the state's GPU before
    it waits on the staging event, or every rank of a node made a context on GPU 0."""
    import threading
    import types

    bound: list[tuple[str, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append((threading.current_thread().name, str(d))))

    class Event:
        def synchronize(self):
            bound.append((threading.current_thread().name, "event.synchronize"))

    with CheckpointManager(CheckpointConfig(url=str(tmp_path / "c"), async_save=True), "run", rank=0, world_size=1) as mgr:
        real_copy = mgr._stager._copy

        def copy(sd):
            out = real_copy(sd)
            mgr._stager.ready = Event()  # what a GPU staging copy on cuda:3 leaves behind
            mgr._stager._copier = types.SimpleNamespace(device=torch.device("cuda", 3))
            return out

        monkeypatch.setattr(mgr._stager, "_copy", copy)
        mgr.save(1, {"w": {"t": torch.ones(3)}})
        assert mgr.wait(30) == 1
    assert [b for b in bound if b[0].startswith("trainguard-ckpt")][:2] == [
        (bound[0][0], "cuda:3"), (bound[0][0], "event.synchronize")]
