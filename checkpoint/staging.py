"""Staging: copy the state to be saved into reusable host buffers, so training can go on.

Training blocks only for this copy; the background persist thread then writes the buffers. The
buffers hold one copy of the state: tensors carved from one exact-size
:class:`~trainguard.checkpoint.pinned.HostArena` (page-locked in place when the state is on a GPU; each
tensor with a storage of its own bytes, so DCP's writer streams them without cloning: issue 44),
allocated on first use (or by :meth:`Stager.prepare` after the first step) and reused by every later
save (rebuilt only when the state's structure, shapes or dtypes change, e.g. when optimizer state
appears after the first step). :attr:`Stager.staging_bytes` is the arena's size: what was allocated.
From a GPU the copies run on a side stream (:class:`~trainguard.checkpoint.pinned.CopyStream`) and
:attr:`Stager.ready` is the event the persist thread waits on; on the CPU they are plain and
:attr:`Stager.ready` is None. Called from the training thread only.

Fed from a tier-0 snapshot: given a :class:`~trainguard.checkpoint.memory.SnapshotSource` (the snapshot
this process took of the same step, :meth:`~trainguard.checkpoint.memory.MemoryTier.lend`),
:meth:`Stager.stage` copies nothing from the training tensors that the snapshot holds: it returns the
staged state at once and leaves :attr:`Stager.deferred`, the copy out of the snapshot's slot, to the
persist thread (which runs it before it reads the buffers). Tensors the snapshot lacks (e.g. RNG
states, made anew by every ``state_dict()``) are copied on the training thread as before; when one of
those is on a GPU the whole stage takes the usual path.
"""

from __future__ import annotations

import copy
import functools
import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._state_dict_utils import (
    CompanionMismatch,
    _copy_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.checkpoint.pinned import CopyStream, HostArena, StepGuard, build, cuda_device_of, layout_bytes


class Stager:
    """Copies a state dict into reusable host buffers (one copy of the state, allocated once); see
    the module docstring. ``cuda`` is ``torch.cuda`` (tests inject a fake)."""

    def __init__(self, cuda: Any = None) -> None:
        self._buffers: dict[str, Any] | None = None
        self._arena: HostArena | None = None
        self._copier: CopyStream | None = None
        self._cuda = cuda
        self.staging_bytes = 0
        self.rebuilds = 0
        self.ready: Any = None
        """The event of the last :meth:`stage`'s GPU copies (None: they are complete)."""
        self.deferred: Callable[[], None] | None = None
        """The last :meth:`stage`'s copies out of a snapshot, for the persist thread to run before it reads
        the buffers (None: every copy is done, or ``ready`` says when)."""
        self.from_snapshot = 0
        """Tensors the last :meth:`stage` left to :attr:`deferred` (0: none, staged from the training state)."""
        self._guard: StepGuard | None = None

    @property
    def device(self) -> torch.device | None:
        """The GPU the staged state comes from (the copies' device), or None on the CPU."""
        return self._copier.device if self._copier is not None else None

    @staticmethod
    def _materialise(state: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}

    def _rebuild(self, sd: dict[str, Any]) -> None:
        if self._arena is not None:  # free (and unregister) the old buffers before allocating new ones
            self._arena.release()
        self._buffers = self._arena = None
        device = cuda_device_of(sd)
        self._arena = HostArena(layout_bytes(sd), pin=device is not None)
        self._buffers = build(sd, self._arena)
        self.staging_bytes = self._arena.nbytes
        self.rebuilds += 1
        if device is None:
            self._copier = None
        elif self._copier is None or self._copier.device != device:
            self._copier = CopyStream(device, self._cuda)

    @torch.no_grad()
    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate the buffers for ``state`` now (no copy), so that the first save does not pay for it."""
        sd = self._materialise(state)
        if self._buffers is None or not _same_layout(sd, self._buffers):
            self._rebuild(sd)

    @torch.no_grad()
    def stage(self, state: dict[str, Any], source: Any = None) -> dict[str, Any]:
        """Copy ``state`` into the buffers and return the staged state dict (the buffers, with the
        state's other values). ``source``: a snapshot of the same state to copy from instead (see the
        module docstring); the caller still releases it when :attr:`deferred` comes back None."""
        self.deferred, self.from_snapshot = None, 0
        sd = self._materialise(state)
        if self._buffers is None or not _same_layout(sd, self._buffers):
            self._rebuild(sd)
        if source is not None:
            staged = self._from_snapshot(sd, source)
            if staged is not None:
                return staged
        try:
            return self._copy(sd)
        except CompanionMismatch:
            self._rebuild(sd)
            return self._copy(sd)

    def _from_snapshot(self, sd: dict[str, Any], source: Any) -> dict[str, Any] | None:
        assert self._buffers is not None
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = _pair(sd, self._buffers, pairs)
        views = source.match([src for src, _ in pairs])
        now = [(src, dst) for (src, dst), v in zip(pairs, views, strict=True) if v is None]
        if any(src.device.type != "cpu" for src, _ in now):
            return None
        if now:
            torch._foreach_copy_([dst for _, dst in now], [src for src, _ in now])
        later = [(v, dst) for (_, dst), v in zip(pairs, views, strict=True) if v is not None]
        self.ready, self.from_snapshot = None, len(later)
        self.deferred = functools.partial(source.copy, [v for v, _ in later], [dst for _, dst in later])
        return staged

    @property
    def guard(self) -> StepGuard:
        """The optimizer whose parameters and state the next ``step()`` may change only after a GPU
        staging copy read them (:meth:`~trainguard.checkpoint.manager.CheckpointManager.guard`)."""
        if self._guard is None:
            self._guard = StepGuard(self._cuda)
        return self._guard

    def _copy(self, sd: dict[str, Any]) -> dict[str, Any]:
        assert self._buffers is not None
        buffers = self._buffers
        if self._copier is None:
            self.ready = None
            return _copy_state_dict(sd, buffers, non_blocking=False, type_check=False)
        # From a GPU: host tensors (e.g. Adam's step counts) now; GPU tensors on the side stream, those
        # of the guarded optimizer last, so that only its next step() waits for them (GPU-side), not the
        # next forward (which waits only for the rest, e.g. BatchNorm statistics).
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = _pair(sd, buffers, pairs)
        host = [(src, dst) for src, dst in pairs if not src.is_cuda]
        if host:
            torch._foreach_copy_([dst for _, dst in host], [src for src, _ in host])
        ptrs = self._guard.ptrs if self._guard is not None else set()
        now = [(src, dst) for src, dst in pairs if src.is_cuda and src.data_ptr() not in ptrs]
        later = [(src, dst) for src, dst in pairs if src.is_cuda and src.data_ptr() in ptrs]
        _, self.ready = self._copier.copy_split(now, later, guarded=bool(later))
        if later:
            self.guard.pending(self.ready, self._copier.device)
        return staged


def _pair(sd: Any, buf: Any, out: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The staged state ``_copy_state_dict(sd, buf)`` returns, without copying: the buffers in the
    places of ``sd``'s tensors (their ``(source, buffer)`` local tensors appended to ``out``), and
    ``sd``'s other values. ``buf`` has ``sd``'s layout (:func:`_same_layout`)."""
    from torch.distributed.tensor import DTensor

    if isinstance(sd, DTensor):
        out.append((sd._local_tensor, buf._local_tensor))
        return buf
    if _is_sharded_tensor(sd):
        out.extend((a.tensor, b.tensor) for a, b in zip(sd.local_shards(), buf.local_shards(), strict=True))
        return buf
    if isinstance(sd, torch.Tensor):
        out.append((sd, buf))
        return buf
    if isinstance(sd, (int, float, str, bytes, io.BytesIO)) or sd is None:
        return sd
    if isinstance(sd, dict):
        return {k: _pair(v, buf[k], out) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        items = [_pair(v, b, out) for v, b in zip(sd, buf, strict=True)]
        return tuple(items) if isinstance(sd, tuple) else items
    return copy.deepcopy(sd)


def _same_layout(a: Any, b: Any) -> bool:
    """Same structure, and tensors of the same shape and dtype (no copying).

    torch's ``_check_state_dict_similarity`` is not used: it walks with a companion object and so
    also *copies* every tensor, which doubled the staging time.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor):
        return isinstance(b, DTensor) and _same_layout(a._local_tensor, b._local_tensor)
    if _is_sharded_tensor(a):
        return _is_sharded_tensor(b) and _same_layout(_shard_layout(a), _shard_layout(b))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and not isinstance(b, DTensor) and a.shape == b.shape
                and a.dtype == b.dtype)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_layout(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    return not isinstance(b, (torch.Tensor, dict, list, tuple))


def _is_sharded_tensor(obj: Any) -> bool:
    """A ``ShardedTensor`` (e.g. a DeepSpeed ZeRO range): it supports no tensor op, only its local shards."""
    return isinstance(obj, torch.Tensor) and callable(getattr(type(obj), "local_shards", None))


def _shard_layout(obj: Any) -> list[Any]:
    return [(list(s.metadata.shard_offsets), s.tensor) for s in obj.local_shards()]


__all__ = ["Stager"]
