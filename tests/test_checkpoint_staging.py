"""Checkpoint staging memory (issue 19): one exact-size host allocation per save plan, so the
staging-bytes figure is what was allocated; pinned in place (``cudaHostRegister``) and released;
GPU copies on a side stream ordered after the compute stream, the persist thread waiting on that
copy's event only. No GPU here: the CUDA entry points are fakes that record what is called."""

from __future__ import annotations

import torch
import torch._dynamo  # noqa: F401 - its lazy import sets TORCHINDUCTOR_CACHE_DIR; do it before the env-leak guard

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


class _FakeCuda:
    """Records the stream/event calls a staging copy makes (torch.cuda's surface, on CPU tensors)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        fake = self

        class Stream:
            def __init__(self, device=None, name="side"):
                self.name = name

            def wait_stream(self, other):
                fake.log.append(f"{self.name}.wait_stream({other.name})")

            def wait_event(self, ev):
                fake.log.append(f"{self.name}.wait_event")

        class Event:
            def record(self, stream):
                fake.log.append(f"event.record({stream.name})")

            def synchronize(self):
                fake.log.append("event.synchronize")

        self.Stream, self.Event = Stream, Event
        self.compute = Stream(name="compute")
        self.current = self.compute

    def current_stream(self, device):
        self.log.append(f"current_stream({device})")
        return self.compute

    def stream(self, s):
        fake = self

        class Ctx:
            def __enter__(self):
                fake.current = s

            def __exit__(self, *a):
                fake.current = fake.compute

        return Ctx()

    def synchronize(self, *a):  # a device-wide synchronize: must never be called
        self.log.append("DEVICE_SYNCHRONIZE")


def test_copies_run_on_a_side_stream_after_the_compute_stream():
    cuda = _FakeCuda()
    copier = pinned.CopyStream(torch.device("cuda", 3), cuda)
    src = torch.arange(4.0)
    recorded: list[str] = []
    src_record = []

    class Tracked:
        def __init__(self, t):
            self.t = t

        def record_stream(self, s):
            src_record.append(s.name)

    dst = torch.zeros(4)

    def do_copy():
        recorded.append(cuda.current.name)  # the copies are issued on the side stream
        dst.copy_(src)
        return {"x": dst}

    out, event = copier.copy([Tracked(src)], do_copy)
    assert torch.equal(out["x"], src) and recorded == ["side"] and src_record == ["side"]
    assert cuda.log == ["current_stream(cuda:3)", "side.wait_stream(compute)", "event.record(side)",
                        "compute.wait_event"]
    event.synchronize()
    assert "DEVICE_SYNCHRONIZE" not in cuda.log


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
