"""Tier 0 and 1 at another world size: resharding a state from the snapshots of the ranks of an earlier world.

When the nodes' memory holds a snapshot of every rank of a world of another size (own slots of any
rank, replicas), every rank receives those whose shards overlap its new ones (:func:`shards_needed`)
and takes each element of its new shards from one of them (:func:`fill_resharded`): each DTensor's
snapshot records its global shape, mesh and placements, so any layout DTensor expresses reshards
(FSDP2 over one mesh dimension, FSDP2 over tensor parallelism on a 2-D mesh: the index arithmetic is
:mod:`trainguard.checkpoint.reshard`); ZeRO's ranges (ShardedTensors) record every rank's offsets and
reshard the same way. The transient memory is those old shards (about ``old / new + 1`` of them per
rank). :class:`ReshardReads` holds the tier's side of it (which snapshots of another size this node
holds, and the load); choosing the set and moving the snapshots between ranks is the restore's
(:mod:`~trainguard.checkpoint.nearest`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from trainguard.checkpoint import reshard
from trainguard.checkpoint.skeleton import (Leaf, _intact, _is_dtensor, _is_sharded, _load_into, _local, _parse,
                                            _Shards, _Tuple, layout, materialise, relaxed, skeleton)
from trainguard.checkpoint.slots import HEADER_BYTES, _HEADER, Header, MemoryTierError, TierState, checksum


def _old_indices(leaf: Leaf, rank: int, old_world: int, shape: tuple[int, ...]) -> reshard.Indices | None:
    """The global indices old ``rank`` held of the tensor at ``leaf`` of an old skeleton (global ``shape``):
    from the DTensor record the snapshot keeps (:func:`trainguard.checkpoint.reshard.indices`), else
    dimension 0 split as ``torch.chunk`` splits it over the old world (a plain tensor standing for an
    FSDP2 shard). None: ``rank`` held none of it."""
    if len(leaf) > 3:
        if tuple(leaf[3][0]) != shape:
            raise MemoryTierError(f"a tensor of global shape {shape} is {tuple(leaf[3][0])} in the snapshots")
        return reshard.indices(leaf[3], rank)
    return reshard.chunk_indices(shape, old_world, rank)


def _sharded_leaves(cur: Any, skel: Any) -> Iterator[tuple[Any, Any]]:
    """Each DTensor and ShardedTensor of a (materialised) state with its node in an old skeleton of the
    same structure (a leaf, a :class:`_Shards`)."""
    if _is_dtensor(cur):
        if not isinstance(skel, tuple):
            raise MemoryTierError("a DTensor of this rank's state is no single tensor in the snapshot")
        yield cur, skel
    elif _is_sharded(cur):
        if not isinstance(skel, _Shards) or skel.record is None:
            raise MemoryTierError("a ShardedTensor of this rank's state has no record of its shards in the snapshot")
        yield cur, skel
    elif isinstance(cur, dict):
        for k, v in cur.items():
            yield from _sharded_leaves(v, skel[k])
    elif isinstance(cur, list):
        for v, sk in zip(cur, skel, strict=True):
            yield from _sharded_leaves(v, sk)
    elif isinstance(cur, tuple):
        for v, sk in zip(cur, skel.items, strict=True):
            yield from _sharded_leaves(v, sk)


def _cover(mine: reshard.Indices, pieces: Iterator[tuple[int, reshard.Indices]], need: set[int]) -> None:
    """Add to ``need`` old ranks whose ``pieces`` (``(rank, indices)``, in the order to try them) hold
    elements of the shard ``mine`` until every element is covered."""
    covered = torch.zeros([len(i) for i in mine], dtype=torch.bool)
    if not covered.numel():
        return
    for r, theirs in pieces:
        got = reshard.overlap(mine, theirs)
        if got is None or bool(reshard.select(covered, got[0]).all()):
            continue
        need.add(r)
        reshard.assign(covered, got[0], True)
        if bool(covered.all()):
            return


def shards_needed(state: dict[str, Any], old_world: int, rank: int, skel: Any) -> set[int]:
    """The old ranks (of a world of ``old_world``) whose snapshots this rank needs to reshard ``state`` from
    snapshots of the skeleton ``skel`` (any old rank's: its DTensor and ShardedTensor records stand for
    every rank's): the old rank its other values come from, and, layout by layout, old ranks whose
    shards hold elements of its new shards until every element is covered. Layouts whose elements have
    a single holder go first, and the ranks already chosen are tried first, so replicated tensors (a
    tensor-parallel bias, a layer norm) add no transfer. Each distinct DTensor layout is worked out once."""
    base = rank if rank < old_world else 0
    need = {base}
    layouts: dict[Any, tuple[Any, Leaf]] = {}
    ranges: list[tuple[Any, _Shards]] = []
    for cur, node in _sharded_leaves(materialise(state), skel):
        if isinstance(node, _Shards):
            ranges.append((cur, node))
        else:
            layouts.setdefault((reshard.describe(cur), node[3] if len(node) > 3 else None), (cur, node))

    def first(ranks: list[int]) -> list[int]:
        return sorted(r for r in ranks if r in need) + sorted(r for r in ranks if r not in need)

    for cur, node in ranges:  # ZeRO's ranges: one holder each
        pieces = [(r, reshard.box(off, size)) for r, off, size in node.record[1] if 0 <= r < old_world]
        for shard in cur.local_shards():
            mine = reshard.box(tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
            order = {r: i for i, r in enumerate(first([r for r, _ in pieces]))}
            _cover(mine, iter(sorted(pieces, key=lambda p: order[p[0]])), need)
    for (_, old), (cur, leaf) in sorted(layouts.items(), key=lambda kv: reshard.replication(kv[0][1]) if kv[0][1] else 1):
        mine = reshard.current_indices(cur)
        shape = tuple(cur.shape)
        _cover(mine, ((r, idx) for r in first(list(range(old_world)))
                      if (idx := _old_indices(leaf, r, old_world, shape)) is not None), need)
    return need


def _take(dst: torch.Tensor, mine: reshard.Indices, covered: torch.Tensor, src: torch.Tensor,
          theirs: reshard.Indices, rank: int) -> None:
    """Copy into ``dst`` (global indices ``mine``) the elements of ``src`` (``theirs``, old ``rank``'s) it lacks."""
    got = reshard.overlap(mine, theirs)
    if got is None or bool(reshard.select(covered, got[0]).all()):
        return
    if tuple(src.shape) != tuple(len(i) for i in theirs):
        raise MemoryTierError(f"old rank {rank}'s shard has shape {tuple(src.shape)}, not the "
                              f"{tuple(len(i) for i in theirs)} its layout says")
    reshard.assign(dst, got[0], reshard.select(src, got[1]))
    reshard.assign(covered, got[0], True)


def fill_resharded(cur: Any, skel: Any, views: dict[int, list[torch.Tensor]], old_world: int, base: int,
                   others: dict[int, Any] | None = None) -> Any:
    """:func:`fill` from the snapshots of ranks of a world of ``old_world`` ranks (``views`` by old rank,
    those :func:`shards_needed` names; ``others``: their skeletons at the same place, by old rank) into
    this rank's state at another world size: a DTensor or ShardedTensor takes each element of its new
    shards from an old shard that holds it (any DTensor placement over any mesh,
    :mod:`trainguard.checkpoint.reshard`; ZeRO's ranges); any other tensor is the same on every rank and
    comes from old rank ``base``, as do the non-tensor values. Raises :class:`MemoryTierError` on a
    layout it cannot reshard, or when the snapshots in ``views`` leave an element of a new shard
    uncovered."""
    others = others or {}
    if _is_dtensor(cur):
        if not isinstance(skel, tuple):
            raise MemoryTierError("a DTensor of this rank's state is no single tensor in the snapshot")
        local = cur._local_tensor
        shape = tuple(cur.shape)
        try:
            mine = reshard.current_indices(cur)
        except reshard.ReshardError as e:
            raise MemoryTierError(str(e)) from e
        if [len(i) for i in mine] != list(local.shape):
            raise MemoryTierError(f"this rank's shard of a {shape} tensor has shape {tuple(local.shape)}, not "
                                  f"{tuple(len(i) for i in mine)} as its placements {tuple(cur.placements)} say")
        covered = torch.zeros(local.shape, dtype=torch.bool)
        for r in sorted(views):
            try:
                theirs = _old_indices(skel, r, old_world, shape)
            except reshard.ReshardError as e:
                raise MemoryTierError(str(e)) from e
            if theirs is not None:
                _take(local, mine, covered, views[r][skel[0]], theirs, r)
        if not bool(covered.all()):
            raise MemoryTierError(f"{int((~covered).sum())} elements of this rank's shard of a {shape} tensor "
                                  f"are in none of the snapshots of old ranks {sorted(views)}")
        return cur
    if _is_sharded(cur):
        if not isinstance(skel, _Shards) or skel.record is None:
            raise MemoryTierError("a ShardedTensor of this rank's state has no record of its shards in the snapshot")
        size = tuple(cur.metadata().size)  # not cur.size(): a tensor method, which warns of ShardedTensor's deprecation
        if size != tuple(skel.record[0]):
            raise MemoryTierError(f"a tensor of global shape {size} is {tuple(skel.record[0])} in the snapshots")
        for shard in cur.local_shards():
            md = shard.metadata
            mine = reshard.box(tuple(md.shard_offsets), tuple(md.shard_sizes))
            covered = torch.zeros(shard.tensor.shape, dtype=torch.bool)
            for r in sorted(views):
                node = others.get(r)
                if not isinstance(node, _Shards):
                    raise MemoryTierError(f"old rank {r}'s snapshot has no shards where this rank has a ShardedTensor")
                for leaf, off in zip(node.leaves, node.offsets, strict=True):
                    _take(shard.tensor, mine, covered, views[r][leaf[0]], reshard.box(off, leaf[1]), r)
            if not bool(covered.all()):
                raise MemoryTierError(f"{int((~covered).sum())} elements of this rank's shard at {tuple(md.shard_offsets)} "
                                      f"of a {size} tensor are in none of the snapshots of old ranks {sorted(views)}")
        return cur
    local = _local(cur)
    if local is not None:
        leaves = skel.leaves if isinstance(skel, _Shards) else (skel,)
        for dst, leaf in zip(local, leaves, strict=True):
            src = views[base][leaf[0]]
            if src.shape != dst.shape:
                raise MemoryTierError(f"a tensor of shape {tuple(dst.shape)} is {tuple(src.shape)} in the snapshot")
            dst.copy_(src)
        return cur

    def sub(key: Any) -> dict[int, Any]:
        return {r: (o.items if isinstance(o, _Tuple) else o)[key] for r, o in others.items()}

    if isinstance(cur, dict):
        return {k: fill_resharded(cur[k], skel[k], views, old_world, base, sub(k)) for k in cur}
    if isinstance(cur, list):
        return [fill_resharded(c, sk, views, old_world, base, sub(i)) for i, (c, sk) in enumerate(zip(cur, skel, strict=True))]
    if isinstance(cur, tuple):
        return tuple(fill_resharded(c, sk, views, old_world, base, sub(i))
                     for i, (c, sk) in enumerate(zip(cur, skel.items, strict=True)))
    return skel


class ReshardReads(TierState):
    """The resharding reads of :class:`~trainguard.checkpoint.memory.MemoryTier` (a mixin: the state it
    reads is the tier's; it writes no slot)."""

    def reshard_candidates(self, state: dict[str, Any]) -> list[tuple[int, int, str, int]]:
        """``(rank, step, world, world_size)`` of every intact sharded snapshot in this node's folder (the
        own slots of any rank, the replicas) written by a world of another size, whose layout fits
        ``state``'s up to the sharded first dimension (:func:`relaxed`)."""
        self.settle()
        want = relaxed(layout(skeleton(materialise(state), [])))
        other_size = _intact(self._node_files(), keep=lambda h: h.world_size != self.world_size)
        out = {(h.rank, h.step, str(meta.get("world", "")), h.world_size) for h, meta in other_size
               if not meta.get("replicated") and relaxed(layout(meta["skeleton"])) == want}
        return sorted(out, key=lambda x: (-x[1], x[0], x[2], x[3]))

    def load_resharded(self, blobs: dict[int, bytes], state: dict[str, Any], old_world: int) -> dict[str, Any]:
        """Load the snapshots of the ranks of a world of ``old_world`` ranks that this rank needs
        (:func:`shards_needed`; ``blobs`` by old rank, each a :meth:`blob`) into its ``state`` at the
        current world size (:func:`fill_resharded`); this rank's RNG states and values come from the old
        rank of the same number when there was one, else old rank 0's (the trainer state then reseeds).
        Returns the snapshot's ``extra``. Raises :class:`MemoryTierError` when a needed blob is missing
        or damaged, or the state cannot be resharded."""
        base = self.rank if self.rank < old_world else 0
        views: dict[int, list[torch.Tensor]] = {}
        metas: dict[int, dict[str, Any]] = {}
        steps: set[tuple[int, str]] = set()

        def take(r: int) -> None:
            blob = blobs.get(r)
            h = Header.unpack(blob[:_HEADER.size]) if blob else None
            data = blob[HEADER_BYTES:] if blob else b""
            if (h is None or not h.complete or h.rank != r or h.world_size != old_world
                    or len(data) != h.tensor_bytes + h.meta_bytes or checksum(data, self._threads) != h.crc32):
                raise MemoryTierError(f"the snapshot of old rank {r} is missing or failed its checksum")
            metas[r], views[r] = _parse(h, data)
            steps.add((h.step, str(metas[r].get("world", ""))))

        take(base)
        try:
            needed = shards_needed(state, old_world, self.rank, metas[base]["skeleton"])
        except reshard.ReshardError as e:
            raise MemoryTierError(str(e)) from e
        for r in sorted(needed - {base}):
            take(r)
        if len(steps) != 1:  # never mix steps or worlds
            raise MemoryTierError(f"the snapshots to reshard are of different steps or worlds: {sorted(steps)[:4]}")
        self._last = None
        _load_into(state, metas[base]["skeleton"], lambda cur, skel, k: fill_resharded(
            cur, skel, views, old_world, base, {r: m["skeleton"][k] for r, m in metas.items()}))
        return dict(metas[base]["extra"])
