"""Flat tensors of which each rank owns one contiguous range, as DCP entries that reshard on load.

A ZeRO partition cuts every parameter, flattened, into contiguous ranges: ZeRO-1/2 cut the
concatenation of a param group's parameters into one equal slice per rank, so a parameter's range on
a rank starts anywhere; ZeRO-3 cuts each parameter into ``ceil(numel / world)`` pieces. To save and
load such ranges with ``torch.distributed.checkpoint`` (DCP) at any world size and stage, each
parameter (and each of its optimizer states) is expressed as a **global 1-D tensor of the parameter's
numel** of which this rank holds its range: a ``ShardedTensor`` built from the local range (a view,
no copy) and the table of every rank's ranges (:class:`PieceTable`, one ``all_gather_object``,
computed once per engine since partitions never move). DCP writes each rank's range once and, on
load, reads exactly the overlap of the saved ranges with the range the loading rank owns.

Why ``ShardedTensor`` and not ``DTensor``: a ``DTensor`` shards evenly (``torch.chunk`` semantics)
while ZeRO-1/2 ranges are arbitrary; DCP plans, writes and reads ``ShardedTensor`` chunks natively
(``planner_helpers._create_write_items`` / ``_create_chunk_list``), and torch's state-dict copy
helpers (the checkpoint manager's staging) copy only local shards. torch marks ``ShardedTensor``
deprecated in favour of ``DTensor`` (a ``FutureWarning`` from its ``__torch_function__``; we silence
the ones our own calls raise); this is the one module that imports ``torch.distributed._shard``, so a
torch upgrade that removes it touches this file only.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_DEPRECATION = "Please use DTensor instead and we are deprecating ShardedTensor"


@dataclass(frozen=True, slots=True)
class Piece:
    """One rank's contiguous range ``[start, start + numel)`` of a flattened tensor."""

    rank: int
    start: int
    numel: int


class PieceTable:
    """Every rank's ranges of every named flat tensor, checked to tile ``[0, numel)`` exactly.

    Build with :meth:`gather` (a collective) or directly from a mapping (tests, pure use).
    """

    def __init__(self, numels: Mapping[str, int], pieces: Mapping[str, list[Piece]]) -> None:
        self.numels = dict(numels)
        self.pieces = {name: sorted(pieces.get(name, []), key=lambda p: p.start) for name in self.numels}
        for name, numel in self.numels.items():
            check_tiling(name, numel, self.pieces[name])

    @classmethod
    def gather(cls, numels: Mapping[str, int], local: Mapping[str, tuple[int, int] | None],
               group: Any = None) -> PieceTable:
        """All ranks' ``local`` ranges (``name -> (start, numel)`` or None) over ``group`` (default: the
        world); ranks are global ranks, as ``ShardedTensor`` placements need. A collective."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        mine = {n: r for n, r in local.items() if r is not None and r[1] > 0}
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            table: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(table, (rank, mine), group=group)
        else:
            table = [(rank, mine)]
        pieces: dict[str, list[Piece]] = {}
        for r, ranges in table:
            for name, (start, numel) in ranges.items():
                pieces.setdefault(name, []).append(Piece(r, int(start), int(numel)))
        return cls(numels, pieces)

    def local(self, name: str, rank: int) -> Piece | None:
        for p in self.pieces[name]:
            if p.rank == rank:
                return p
        return None


def check_tiling(name: str, numel: int, pieces: list[Piece]) -> None:
    """Raise ``ValueError`` unless ``pieces`` (sorted by start) cover ``[0, numel)`` once, without gaps."""
    at = 0
    for p in pieces:
        if p.start != at or p.numel <= 0:
            raise ValueError(f"the ranks' ranges of {name!r} do not tile [0, {numel}): {pieces} (expected a range "
                             f"starting at {at})")
        at += p.numel
    if at != numel:
        raise ValueError(f"the ranks' ranges of {name!r} do not tile [0, {numel}): they cover [0, {at}): {pieces}")


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATION, category=FutureWarning)
        yield


def sharded(table: PieceTable, name: str, local: torch.Tensor | None, rank: int) -> Any:
    """The ``ShardedTensor`` of global shape ``(numel,)`` whose local shard is ``local`` (this rank's
    range of ``name`` per ``table``; a contiguous 1-D view, shared, not copied).

    A rank that owns none of it gets an *empty* local shard at offset ``numel``: DCP's load planner
    drops a ``ShardedTensor`` without local shards from the rank's plan and then takes the missing key
    for a pre-2.4 checkpoint layout (and fails on it); an empty shard reads and writes nothing, and at
    offset ``numel`` its index never equals a real range's, so DCP's de-duplication of equal write
    items across ranks cannot drop a real range in its favour.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    mine = table.local(name, rank)
    numel = table.numels[name]
    if mine is not None and (local is None or local.dim() != 1 or local.numel() != mine.numel):
        raise ValueError(f"{name!r}: local range {mine} but a local tensor of shape "
                         f"{None if local is None else tuple(local.shape)}")
    if mine is None:
        local = torch.empty(0, dtype=local.dtype if local is not None else torch.float32)
    assert local is not None
    # Only this rank's placement is validated against its tensor; the others' device is informational.
    device = str(local.device)
    mds = [ShardMetadata([p.start], [p.numel], f"rank:{p.rank}/{device}") for p in table.pieces[name]
           if p.rank != rank]
    own = ShardMetadata([mine.start if mine else numel], [mine.numel if mine else 0], f"rank:{rank}/{device}")
    mds.append(own)
    shards = [Shard(local, own)]
    meta = ShardedTensorMetadata(mds, torch.Size([numel]), TensorProperties(dtype=local.dtype))
    with _quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


def local_shard(t: Any) -> torch.Tensor | None:
    """The local shard's tensor of a ``ShardedTensor`` made by :func:`sharded` (None without one)."""
    with _quiet():
        shards = t.local_shards()
    return shards[0].tensor if shards else None


__all__ = ["Piece", "PieceTable", "check_tiling", "local_shard", "sharded"]
