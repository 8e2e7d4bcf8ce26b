"""Tier-0 snapshots of GPU state (issue 35, item 7): copied asynchronously into pinned host memory,
with no GPU memory growth, and waited for by the guarded optimizer's next step only.

The memory tier hands its GPU tensors here (:class:`GpuCopies`) instead of copying them one by one,
blocking, into pageable slot memory (a full stream sync per tensor), and - with parity - instead of
cloning them on the device (+1x parameters and optimizer state in GPU memory: ~26 GB per GPU for a
70B FSDP job on 32 H100s). The copies run on a side stream of the state's device (after the compute
stream's queued work): the tensors the forward may change first (the compute stream waits for them,
GPU-side), the guarded optimizer's parameters and state last (nothing waits for them but the commit
thread, which waits on the returned event, and the optimizer's next step, which waits for the commit
thread's copies). The slot's mapping is page-locked in place once per mapping
(:class:`~trainguard.checkpoint.pinned.PinnedRegion`); parity's staging copy goes to one exact-size
pinned :class:`~trainguard.checkpoint.pinned.HostArena`, reused while the layout holds.
Nothing here has run on a GPU yet: docs/gpu.md; the CPU tests use tests/fixtures/strict_cuda.py.
"""

from __future__ import annotations

from typing import Any

import torch

from trainguard.checkpoint.pinned import CopyStream, HostArena, build, layout_bytes


class GpuCopies:
    """GPU -> host copies of one rank's snapshots (one side stream per device). ``cuda``: ``torch.cuda``
    (tests inject a fake)."""

    def __init__(self, cuda: Any = None) -> None:
        self._cuda = cuda
        self._copier: CopyStream | None = None
        self._arena: HostArena | None = None
        self._arena_sig: Any = None
        self._arena_views: list[torch.Tensor] = []
        self.device: torch.device | None = None

    def _stream(self, device: torch.device) -> CopyStream:
        if self._copier is None or self._copier.device != device:
            self._copier = CopyStream(device, self._cuda)
        self.device = device
        return self._copier

    def start(self, srcs: list[torch.Tensor], dsts: list[torch.Tensor], ptrs: set[int]) -> Any:
        """Copy the GPU tensors of ``srcs`` into ``dsts`` (host, same index) asynchronously; returns the
        event after the last copy, or None when no source is on a GPU. ``ptrs``: the guarded optimizer's
        storages (:func:`~trainguard.checkpoint.pinned.optimizer_storages`), copied last and held back
        by nothing but its own next step."""
        gpu = [i for i, t in enumerate(srcs) if t.is_cuda]
        if not gpu:
            return None
        now = [(srcs[i], dsts[i]) for i in gpu if srcs[i].data_ptr() not in ptrs]
        later = [(srcs[i], dsts[i]) for i in gpu if srcs[i].data_ptr() in ptrs]
        _, done = self._stream(srcs[gpu[0]].device).copy_split(now, later, guarded=bool(later))
        return done

    def to_host(self, srcs: list[torch.Tensor], ptrs: set[int]) -> tuple[list[torch.Tensor], Any]:
        """``srcs`` with every GPU tensor replaced by a host copy in a pinned arena (being copied: wait on
        the returned event before reading them); host tensors as they are. For parity, which reads its
        sources in the background: the GPU tensors are not cloned on the device."""
        gpu = [t for t in srcs if t.is_cuda]
        if not gpu:
            return srcs, None
        sig = tuple((tuple(t.shape), t.dtype) for t in gpu)
        if sig != self._arena_sig:
            if self._arena is not None:
                self._arena.release()
            self._arena = HostArena(layout_bytes(gpu), pin=True)
            self._arena_views = build(list(gpu), self._arena)
            self._arena_sig = sig
        it = iter(self._arena_views)
        hosts = [next(it) if t.is_cuda else t for t in srcs]
        done = self.start(srcs, hosts, ptrs)
        return hosts, done

    def close(self) -> None:
        if self._arena is not None:
            self._arena.release()
        self._arena, self._arena_sig, self._arena_views = None, None, []


__all__ = ["GpuCopies"]
