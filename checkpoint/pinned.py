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

Copies from the GPU (:func:`copy_async`) run on a side stream that first waits for the compute
stream, then record an event; the compute stream waits for that event (GPU-side, the host does not
block: later in-place updates of the parameters queue behind the copy) and the persist thread waits
on the event alone before it reads the buffers — never on a device-wide synchronize, and never on the
wrong device. Nothing here has run on a GPU yet (docs/gpu.md); on the CPU the same layout code runs
and the copies are plain.
"""

from __future__ import annotations

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

    _pin_memory_utils.pin_memory(ptr, nbytes)


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


class CopyStream:
    """GPU -> arena copies on a side stream of one device, ordered after the compute stream's queued
    work; :meth:`copy` returns the event the persist thread waits on. ``cuda`` is ``torch.cuda`` (tests
    inject a fake)."""

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.device = device
        self._cuda = cuda if cuda is not None else torch.cuda
        self.stream = self._cuda.Stream(device=device)

    def copy(self, sources: list[torch.Tensor], do_copy: Callable[[], Any]) -> tuple[Any, Any]:
        """Run ``do_copy`` (non-blocking copies of ``sources`` into the arena) on the side stream;
        return ``(its result, the recorded event)``."""
        cuda = self._cuda
        compute = cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the values as of now, after every queued update
        with cuda.stream(self.stream):
            for src in sources:
                src.record_stream(self.stream)  # a temporary source is not reused before the copy ran
            out = do_copy()
            done = cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)  # later in-place updates queue behind the copy (no host wait)
        return out, done


__all__ = ["ALIGN", "CopyStream", "HostArena", "build", "cuda_device_of", "layout_bytes"]
