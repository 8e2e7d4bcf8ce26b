"""Restore from the nearest tier first: the nodes' memory (tiers 0 and 1) before storage (tier 2).

:class:`NearestTiers` is the part of a restore that reads no storage: over the checkpoint group (every
method is a collective, called on every rank in the same order) it

1. with parity (``checkpoint.memory_replica_parity``), rebuilds the snapshots of a lost node's ranks
   from the survivors' parity blocks (:meth:`NearestTiers.rebuild_from_parity`), into replica files
   the next step finds as buddy replicas;
2. picks the newest step newer than storage's for which a snapshot of *every* rank exists in some
   node's memory (its own, a buddy's replica, a replicated one: :func:`choose_sources`), hands the
   missing ones over point to point and loads them on every rank;
3. else, the newest such set written by a world of another size, resharded
   (:mod:`~trainguard.checkpoint.memreshard`).

It returns a :class:`NearestRestore` (which tier, which step, how long, why the nearer ways were not
taken); the durable manager (:mod:`~trainguard.checkpoint.manager`) then claims the world's epoch from
it, or restores from storage when nothing was loaded. A set that failed to load on some rank is
invalidated on every rank, so it is never chosen again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainguard.checkpoint import parity
from trainguard.checkpoint.collective import Group
from trainguard.checkpoint.discovery import StepRef
from trainguard.checkpoint.errors import CheckpointError
from trainguard.checkpoint.integrity import describe
from trainguard.checkpoint.memreshard import shards_needed
from trainguard.checkpoint.replicaslots import ANY_RANK
from trainguard.checkpoint.skeleton import blob_skeleton
from trainguard.checkpoint.slots import HEADER_BYTES
from trainguard.contract.protocol import CheckpointTier

if TYPE_CHECKING:
    from trainguard.checkpoint.memory import MemoryTier


def choose_sources(provided: Sequence[Sequence[tuple[int, int, str]]], *, world_size: int,
                   newest_durable: int | None) -> tuple[tuple[int, str] | None, dict[int, tuple[int, int]], str]:
    """Tiers 0 and 1: given the ``(rank, step, world)`` snapshots each current rank can hand out (its
    own, the replicas its node holds for a buddy, and — replicated state, DDP — :data:`ANY_RANK`
    snapshots that stand for every rank), the newest ``(step, world)`` for which *every* rank
    ``0..world_size-1`` has a snapshot somewhere, and for each rank ``(provider, source rank)``: the rank
    that hands it over (itself when it can: a local load; else the lowest rank holding one: a transfer)
    and which snapshot (the rank's own or its replica, or :data:`ANY_RANK`). Never mixes steps or
    worlds; only a step newer than ``newest_durable`` (storage) counts. Returns ``(pick, sources, why)``."""
    holders: dict[tuple[int, str], dict[int, set[tuple[int, int]]]] = {}
    for provider, items in enumerate(provided):
        for rank, step, world in items:
            targets = range(world_size) if rank == ANY_RANK else [rank] if 0 <= rank < world_size else []
            for r in targets:
                holders.setdefault((step, world), {}).setdefault(r, set()).add((provider, rank))
    complete = [k for k, by_rank in holders.items() if len(by_rank) == world_size]
    if not complete:
        if not holders:
            return None, {}, "no rank holds a snapshot"
        best = max(holders, key=lambda k: (len(holders[k]), k[0]))
        missing = sorted(set(range(world_size)) - set(holders[best]))
        return None, {}, f"no step has a snapshot of every rank (step {best[0]} lacks ranks {missing[:8]})"
    pick = max(complete)
    if newest_durable is not None and pick[0] <= newest_durable:
        return None, {}, f"storage holds committed step {newest_durable}, not older than the snapshots' {pick[0]}"
    sources = {}
    for r, options in holders[pick].items():
        local = sorted(o for o in options if o[0] == r)
        sources[r] = local[0] if local else min(options)
    return pick, sources, "ok"


@dataclass(frozen=True, slots=True)
class NearestRestore:
    """What the restore from the nodes' memory did, the same on every rank (the transfers this rank
    took part in aside)."""

    tier: CheckpointTier
    """``MEMORY``: every rank loaded its own snapshot; ``PEER``: some rank received a replica, or the set
    was resharded from another world size; ``NONE``: nothing was loaded (storage next)."""
    step: int | None
    """The step loaded, or None."""
    seconds: float = 0.0
    """The hand-over and the load until every rank agreed it loaded (seconds)."""
    base: StepRef | None = None
    """The newest committed step the loaded state descends from (any rank's), or None."""
    skipped: tuple[str, ...] = ()
    """Why each nearer way was not taken (no complete set, storage newer, a load that failed)."""
    world: str = ""
    """The world that wrote the snapshots loaded."""
    from_peers: dict[int, int] | None = None
    """Same world size: each rank that received its snapshot, and from which rank."""
    replicated: bool = False
    """Same world size: the set was a replicated one (:data:`ANY_RANK`, DDP)."""
    resharded_from: int | None = None
    """Another world size: the old world's size."""
    from_ranks: dict[int, int] | None = None
    """Resharded: each old rank's snapshot, and the rank that held it."""
    needed: tuple[int, ...] = ()
    """Resharded: the old ranks whose snapshots this rank loaded."""
    transfers: int = 0
    """Resharded: the snapshots sent between ranks."""


class NearestTiers:
    """Tiers 0 and 1 at restore, over the checkpoint ``group`` (each method a collective). ``log`` is the
    manager's bound logger."""

    def __init__(self, group: Group, log: Any) -> None:
        self.group = group
        self.rank, self.world_size = group.rank, group.world_size
        self._log = log

    def restore(self, state: dict[str, Any], memory: MemoryTier, newest_durable: int | None) -> NearestRestore:
        """Agree on the newest step for which a snapshot of every rank exists in some node's memory (its own,
        or a buddy's replica), hand the replicas to the ranks that lack their own, load on every rank. When
        there is none, the same at another world size (:meth:`restore_resharded`). Nothing loaded (tier
        ``NONE``) when there is no such step newer than storage's, or a load or transfer failed (storage
        next)."""
        if memory.parity_restore:
            self.rebuild_from_parity(memory)
        try:
            mine = memory.provides(state)
        except Exception as e:  # noqa: BLE001 - an unreadable tier 0 is no reason to fail a restore
            self._log.warning("checkpoint_memory_unreadable", error=describe(e)[:500])
            mine = []
        provided = self.group.all_gather(mine)
        pick, sources, why = choose_sources(provided, world_size=self.world_size, newest_durable=newest_durable)
        if pick is None:
            got = self.restore_resharded(state, memory, newest_durable)
            if got.step is not None:
                return got
            if self.rank == 0:
                self._log.info("checkpoint_memory_skipped", reason=why, newest_durable=newest_durable)
            return NearestRestore(CheckpointTier.NONE, None, skipped=(why, *got.skipped))
        chosen, world = pick
        t0 = time.monotonic()
        err: str | None = None
        extra: dict[str, Any] = {}
        received: bytes | None = None
        moved = sorted(r for r, (p, _) in sources.items() if p != r)
        try:
            received = self._hand_over(memory, sources, moved, chosen, world)
        except Exception as e:  # noqa: BLE001 - agreed below
            err = describe(e)[:500]
        if not any(self.group.all_gather(err)):
            try:
                _, src = sources[self.rank]
                if received is None and src == self.rank:
                    extra = memory.load(chosen, state, world=world)  # its own snapshot: the common case
                else:
                    blob = received if received is not None else memory.blob(src, chosen, world)
                    extra = memory.load_blob(blob, state)
            except Exception as e:  # noqa: BLE001 - agreed below; every rank then goes to storage
                err = describe(e)[:500]
        what = f"loading the in-memory snapshot of step {chosen}"
        failed = self._agreed_load(memory, err, newest_durable, what, step=chosen)
        if failed is not None:
            return NearestRestore(CheckpointTier.NONE, None, skipped=(failed,))
        return NearestRestore(CheckpointTier.PEER if moved else CheckpointTier.MEMORY, chosen,
                              base=self._agreed_base(extra), seconds=time.monotonic() - t0, world=world,
                              from_peers={r: sources[r][0] for r in moved},
                              replicated=any(src == ANY_RANK for _, src in sources.values()))

    def restore_resharded(self, state: dict[str, Any], memory: MemoryTier, newest_durable: int | None) -> NearestRestore:
        """Tiers 0 and 1 at another world size: the newest step newer than storage's for which the nodes'
        memory holds a snapshot of every rank of an earlier world of another size (own slots or replicas),
        of DTensors (FSDP2, tensor parallelism) or ShardedTensors (ZeRO's ranges); old rank 0's skeleton
        (the records of every rank's shards: global shapes, meshes, placements, offsets) goes to every
        rank, which works out the old ranks whose shards overlap its new ones; each receives those (point
        to point, from the lowest holder) and takes the elements of its new shards
        (:meth:`MemoryTier.load_resharded`). Nothing loaded when there is no such set (storage next) or
        loading it failed on some rank (its snapshots are invalidated)."""
        try:
            mine = memory.reshard_candidates(state)
        except Exception as e:  # noqa: BLE001 - an unreadable tier is no reason to fail a restore
            self._log.warning("checkpoint_memory_unreadable", error=describe(e)[:500])
            mine = []
        holders: dict[tuple[int, str, int], dict[int, int]] = {}
        for provider, items in enumerate(self.group.all_gather(mine)):
            for rank, step, world, old_world in items:
                if 0 <= rank < old_world:
                    holders.setdefault((step, world, old_world), {}).setdefault(rank, provider)
        complete = [k for k, by in holders.items() if len(by) == k[2]
                    and (newest_durable is None or k[0] > newest_durable)]
        if not complete:
            return NearestRestore(CheckpointTier.NONE, None)
        step, world, old_world = max(complete)
        by_rank = holders[(step, world, old_world)]
        t0 = time.monotonic()
        err: str | None = None
        held: dict[int, bytes] = {}  # old rank 0's snapshot, read once by its holder: the layout, then sent
        skel: Any = None
        if by_rank[0] == self.rank:
            try:
                held[0] = memory.blob(0, step, world, world_size=old_world)
                skel = blob_skeleton(held[0])
            except Exception as e:  # noqa: BLE001 - agreed below
                err = describe(e)[:500]
        skel = next((s for s in self.group.all_gather(skel) if s is not None), None)
        mine_needed: list[int] = []
        if skel is None:
            err = err or f"old rank 0's snapshot of step {step} could not be read on rank {by_rank[0]}"
        else:
            try:
                mine_needed = sorted(shards_needed(state, old_world, self.rank, skel))
            except Exception as e:  # noqa: BLE001 - agreed below
                err = describe(e)[:500]
        needed = self.group.all_gather(mine_needed)
        blobs: dict[int, bytes] = {}
        moved = 0
        for r in range(old_world):  # each old shard to the ranks whose new shards overlap it, from its lowest holder
            p = by_rank[r]
            wanted = [q for q in range(self.world_size) if r in needed[q]]
            blob: bytes | None = None
            if self.rank == p and wanted:
                try:
                    blob = held.pop(r, None) or memory.blob(r, step, world, world_size=old_world)
                except Exception as e:  # noqa: BLE001 - agreed below; the receivers get an empty blob
                    err = describe(e)[:500]
                if self.rank in wanted and blob is not None:
                    blobs[r] = blob
            for q in wanted:
                if q == p:
                    continue
                if self.rank == p:
                    self.group.send_bytes(blob or b"", q)  # empty when it could not be read: the receiver fails, agreed below
                elif self.rank == q and (got := self.group.recv_bytes(p)) is not None:
                    blobs[r] = got
                moved += 1
        extra: dict[str, Any] = {}
        if err is None:
            try:
                extra = memory.load_resharded(blobs, state, old_world)
            except Exception as e:  # noqa: BLE001 - agreed below
                err = describe(e)[:500]
        what = f"resharding the in-memory snapshots of step {step} from {old_world} ranks"
        failed = self._agreed_load(memory, err, newest_durable, what, step=step, old_world_size=old_world)
        if failed is not None:
            return NearestRestore(CheckpointTier.NONE, None, skipped=(failed,))
        return NearestRestore(CheckpointTier.PEER, step, base=self._agreed_base(extra), seconds=time.monotonic() - t0,
                              world=world, resharded_from=old_world, from_ranks=by_rank, needed=tuple(mine_needed),
                              transfers=moved)

    def rebuild_from_parity(self, memory: MemoryTier) -> None:
        """Tier 1 with parity: rebuild the snapshots of the ranks of a lost node from the survivors' parity
        blocks and snapshots (:func:`~trainguard.checkpoint.parity.plan_rebuilds`), each into a replica
        file on its rebuilder's node; the restore then finds them as buddy replicas. A rebuild that fails
        is logged and left out (the restore then takes what is complete, or storage)."""
        try:
            mine = memory.parity_inventory()
        except Exception as e:  # noqa: BLE001 - an unreadable tier 0 is no reason to fail a restore
            self._log.warning("checkpoint_memory_unreadable", error=describe(e)[:500])
            mine = {}
        plan = parity.plan_rebuilds(self.group.all_gather(mine))
        for rb in plan:
            blobs: dict[int, bytes] = {}  # the snapshots this rank reads pieces of: each read (and checked) once
            t0 = time.monotonic()
            err: str | None = None
            acc: torch.Tensor | None = None
            out: list[bytes] = []
            for k, (pieces, want_crc) in enumerate(rb.segments):
                acc = torch.zeros(rb.seg, dtype=torch.uint8) if self.rank == rb.rebuilder else None
                for piece in pieces:
                    buf = None
                    if self.rank == piece.provider:
                        try:
                            buf = self._parity_piece(memory, rb, piece, blobs)
                        except Exception as e:  # noqa: BLE001 - sent empty: the rebuild fails, nothing hangs
                            err = describe(e)[:500]
                            buf = b""
                        if piece.provider != rb.rebuilder:
                            self.group.send_bytes(buf, rb.rebuilder)
                    elif self.rank == rb.rebuilder:
                        buf = self.group.recv_bytes(piece.provider) or b""
                    if acc is not None and buf is not None:
                        if len(buf) != rb.seg:
                            err = err or f"a piece of old rank {piece.source} ({piece.kind}) could not be read"
                        else:
                            parity.xor_(acc, torch.frombuffer(bytearray(buf), dtype=torch.uint8))
                if acc is not None and err is None:
                    if parity.crc(acc) != want_crc:
                        err = f"segment {k} of old rank {rb.rank} failed its checksum after the rebuild"
                    out.append(acc.numpy().tobytes())
            if self.rank != rb.rebuilder:
                continue
            if err is None:
                data = b"".join(out)[:rb.tensor_bytes + rb.meta_bytes]
                try:
                    memory.write_rebuilt(rb.rank, rb.step, rb.world_size, rb.tensor_bytes, data)
                except Exception as e:  # noqa: BLE001
                    err = describe(e)[:500]
            if err is None:
                self._log.info("memory_parity_rebuilt", rank=rb.rank, step=rb.step, world=rb.world,
                               nbytes=len(data), seconds=round(time.monotonic() - t0, 3))
            else:
                self._log.warning("memory_parity_rebuild_failed", rank=rb.rank, step=rb.step, error=err,
                                  effect="the restore takes what is complete in memory, or storage")

    def _parity_piece(self, memory: MemoryTier, rb: parity.Rebuild, piece: parity.Piece, blobs: dict[int, bytes]) -> bytes:
        """This rank's input to a rebuilt segment, :attr:`~.Rebuild.seg` bytes (zero-padded); ``blobs``
        keeps the snapshots read for the rebuild (several segments come from one)."""
        if piece.kind == "block":
            raw = memory.parity_block(piece.source, rb.step, rb.world)
        else:
            if piece.source not in blobs:
                blobs[piece.source] = memory.blob(piece.source, rb.step, rb.world, world_size=rb.world_size)
            blob = blobs[piece.source]
            raw = blob[HEADER_BYTES + piece.segment * rb.seg:HEADER_BYTES + (piece.segment + 1) * rb.seg]
        return bytes(raw[:rb.seg]).ljust(rb.seg, b"\0")

    def _hand_over(self, memory: MemoryTier, sources: dict[int, tuple[int, int]], moved: list[int], step: int,
                   world: str) -> bytes | None:
        """Send the snapshots of ``moved`` ranks from their providers to them (point to point over the
        checkpoint group, one rank after the other); return what this rank received, if anything."""
        got: bytes | None = None
        for r in moved:
            p, src = sources[r]
            if self.rank == p:
                self.group.send_bytes(memory.blob(src, step, world), r)
            elif self.rank == r:
                got = self.group.recv_bytes(p)
        return got

    def _agreed_load(self, memory: MemoryTier, err: str | None, newest_durable: int | None, what: str,
                     **log: Any) -> str | None:
        """Whether every rank loaded the chosen in-memory set (``err``: this rank's failure): None when it
        did. When some rank did not: log it, invalidate the node's snapshots so that the set is never
        chosen again, and return why (storage next), or raise :class:`CheckpointError` when storage has
        nothing to fall back to (other ranks may have loaded it)."""
        errors = [e for e in self.group.all_gather(err) if e]
        if not errors:
            return None
        self._log.error("checkpoint_memory_load_failed", errors=errors[:4],
                        effect="the snapshots of this set are invalidated on every rank", **log)
        memory.invalidate_all()  # never chosen again: the next restore (or restart) goes to storage
        if newest_durable is None:
            raise CheckpointError(f"{what} failed on some ranks ({errors[0]}) after others may have loaded it, and "
                                  f"storage holds no committed step to fall back to; the snapshots were invalidated, "
                                  f"so the restarted workers start from step 0. Fix: none needed; set "
                                  f"checkpoint.memory_interval_steps=0 (TRAINGUARD_CHECKPOINT_MEMORY_INTERVAL_STEPS) "
                                  f"if it happens again")
        return f"{what} failed on some ranks: {errors[0]}"

    def _agreed_base(self, extra: dict[str, Any]) -> StepRef | None:
        """Every rank loaded the set: the newest committed step it descends from (its ``extra``), any rank's."""
        bases = [b for b in self.group.all_gather(extra.get("base")) if b is not None]
        return max(bases) if bases else None


__all__ = ["NearestRestore", "NearestTiers", "choose_sources"]
