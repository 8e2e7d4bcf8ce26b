"""Tier 1 as XOR parity, the tier's side: the exchange run beside the next step, the parity slots, the reads a rebuild needs.

With parity (``checkpoint.memory_replica_parity``) each rank keeps one own slot, not two, and every
snapshot's parity is exchanged with the members of its group before the snapshot is written into that
slot (the exchange and the parity arithmetic: :mod:`trainguard.checkpoint.parity`; why this order:
there). The exchange runs on the tier's background thread while the next forward and backward run;
the guarded optimizer's ``step()`` waits for what is left of it. Parity blocks live in
``parity-<rank>-<k>.snap`` files, double buffered, commit word last. At restore the survivors'
inventories (:meth:`ParitySlots.parity_inventory`) say what can be rebuilt, and the rebuild reads the
blocks (:meth:`ParitySlots.parity_block`); the rebuild itself is the restore's
(:mod:`~trainguard.checkpoint.nearest`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainguard.checkpoint import parity, pinned
from trainguard.checkpoint.gpusnap import GpuCopies
from trainguard.checkpoint.skeleton import _intact
from trainguard.checkpoint.slots import (_COMMIT_OFFSET, ALIGN, HEADER_BYTES, SLOTS, Header, MemoryTierError, _commit,
                                         _seal, _Slot, TierState, _write, checksum)

_PARITY_META = 4096
"""Room after a parity block for its record (world, members, each contributor's lengths and CRC32)."""

class ParitySlots(TierState):
    """Tier 1 as parity in :class:`~trainguard.checkpoint.memory.MemoryTier` (a mixin: the group, the
    own slot and the background thread are the tier's)."""

    fault_hook: Any
    parity_failed: str | None
    parity_step: int | None
    parity_seconds: float
    _parity: tuple[Any, list[int], int] | None
    _parity_lock: threading.Lock
    _pool: ThreadPoolExecutor | None
    _committing: Future[None] | None
    _copied: threading.Event | None
    _guarded: Any
    _gpu: GpuCopies
    _sig: Any

    if TYPE_CHECKING:
        def _attach(self, rank: int, world_size: int, parity: tuple[Any, list[int], int] | None = None) -> None: ...
        def _background(self, job: Any) -> None: ...
        def _guarded_ptrs(self, sig: Any) -> set[int]: ...

    @property
    def parity(self) -> bool:
        """Tier 1 is XOR parity for this world (:meth:`set_parity`)."""
        return self._parity is not None

    def set_parity(self, group: Any, members: list[int], index: int) -> None:
        """Tier 1 as XOR parity in this world (:mod:`trainguard.checkpoint.parity`): every snapshot's
        parity is exchanged with ``members`` (global ranks of ``group``, this rank at ``index``) before
        the snapshot is written into this rank's one own slot. Call on every rank of the world after
        :meth:`rebind` (which ends it), before the first snapshot."""
        self._attach(self.rank, self.world_size, parity=(group, members, index))

    def _snapshot_parity(self, step: int, target: _Slot, views: list[torch.Tensor], tensors: list[torch.Tensor],
                         later: set[int], meta: bytes, tensor_bytes: int, world: str) -> None:
        """:meth:`snapshot` with parity: the tensors the guarded optimizer does not own are cloned now
        (they may change in the next forward); the exchange, then the write into the one own slot, run in
        the background (:meth:`_parity_job`) while the optimizer waits (:meth:`guard`)."""
        srcs = [t if (i in later and t.is_contiguous()) or t.is_cuda
                else t.detach().clone(memory_format=torch.contiguous_format) for i, t in enumerate(tensors)]
        srcs, gpu_done = self._gpu.to_host(srcs, self._guarded_ptrs(self._sig) if self._guarded is not None else set())  # GPU tensors: host copies, never device clones
        self._copied = None  # the exchange reads host tensors of the optimizer: its step waits for all of it
        job = functools.partial(self._parity_job, step, target, views, srcs, meta, tensor_bytes, world, gpu_done)
        self._newest, self._last = 0, None
        self._background(job)

    def _parity_job(self, step: int, target: _Slot, views: list[torch.Tensor], srcs: list[torch.Tensor],
                    meta: bytes, tensor_bytes: int, world: str, gpu_done: Any = None) -> bool:
        """Exchange the parity of step ``step``, agree that every rank committed its block, then write and
        commit the own slot (see :mod:`trainguard.checkpoint.parity` for why this order). False when the
        own slot was not written (the exchange failed: the previous snapshot stands)."""
        assert self._parity is not None
        group, members, index = self._parity
        t0 = time.monotonic()
        me = threading.current_thread()
        ok = 0
        try:
            if gpu_done is not None:
                pinned.bind_thread(self._gpu.device)
                gpu_done.synchronize()  # the host copies of the GPU tensors are complete
            flat = parity.Flat.of(srcs, meta, ALIGN)
            self._write_parity(step, world, flat, group, members, index, tensor_bytes, len(meta))
            ok = 1
        except Exception as e:  # noqa: BLE001 - a failed exchange must not kill training
            self.parity_failed = f"{type(e).__name__}: {e}"[:500]
        # Every rank committed its block before any own slot is overwritten (a rank whose exchange failed
        # says so here too; with a peer gone this fails, or hangs until the worker parks and leaves it).
        flag = torch.tensor([ok], dtype=torch.int64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        except Exception as e:  # noqa: BLE001
            self.parity_failed = self.parity_failed or f"{type(e).__name__}: {e}"[:500]
            flag[0] = 0
        if not int(flag[0]) and self.parity_failed is None:
            self.parity_failed = "another rank's parity exchange failed"
        ok = int(flag[0])
        with self._parity_lock:
            if not ok or getattr(me, "tg_abandoned", False):
                return False
            self.parity_step = step
            _write(target.mm, views, srcs, tensor_bytes=tensor_bytes, meta=meta)
            if self.fault_hook is not None:
                self.fault_hook(step)
            _commit(target.mm, step=step, world_size=self.world_size, rank=self.rank, tensor_bytes=tensor_bytes,
                    meta_bytes=len(meta), threads=self._threads)
        self.parity_seconds = time.monotonic() - t0
        return True

    def _write_parity(self, step: int, world: str, flat: parity.Flat, group: Any, members: list[int],
                      index: int, tensor_bytes: int, meta_bytes: int) -> None:
        """The exchange itself, into the parity slot that does not hold the newest complete block
        (commit word zeroed first, written last: a cut exchange never replaces a good block)."""
        slots = self._parity_slots(self.rank)
        newest = max(((h.step, i) for i, h in enumerate(s.header() for s in slots) if h is not None and h.complete),
                     default=None)
        target = slots[0 if newest is None else (newest[1] + 1) % SLOTS]
        views: list[torch.Tensor] = []

        def block(n: int) -> torch.Tensor:
            target.ensure(max(HEADER_BYTES + n + _PARITY_META, target.size))
            target.mm[_COMMIT_OFFSET:_COMMIT_OFFSET + 8] = b"\0" * 8
            views.append(torch.frombuffer(target.mm, dtype=torch.uint8, offset=HEADER_BYTES, count=n))
            return views[-1]

        try:
            contrib = parity.exchange(flat, block, group=group, members=members, index=index, step=step,
                                      tensor_bytes=tensor_bytes, meta_bytes=meta_bytes)
            seg = views[0].numel()
            views.clear()
            pmeta = pickle.dumps({"world": world, "members": members, "index": index, "seg": seg,
                                  "contrib": [dataclasses.asdict(c) for c in contrib]}, protocol=pickle.HIGHEST_PROTOCOL)
            if HEADER_BYTES + seg + len(pmeta) > target.size:
                raise MemoryTierError(f"the parity block's record ({len(pmeta)} bytes) does not fit its slot")
            target.mm[HEADER_BYTES + seg:HEADER_BYTES + seg + len(pmeta)] = pmeta
            with memoryview(target.mm) as mv, mv[HEADER_BYTES:HEADER_BYTES + seg + len(pmeta)] as data:
                crc = checksum(data, self._threads)
            _seal(target.mm, Header(commit=0, step=step, world_size=self.world_size, rank=self.rank, tensor_bytes=seg,
                                    meta_bytes=len(pmeta), capacity=target.size - HEADER_BYTES, crc32=crc))
        finally:
            views.clear()  # the view into the mapping goes before the mapping
            self._replica_sizes[target.path] = target.size
            with contextlib.suppress(BufferError):  # a failed gloo work may still hold a view
                target.close()

    def _parity_slots(self, rank: int) -> list[_Slot]:
        return [_Slot(os.path.join(self.directory, f"parity-{rank:05d}-{k}.snap")) for k in range(SLOTS)]

    def release_parity(self) -> None:
        """Drop the parity exchange's group (after :meth:`close`, the world's groups destroyed)."""
        if self._parity is not None:
            self._parity = (None, self._parity[1], self._parity[2])

    def parity_inventory(self) -> dict[str, Any]:
        """What this node's folder holds for a parity rebuild (:func:`~trainguard.checkpoint.parity.plan_rebuilds`):
        every intact snapshot (own or replica, any rank and world size) and every intact parity block."""
        self.settle()
        data = [(h.rank, h.step, str(meta.get("world", "")), h.world_size) for h, meta in _intact(self._node_files())]
        blocks = []
        for name in sorted(os.listdir(self.directory)):
            if not (name.startswith("parity-") and name.endswith(".snap")):
                continue
            slot = _Slot(os.path.join(self.directory, name))
            h = slot.header()
            got = slot.read_valid(h.world_size, None) if h is not None else None
            if got is None:
                continue
            try:
                record = pickle.loads(got[1][h.tensor_bytes:])
            except Exception:  # noqa: BLE001 - a block we cannot read is not a candidate
                continue
            blocks.append((h.rank, h.step, str(record["world"]), h.world_size, record))
        return {"node": self.directory, "data": data, "blocks": blocks}

    def parity_block(self, rank: int, step: int, world: str) -> bytes:
        """The parity block old rank ``rank`` held for ``(step, world)`` in this node's folder (checksum
        verified). Raises :class:`MemoryTierError` when there is none."""
        for slot in self._parity_slots(rank):
            h = slot.header()
            got = slot.read_valid(h.world_size, rank) if h is not None else None
            if got is not None and h.step == step and pickle.loads(got[1][h.tensor_bytes:])["world"] == world:
                return got[1][:h.tensor_bytes]
        raise MemoryTierError(f"no valid parity block of rank {rank}, step {step} in {self.directory}")

    def abandon(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the snapshot in the background; when it is still running
        (a parity exchange stuck with a vanished peer), leave it behind: it will not write the own slot,
        the previous snapshot stands. True when nothing was left behind."""
        pending = self._committing
        if pending is None:
            return True
        try:
            pending.result(timeout)
            self._committing = None
            return True
        except TimeoutError:
            pass
        with self._parity_lock:
            if self._pool is not None:
                for t in getattr(self._pool, "_threads", ()):
                    t.tg_abandoned = True  # type: ignore[attr-defined]
                self._pool.shutdown(wait=False)
                self._pool = None
            self._committing = None
            self.parity_failed = self.parity_failed or "the parity exchange was left behind (a peer is gone)"
        return False
