"""Tier 0: in-memory snapshots of each worker's checkpoint state, in shared memory its agent owns.

Every ``checkpoint.memory_interval_steps`` steps each rank copies its checkpoint state (the state
dict the durable save stages: model and optimizer shards, trainer state) into a file under the node's
snapshot folder, which the *agent* creates on a tmpfs (``/dev/shm``) and removes when the job ends
(:mod:`trainguard.agent.memtier`). The worker only maps the files, so a worker killed with SIGKILL
leaves its last snapshot in memory; the restarted worker restores it instead of the last checkpoint in
storage.

Slots and the header (torn writes)
    Each rank has :data:`SLOTS` slot files, ``rank-<rank>-<k>.snap``, and writes each snapshot into
    the slot that does not hold its newest one. A slot is a 4 KiB header, then the data: every
    tensor's bytes back to back (:data:`ALIGN`-aligned), then a pickled *skeleton* (the state dict's
    structure with every tensor replaced by its index, and every non-tensor value as it is). The
    header's commit word is zeroed before the data is written and set to ``step + 1`` after the data
    and the other header fields (step, world size, rank, lengths, CRC32 of the data): a slot whose
    writer died half-way has commit 0 (or a commit that does not match its step), and a slot is valid
    only when its CRC32 matches. So a kill during a snapshot loses that snapshot, never the previous
    one in the other slot.

Completeness: agreement at restore time, no collective per snapshot
    A snapshot of step ``s`` is complete when *every* rank of the world holds a valid slot of ``s``
    written by the same world (each snapshot records a world id: rendezvous id and round).
    Ranks never agree on that while training (that would add a collective per step): at restore
    every rank reports the snapshots it can hand out (:meth:`MemoryTier.provides`: its own, and the
    replicas of a buddy's, tier 1, see :mod:`trainguard.checkpoint.replica`) and the newest step for
    which every rank's snapshot exists somewhere is chosen (:func:`choose_sources`), never a mix of
    steps; a rank that lacks its own receives the replica from the rank holding it. Two slots suffice: a rank cannot
    start snapshot ``s + 2`` before every rank finished snapshot ``s + 1`` (the gradient all-reduce of
    step ``s + 2`` needs every rank, and a rank snapshots ``s + 1`` before it starts step ``s + 2``),
    so when a rank dies mid-write the others still hold the step it holds.

Where tier 0 applies, and where it does not
    A rank reads its own rank's files on its own node, or receives a replica of its rank: the world
    must have the same size (torch elastic keeps the ranks of a restarted world of the same nodes in the
    same order). Replicated state (DDP, ``replicated=True``) is the exception: any rank's snapshot
    restores any rank at any world size (:data:`ANY_RANK`). Sharded state at another world size is
    resharded (:meth:`MemoryTier.reshard_candidates`, :meth:`MemoryTier.load_resharded`): when the
    nodes' memory holds a snapshot of every rank of the earlier world (own slots of any rank, replicas),
    every rank receives those whose shards overlap its new ones (:func:`shards_needed`) and takes each
    element of its new shards from one of them: each DTensor's snapshot records its global shape, mesh
    and placements, so any layout DTensor expresses reshards (FSDP2 over one mesh dimension, FSDP2 over
    tensor parallelism on a 2-D mesh: :mod:`trainguard.checkpoint.reshard`); the transient memory is
    those old shards (about ``old / new + 1`` of them per rank). ZeRO's ranges (ShardedTensors) record
    every rank's offsets and reshard the same way. Anything else (a pending reduction, a rank moved to
    another node and not replicated there, a layout that changed) makes the restore fall back to
    storage. A restore from storage invalidates every slot and replica of the node (:meth:`MemoryTier.invalidate_all`);
    a world re-formed in place invalidates this rank's slots (:meth:`MemoryTier.rebind`; the live state
    is newer) unless it reloads its state (sharded state re-formed through a checkpoint), so a snapshot
    of an abandoned branch of history is never restored later.

Feeding the durable save (tier 2)
    :meth:`MemoryTier.lend` hands the snapshot this process just took to the durable save of the same
    step (:class:`SnapshotSource`): the save's staging copy reads the slot, in the persist thread,
    instead of the training tensors (:mod:`trainguard.checkpoint.staging`). The slot is held until that
    copy is done; the snapshot that would overwrite it (two snapshots on) waits, and so does
    :meth:`MemoryTier.close`.

Threading: the training thread copies the tensors and the skeleton into the slot and returns; the
checksum (CRC32 over the data, which releases the GIL), the header and the commit word are written by
one background thread while the next step runs (:meth:`MemoryTier.settle` waits for it; every reader
of the slots and the next snapshot call it first). A worker killed before that commit leaves the slot
invalid and the previous snapshot in the other slot, as a kill during the copy does.
:meth:`MemoryTier.newest_view`, :meth:`MemoryTier.receive_replica` and :meth:`MemoryTier.commit_replica`
run on the replication thread while the training thread waits for it before the next snapshot.
GPU tensors are copied asynchronously into the page-locked slot (:mod:`~trainguard.checkpoint.gpusnap`;
not verified on a GPU yet, see ``docs/gpu.md``). The slot file format and its sizing live in
:mod:`~trainguard.checkpoint.slots`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import mmap
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.checkpoint import parity, pinned, reshard
from trainguard.checkpoint.gpusnap import GpuCopies
from trainguard.checkpoint.localplan import LocalPlan
from trainguard.checkpoint.slots import (  # noqa: F401 - the slot format's names, re-exported here
    _COMMIT_OFFSET, _HEADER, ALIGN, HEADER_BYTES, SLOTS, Header, MemoryTierError, _align,
    _commit, _numel, _seal, _Slot, _write, checksum, checksum_threads, _zero_commit, check_fits, folder_bytes, host_available_bytes, node_bytes,
    parity_buffers, slot_bytes)

ANY_RANK = -1
"""The rank of a *replicated* snapshot (DDP: every rank holds the whole model and optimizer state) in
:meth:`MemoryTier.provides`: it restores any rank of a world of any size."""
_PARITY_META = 4096
"""Room after a parity block for its record (world, members, each contributor's lengths and CRC32)."""


# ---- pure parts -------------------------------------------------------------------------------------


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


# ---- state walking ----------------------------------------------------------------------------------


Leaf = tuple  # (index in the slot, local shape, dtype name[, DTensor record])
"""A tensor's place in the skeleton: a plain ``(index, shape, dtype name)`` tuple, and for a DTensor a
fourth item, its global shape, mesh and placements (:func:`trainguard.checkpoint.reshard.describe`: what
resharding it from memory needs). The skeleton holds no
other bare tuple (a state's own tuples become :class:`_Tuple`), and a plain tuple pickles ten times
faster than a NamedTuple (one leaf per tensor per snapshot: the NamedTuple was a sixth of its cost)."""


class _Leaf(NamedTuple):
    """A leaf as snapshots written before plain tuples hold it (still read: a tuple subclass)."""

    index: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class _Shards:
    """A ShardedTensor's local shards (e.g. a DeepSpeed ZeRO range): their leaves, each one's offsets in the
    global tensor, and the record of every rank's shards (``(global shape, ((rank, offsets, sizes),
    ...))``, :func:`trainguard.checkpoint.reshard.sharded_record`: what resharding it from memory needs)."""

    leaves: tuple[Leaf, ...]
    offsets: tuple[tuple[int, ...], ...] = ()
    record: tuple | None = None


@dataclass(frozen=True, slots=True)
class _Tuple:
    items: list[Any]


def _local(t: Any) -> list[torch.Tensor] | None:
    """The local tensors of a tensor-like leaf (a DTensor's shard, a ShardedTensor's shards), else None."""
    if not isinstance(t, torch.Tensor):
        return None
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return [t]
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return [t._local_tensor]
    if _is_sharded(t):
        return [s.tensor for s in t.local_shards()]
    return [t]


@functools.cache
def _dtensor_class() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, _dtensor_class())


def _is_sharded(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and callable(getattr(type(t), "local_shards", None))


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def skeleton(sd: Any, out: list[torch.Tensor], sig: list[tuple[tuple[int, ...], torch.dtype]] | None = None) -> Any:
    """``sd`` with every tensor replaced by a :data:`Leaf` (its local tensors appended to ``out``, their
    ``(shape, dtype)`` to ``sig`` when given). Runs at every snapshot: plain tensors take a fast path,
    scalars in dicts and lists no call at all."""
    kind = type(sd)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        dtype = sd.dtype
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = str(dtype)
        shape = tuple(sd.shape)
        leaf = (len(out), shape, name)
        out.append(sd)
        if sig is not None:
            sig.append((shape, dtype))
        return leaf
    if isinstance(sd, dict):
        return {k: v if type(v) in _SCALARS else skeleton(v, out, sig) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        local = _local(sd)
        assert local is not None
        leaves = []
        for t in local:
            shape = tuple(t.shape)
            leaves.append((len(out), shape, str(t.dtype)))
            out.append(t)
            if sig is not None:
                sig.append((shape, t.dtype))
        if _is_sharded(sd):
            return _Shards(tuple(leaves), *reshard.sharded_record(sd))
        if len(local) != 1:
            return _Shards(tuple(leaves))
        return (*leaves[0], reshard.describe(sd)) if _is_dtensor(sd) else leaves[0]
    if isinstance(sd, list):
        return [v if type(v) in _SCALARS else skeleton(v, out, sig) for v in sd]
    if isinstance(sd, tuple):
        return _Tuple([skeleton(v, out, sig) for v in sd])
    return sd


def layout(skel: Any) -> Any:
    """The tensor layout of a skeleton (structure, shapes, dtypes; no values): two states load into each
    other only when their layouts are equal."""
    if isinstance(skel, tuple):  # a leaf; a DTensor's also names its global shape
        return ("T", skel[1], skel[2], tuple(skel[3][0])) if len(skel) > 3 else ("T", skel[1], skel[2])
    if isinstance(skel, _Shards):  # a ShardedTensor's also names its global shape
        leaves = tuple(layout(x) for x in skel.leaves)
        return ("S", leaves, tuple(skel.record[0])) if skel.record is not None else ("S", leaves)
    if isinstance(skel, dict):
        return {k: layout(v) for k, v in skel.items()}
    if isinstance(skel, list):
        return [layout(v) for v in skel]
    if isinstance(skel, _Tuple):
        return ("U", tuple(layout(v) for v in skel.items))
    return None


def relaxed(lay: Any) -> Any:
    """A :func:`layout` with each tensor's first dimension dropped, and a DTensor's global shape in place
    of its shard's, and a ShardedTensor's global shape and dtype in place of its local shards: two states
    sharded at different world sizes (FSDP2, tensor parallelism beside it, ZeRO's ranges) have equal
    relaxed layouts."""
    if isinstance(lay, tuple) and len(lay) in (3, 4) and lay[0] == "T":
        return ("T", tuple(lay[-1 if len(lay) == 4 else 1][1:]), lay[2])
    if isinstance(lay, tuple) and len(lay) == 3 and lay[0] == "S":  # a ShardedTensor: its global shape
        return ("G", lay[2], tuple(sorted({x[2] for x in lay[1]})))
    if isinstance(lay, tuple) and len(lay) == 2 and lay[0] in ("S", "U"):
        return (lay[0], tuple(relaxed(x) for x in lay[1]))
    if isinstance(lay, dict):
        return {k: relaxed(v) for k, v in lay.items()}
    if isinstance(lay, list):
        return [relaxed(v) for v in lay]
    return lay


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


def fill(cur: Any, skel: Any, views: list[torch.Tensor]) -> Any:
    """Copy the snapshot into the tensors of ``cur`` (in place, as ``dcp.load`` does) and return ``cur``'s
    structure with the snapshot's non-tensor values."""
    local = _local(cur)
    if local is not None:
        leaves = skel.leaves if isinstance(skel, _Shards) else (skel,)
        for dst, leaf in zip(local, leaves, strict=True):
            dst.copy_(views[leaf[0]])
        return cur
    if isinstance(cur, dict):
        return {k: fill(cur[k], skel[k], views) for k in cur}
    if isinstance(cur, list):
        return [fill(c, s, views) for c, s in zip(cur, skel, strict=True)]
    if isinstance(cur, tuple):
        return tuple(fill(c, s, views) for c, s in zip(cur, skel.items, strict=True))
    return skel


def _has_local(v: Any) -> bool:
    return callable(getattr(v, "local_state_dict", None)) and callable(getattr(v, "load_local_state_dict", None))


def materialise(state: dict[str, Any]) -> dict[str, Any]:
    """The state dicts of ``state``'s entries. An entry with ``local_state_dict()`` /
    ``load_local_state_dict()`` gives the former: this rank's own state in the objects' own format, no
    collective, no FQN conversion (model + optimizer: ``ModelOptimizerState``; the trainer state: this
    rank's RNG only). Other ``Stateful`` entries give ``state_dict()``."""
    return {k: _materialise_one(v) for k, v in state.items()}


def _materialise_one(v: Any) -> Any:
    if _has_local(v):
        return v.local_state_dict()
    if isinstance(v, Stateful):
        return v.state_dict()
    return v


# ---- slot files -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """What one snapshot cost this rank."""

    step: int
    seconds: float
    nbytes: int
    """Bytes of state copied (tensors + skeleton)."""


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


class MemoryTier:
    """This rank's tier-0 snapshots in ``directory`` (the node folder its agent created).

    Args:
        directory: the agent's node folder (must exist: the agent owns it).
        rank, world_size: this rank in the current world.
        local_world_size: workers on this node (the cap is per node).
        max_bytes: ``checkpoint.memory_max_bytes`` (0: no cap besides the folder's free space).
    """

    def __init__(self, directory: str, *, rank: int, world_size: int, local_world_size: int = 1,
                 max_bytes: int = 0, copies: int = 1, replicated: bool = False, cuda: Any = None) -> None:
        if not os.path.isdir(directory):
            raise MemoryTierError(f"the tier-0 snapshot folder {directory} does not exist (its agent creates it). "
                                  f"Fix: start the workers through the trainguard agent, or set "
                                  f"checkpoint.memory_interval_steps=0 (TRAINGUARD_CHECKPOINT_MEMORY_INTERVAL_STEPS)")
        self.directory = directory
        self.local_world_size = local_world_size
        self.waited_s = 0.0
        """Seconds the guarded optimizer's ``step()`` waited for snapshots' copies, in all (the part of a
        snapshot's cost :attr:`SnapshotResult.seconds` does not hold: it is paid at the next step)."""
        self._threads = checksum_threads(local_world_size)  # the slots' checksum (slots.checksum)
        self.max_bytes = max_bytes
        self.copies = copies
        """1: tier 0 only; 2: this rank also holds a buddy's replica (counted against the cap)."""
        self.replicated = replicated
        """Every rank holds the whole state (DDP): a snapshot of any rank restores any rank of a world of
        any size (:data:`ANY_RANK`)."""
        self._slots: list[_Slot] = []
        self._newest: int | None = None  # index of the slot holding this rank's newest snapshot
        self._views: list[torch.Tensor] | None = None
        self._sig: Any = None
        self._tensor_bytes = 0
        self._replica_sizes: dict[str, int] = {}
        self.background_commit = True
        """Checksum and commit each snapshot in a background thread (the training thread only copies)."""
        self.fault_hook: Callable[[int], None] | None = None
        """Tests: called with the step once a snapshot's data is written, before its commit (a hook that
        kills the process leaves the slot torn, as a SIGKILL mid-snapshot does)."""
        self._pool: ThreadPoolExecutor | None = None
        self._committing: Future[None] | None = None
        self._guarded: Any = None  # the optimizer whose parameters and state are copied in the background
        self._gpu = GpuCopies(cuda)  # GPU tensors: asynchronous copies into pinned memory (gpusnap)
        self._copied: threading.Event | None = None
        """Set once the newest snapshot has read every tensor (its checksum and commit may still run):
        what the guarded optimizer's next step waits for."""
        self.pin_error: str | None = None
        """Why a slot could not be page-locked for GPU copies (they are then slower), or None."""
        self._guard_hook: Any = None
        self._split: tuple[Any, set[int]] | None = None
        self._last: tuple[int, int, list[torch.Tensor], list[torch.Tensor]] | None = None
        """The newest snapshot taken by this process: step, slot, the tensors it copied, their views."""
        self._holds: dict[int, SnapshotSource] = {}  # slot -> the durable save reading it
        self.replay_state = True
        """Replay a plain model + optimizer entry's state dict from its objects (:mod:`.localplan`)."""
        self._plans: dict[str, LocalPlan | Literal[False]] = {}  # entry -> its plan, False: none can be built
        self._parity: tuple[Any, list[int], int] | None = None
        """Tier 1 as XOR parity (:meth:`set_parity`): the exchange's group, its members' global ranks, this
        rank's index among them. With it this rank keeps one own slot, not two."""
        self._parity_lock = threading.Lock()  # the own slot's write vs. :meth:`abandon`
        self.parity_failed: str | None = None
        """Why the parity exchange stopped for this world (no snapshot is taken after it), or None."""
        self.parity_step: int | None = None
        """The step of the newest parity block this rank committed."""
        self.parity_seconds = 0.0
        """How long the newest exchange, agreement and own write took (in the background; the next
        ``optimizer.step()`` waits for what is left of it)."""
        self.parity_restore = False
        """The job keeps parity (``checkpoint.memory_replica_parity``): a restore first rebuilds what a lost
        node held (:meth:`~trainguard.checkpoint.manager.CheckpointManager.restore`). The same on every rank."""
        self._attach(rank, world_size)

    @property
    def nbytes(self) -> int:
        """Host memory this rank's slot files take (bytes)."""
        return sum(s.size for s in self._slots)

    @property
    def replica_bytes(self) -> int:
        """Host memory of the replica files this rank wrote for its buddy's source rank, or of its parity
        blocks (bytes)."""
        return sum(self._replica_sizes.values())

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

    def _attach(self, rank: int, world_size: int, parity: tuple[Any, list[int], int] | None = None) -> None:
        self.close()
        self._last = None
        self.rank, self.world_size = rank, world_size
        self._parity, self.parity_failed, self.parity_step = parity, None, None
        own = 1 if parity is not None else SLOTS
        self._slots = [_Slot(os.path.join(self.directory, f"rank-{rank:05d}-{k}.snap")) for k in range(own)]
        self._sig, self._newest, self._on_cpu = None, None, True
        self._plans = {}

    def rebind(self, rank: int, world_size: int, *, keep: bool = False) -> None:
        """A new world formed in place: write and read as ``rank`` of ``world_size`` from now on. What
        this rank's old files and the new rank's files hold is invalidated: snapshots of the old world
        are older than the live state this process continues with. ``keep``: the new world reloads its
        state (sharded state re-formed through a checkpoint): the old world's snapshots stay candidates
        for that restore (a restore from storage invalidates them all)."""
        if not keep:
            self.invalidate()
        self._attach(rank, world_size)
        if not keep:
            self.invalidate()

    def invalidate(self) -> None:
        """Make this rank's slots read as empty (after a restore from storage: what they hold belongs to
        a branch of history the job left)."""
        self.settle()
        for s in self._slots:
            s.invalidate()
        self._newest, self._last = None, None

    def discard_from(self, step: int) -> int:
        """Make this rank's own snapshots of ``step`` and later read as empty (after the background commit
        of the newest one ended): their data may come from an update that ran on half-reduced gradients,
        or from replicas that disagree. Returns how many were discarded."""
        self.settle()
        gone = 0
        for i, s in enumerate(self._slots):
            h = s.header()
            if h is not None and h.complete and h.step >= step:
                s.invalidate()
                gone += 1
                if i == self._newest:
                    self._newest, self._last = None, None
        return gone

    def invalidate_all(self) -> None:
        """:meth:`invalidate`, and every other snapshot and replica in the node folder too: after a restore
        from storage they all belong to a branch of history the job left, and a snapshot set that failed
        to load must not be chosen again by the next restart."""
        self.invalidate()
        for name in os.listdir(self.directory):
            if name.endswith(".snap"):
                _Slot(os.path.join(self.directory, name)).invalidate()

    def snapshot(self, step: int, state: dict[str, Any], *, world: str = "",
                 extra: dict[str, Any] | None = None) -> SnapshotResult:
        """Copy ``state`` (as the durable save would stage it) into the slot not holding the newest
        snapshot, and commit that slot as ``step``. ``world`` names the world writing it (the same on
        every rank, e.g. rendezvous id and round): a restore never combines snapshots of different
        worlds. ``extra``: small picklable values restored with it (e.g. the committed step the state
        descends from). Raises :class:`MemoryTierError` when it does not fit."""
        t0 = time.monotonic()
        self.settle()
        self._last = None
        tensors: list[torch.Tensor] = []
        shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
        skel = self._skeleton(state, tensors, shapes)
        meta = pickle.dumps({"skeleton": skel, "world": world, "replicated": self.replicated,
                             "extra": dict(extra or {})}, protocol=pickle.HIGHEST_PROTOCOL)
        if self.parity_failed is not None:
            raise MemoryTierError(f"no more snapshots in this world: the parity exchange failed ({self.parity_failed})")
        idx = 0 if self._newest is None else (self._newest + 1) % len(self._slots)
        self._wait_hold(idx)  # a durable save still copying from this slot (two snapshots ago)
        target = self._slots[idx]
        sig = tuple(shapes)
        if sig != self._sig:
            tensor_bytes = sum(_align(t.numel() * t.element_size()) for t in tensors)
        else:
            tensor_bytes = self._tensor_bytes
        if sig != self._sig or target.size < HEADER_BYTES + tensor_bytes + len(meta):
            per_slot = max(slot_bytes(tensor_bytes, len(meta)), target.size if sig == self._sig else 0)
            st = os.statvfs(self.directory)
            avail = None if self.max_bytes else host_available_bytes()
            if avail is not None:
                avail += folder_bytes(self.directory)
            check_fits(per_slot, local_world_size=self.local_world_size, max_bytes=self.max_bytes,
                       available_bytes=avail,
                       free_bytes=st.f_bavail * st.f_frsize + self.nbytes + self.replica_bytes,
                       directory=self.directory, copies=self.copies,
                       buffers=parity_buffers(len(self._parity[1])) if self._parity is not None else None)
            if self._sig is not None and sig != self._sig:
                self.invalidate()  # the other slot holds another layout: never restored into this state
            if self._parity is None or sig != self._sig:
                target.invalidate()  # (parity: the one own slot grows in place, its snapshot still good)
            target.ensure(per_slot)
            self._sig, self._tensor_bytes = sig, tensor_bytes
            self._on_cpu = not any(t.is_cuda for t in tensors)
            self._split = None
        target.ensure(target.size)
        views = target.views(sig)
        last = (step, idx, tensors, views)
        now, later = self._deferred(sig, tensors) if self.background_commit else ((), ())
        if self._parity is not None:
            return self._snapshot_parity(t0, step, target, views, tensors, set(later), meta, tensor_bytes, world)
        if later:  # the guarded optimizer's parameters and state: copied by the background thread
            late_views, late_tensors = [views[i] for i in later], [tensors[i] for i in later]
            views, tensors = [views[i] for i in now], [tensors[i] for i in now]
        else:
            late_views, late_tensors = [], []
        gpu_done = None
        if not self._on_cpu:  # GPU tensors: asynchronous copies into the pinned slot (gpusnap)
            self.pin_error = target.pin()
            _zero_commit(target.mm)
            gpu_done = self._gpu.start(tensors, views, self._guarded_ptrs(sig) if self._guarded is not None else set())
            views, tensors = [v for v, t in zip(views, tensors) if not t.is_cuda], [t for t in tensors if not t.is_cuda]
        _write(target.mm, views, tensors, tensor_bytes=tensor_bytes, meta=meta)
        if self.fault_hook is not None and gpu_done is None:
            self.fault_hook(step)
        self._newest, self._last = idx, last
        self._copied = threading.Event()
        commit = functools.partial(_copy_and_commit, target.mm, late_views, late_tensors, step=step,
                                   world_size=self.world_size, rank=self.rank, tensor_bytes=tensor_bytes,
                                   meta_bytes=len(meta), threads=self._threads, copied=self._copied, gpu_done=gpu_done,
                                   device=self._gpu.device, fault_hook=self.fault_hook if gpu_done is not None else None)
        self._background(commit)
        return SnapshotResult(step=step, seconds=time.monotonic() - t0, nbytes=tensor_bytes + len(meta))

    def _background(self, job: Callable[[], Any]) -> None:
        """Run a snapshot's background half on the commit thread (:meth:`settle` waits for it), or now
        when :attr:`background_commit` is off."""
        if self.background_commit:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tg-snapshot-commit")
            self._committing = self._pool.submit(job)
        else:
            job()

    def _snapshot_parity(self, t0: float, step: int, target: _Slot, views: list[torch.Tensor],
                         tensors: list[torch.Tensor], later: set[int], meta: bytes, tensor_bytes: int,
                         world: str) -> SnapshotResult:
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
        return SnapshotResult(step=step, seconds=time.monotonic() - t0, nbytes=tensor_bytes + len(meta))

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

    def _skeleton(self, state: dict[str, Any], tensors: list[torch.Tensor], shapes: list[Any]) -> dict[str, Any]:
        """``skeleton(materialise(state), tensors, shapes)``, a model + optimizer entry replayed from its
        :class:`~trainguard.checkpoint.localplan.LocalPlan` while the plan holds (built after its first
        full pass; an entry no plan can describe is not tried again)."""
        out: dict[str, Any] = {}
        for k, v in state.items():
            plan = self._plans.get(k)
            part = plan.replay(v, tensors, shapes, skeleton) if plan else None
            if part is None:
                base = len(tensors)
                sd = _materialise_one(v)
                part = skeleton(sd, tensors, shapes)
                if self.replay_state and _has_local(v) and plan is not False:
                    self._plans[k] = LocalPlan.build(v, sd, part, tensors[base:], base) or False
            out[k] = part
        return out

    def guard(self, optimizer: Any) -> None:
        """Copy ``optimizer``'s parameters and state in the background too, beside the next forward and
        backward, which do not change them: a step pre-hook on ``optimizer`` waits for the copy (and the
        commit) before its next step changes them. Buffers (e.g. BatchNorm statistics, changed by the
        forward) and everything else are still copied before :meth:`snapshot` returns. Call again when
        the optimizer object changes; whoever changes parameters or optimizer state other than through
        ``optimizer.step()`` (a restore, a re-formation) calls :meth:`settle` first."""
        if optimizer is self._guarded or not isinstance(optimizer, torch.optim.Optimizer):
            return
        if self._guard_hook is not None:
            self._guard_hook.remove()
        self._guard_hook = optimizer.register_step_pre_hook(lambda *_: self._wait_copied())
        self._guarded, self._split = optimizer, None

    def _wait_copied(self) -> None:
        """The guarded optimizer's step pre-hook: wait until the newest snapshot has read every tensor
        (not for its checksum and commit, which read only the slot); :meth:`settle` where it cannot tell."""
        t0 = time.monotonic()
        try:
            copied = self._copied
            if copied is None:
                self.settle()
                return
            while not copied.wait(0.05):
                pending = self._committing
                if pending is None or pending.done():  # the job ended without setting it: its error, if any
                    self.settle()
                    return
        finally:
            self.waited_s += time.monotonic() - t0

    def _deferred(self, sig: Any, tensors: list[torch.Tensor]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Indices of ``tensors`` to copy now, and those the background thread may copy: CPU tensors that
        are the guarded optimizer's parameters or state (by storage). Cached per layout."""
        if self._guarded is None:
            return (), ()
        ptrs = self._guarded_ptrs(sig)
        later = tuple(i for i, t in enumerate(tensors) if not t.is_cuda and t.data_ptr() in ptrs)
        return tuple(i for i in range(len(tensors)) if i not in set(later)), later

    def _guarded_ptrs(self, sig: Any) -> set[int]:
        """The guarded optimizer's parameter and state storages (:func:`pinned.optimizer_storages`),
        cached per layout."""
        if self._split is None or self._split[0] != sig:
            self._split = (sig, pinned.optimizer_storages(self._guarded))
        return self._split[1]

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

    def settle(self) -> None:
        """Wait until the newest snapshot is committed (its deferred copies, checksum and commit word are
        written in the background): every reader of the slots, and the next snapshot, call it first."""
        pending, self._committing = self._committing, None
        if pending is not None:
            pending.result()

    def _valid(self) -> list[tuple[int, Header, bytes]]:
        self.settle()
        out = []
        for i, s in enumerate(self._slots):
            got = s.read_valid(self.world_size, self.rank)
            if got is not None:
                out.append((i, *got))
        return out

    def available(self, state: dict[str, Any]) -> list[tuple[int, str]]:
        """The ``(step, world)`` snapshots this rank holds complete and checksum-verified, of this world
        size, whose layout fits ``state`` (newest first)."""
        want = layout(skeleton(materialise(state), []))
        steps = []
        for _, h, data in self._valid():
            try:
                meta = pickle.loads(data[h.tensor_bytes:])
            except Exception:  # noqa: BLE001 - a slot we cannot read is not a candidate
                continue
            if layout(meta["skeleton"]) == want:
                steps.append((h.step, str(meta.get("world", ""))))
        return sorted(steps, reverse=True)

    def load(self, step: int, state: dict[str, Any], *, world: str = "") -> dict[str, Any]:
        """Load the snapshot of ``step`` written by ``world`` into ``state`` in place (as ``dcp.load``:
        tensors copied into the current state dicts, then ``load_state_dict``); return its ``extra``.
        Raises :class:`MemoryTierError` when this rank holds no valid snapshot of ``step``."""
        for i, h, data in self._valid():
            if h.step == step and _world_of(h, data) == world:
                extra = _load_data(h, data, state)
                self._newest, self._last = i, None
                return extra
        raise MemoryTierError(f"rank {self.rank} holds no valid in-memory snapshot of step {step} in {self.directory}")

    # -- tier 1: replicas of a buddy's snapshots ---------------------------------------------------

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

    def _own_files(self) -> list[_Slot]:
        return self._node_files(("rank-",))

    def _node_files(self, prefixes: tuple[str, ...] = ("rank-", "replica-")) -> list[_Slot]:
        """The node folder's slots (every rank's own, and the replicas), by name."""
        return [_Slot(os.path.join(self.directory, n)) for n in sorted(os.listdir(self.directory))
                if n.startswith(prefixes) and n.endswith(".snap")]

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

    # -- resharding: the snapshots of a world of another size ---------------------------------------

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

    def close(self) -> None:
        """Unmap the slot files (they stay: the agent owns them)."""
        self.settle()
        self._wait_hold()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for s in self._slots:
            s.close()
        self._gpu.close()


def _intact(slots: list[_Slot], keep: Callable[[Header], bool] = lambda h: True) -> Iterator[tuple[Header, dict[str, Any]]]:
    """The header and meta of each slot that is complete and checksum-verified, of any rank and world
    size, whose header ``keep`` accepts (checked before the data is read); a slot whose meta cannot be
    read is skipped: not a candidate."""
    for slot in slots:
        h = slot.header()
        got = slot.read_valid(h.world_size, None) if h is not None and keep(h) else None
        if got is None:
            continue
        try:
            meta = pickle.loads(got[1][got[0].tensor_bytes:])
        except Exception:  # noqa: BLE001 - unreadable: not a candidate
            continue
        yield got[0], meta


def _world_of(h: Header, data: bytes) -> str:
    try:
        return str(pickle.loads(data[h.tensor_bytes:]).get("world", ""))
    except Exception:  # noqa: BLE001 - unreadable meta: matches no world
        return "\0unreadable"


def _parse(h: Header, data: bytes) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One snapshot's meta and a view of each of its tensors (over a private copy of ``data``)."""
    meta = pickle.loads(data[h.tensor_bytes:])
    raw = torch.frombuffer(bytearray(data[:h.tensor_bytes]), dtype=torch.uint8) if h.tensor_bytes else None
    views: list[torch.Tensor] = []
    off = 0
    for leaf in _leaves(meta["skeleton"]):
        shape, dtype_name = leaf[1], leaf[2]
        dtype = _dtype(dtype_name)
        n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        chunk = raw[off:off + n] if raw is not None and n else torch.empty(0, dtype=torch.uint8)
        views.append(chunk.view(dtype).view(shape))
        off += _align(n)
    return meta, views


def blob_skeleton(blob: bytes) -> Any:
    """The skeleton of a snapshot handed out as a :meth:`MemoryTier.blob` (its layout and DTensor records:
    what :func:`shards_needed` reads), without checking the data."""
    h = Header.unpack(blob[:_HEADER.size])
    if h is None:
        raise MemoryTierError("not a snapshot")
    return pickle.loads(blob[HEADER_BYTES + h.tensor_bytes:HEADER_BYTES + h.tensor_bytes + h.meta_bytes])["skeleton"]


def _load_into(state: dict[str, Any], skel: Any, fill_one: Callable[[Any, Any, str], Any]) -> None:
    """Fill every entry of ``state`` in place from ``skel`` (``fill_one(current, skeleton, entry name)``),
    then load it."""
    with torch.no_grad():
        for k, v in state.items():
            if _has_local(v):
                v.load_local_state_dict(fill_one(v.local_state_dict(), skel[k], k))
            elif isinstance(v, Stateful):
                v.load_state_dict(fill_one(v.state_dict(), skel[k], k))
            elif isinstance(v, dict):
                v.update(fill_one(v, skel[k], k))


def _load_data(h: Header, data: bytes, state: dict[str, Any]) -> dict[str, Any]:
    """Load one snapshot's data (tensors + skeleton) into ``state`` in place; return its ``extra``."""
    meta, views = _parse(h, data)
    _load_into(state, meta["skeleton"], lambda cur, skel, _: fill(cur, skel, views))
    return dict(meta["extra"])


def _copy_and_commit(mm: mmap.mmap, views: list[torch.Tensor], tensors: list[torch.Tensor], *,
                     copied: threading.Event | None = None, gpu_done: Any = None, device: Any = None,
                     fault_hook: Callable[[int], None] | None = None, **kw: Any) -> None:
    """The background half of a snapshot: the deferred copies (CPU tensors: the copy releases the GIL),
    the wait for the GPU copies (``gpu_done``, on ``device`` made current first), then - ``copied`` set:
    the guarded optimizer may step - :func:`_commit`."""
    try:
        if tensors:
            with torch.no_grad():
                torch._foreach_copy_(views, tensors)
        if gpu_done is not None:
            pinned.bind_thread(device)
            gpu_done.synchronize()
    finally:
        if copied is not None:
            copied.set()
    if fault_hook is not None:
        fault_hook(kw["step"])
    _commit(mm, **kw)


def _leaves(skel: Any) -> list[Leaf]:
    """The leaves of a skeleton in index order."""
    out: list[Leaf] = []

    def walk(x: Any) -> None:
        if isinstance(x, tuple):  # a leaf
            out.append(x)
        elif isinstance(x, _Shards):
            out.extend(x.leaves)
        elif isinstance(x, _Tuple):
            for v in x.items:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(skel)
    out.sort(key=lambda leaf: leaf[0])
    return out


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise MemoryTierError(f"unknown dtype {name!r} in an in-memory snapshot")
    return d


__all__ = ["HEADER_BYTES", "SLOTS", "Header", "MemoryTier", "MemoryTierError", "SnapshotResult", "SnapshotSource", "check_fits",
           "folder_bytes", "host_available_bytes",
           "choose_sources", "node_bytes", "slot_bytes"]
