"""Tier 1 as XOR parity: a lost node's snapshots rebuilt from the survivors, in ``2 / (g - 1)`` of a copy.

With ``checkpoint.memory_replica_parity`` the nodes of a world form *parity groups* of ``g`` nodes
(:func:`parity_groups`: all of them up to :data:`MAX_GROUP`). Member ``i`` of a group (the same local
rank on each of its nodes) splits its snapshot's data (tensors, then skeleton: the slot's data area,
zero-padded to the group's longest, :func:`seg_bytes`) into ``g - 1`` segments and sends segment ``k``
to member :func:`holder` ``(i, k)``; every member XORs the ``g - 1`` segments it receives into its
*parity block* (``1 / (g - 1)`` of a snapshot). Any one member's data is then the XOR of each of its
segments' block with the other segments in that block (:func:`rebuild_order`), read from the surviving
members' own snapshots: one node lost per group is rebuilt, at restore, into a replica file
(:mod:`trainguard.checkpoint.manager`), and the restore goes on as with buddy replicas.

Memory per rank: one own snapshot (no second buffer) + two parity blocks (double-buffered):
``1 + 2 / (g - 1)`` of the state, 2.0 with 3 nodes (buddy replicas: 4, own and replica both double).

Why one own buffer suffices (the order of a snapshot, :meth:`~trainguard.checkpoint.memory.MemoryTier.snapshot`):
    the parity of step ``s`` is computed from the *live* state (the optimizer guarded, as for any
    snapshot), written into the parity buffer that does not hold the newest complete block, and every
    rank of the world agrees that every block is complete (a MIN all-reduce) before any rank
    overwrites its own snapshot with ``s``. So at every instant one step is recoverable: before that
    agreement, the previous step (every own snapshot is intact; a lost node is rebuilt from the blocks
    of the previous step, still in the other buffer); after it, step ``s`` (the survivors finish the
    local copy; the one rank whose copy was cut short, or the lost node, is rebuilt from the blocks of
    ``s``). An exchange that fails (a peer gone) writes no own snapshot: the previous one stands.

Limits: one lost node per group (two lost at once, in one group, fall back to storage; so does a peer
that dies inside the agreement itself, if that lets some ranks write their own snapshot and not others:
a narrow window, the same as two losses); the own
snapshot's local copy must finish on the survivors (a SIGKILL of two ranks of one group during that
copy, a few milliseconds, loses the step to storage); tensors the optimizer does not own (buffers, and
every tensor on a GPU) are cloned before the exchange (on the GPU, in device memory).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MAX_GROUP = 8
"""The most nodes in one parity group (a rebuild reads every other member: more nodes, less memory,
longer rebuilds and more exchange messages per snapshot)."""
CHUNK_BYTES = 4 << 20
"""Bytes per message of the exchange (the transient buffers: ``2 (g - 1)`` chunks per rank)."""
WORD = 8
"""Segments are whole 8-byte words (the XOR runs on int64)."""


def parity_groups(nodes: int, max_size: int = MAX_GROUP) -> list[list[int]]:
    """The node indices of each parity group: consecutive nodes, as few groups as ``max_size`` allows,
    of near-equal size (never one of a single node when ``nodes >= 2``). ``[]`` for fewer than 2 nodes."""
    if nodes < 2:
        return []
    count = -(-nodes // max(2, max_size))
    base, extra = divmod(nodes, count)
    out, start = [], 0
    for g in range(count):
        size = base + (g < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def group_of(rank: int, world_size: int, local_world_size: int, max_size: int = MAX_GROUP) -> tuple[list[int], int] | None:
    """This rank's parity group: the global ranks of its members (the same local rank on each node of
    its node's group, in node order) and its index among them; None when the world has one node (or
    its size is not a whole number of nodes)."""
    step = max(1, local_world_size)
    if world_size % step:
        return None
    node, local = divmod(rank, step)
    for nodes in parity_groups(world_size // step, max_size):
        if node in nodes:
            return [n * step + local for n in nodes], nodes.index(node)
    return None


def seg_bytes(length: int, g: int) -> int:
    """Bytes of one segment (and of a parity block) for data of ``length`` bytes in a group of ``g``."""
    per = -(-max(0, length) // (g - 1))
    return -(-per // WORD) * WORD


def holder(i: int, k: int, g: int) -> int:
    """The member that holds the parity block segment ``k`` of member ``i`` is XORed into."""
    return (i + 1 + k) % g


def segment_to(i: int, j: int, g: int) -> int:
    """Which segment of member ``i`` goes to holder ``j`` (``j != i``)."""
    assert i != j
    return (j - i - 1) % g


def rebuild_order(x: int, g: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """How member ``x``'s segments are rebuilt: for each segment ``k``, ``(k, holder j, [(member i,
    its segment)])``: segment ``k`` of ``x`` = block of ``j`` XOR those segments of the other members."""
    out = []
    for k in range(g - 1):
        j = holder(x, k, g)
        out.append((k, j, [(i, segment_to(i, j, g)) for i in range(g) if i not in (j, x)]))
    return out


class Flat:
    """A snapshot's data area (each tensor's bytes at its slot offset, then the skeleton) read as one
    run of bytes, zero where nothing is (alignment gaps, the padding to the group's length)."""

    def __init__(self, pieces: Sequence[tuple[int, torch.Tensor]], length: int) -> None:
        self.pieces = [(off, t) for off, t in pieces if t.numel()]  # uint8, 1-D, by offset
        self.length = length

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], meta: bytes, align: int) -> Flat:
        """The data area :func:`~trainguard.checkpoint.memory._write` would write for ``tensors``
        (contiguous) and the pickled ``meta``, without writing it."""
        pieces, off = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                pieces.append((off, t.detach().reshape(-1).view(torch.uint8)))
            off += -(-n // align) * align
        if meta:
            pieces.append((off, torch.frombuffer(bytearray(meta), dtype=torch.uint8)))
        return cls(pieces, off + len(meta))

    @classmethod
    def of_bytes(cls, data: bytes | memoryview) -> Flat:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        return cls([(0, t)], len(data))

    def read(self, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` (uint8, CPU) with bytes ``start .. start + len(out)``."""
        end = start + out.numel()
        out.zero_()
        for off, t in self.pieces:
            lo, hi = max(start, off), min(end, off + t.numel())
            if lo < hi:
                out[lo - start:hi - start].copy_(t[lo - off:hi - off])


def xor_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst ^= src`` over uint8 tensors of a whole number of words (as int64: 8 bytes per op)."""
    dst.view(torch.int64).bitwise_xor_(src.view(torch.int64))


def crc(t: torch.Tensor, value: int = 0) -> int:
    return zlib.crc32(t.numpy(), value)


@dataclass(frozen=True)
class Contribution:
    """What a holder keeps of each member whose segment went into its block (to rebuild and check it)."""

    rank: int
    tensor_bytes: int
    meta_bytes: int
    seg_crc: int
    """CRC32 of the segment (padded) this member sent to the holder."""


def exchange(flat: Flat, block: Callable[[int], torch.Tensor], *, group: Any, members: list[int], index: int,
             step: int, tensor_bytes: int, meta_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[Contribution]:
    """One snapshot's parity exchange among ``members`` (global ranks, this one at ``index``) over
    ``group``, in two rounds of messages: every member's step and lengths (the segment length follows:
    :func:`seg_bytes` of the group's longest data), then the data: each segment of ``flat`` to its
    holder, in chunks, the segment's CRC32 riding on its last chunk. ``block(seg)`` returns where this
    member's block goes (uint8, ``seg`` long); the segments it holds are XORed into it. Returns what each
    contributor declared (its lengths, its segment's CRC32). Raises what the process group raises (a
    peer gone) or :class:`ValueError` when a contributor is at another step."""
    g = len(members)
    others = [m for m in range(g) if m != index]
    head = torch.tensor([step, tensor_bytes, meta_bytes, flat.length], dtype=torch.int64)
    heads = {i: torch.empty(4, dtype=torch.int64) for i in others}
    _pairwise({members[j]: head for j in others}, {members[i]: heads[i] for i in others}, group)
    for i in others:
        if int(heads[i][0]) != step:
            raise ValueError(f"parity member rank {members[i]} sent step {int(heads[i][0])}, this rank is at {step}")
    seg = seg_bytes(max([flat.length, *(int(h[3]) for h in heads.values())]), g)
    out = block(seg)
    chunk = max(WORD, min(chunk_bytes, seg) // WORD * WORD)
    send = {j: torch.empty(chunk + WORD, dtype=torch.uint8) for j in others}  # + the CRC32 on the last chunk
    recv = {i: torch.empty(chunk + WORD, dtype=torch.uint8) for i in others}
    crcs = {j: 0 for j in others}
    theirs: dict[int, int] = {}
    out.zero_()
    for lo in range(0, seg, chunk):
        n = min(chunk, seg - lo)
        last = lo + n >= seg
        m = n + WORD if last else n
        for j in others:
            flat.read(segment_to(index, j, g) * seg + lo, send[j][:n])
            crcs[j] = crc(send[j][:n], crcs[j])
            if last:
                send[j][n:m].view(torch.int64)[0] = crcs[j]
        _pairwise({members[j]: send[j][:m] for j in others}, {members[i]: recv[i][:m] for i in others}, group)
        for i in others:
            xor_(out[lo:lo + n], recv[i][:n])
            if last:
                theirs[i] = int(recv[i][n:m].view(torch.int64)[0])
    return [Contribution(rank=members[i], tensor_bytes=int(heads[i][1]), meta_bytes=int(heads[i][2]),
                         seg_crc=theirs[i]) for i in others]


def _pairwise(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group: Any) -> None:
    """Post every receive and send (by global rank), then wait for all."""
    works = [dist.irecv(t, src=r, group=group) for r, t in recvs.items()]
    works += [dist.isend(t, dst=r, group=group) for r, t in sends.items()]
    for w in works:
        w.wait()


@dataclass(frozen=True)
class Piece:
    """One input of a rebuilt segment: ``provider`` (a rank of the restoring world) reads ``kind``
    (``block``: the parity block of old rank ``source``; ``data``: segment ``segment`` of old rank
    ``source``'s snapshot) and sends it to the rebuilder."""

    provider: int
    kind: str
    source: int
    segment: int = 0


@dataclass(frozen=True)
class Rebuild:
    """How old rank ``rank``'s snapshot of ``(step, world)`` (a world of ``world_size``) is rebuilt by
    ``rebuilder``: for each of its segments (in order), the pieces XORed together, and the CRC32 the
    segment must have; ``tensor_bytes``/``meta_bytes``: its lengths (its header)."""

    rank: int
    step: int
    world: str
    world_size: int
    rebuilder: int
    seg: int
    tensor_bytes: int
    meta_bytes: int
    segments: tuple[tuple[tuple[Piece, ...], int], ...]


def plan_rebuilds(inventories: Sequence[dict[str, Any]]) -> list[Rebuild]:
    """Given what each rank of the restoring world can read in its node's folder (``data``: ``(old rank,
    step, world, world size)`` of every intact snapshot, own or replica; ``blocks``: ``(holder rank,
    step, world, world size, record)`` of every intact parity block; ``node``: the folder, so that one
    rank per node reads each file), the rebuilds that make the newest snapshot set with parity complete:
    for each ``(step, world)`` with parity blocks, newest first, the old ranks whose snapshot no node
    holds, when each is alone in its group and every other member's snapshot and block are there.
    ``[]`` when the newest such set is complete already or none can be completed. Pure."""
    data: dict[tuple[int, str], dict[int, list[int]]] = {}
    blocks: dict[tuple[int, str], dict[int, tuple[list[int], dict[str, Any]]]] = {}
    sizes: dict[tuple[int, str], int] = {}
    seen: dict[tuple[str, str, int, int, str], int] = {}  # (node, kind, rank, step, world) -> first provider

    def first(provider: int, inv: dict[str, Any], kind: str, rank: int, key: tuple[int, str]) -> bool:
        ident = (str(inv.get("node", provider)), kind, rank, *key)
        if ident in seen:
            return False
        seen[ident] = provider
        return True

    for provider, inv in enumerate(inventories):
        for rank, step, world, ws in inv.get("data", ()):
            if first(provider, inv, "data", rank, (step, world)):
                data.setdefault((step, world), {}).setdefault(rank, []).append(provider)
                sizes.setdefault((step, world), ws)
        for rank, step, world, ws, record in inv.get("blocks", ()):
            if first(provider, inv, "block", rank, (step, world)):
                got = blocks.setdefault((step, world), {}).setdefault(rank, ([], record))
                got[0].append(provider)
                sizes.setdefault((step, world), ws)
    for key in sorted(blocks, key=lambda k: (-k[0], k[1])):
        size = sizes[key]
        have = data.get(key, {})
        missing = [r for r in range(size) if r not in have]
        if not missing:
            return []
        plan = _plan_step(key, size, missing, have, blocks[key], len(inventories))
        if plan is not None:
            return plan
    return []


def _plan_step(key: tuple[int, str], size: int, missing: list[int], have: dict[int, list[int]],
               blocks: dict[int, tuple[list[int], dict[str, Any]]], world_now: int) -> list[Rebuild] | None:
    out = []
    for x in missing:
        record = next((rec for _, rec in blocks.values() if x in rec["members"]), None)
        if record is None:
            return None
        members: list[int] = list(record["members"])
        g = len(members)
        xi = members.index(x)
        segs = []
        lengths = None
        for _, j, others in rebuild_order(xi, g):
            hj = members[j]
            if hj not in blocks or any(members[i] not in have for i, _ in others):
                return None
            providers, rec = blocks[hj]
            if rec["members"] != members or rec["seg"] != record["seg"]:
                return None
            mine = next((c for c in rec["contrib"] if c["rank"] == x), None)
            if mine is None:
                return None
            lengths = (mine["tensor_bytes"], mine["meta_bytes"])
            pieces = [Piece(provider=providers[0], kind="block", source=hj)]
            pieces += [Piece(provider=have[members[i]][0], kind="data", source=members[i], segment=k)
                       for i, k in others]
            segs.append((tuple(pieces), mine["seg_crc"]))
        assert lengths is not None
        first_block = blocks[members[rebuild_order(xi, g)[0][1]]][0][0]
        rebuilder = first_block if first_block != x or world_now < 2 else (first_block + 1) % world_now
        out.append(Rebuild(rank=x, step=key[0], world=key[1], world_size=size, rebuilder=rebuilder,
                           seg=int(record["seg"]), tensor_bytes=lengths[0], meta_bytes=lengths[1],
                           segments=tuple(segs)))
    return out


__all__ = ["CHUNK_BYTES", "Contribution", "Flat", "MAX_GROUP", "Piece", "Rebuild", "exchange", "group_of", "holder",
           "parity_groups", "plan_rebuilds", "rebuild_order", "seg_bytes", "segment_to", "xor_"]
