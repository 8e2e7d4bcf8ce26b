"""Host staging memory for checkpoints: one exact-size allocation per save plan.

Why not ``tensor.pin_memory()`` per tensor (what torch's ``_create_cpu_state_dict`` does): pinned
tensors come from CUDA's caching host allocator, which rounds every block up to a power of two and
never returns it — up to 2x the checkpoint in page-locked RAM, invisible in any byte count. Here the
state's tensors are laid out back to back (each aligned to :data:`ALIGN` bytes) in ONE ordinary CPU
allocation of exactly that size; when the state lives on a GPU the allocation is page-locked in place
with ``cudaHostRegister`` (unregistered when the arena is released). So the staging-bytes metric is
what was allocated, byte for byte (:attr:`HostArena.nbytes`).

Each tensor carved from the arena has a storage of its own bytes only (aliasing the arena, not a
view of the arena's one storage). DCP's writer clones every CPU tensor whose storage is larger than
the tensor (``_SerialCpuLoader``: "a new tensor with minimal storage") and keeps each clone until its
file is written, so views of one big storage made every save hold a second copy of the state (issue
44: 2.0x the rank's share of host memory instead of 1.0x).

Copies from the GPU (:meth:`CopyStream.copy_split`) run on a side stream that first waits for the
compute stream: the tensors the next forward may change first (the compute stream waits for those,
GPU-side), a guarded optimizer's parameters and state last (only that optimizer's next ``step()``
waits for them, GPU-side: :class:`StepGuard`). The persist thread makes the state's GPU current
(:func:`bind_thread`) and waits on the last event alone before it reads the buffers — never on a
device-wide synchronize, and never on the wrong device. :class:`PinnedRegion` page-locks memory
allocated elsewhere (a tier-0 slot's mapping) the same way. Nothing here has run on a GPU yet
(docs/gpu.md); on the CPU the same layout code runs and the copies are plain.
"""

from __future__ import annotations

import os

import copy
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

ALIGN = 16
"""Byte alignment of every tensor in the arena (>= any dtype's alignment)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _is_sharded_tensor(obj: Any) -> bool:
    """A ``ShardedTensor`` (e.g. a DeepSpeed ZeRO range): no tensor ops, only local shards."""
    return isinstance(obj, torch.Tensor) and callable(getattr(type(obj), "local_shards", None))


def _leaves(obj: Any) -> list[torch.Tensor]:
    """The plain tensors of a state dict, in walk order (a DTensor contributes its local shard, a
    ShardedTensor its local shards)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return [obj._local_tensor]
    if _is_sharded_tensor(obj):
        return [s.tensor for s in obj.local_shards()]
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _leaves(v)]
    return []


def layout_bytes(state: Any) -> int:
    """Bytes the arena for ``state`` needs: every tensor's bytes, each rounded up to :data:`ALIGN`."""
    return sum(_align(t.numel() * t.element_size()) for t in _leaves(state))


def _register(ptr: int, nbytes: int) -> None:  # pragma: no cover - needs a GPU (docs/gpu.md)
    from torch.cuda import _pin_memory_utils

    try:
        _pin_memory_utils.pin_memory(ptr, nbytes)
    except Exception:
        _clear_last_cuda_error()
        raise


def _clear_last_cuda_error() -> None:  # pragma: no cover - needs a GPU
    """Reset the CUDA runtime's last error after a failed ``cudaHostRegister``: left set, the next kernel
    launch of this process raises it ("CUDA error: invalid argument" from ``torch.zeros``; gpu-check of
    2026-11-27). torch binds no ``cudaGetLastError``, so it is called in the libcudart this process has
    loaded already (best effort)."""
    import ctypes

    try:
        with open("/proc/self/maps") as fh:
            path = next((ln.split()[-1] for ln in fh if "libcudart" in ln and ln.split()[-1].startswith("/")), None)
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception:  # noqa: BLE001 - nothing more to do
        pass


PINNABLE_FS = frozenset({"tmpfs", "hugetlbfs"})
"""File systems whose mapped pages ``cudaHostRegister`` can lock in place: shared memory. Linux refuses a
long-term pin of a regular file's page cache (the registration fails with cudaErrorInvalidValue)."""


def fs_type(path: str, mounts: str | None = None) -> str:
    """The file system type of the mount holding ``path`` (the longest mount point that prefixes its real
    path) in ``mounts`` (``/proc/self/mounts``'s text; read when None); "" when unknown."""
    if mounts is None:
        try:
            with open("/proc/self/mounts") as fh:
                mounts = fh.read()
        except OSError:
            return ""
    real = os.path.realpath(path)
    best, kind = -1, ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), parts[2]
    return kind


def pin_refusal(path: str, mounts: str | None = None) -> str | None:
    """Why a mapping of the file ``path`` cannot be page-locked (None: it can be tried): it is not on a
    shared-memory file system. The copies from a GPU then go through pageable memory, slower."""
    kind = fs_type(path, mounts)
    if kind in PINNABLE_FS:
        return None
    return (f"{os.path.dirname(path) or path} is on {kind or 'an unknown file system'}, not a tmpfs: its mapped "
            "pages cannot be page-locked, so copies from the GPU go through pageable memory; put "
            "checkpoint.memory_dir on a tmpfs such as /dev/shm (the default)")


def _unregister(ptr: int) -> None:  # pragma: no cover - needs a GPU
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.unpin_memory(ptr)


class HostArena:
    """One CPU allocation of exactly ``nbytes`` (page-locked in place when ``pin``).

    ``register``/``unregister`` default to ``cudaHostRegister``/``cudaHostUnregister``; tests inject
    fakes. :meth:`release` (or garbage collection) unregisters."""

    def __init__(self, nbytes: int, *, pin: bool, register: Callable[[int, int], None] = _register,
                 unregister: Callable[[int], None] = _unregister) -> None:
        self.nbytes = nbytes
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self._memory = memoryview(self.buffer.numpy())  # what torch.frombuffer carves exact-size storages from
        self.pinned = False
        self._offset = 0
        self._finalizer: Any = None
        if pin and nbytes > 0:
            ptr = self.buffer.data_ptr()
            register(ptr, nbytes)
            self.pinned = True
            self._finalizer = weakref.finalize(self, unregister, ptr)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU tensor shaped like ``like``, carved from the arena: its storage is exactly its
        bytes (see the module docstring) and keeps the arena's memory alive."""
        n = like.numel() * like.element_size()
        if self._offset + n > self.nbytes:
            raise RuntimeError(f"staging arena overflow: {self._offset + n} > {self.nbytes} bytes (layout changed "
                               f"between sizing and carving)")
        offset = self._offset
        self._offset += _align(n)
        if n == 0:
            return torch.empty(like.shape, dtype=like.dtype)
        flat = torch.frombuffer(self._memory, dtype=like.dtype, count=like.numel(), offset=offset)
        return flat.view(like.shape)

    def release(self) -> None:
        """Unregister the pinned pages now (idempotent); the memory goes with the last reference."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.pinned = False


def build(state: Any, arena: HostArena) -> Any:
    """A CPU state dict with ``state``'s structure whose tensors are views into ``arena`` (DTensors
    keep their spec with a CPU local shard, as torch's ``_create_cpu_state_dict`` does)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return DTensor(arena.take(state._local_tensor), state._spec, requires_grad=False)
    if _is_sharded_tensor(state):
        if state.device.type == "cpu":  # the same sharding over arena shards. Not copy.deepcopy: it copies
            # each shard's whole base storage (a ZeRO flat partition per parameter) only to drop it.
            shards = [dataclasses.replace(s, tensor=arena.take(s.tensor)) for s in state.local_shards()]
            return type(state)._init_from_local_shards_and_global_metadata(
                shards, copy.deepcopy(state.metadata()), process_group=state._process_group)
        ret = state.to("cpu")  # as torch's _create_cpu_state_dict: a CPU copy whose shards become arena tensors
        for shard in ret.local_shards():
            shard.tensor = arena.take(shard.tensor)
        return ret
    if isinstance(state, torch.Tensor):
        return arena.take(state)
    if isinstance(state, dict):
        return {k: build(v, arena) for k, v in state.items()}
    if isinstance(state, list):
        return [build(v, arena) for v in state]
    if isinstance(state, tuple):
        return tuple(build(v, arena) for v in state)
    return state


def cuda_device_of(state: Any) -> torch.device | None:
    """The GPU the state's tensors live on (the worker's ``rt.device``), or None when none does.
    Raises when they span several GPUs (one worker, one GPU)."""
    devices = {t.device for t in _leaves(state) if t.is_cuda}
    if len(devices) > 1:
        raise RuntimeError(f"the checkpoint state spans several GPUs {sorted(map(str, devices))}; one worker trains "
                           f"on one device (rt.device)")
    return next(iter(devices), None)


class PinnedRegion:
    """Host memory someone else allocated (a tier-0 slot's mapping), page-locked in place with
    ``cudaHostRegister`` so that GPU copies into it run asynchronously (into pageable memory CUDA
    copies through a bounce buffer and the host waits). :meth:`release` unregisters (idempotent); a
    failed registration leaves it unpinned (:attr:`error` says why): the copies are then correct, slower."""

    def __init__(self, buffer: Any, *, refused: str | None = None) -> None:
        self._view = torch.frombuffer(buffer, dtype=torch.uint8)
        self.ptr, self.nbytes = self._view.data_ptr(), self._view.numel()
        self.error: str | None = refused
        """Why it is not page-locked (``refused``: not even tried, see :func:`pin_refusal`); None: it is."""
        self.pinned = False
        if refused is not None:
            return
        try:
            _register(self.ptr, self.nbytes)
            self.pinned = True
        except Exception as e:  # noqa: BLE001 - see the docstring
            self.error = f"{type(e).__name__}: {e}"[:300]

    def release(self) -> None:
        if self.pinned:
            self.pinned = False
            try:
                _unregister(self.ptr)
            except Exception:  # noqa: BLE001 - the mapping goes anyway
                pass
        self._view = None  # the exported buffer, before the owner unmaps it


def bind_thread(device: torch.device | None, cuda: Any = None) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op for None or the CPU). Every
    background thread that touches CUDA (the persist thread waiting on a staging event, a snapshot's
    commit thread) calls it first: the current device is per thread and defaults to GPU 0, so an
    unbound thread made a CUDA context on GPU 0 in every rank of a node."""
    if device is not None and device.type == "cuda":
        (cuda if cuda is not None else torch.cuda).set_device(device)


class CopyStream:
    """GPU -> host copies on a side stream of one device, ordered after the compute stream's queued
    work; :meth:`copy_split` returns the events the persist or commit thread waits on. ``cuda`` is ``torch.cuda`` (tests
    inject a fake)."""

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.device = device
        self._cuda = cuda if cuda is not None else torch.cuda
        self.stream = self._cuda.Stream(device=device)

    def copy_split(self, now: list[tuple[torch.Tensor, torch.Tensor]],
                   later: list[tuple[torch.Tensor, torch.Tensor]], *, guarded: bool) -> tuple[Any, Any]:
        """Non-blocking ``dst.copy_(src)`` of every pair on the side stream (after the compute stream's
        queued work): ``now`` first (tensors the next forward may change, e.g. BatchNorm statistics), then
        ``later`` (the guarded optimizer's parameters and state, which only its next ``step`` changes).
        The compute stream waits GPU-side for the ``now`` copies; for ``later`` too unless ``guarded``
        (then the optimizer's step pre-hook makes it wait, :class:`StepGuard`, and the next forward and
        backward run beside the copy). Returns ``(event after now, event after all)``; the host never
        blocks here."""
        cuda = self._cuda
        compute = cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with cuda.stream(self.stream):
            for src, _ in (*now, *later):
                # A temporary source is not reused before the copy ran. CUDA tensors only: aten's
                # record_stream has no CPU kernel, and a state dict mixes both (Adam/AdamW keep
                # state["step"] on the CPU unless fused or capturable).
                if src.is_cuda:
                    src.record_stream(self.stream)
            for src, dst in now:
                dst.copy_(src, non_blocking=True)
            first = cuda.Event()
            first.record(self.stream)
            for src, dst in later:
                dst.copy_(src, non_blocking=True)
            done = cuda.Event()
            done.record(self.stream)
        compute.wait_event(first)
        if not guarded:
            compute.wait_event(done)
        return first, done


def optimizer_storages(optimizer: Any) -> set[int]:
    """Data pointers of ``optimizer``'s parameters and state tensors (local shards of DTensors): what
    only its ``step()`` changes. Empty for anything that is not a ``torch.optim.Optimizer``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return set()
    ptrs = {t.data_ptr() for g in optimizer.param_groups for p in g["params"] for t in _leaves(p)}
    ptrs |= {t.data_ptr() for st in optimizer.state.values() for v in st.values() for t in _leaves(v)}
    ptrs.discard(0)
    return ptrs


class StepGuard:
    """Makes an optimizer's next ``step()`` wait, GPU-side, for the copies that read its parameters and
    state (:meth:`CopyStream.copy_split` with ``guarded``): a step pre-hook queues
    ``wait_event`` on the compute stream, so the host never blocks and the forward and backward before
    it overlap the copy. :meth:`pending` hands it the event; one guard per optimizer object."""

    def __init__(self, cuda: Any = None) -> None:
        self._cuda = cuda if cuda is not None else torch.cuda
        self._optimizer: Any = None
        self._hook: Any = None
        self._event: Any = None
        self._device: Any = None
        self.ptrs: set[int] = set()

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    def attach(self, optimizer: Any) -> None:
        """Guard ``optimizer`` (again after it changes; a non-optimizer detaches)."""
        if optimizer is self._optimizer:
            self.ptrs = optimizer_storages(optimizer)
            return
        self.detach()
        if isinstance(optimizer, torch.optim.Optimizer):
            self._optimizer = optimizer
            self._hook = optimizer.register_step_pre_hook(lambda *_: self.release())
            self.ptrs = optimizer_storages(optimizer)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook = self._optimizer = None
        self.ptrs = set()

    def pending(self, event: Any, device: torch.device) -> None:
        """The next ``step()`` waits for ``event`` (recorded on ``device``'s side stream)."""
        self._event, self._device = event, device

    def release(self) -> None:
        """Queue the wait on the compute stream now (also before anything else changes the guarded tensors)."""
        ev, self._event = self._event, None
        if ev is not None:
            self._cuda.current_stream(self._device).wait_event(ev)


__all__ = ["ALIGN", "CopyStream", "HostArena", "PinnedRegion", "StepGuard", "bind_thread", "build", "cuda_device_of", "layout_bytes",
           "optimizer_storages"]
