"""A snapshot's data as tier 0 keeps it: the *skeleton* of a state and the reads of a slot's data.

A snapshot is every tensor's bytes back to back, then a pickled skeleton: the state dict's structure
with every tensor replaced by a :data:`Leaf` (its index in the slot, shape, dtype, and for a DTensor
the record resharding needs), every non-tensor value as it is. :func:`skeleton` builds it at every
snapshot, :func:`layout` / :func:`relaxed` tell whether two states load into each other (at the same
or at another world size), :func:`materialise` gives the state dicts a snapshot copies, and
:func:`fill` copies a snapshot back into them. The reads below parse a slot's data (header from
:mod:`~trainguard.checkpoint.slots`) into a view per tensor and load it into a state in place.
Used by the tier (:mod:`~trainguard.checkpoint.memory`), its replicas, parity and resharding; all
pure functions of their arguments (no slot is written here).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.checkpoint import reshard
from trainguard.checkpoint.slots import HEADER_BYTES, _HEADER, Header, MemoryTierError, _align, _numel, _Slot

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



# ---- reading a slot's data ----------------------------------------------------------------------


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

