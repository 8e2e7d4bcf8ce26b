"""Tier 1 in the tier's folder: a buddy's replicas, and the snapshots this node hands out.

A rank's newest snapshot goes to its buddy node (the transfer: :mod:`trainguard.checkpoint.replica`),
which keeps it double buffered in ``replica-<rank>-<k>.snap`` files: received into the slot that does
not hold the newest intact replica, checked against the sender's header (length, CRC32) and committed
with the commit word last, so a transfer cut short never replaces a good replica. At restore every rank
reports what it can hand out (:meth:`ReplicaSlots.provides`: its own snapshots, the replicas its node
holds and, for replicated state, :data:`ANY_RANK` ones) and hands a snapshot to a peer as a
:meth:`~ReplicaSlots.blob` (header + data), which the peer loads with :meth:`~ReplicaSlots.load_blob`.
:meth:`~ReplicaSlots.newest_view`, :meth:`~ReplicaSlots.receive_replica` and
:meth:`~ReplicaSlots.commit_replica` run on the replication thread while the training thread waits for
it before the next snapshot.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import TYPE_CHECKING, Any

from trainguard.checkpoint.skeleton import _intact, _load_data, _world_of, layout, materialise, skeleton
from trainguard.checkpoint.slots import (_COMMIT_OFFSET, _HEADER, HEADER_BYTES, SLOTS, Header, MemoryTierError,
                                         _seal, _Slot, TierState, checksum)

ANY_RANK = -1
"""The rank of a *replicated* snapshot (DDP: every rank holds the whole model and optimizer state) in
:meth:`MemoryTier.provides`: it restores any rank of a world of any size."""

class ReplicaSlots(TierState):
    """Tier 1 of :class:`~trainguard.checkpoint.memory.MemoryTier`: the replicas it keeps for a buddy and
    the snapshots it hands out (a mixin: the folder, slots and rank are the tier's)."""

    replicated: bool

    if TYPE_CHECKING:
        def available(self, state: dict[str, Any]) -> list[tuple[int, str]]: ...
        def _own_files(self) -> list[_Slot]: ...

    def blob(self, rank: int, step: int, world: str, world_size: int | None = None) -> bytes:
        """A complete slot (header + data) of ``rank``'s snapshot of ``step`` by ``world``: this rank's
        own, a replica this node holds, or (``rank`` :data:`ANY_RANK`) a replicated snapshot of any rank
        and world size in this node's folder; with ``world_size`` (a world of another size, to reshard),
        any slot or replica of the node folder of that rank and size. Raises :class:`MemoryTierError`
        when there is none."""
        self.settle()
        if world_size is not None:
            slots = self._node_files()
        elif rank == ANY_RANK:
            slots = self._own_files()
        else:
            slots = self._slots if rank == self.rank else self._replica_slots(rank)
        for s in slots:
            if world_size is not None:
                got = s.read_valid(world_size, rank)
            elif rank == ANY_RANK:
                got = s.read_valid(s.header().world_size if s.header() else -1, None)
            else:
                got = s.read_valid(self.world_size, rank)
            if got is not None and got[0].step == step and _world_of(*got) == world:
                h, data = got
                return h.pack() + bytes(HEADER_BYTES - _HEADER.size) + data
        raise MemoryTierError(f"no valid in-memory snapshot of rank {rank}"
                              f"{'' if world_size is None else f' of a world of {world_size}'}, step {step} "
                              f"in {self.directory}")

    def newest_blob(self) -> bytes | None:
        """This rank's newest snapshot as a blob (header + data, a copy), or None."""
        got = self.newest_view()
        if got is None:
            return None
        header, view = got
        with view:
            return header + bytes(view)

    def newest_view(self) -> tuple[bytes, memoryview] | None:
        """This rank's newest snapshot for the buddy without a copy: its header block
        (:data:`HEADER_BYTES`) and a view of its checksum-verified data in the mapped slot (release it
        before the next snapshot, which the runtime only takes once the transfer is over). None when
        there is none."""
        self.settle()
        if self._newest is None:
            return None
        slot = self._slots[self._newest]
        h = slot.valid_header(self.world_size, self.rank)
        if h is None:
            return None
        if slot._mm is None:  # restored, not written by this process: map it
            slot.ensure(slot.size)
        view = memoryview(slot.mm)[HEADER_BYTES:HEADER_BYTES + h.tensor_bytes + h.meta_bytes]
        if checksum(view, self._threads) != h.crc32:
            view.release()
            return None
        return h.pack() + bytes(HEADER_BYTES - _HEADER.size), view

    def _replica_slots(self, rank: int) -> list[_Slot]:
        return [_Slot(os.path.join(self.directory, f"replica-{rank:05d}-{k}.snap")) for k in range(SLOTS)]

    def receive_replica(self, rank: int, nbytes: int) -> tuple[_Slot, memoryview]:
        """Where the next replica of ``rank`` (``nbytes`` of data) is received: the replica slot that does
        not hold its newest complete one (by commit word), commit word zeroed first, and a writable view
        of its data area. End with :meth:`commit_replica` (releasing the view first)."""
        slots = self._replica_slots(rank)
        newest = max(((h.step, i) for i, h in enumerate(s.header() for s in slots)
                      if h is not None and h.complete and h.rank == rank), default=None)
        target = slots[0 if newest is None else (newest[1] + 1) % SLOTS]
        target.ensure(max(HEADER_BYTES + nbytes, target.size))
        target.mm[_COMMIT_OFFSET:_COMMIT_OFFSET + 8] = b"\0" * 8
        return target, memoryview(target.mm)[HEADER_BYTES:HEADER_BYTES + nbytes]

    def commit_replica(self, target: _Slot, header: bytes, rank: int) -> Header:
        """Check a replica received into ``target`` against its sender's ``header`` (complete, of ``rank``,
        the length and the CRC32 of the data), then write the header, the commit word last. Raises
        :class:`MemoryTierError` (the slot stays invalid; the other one, the newest good replica, stands)."""
        h = Header.unpack(bytes(header[:_HEADER.size]))
        try:
            if h is None or not h.complete or h.rank != rank or HEADER_BYTES + h.tensor_bytes + h.meta_bytes > target.size:
                raise MemoryTierError("a replica that is not a complete snapshot was refused")
            with memoryview(target.mm)[HEADER_BYTES:HEADER_BYTES + h.tensor_bytes + h.meta_bytes] as data:
                if checksum(data, self._threads) != h.crc32:
                    raise MemoryTierError("a replica that failed its checksum was refused")
            _seal(target.mm, dataclasses.replace(h, commit=0))
        finally:
            self._replica_sizes[target.path] = target.size
            target.close()
        return h

    def write_replica(self, blob: bytes) -> Header:
        """Keep a buddy's snapshot (a :meth:`newest_blob`): at most one replica per source rank, double
        buffered: written into the slot that does not hold the newest intact replica, commit word last,
        so a transfer cut short never replaces a good replica. Raises :class:`MemoryTierError` on a blob
        that is not a complete snapshot (checked before any slot is touched)."""
        h = Header.unpack(blob[:_HEADER.size])
        data = memoryview(blob)[HEADER_BYTES:]
        if h is None or not h.complete or len(data) != h.tensor_bytes + h.meta_bytes or checksum(data, self._threads) != h.crc32:
            raise MemoryTierError("a replica that is not a complete snapshot was refused")
        target, view = self.receive_replica(h.rank, len(data))
        with view:
            view[:] = data
        return self.commit_replica(target, blob[:HEADER_BYTES], h.rank)

    def write_rebuilt(self, rank: int, step: int, world_size: int, tensor_bytes: int, data: bytes) -> Header:
        """Keep the snapshot of old ``rank`` rebuilt from parity (its data, checked segment by segment) as
        a replica in this node's folder (:meth:`write_replica`)."""
        h = Header(commit=step + 1, step=step, world_size=world_size, rank=rank, tensor_bytes=tensor_bytes,
                   meta_bytes=len(data) - tensor_bytes, capacity=len(data), crc32=checksum(data, self._threads))
        return self.write_replica(h.pack() + bytes(HEADER_BYTES - _HEADER.size) + data)

    def provides(self, state: dict[str, Any]) -> list[tuple[int, int, str]]:
        """``(rank, step, world)`` of every intact snapshot this rank can hand out: of this world size,
        its own (whose layout fits ``state``) and the replicas its node holds (checked by their rank);
        when :attr:`replicated`, also every replicated snapshot in the node folder whose layout fits, of
        any rank and world size, as ``(ANY_RANK, step, world)``."""
        out = [(self.rank, step, world) for step, world in self.available(state)]
        if self.replicated:
            want = layout(skeleton(materialise(state), []))
            for h, meta in _intact(self._own_files()):
                if meta.get("replicated") and layout(meta["skeleton"]) == want:
                    out.append((ANY_RANK, h.step, str(meta.get("world", ""))))
        for name in sorted(os.listdir(self.directory)):
            if not name.startswith("replica-") or not name.endswith(".snap"):
                continue
            got = _Slot(os.path.join(self.directory, name)).read_valid(self.world_size, None)
            if got is not None and got[0].rank != self.rank:
                out.append((got[0].rank, got[0].step, _world_of(*got)))
        return sorted(set(out), key=lambda x: (-x[1], x[0], x[2]))

    def load_blob(self, blob: bytes, state: dict[str, Any]) -> dict[str, Any]:
        """Load a snapshot received from a peer (a :meth:`blob`) into ``state``; raises
        :class:`MemoryTierError` when it is damaged or does not fit ``state``'s layout."""
        h = Header.unpack(blob[:_HEADER.size])
        data = blob[HEADER_BYTES:]
        if h is None or not h.complete or checksum(data, self._threads) != h.crc32:
            raise MemoryTierError("a snapshot received from a peer failed its checksum")
        meta = pickle.loads(data[h.tensor_bytes:])
        if layout(meta["skeleton"]) != layout(skeleton(materialise(state), [])):
            raise MemoryTierError(f"the snapshot of rank {h.rank} received from a peer does not fit this rank's state")
        self._last = None
        return _load_data(h, data, state)
