"""Tier 0 feeding tier 2: a snapshot lent to the durable save of the same step.

:meth:`Lending.lend` hands the snapshot this process just took to the durable save of the same step
(:class:`SnapshotSource`): the save's staging copy reads the slot, in the persist thread, instead of
the training tensors (:mod:`trainguard.checkpoint.staging`). The slot is held until that copy is done;
the snapshot that would overwrite it (two snapshots on) waits, and so does
:meth:`MemoryTier.close <trainguard.checkpoint.memory.MemoryTier.close>`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

def _key(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same data: device, address, shape, strides, dtype."""
    return t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class SnapshotSource:
    """A committed (or committing) snapshot lent to the durable save of the same step
    (:meth:`MemoryTier.lend`): which slot view holds each tensor the save stages, and the copy out of
    the slot, run by the persist thread. The slot stays held until :meth:`release`."""

    def __init__(self, step: int, tensors: list[torch.Tensor], views: list[torch.Tensor],
                 pending: Future[None] | None) -> None:
        self.step = step
        self._tensors, self._views, self._pending = tensors, views, pending
        self._released = threading.Event()

    def match(self, wanted: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """For each of ``wanted`` (local tensors of the state being staged), the slot view holding its
        snapshot (the same storage, shape, strides and dtype as a tensor the snapshot copied), else None."""
        index: dict[tuple[Any, ...], torch.Tensor] = {}
        for t, v in zip(self._tensors, self._views, strict=True):
            index.setdefault(_key(t), v)
        return [index.get(_key(t)) for t in wanted]

    def copy(self, views: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
        """Copy ``views`` (from :meth:`match`) into ``dsts`` once the snapshot's background half is done
        (the guarded optimizer's tensors are copied there), then release the slot. Thread-safe."""
        try:
            if self._pending is not None:
                self._pending.result()
            if views:
                with torch.no_grad():
                    torch._foreach_copy_(dsts, views)
        finally:
            self.release()

    def release(self) -> None:
        """The save no longer reads the slot (idempotent, thread-safe)."""
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def wait(self) -> None:
        self._released.wait()


class Lending:
    """The lending side of :class:`~trainguard.checkpoint.memory.MemoryTier` (a mixin: the snapshot it
    lends and the slots it holds are the tier's)."""

    _last: tuple[int, int, list[torch.Tensor], list[torch.Tensor]] | None
    _parity: Any
    _holds: dict[int, SnapshotSource]
    _committing: Future[None] | None

    def lend(self, step: int) -> SnapshotSource | None:
        """The snapshot this process just took, as the source of the durable save of the same ``step``
        (tier 2 fed from tier 0: the staging copy reads the slot, in the persist thread, instead of the
        training tensors on the training thread). The slot is held until the save calls
        :meth:`SnapshotSource.release` (it does, when its copy ends or the save ends without one): the
        snapshot that would overwrite it, two snapshots on, waits for that. None when the newest
        snapshot is not of ``step`` or was not taken by this process since it last loaded a snapshot
        into the state, rebound or invalidated (every restore and re-formation does one of these). Call
        only while the training state still is that snapshot's (the same step boundary): whether a
        tensor is the one snapshotted is judged by its storage, not its values."""
        last = self._last
        if last is None or last[0] != step or self._parity is not None:  # parity: the slot may stay unwritten
            return None
        _, idx, tensors, views = last
        held = self._holds.get(idx)
        if held is not None and not held.released:
            return None
        self._holds[idx] = src = SnapshotSource(step, tensors, views, self._committing)
        return src

    def _wait_hold(self, idx: int | None = None) -> None:
        """Wait until the durable save reading slot ``idx`` (None: any slot) has copied it."""
        for i in list(self._holds) if idx is None else [idx]:
            held = self._holds.pop(i, None)
            if held is not None:
                held.wait()
