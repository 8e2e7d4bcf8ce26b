"""Tier 0's slot files: their format, their sizing and the checks that they fit (split out of
:mod:`trainguard.checkpoint.memory`, which keeps the tier itself).

A slot file is ``HEADER_BYTES`` of header (:class:`Header`, packed by ``_HEADER``), then the tensors
back to back (each aligned to :data:`ALIGN`), then the pickled skeleton. A writer zeroes the commit
word first (:func:`_zero_commit`), writes the data (:func:`_write`), checksums it and writes the header
with the commit word ``step + 1`` last (:func:`_commit`, :func:`_seal`): a slot whose commit word does
not name its step is torn and never read. Each rank keeps :data:`SLOTS` of them (double buffering).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainguard.checkpoint import pinned
from trainguard.checkpoint.errors import CheckpointError


SLOTS = 2
"""Slot files per rank (double buffering: a torn write never destroys the previous snapshot)."""


HEADER_BYTES = 4096
"""The header's room at the start of every slot file (the data starts page-aligned after it)."""


ALIGN = 16
"""Byte alignment of every tensor in a slot."""


MAGIC = b"TGMEM002"
"""Version 2: the data's checksum is :func:`checksum` (CRC32 of per-chunk CRC32s), not one CRC32."""


_HEADER = struct.Struct("<8sQqqqQQQI")
"""magic, commit (step + 1 once complete, else 0), step, world size, rank, tensor bytes, skeleton bytes,
data capacity, :func:`checksum` of the data (tensors + skeleton)."""


_COMMIT_OFFSET = 8


_META_SLACK = 64 * 1024
"""Room for the skeleton to grow between snapshots (the cursor and RNG blobs change size a little)."""


CHUNK_BYTES = 64 * 1024 * 1024
""":func:`checksum`'s chunk: each is CRC32-ed on its own, by several threads at once."""


def checksum_threads(local_world_size: int = 1) -> int:
    """Threads one rank's :func:`checksum` uses: its share of this process's CPUs (8 at most)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // max(1, local_world_size)))


def checksum(data: Any, threads: int = 1) -> int:
    """The checksum of a slot's data: CRC32 of the little-endian CRC32s of its :data:`CHUNK_BYTES`
    chunks, computed by up to ``threads`` threads (``zlib.crc32`` releases the GIL). One CRC32 over 15 GB
    ran at 1.9 GB/s on the first GPU machine and held every snapshot's commit for 7.7 s (gpu-check of
    2026-11-27); the chunks' CRCs in parallel scale with the CPUs. The value depends on the data only,
    never on ``threads``."""
    with memoryview(data) as mv, mv.cast("B") as flat:
        n = len(flat)
        chunks = max(1, -(-n // CHUNK_BYTES))
        crcs = [0] * chunks

        def run(first: int, step: int) -> None:
            for i in range(first, chunks, step):
                with flat[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES] as part:
                    crcs[i] = zlib.crc32(part)

        k = max(1, min(threads, chunks))
        workers = [threading.Thread(target=run, args=(j, k), name=f"tg-checksum-{j}", daemon=True) for j in range(1, k)]
        for w in workers:
            w.start()
        try:
            run(0, k)
        finally:
            for w in workers:
                w.join()
    return zlib.crc32(struct.pack(f"<{chunks}I", *crcs))


class MemoryTierError(CheckpointError):
    """Tier 0 cannot work as configured (does not fit, or its folder is unusable): the message names
    the setting and the fix."""


@dataclass(frozen=True, slots=True)
class Header:
    """A slot's header, as read back."""

    commit: int
    step: int
    world_size: int
    rank: int
    tensor_bytes: int
    meta_bytes: int
    capacity: int
    crc32: int

    @property
    def complete(self) -> bool:
        """The writer finished this slot (the commit word is written last and names its step)."""
        return self.commit == self.step + 1 and self.step >= 0

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.commit, self.step, self.world_size, self.rank, self.tensor_bytes,
                            self.meta_bytes, self.capacity, self.crc32)

    @classmethod
    def unpack(cls, raw: bytes) -> Header | None:
        """The header in ``raw`` (None: too short, or not a slot of ours)."""
        if len(raw) < _HEADER.size:
            return None
        magic, *rest = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            return None
        return cls(*rest)


def slot_bytes(tensor_bytes: int, meta_bytes: int) -> int:
    """Size of one slot file for a state of ``tensor_bytes`` (aligned) and a skeleton of ``meta_bytes``:
    room for the skeleton to grow by as much again (4 KiB at least, :data:`_META_SLACK` at most; a
    skeleton that outgrows it resizes the slot)."""
    return HEADER_BYTES + tensor_bytes + meta_bytes + min(_META_SLACK, max(4096, meta_bytes))


def node_bytes(per_slot: int, local_world_size: int, copies: int = 1, buffers: float | None = None) -> int:
    """Host memory this node's snapshots take when every local rank holds a state like this one:
    ``copies`` = 1 (tier 0: its own two slots) or 2 (tier 1 too: two slots of a buddy's replica);
    ``buffers``, when given, is the number of slot-sized buffers per rank instead (parity: one own slot
    and two parity blocks, :func:`parity_buffers`)."""
    per_rank = SLOTS * max(1, copies) if buffers is None else buffers
    return int(per_slot * per_rank * max(1, local_world_size))


def parity_buffers(g: int) -> float:
    """Slot-sized buffers per rank with XOR parity over ``g`` nodes: one own slot and two parity blocks
    of ``1 / (g - 1)`` of a slot each (:mod:`trainguard.checkpoint.parity`)."""
    return 1 + 2 / max(1, g - 1)


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of ``meminfo`` in bytes: what the host can give without swapping; None when it
    cannot be read (not Linux)."""
    try:
        with open(meminfo) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def folder_bytes(directory: str) -> int:
    """Bytes the snapshot and replica files in ``directory`` take (0 when it cannot be listed)."""
    total = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if name.endswith(".snap"):
            try:
                total += os.path.getsize(os.path.join(directory, name))
            except OSError:
                pass
    return total


def check_fits(per_slot: int, *, local_world_size: int, max_bytes: int, free_bytes: int, directory: str,
               copies: int = 1, available_bytes: int | None = None, buffers: float | None = None) -> None:
    """Raise :class:`MemoryTierError` (naming the setting and the fix) when this node's snapshots (and
    replicas: ``copies`` 2) do not fit under ``checkpoint.memory_max_bytes``, or in the free space of
    the folder (what is free plus what this rank already holds there). With ``memory_max_bytes`` 0 the
    cap is half of ``available_bytes`` (the host's available memory plus what the node's snapshots
    already hold; None: no such cap): tier 0 is on by default and must not take the memory training
    needs."""
    need = node_bytes(per_slot, local_world_size, copies, buffers)
    what = (f"{SLOTS} buffers x {per_slot} bytes x {max(1, local_world_size)} local workers" + (
        f" x {copies} (own + a buddy's replica)" if copies > 1 else "") if buffers is None else
        f"{buffers:.2f} buffers (own + parity) x {per_slot} bytes x {max(1, local_world_size)} local workers")
    off = ("or turn tier 0 off with checkpoint.memory_interval_steps=0 "
           "(TRAINGUARD_CHECKPOINT_MEMORY_INTERVAL_STEPS)")
    if max_bytes and need > max_bytes:
        raise MemoryTierError(
            f"in-memory snapshots need {need} bytes on this node ({what}) but checkpoint.memory_max_bytes "
            f"(TRAINGUARD_CHECKPOINT_MEMORY_MAX_BYTES) is {max_bytes}. Fix: raise it to at least {need}, {off}")
    if not max_bytes and available_bytes is not None and need > available_bytes // 2:
        raise MemoryTierError(
            f"in-memory snapshots need {need} bytes on this node ({what}), more than half of the "
            f"{available_bytes} bytes of memory the host has available (MemAvailable plus the snapshots "
            f"already held), the cap while checkpoint.memory_max_bytes (TRAINGUARD_CHECKPOINT_MEMORY_MAX_BYTES) "
            f"is 0. Fix: set checkpoint.memory_max_bytes to at least {need} if the host can spare it, {off}")
    mine = node_bytes(per_slot, 1, copies, buffers)
    if mine > free_bytes:
        raise MemoryTierError(
            f"in-memory snapshots need {mine} bytes for this rank ({what.split(' x ')[0]} x {per_slot} bytes"
            f"{' x 2 with the replica' if copies > 1 and buffers is None else ''}) but "
            f"{directory} has {free_bytes} bytes free. Fix: make the tmpfs larger (e.g. `mount -o remount,"
            f"size=...` for /dev/shm, or --shm-size for a container), point checkpoint.memory_dir "
            f"(TRAINGUARD_CHECKPOINT_MEMORY_DIR) at a larger tmpfs, {off}")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Slot:
    """One slot file of this rank, mapped read-write while it is the one being written."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = os.path.getsize(path) if os.path.exists(path) else 0
        self._mm: mmap.mmap | None = None
        self._views: list[torch.Tensor] = []
        self._views_sig: Any = None
        self._pin: pinned.PinnedRegion | None = None

    def header(self) -> Header | None:
        try:
            with open(self.path, "rb") as fh:
                return Header.unpack(fh.read(_HEADER.size))
        except OSError:
            return None

    def ensure(self, size: int) -> None:
        """Size the file to ``size`` bytes, reserving the memory now (a full tmpfs fails here, cleanly,
        instead of with SIGBUS on a later write into the mapping)."""
        if self._mm is not None and self.size == size:
            return
        self.close()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size

    @property
    def mm(self) -> mmap.mmap:
        assert self._mm is not None
        return self._mm

    def pin(self) -> str | None:
        """Page-lock the mapping in place (once per mapping), for asynchronous copies from a GPU; returns
        why it could not be (the copies then go through pageable memory), else None."""
        if self._pin is None:
            refused = pinned.pin_refusal(self.path)
            self._pin = pinned.PinnedRegion(self.mm, refused=refused)
        return self._pin.error

    def views(self, sig: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> list[torch.Tensor]:
        """Tensors over the mapped data area, one per ``(shape, dtype)`` of ``sig`` (built once per layout)."""
        if self._views_sig != sig:
            self._views = []
            total = sum(_align(_numel(sh) * torch.empty((), dtype=dt).element_size()) for sh, dt in sig)
            buf = torch.frombuffer(self.mm, dtype=torch.uint8, offset=HEADER_BYTES, count=total) if total else None
            off = 0
            for shape, dtype in sig:
                n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
                raw = buf[off:off + n] if buf is not None and n else torch.empty(0, dtype=torch.uint8)
                self._views.append(raw.view(dtype).view(shape))
                off += _align(n)
            self._views_sig = sig
        return self._views

    def invalidate(self) -> None:
        """Zero the commit word (the slot reads as torn from now on)."""
        if self._mm is not None:
            self._mm[_COMMIT_OFFSET:_COMMIT_OFFSET + 8] = b"\0" * 8
            return
        try:
            with open(self.path, "r+b") as fh:
                if Header.unpack(fh.read(_HEADER.size)) is not None:
                    fh.seek(_COMMIT_OFFSET)
                    fh.write(b"\0" * 8)
        except OSError:
            pass

    def valid_header(self, world_size: int, rank: int | None) -> Header | None:
        """The header when this slot is complete, of this world size and ``rank`` (None: any); else None.
        (The data's CRC32 is the caller's to check.)"""
        h = self.header()
        if h is None or not h.complete or h.world_size != world_size or (rank is not None and h.rank != rank):
            return None
        return h

    def read_valid(self, world_size: int, rank: int | None) -> tuple[Header, bytes] | None:
        """The header and data of this slot when it is complete, of this world size and ``rank`` (None:
        any), and its CRC32 matches; else None."""
        h = self.valid_header(world_size, rank)
        if h is None:
            return None
        n = h.tensor_bytes + h.meta_bytes
        try:
            with open(self.path, "rb") as fh:
                fh.seek(HEADER_BYTES)
                data = fh.read(n)
        except OSError:
            return None
        if len(data) != n or checksum(data, checksum_threads()) != h.crc32:
            return None
        return h, data

    def close(self) -> None:
        self._views, self._views_sig = [], None  # release the exported buffer before unmapping
        if self._pin is not None:
            self._pin.release()
            self._pin = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def _zero_commit(mm: mmap.mmap) -> None:
    """Zero a slot's commit word: it reads as torn until :func:`_commit` ends the snapshot being written."""
    mm[_COMMIT_OFFSET:_COMMIT_OFFSET + 8] = b"\0" * 8


def _write(mm: mmap.mmap, views: list[torch.Tensor], tensors: list[torch.Tensor], *, tensor_bytes: int,
           meta: bytes) -> None:
    """Write one snapshot's host tensors and metadata into a mapped slot, its commit word zeroed first
    (:func:`_commit` ends it). GPU tensors are not copied here (:class:`~trainguard.checkpoint.gpusnap.GpuCopies`)."""
    _zero_commit(mm)
    if tensors:
        with torch.no_grad():
            torch._foreach_copy_(views, tensors)
    mm[HEADER_BYTES + tensor_bytes:HEADER_BYTES + tensor_bytes + len(meta)] = meta


def _commit(mm: mmap.mmap, *, step: int, world_size: int, rank: int, tensor_bytes: int, meta_bytes: int,
            threads: int = 1) -> None:
    """Checksum the data :func:`_write` wrote (``threads``: :func:`checksum`'s), then the header, the
    commit word last."""
    end = HEADER_BYTES + tensor_bytes + meta_bytes
    with memoryview(mm) as mv, mv[HEADER_BYTES:end] as data:
        crc = checksum(data, threads)  # releases the GIL: the training thread runs on meanwhile
    _seal(mm, Header(commit=0, step=step, world_size=world_size, rank=rank, tensor_bytes=tensor_bytes,
                     meta_bytes=meta_bytes, capacity=len(mm) - HEADER_BYTES, crc32=crc))


def _seal(mm: mmap.mmap, h: Header) -> None:
    """Write a slot's header ``h`` (its commit word zero), then the commit word ``step + 1``: last."""
    mm[0:_HEADER.size] = h.pack()
    mm[_COMMIT_OFFSET:_COMMIT_OFFSET + 8] = struct.pack("<Q", h.step + 1)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class TierState:
    """What every part of :class:`~trainguard.checkpoint.memory.MemoryTier` reads of the tier (declared
    once here; the tier sets it): its node folder, its rank in the world, its own slots and the newest
    of them, the snapshot this process took last, the checksum threads, the replica files' sizes."""

    directory: str
    rank: int
    world_size: int
    _slots: list[_Slot]
    _newest: int | None
    _last: Any
    _threads: int
    _replica_sizes: dict[str, int]

    if TYPE_CHECKING:
        def settle(self) -> None: ...
        def _node_files(self) -> list[_Slot]: ...
