"""Resharding from memory: which elements of a DTensor each rank of a world that no longer exists held,
and copying the elements two shards share.

An in-memory snapshot records, for each DTensor, its global shape, its mesh (the global ranks, as a
nested tuple; for a submesh, also its root mesh's: the other ranks' submeshes are its translations) and
its placements (:func:`describe`, cached per DTensor spec: it runs at every snapshot). From that record alone, without the old world's process group, :func:`indices` gives
the global index along each dimension of every element an old rank's local tensor holds, by torch's own
shard arithmetic (``Shard`` splits as ``torch.chunk`` does; ``_StridedShard``, which FSDP2 over tensor
parallelism makes, interleaves; ``Replicate`` keeps the whole dimension). The current rank computes the
same for its new shard (:func:`current_indices`), and :func:`overlap` says which positions of the two
local tensors hold the same global elements. ``Partial`` (a pending reduction) cannot be resharded.

So any layout torch's DTensor can express over any mesh reshards from memory, as DCP reshards it from
storage: FSDP2 over one mesh dimension, FSDP2 over tensor parallelism on a 2-D mesh, uneven shards.
A ``ShardedTensor`` (DeepSpeed ZeRO's ranges) carries every rank's blocks in its global metadata
(:func:`sharded_record`); its blocks are boxes (:func:`box`) and reshard the same way.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from trainguard.checkpoint.errors import CheckpointError

Code = tuple
"""A placement as plain data: ``("S", dim)``, ``("SS", dim, split_factor)``, ``("R",)``, ``("P", repr)``."""
Info = tuple
"""A DTensor's record in a snapshot: ``(global shape, its mesh's ranks as a nested tuple, placement codes,
the root mesh's ranks or None when the mesh is its own root)``."""
Indices = list[torch.Tensor]
"""Per dimension of a local tensor, the ascending global indices of its elements along that dimension."""


class ReshardError(CheckpointError):
    """A layout that cannot be resharded from memory (the restore then reads storage)."""


def _kept(cache: dict[Any, tuple[Any, Any]], anchor: Any, key: Any, make: Any, most: int) -> Any:
    """``make()``, kept in ``cache`` under ``key`` (which holds ``id(anchor)``) while ``anchor`` is that
    object: the entry holds ``anchor``, so its id is not reused while the entry lives. Cleared past
    ``most`` entries."""
    hit = cache.get(key)
    if hit is not None and hit[0] is anchor:
        return hit[1]
    if len(cache) > most:
        cache.clear()
    value = make()
    cache[key] = (anchor, value)
    return value


_BY_SPEC: dict[int, tuple[Any, Info]] = {}
_BY_LAYOUT: dict[tuple[int, Any, tuple[int, ...]], tuple[Any, Info]] = {}
_ROOTS: dict[int, tuple[Any, tuple]] = {}


def describe(t: Any) -> Info:
    """The record of DTensor ``t`` (global shape, mesh, placements) a snapshot keeps beside its shard.
    Runs per DTensor at every snapshot: a parameter's or an optimizer state's spec object lives as long
    as the tensor, so the lookup is one dict access and an identity check. DTensors of one layout share
    one record (and one root mesh tuple), which a snapshot's pickle then holds once."""
    spec = t._spec
    hit = _BY_SPEC.get(id(spec))  # the hit inline: this runs per DTensor at every snapshot
    if hit is not None and hit[0] is spec:
        return hit[1]
    return _kept(_BY_SPEC, spec, id(spec), lambda: _describe(t), 65536)


def _describe(t: Any) -> Info:
    mesh, placements, shape = t.device_mesh, t.placements, tuple(t.shape)

    def make() -> Info:
        root = _root_of(mesh)
        return (shape, _nested(mesh.mesh.tolist()), tuple(code(p) for p in placements),
                None if root is None or root is mesh else
                _kept(_ROOTS, root, id(root), lambda: _nested(root.mesh.tolist()), 4096))

    return _kept(_BY_LAYOUT, mesh, (id(mesh), placements, shape), make, 4096)


def _root_of(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (itself when it is a root; None where this torch cannot say:
    the record then names the mesh alone, and only its own ranks' shards reshard from it)."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    try:
        from torch.distributed.device_mesh import _mesh_resources

        return _mesh_resources.get_root_mesh(mesh)
    except (ImportError, AttributeError):
        return None


def _nested(x: Any) -> Any:
    return tuple(_nested(v) for v in x) if isinstance(x, list) else int(x)


def code(p: Any) -> Code:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return ("SS", int(p.dim), int(p.split_factor))
    if isinstance(p, Shard):
        return ("S", int(p.dim))
    if isinstance(p, Replicate):
        return ("R",)
    return ("P", repr(p))


def placement(c: Code) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if c[0] == "S":
        return Shard(c[1])
    if c[0] == "SS":
        return _StridedShard(c[1], split_factor=c[2])
    if c[0] == "R":
        return Replicate()
    raise ReshardError(f"cannot reshard a DTensor placed {c[1] if len(c) > 1 else c} from memory (a pending "
                       f"reduction: only Shard, _StridedShard and Replicate placements)")


def local_indices(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
                  placements: list[Any]) -> Indices:
    """The global indices, per dimension, of the local tensor of the rank at ``coord`` of a mesh of
    ``mesh_shape`` holding a DTensor of ``global_shape`` placed ``placements`` (torch's arithmetic:
    the one ``compute_local_shape_and_global_offset`` runs, keeping every offset, not only the first)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    except ImportError as e:  # torch's shard arithmetic moved: storage reshards instead
        raise ReshardError(f"this torch ({torch.__version__}) lacks the shard arithmetic resharding from memory "
                           f"uses; the restore reads storage") from e
    sizes = list(global_shape)
    offsets: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, (Shard, _StridedShard)):
            raise ReshardError(f"cannot reshard a DTensor placed {p!r} from memory")
        d = p.dim
        size, off = _get_shard_size_and_offsets(sizes[d], mesh_shape[mesh_dim], coord[mesh_dim], p,
                                                offsets.get(d), global_shape[d], False)
        sizes[d] = size
        offsets[d] = off[:size].to(torch.long) if size else torch.empty(0, dtype=torch.long)
    return [offsets[d] if d in offsets else torch.arange(n) for d, n in enumerate(global_shape)]


@functools.lru_cache(maxsize=256)
def _coordinates(ranks: tuple) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
    """A mesh's shape and each of its ranks' coordinate."""
    mesh = torch.tensor(ranks)
    return tuple(mesh.shape), {int(r): tuple(c) for r, c in zip(mesh.flatten().tolist(),
                                                                 torch.cartesian_prod(*(torch.arange(n) for n in mesh.shape)).view(mesh.numel(), -1).tolist(), strict=True)}


@functools.lru_cache(maxsize=65536)
def _cached(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], codes: tuple) -> tuple:
    return tuple(local_indices(shape, mesh_shape, coord, [placement(c) for c in codes]))


@functools.lru_cache(maxsize=256)
def _translations(sub: tuple, root: tuple) -> tuple[tuple[int, ...], dict[tuple[int, ...], tuple[int, ...]]]:
    """For a mesh ``sub`` sliced (or flattened) out of ``root``: the root dimensions along which its ranks
    vary, and for each combination of coordinates along them, the coordinate in ``sub`` it stands at.
    Every rank of ``root`` sits in the same place of its own slice (the slices are translations of one
    another along the other dimensions)."""
    _, sub_coords = _coordinates(sub)
    _, root_coords = _coordinates(root)
    members = [root_coords[r] for r in sub_coords]
    varying = tuple(d for d in range(len(members[0])) if len({m[d] for m in members}) > 1)
    return varying, {tuple(root_coords[r][d] for d in varying): c for r, c in sub_coords.items()}


def _coordinate(info: Info, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shape of the mesh of ``rank``'s shard of a DTensor recorded as ``info`` and ``rank``'s place in it:
    in the recorded mesh, or in its translation to ``rank`` within the root mesh (a submesh, e.g. the
    data-parallel one, is recorded as the recording rank's). None: ``rank`` is in neither."""
    sub = info[1]
    mesh_shape, coords = _coordinates(sub)
    coord = coords.get(rank)
    if coord is not None:
        return mesh_shape, coord
    root = info[3] if len(info) > 3 else None
    if root is None:
        return None
    _, root_coords = _coordinates(root)
    if rank not in root_coords:
        return None
    varying, place = _translations(sub, root)
    at = place.get(tuple(root_coords[rank][d] for d in varying))
    return None if at is None else (mesh_shape, at)


def indices(info: Info, rank: int) -> Indices | None:
    """:func:`local_indices` of global ``rank`` for a DTensor recorded as ``info`` (None: not in its mesh).
    Cached: a model's DTensors share a few layouts, and a restore asks for each old rank's."""
    got = _coordinate(info, rank)
    return None if got is None else list(_cached(tuple(info[0]), got[0], got[1], tuple(info[2])))


def current_indices(t: Any) -> Indices:
    """:func:`local_indices` of this rank's shard of the live DTensor ``t``."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ReshardError("this rank is not in the mesh of a DTensor of its state")
    return list(_cached(tuple(t.shape), tuple(mesh.shape), tuple(coord), tuple(code(p) for p in t.placements)))


def replication(info: Info) -> int:
    """How many ranks hold each element of a DTensor recorded as ``info``: the sizes of the mesh
    dimensions it is replicated over, multiplied, times the number of submeshes of its root mesh like its
    own (a data-parallel submesh's shards are replicated over tensor parallelism)."""
    mesh_shape, coords = _coordinates(info[1])
    n = 1
    for size, c in zip(mesh_shape, info[2], strict=True):
        n *= size if c[0] == "R" else 1
    root = info[3] if len(info) > 3 else None
    return n * (len(_coordinates(root)[1]) // len(coords) if root is not None else 1)


def sharded_record(t: Any) -> tuple[tuple[tuple[int, ...], ...], tuple]:
    """For a ``ShardedTensor`` (DeepSpeed ZeRO's ranges, :mod:`trainguard.strategies.flat_shards`): the
    global offsets of each of its local shards, and the record of every rank's shards from its global
    metadata, ``(global shape, ((rank, offsets, sizes), ...))``."""
    md = t.metadata()
    local = tuple(tuple(int(x) for x in s.metadata.shard_offsets) for s in t.local_shards())
    shards = tuple((int(s.placement.rank()), tuple(int(x) for x in s.shard_offsets), tuple(int(x) for x in s.shard_sizes))
                   for s in md.shards_metadata)
    return local, (tuple(int(x) for x in md.size), shards)


def box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Indices:
    """The global indices of a block at ``offsets`` of ``sizes`` (a ShardedTensor's shard)."""
    return [torch.arange(o, o + n) for o, n in zip(offsets, sizes, strict=True)]


def chunk_indices(global_shape: tuple[int, ...], parts: int, index: int) -> Indices:
    """Dimension 0 split as ``torch.chunk`` splits it (FSDP2 over one mesh dimension), part ``index``: the
    layout assumed for a snapshot whose tensor carries no record (a plain tensor standing for a shard)."""
    total = global_shape[0] if global_shape else 0
    size = -(-total // parts) if parts else 0
    lo = min(total, index * size)
    return [torch.arange(lo, lo + max(0, min(size, total - lo))), *(torch.arange(n) for n in global_shape[1:])]


Pos = slice | torch.Tensor


def _positions(a: torch.Tensor, b: torch.Tensor) -> tuple[Pos, Pos] | None:
    """The positions in ``a`` and in ``b`` (both ascending) of the indices they share, as slices when they
    are runs; None when they share none."""
    if not len(a) or not len(b):
        return None
    a0, b0 = int(a[0]), int(b[0])
    if int(a[-1]) - a0 + 1 == len(a) and int(b[-1]) - b0 + 1 == len(b):  # two runs: the common case
        lo, hi = max(a0, b0), min(a0 + len(a), b0 + len(b))
        return (slice(lo - a0, hi - a0), slice(lo - b0, hi - b0)) if lo < hi else None
    pa = torch.isin(a, b).nonzero().flatten()
    if not len(pa):
        return None
    pb = torch.searchsorted(b, a[pa])
    return _run(pa), _run(pb)


def _run(p: torch.Tensor) -> Pos:
    first = int(p[0])
    return slice(first, first + len(p)) if int(p[-1]) - first + 1 == len(p) else p


def overlap(mine: Indices, theirs: Indices) -> tuple[list[Pos], list[Pos]] | None:
    """Where two shards of one tensor hold the same elements: per dimension, the positions in ``mine``'s
    local tensor and in ``theirs``' (None: no element in common)."""
    if len(mine) != len(theirs):
        raise ReshardError(f"a tensor of {len(mine)} dimensions is recorded with {len(theirs)}")
    pm: list[Pos] = []
    pt: list[Pos] = []
    for a, b in zip(mine, theirs, strict=True):
        got = _positions(a, b)
        if got is None:
            return None
        pm.append(got[0])
        pt.append(got[1])
    return pm, pt


def select(t: torch.Tensor, pos: list[Pos]) -> torch.Tensor:
    """The block of ``t`` at ``pos`` (a view when every position is a slice)."""
    for d, p in enumerate(pos):
        t = t[(slice(None),) * d + (p,)] if isinstance(p, slice) else t.index_select(d, p)
    return t


def assign(t: torch.Tensor, pos: list[Pos], block: torch.Tensor | bool) -> None:
    """Write ``block`` into ``t`` at ``pos``. ``block`` may live elsewhere (a host block read from a
    snapshot into a GPU tensor): ``index_put_`` needs its values and indices on ``t``'s device."""
    if all(isinstance(p, slice) for p in pos):
        t[tuple(pos)] = block
        return
    n = len(pos)
    ix = tuple((torch.arange(p.start, p.stop) if isinstance(p, slice) else p).to(t.device)
               .view([-1 if i == d else 1 for i in range(n)]) for d, p in enumerate(pos))
    values = torch.as_tensor(block, dtype=t.dtype) if isinstance(block, bool) else block
    t.index_put_(ix, values.to(device=t.device, dtype=t.dtype))
