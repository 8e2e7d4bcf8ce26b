"""The keyed rendezvous protocol's decisions (``rendezvous.protocol: keyed``, issue 40), as pure functions.

torch's dynamic rendezvous keeps its whole state (participants, wait list, every node's heartbeat) in one
pickled value behind one compare-and-set key: every keep-alive and every join rewrites O(N) bytes and the
N writers collide, so a membership change costs O(N^2) bytes (measured: N^2.7-3.1, ``docs/benchmarks.md``).
The keyed protocol splits that state into keys that each have one writer:

==========================  =======================================================================
``hb/<node>``               the node's heartbeat, written by it alone: O(1) per keep-alive (TCPStore:
                            its wall-clock time; etcd: a key on the node's own lease, renewed)
``jseq``, ``j/<seq>``       the announcement log: a node that wants into the next round, leaves, or
                            has evidence that a member is gone appends one entry (``add`` + ``set``)
``lead``                    the decider's lease: ``"<term> <node>"``, taken by compare-and-set when it
                            is vacant or its holder's heartbeat expired, released after publishing
``r/<k>/<term>/a/<node>``   node's group rank and the world size in round ``k``, written by the decider
``r/<k>/<term>/rec``        the whole record of round ``k`` (members by rank, spares carried, log
                            position consumed) under the publishing term: read, through ``go``'s term,
                            by the next decider and by ``members()`` only (a decider that lost the race
                            for ``go`` wrote its record under its own term: never read)
``r/<k>/go``                created once (compare-and-set against absent): the fence, so two deciders
                            can never publish the same round; the waiting nodes block on it
``cur``                     the newest round published (a hint for nodes that arrive)
==========================  =======================================================================

So a change costs each node O(1) (its announcement, its wait on ``go``, its own assignment) and the
decider O(N) (the log, the heartbeats, the assignments): O(N) bytes per change, O(N) bytes per keep-alive
interval. This module holds what is decided: how an announcement log folds into who wants in
(:func:`fold`), whether a heartbeat is fresh (:func:`heartbeat_alive`), whether a node takes the decider's
lease (:func:`lease_action`), what the next round is (:func:`decide`) and what a member republishes into a
restarted store (:func:`republish_action`, :func:`floor_value`, :func:`lease_floor`); the store I/O is
:mod:`trainguard.agent.membership_kv`, the handler :mod:`trainguard.agent.keyed_rendezvous`.
"""

from __future__ import annotations

import bisect
import enum
import json
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

JOIN, LEAVE, EVICT = "join", "leave", "evict"
KINDS = (JOIN, LEAVE, EVICT)


@dataclass(frozen=True, slots=True)
class Entry:
    """One line of the announcement log: ``node`` wants into the round after ``base`` (``join``), leaves
    (``leave``), or is gone on a peer's evidence about round ``base`` (``evict``). A ``join`` carries
    ``port``, a free port of the node's: should it get group rank 0, the round's ``go`` names it as the
    workers' ``MASTER_PORT``, so no member reads ``MASTER_ADDR`` / ``MASTER_PORT`` from the store (0: none,
    as from an older agent; then the members read them as torch's handler does)."""

    node: str
    kind: str
    base: int
    port: int = 0

    def encode(self) -> bytes:
        tail = f" {self.port}" if self.port else ""
        return f"{self.kind} {self.base} {self.node}{tail}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> Entry | None:
        """None for a line that is not an entry (a torn or foreign write is skipped, never fatal)."""
        parts = raw.decode(errors="replace").split(" ")
        if len(parts) not in (3, 4) or parts[0] not in KINDS:
            return None
        try:
            return cls(parts[2], parts[0], int(parts[1]), int(parts[3]) if len(parts) == 4 else 0)
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class Record:
    """What the decider publishes for round ``round``: ``members`` by group rank, the ``spares`` that
    announced and did not fit (``max_nodes``; carried into the next round without announcing again) and
    ``consumed``, the log position up to which announcements were taken into account."""

    round: int
    members: tuple[str, ...]
    spares: tuple[str, ...] = ()
    consumed: int = 0
    term: int = 0

    def encode(self) -> bytes:
        return json.dumps({"round": self.round, "members": list(self.members), "spares": list(self.spares),
                           "consumed": self.consumed, "term": self.term}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Record:
        d = json.loads(raw)
        return cls(int(d["round"]), tuple(d["members"]), tuple(d.get("spares", ())), int(d.get("consumed", 0)),
                   int(d.get("term", 0)))


NO_RECORD = Record(round=-1, members=())
"""Before the first round."""


CHANGE_MAX = 32
"""At most this many names (members added and removed, spares) in a round's :class:`Change`; a bigger change
(the first round, a mass arrival) has none and every member reads the round's record."""


def members_digest(members: Sequence[str]) -> int:
    """CRC-32 of the members by group rank: what a member checks the members it derived against."""
    return zlib.crc32("\n".join(members).encode())


@dataclass(frozen=True, slots=True)
class Change:
    """Round ``k``'s members as a change of round ``prev``'s, carried by ``go``: a member that holds round
    ``prev``'s record derives round ``k``'s from it (:func:`apply_change`) instead of reading the whole
    record, so a membership change costs each member O(change) bytes, not O(N) (N members reading N names
    each was O(N^2) per change). ``digest`` (:func:`members_digest`) guards the derivation: on a mismatch the
    member reads the record."""

    prev: int
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    spares: tuple[str, ...] = ()
    digest: int = 0

    def encode(self) -> str:
        return json.dumps([self.prev, list(self.added), list(self.removed), list(self.spares), self.digest],
                          separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> Change | None:
        """None for what is not a change (never fatal: the member reads the record)."""
        try:
            prev, added, removed, spares, digest = json.loads(text)
            return cls(int(prev), tuple(map(str, added)), tuple(map(str, removed)), tuple(map(str, spares)),
                       int(digest))
        except (ValueError, TypeError):
            return None


def change_of(prev: Record, members: Sequence[str], spares: Sequence[str]) -> Change | None:
    """Pure: round ``members`` (and ``spares``) as a change of ``prev`` (a published round), None when there is
    no previous round or the change names more than :data:`CHANGE_MAX` nodes."""
    if prev.round < 0:
        return None
    now, before = set(members), set(prev.members)
    added = tuple(m for m in members if m not in before)
    removed = tuple(m for m in prev.members if m not in now)
    if len(added) + len(removed) + len(spares) > CHANGE_MAX:
        return None
    return Change(prev.round, added, removed, tuple(spares), members_digest(members))


def apply_change(prev: Record, change: Change) -> tuple[str, ...] | None:
    """Pure: the members of the round ``change`` describes, derived from ``prev`` (by group rank:
    :func:`ranked`, as :func:`decide` orders them); None when ``prev`` is not the change's base or the result
    does not match its digest."""
    if prev.round < 0 or change.prev != prev.round:
        return None
    # prev's members are ranked already: drop the removed, insert the added in order (O(N) and a few sort keys;
    # ranking all N again cost each of 1,023 members 0.6 ms of CPU per change). An unranked prev (not what
    # decide publishes) gives a list the digest refuses: the member then reads the record.
    removed, added = set(change.removed), set(change.added)
    kept = [n for n in prev.members if n not in removed and n not in added]
    for n in sorted(added, key=node_order):
        kept.insert(bisect.bisect_left(kept, node_order(n), key=node_order), n)
    members = tuple(kept)
    return members if members_digest(members) == change.digest else None


@dataclass(frozen=True, slots=True)
class Go:
    """The value of ``r/<k>/go``: which decider's term published round ``k``, its size, the log position,
    where the workers of group rank 0 listen (``master``: ``"addr:port"`` from rank 0's ``join``; empty when
    it announced none: the members then read ``MASTER_ADDR`` / ``MASTER_PORT`` from the round's store), and
    the round as a :class:`Change` of the one before (None: none, read the record)."""

    term: int
    world_size: int
    consumed: int
    master: str = ""
    change: Change | None = None

    def encode(self) -> bytes:
        tail = f" {self.master}" if self.master else ""
        change = f"|{self.change.encode()}" if self.change is not None else ""
        return f"{self.term} {self.world_size} {self.consumed}{tail}{change}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> Go:
        head, sep, change = raw.decode().partition("|")
        term, size, consumed, *rest = head.split()
        return cls(int(term), int(size), int(consumed), rest[0] if rest else "",
                   Change.decode(change) if sep else None)

    @property
    def master_addr_port(self) -> tuple[str, int] | None:
        """``(addr, port)`` of ``master``, None when absent or malformed."""
        addr, _, port = self.master.rpartition(":")
        return (addr.strip("[]"), int(port)) if addr and port.isdigit() else None


@dataclass(frozen=True, slots=True)
class Wants:
    """The log folded: who wants into the next round (in order of first announcement), who leaves, who is
    evicted on evidence about the previous round."""

    joined: tuple[str, ...] = ()
    leaving: frozenset[str] = frozenset()
    evicted: frozenset[str] = frozenset()
    ports: tuple[tuple[str, int], ...] = ()
    """``(node, port)`` of the last ``join`` of each node that announced one with a port."""

    def port_of(self, node: str) -> int:
        return dict(self.ports).get(node, 0)


def fold(entries: Iterable[Entry], prev_round: int) -> Wants:
    """Pure: the announcements read so far, in log order. A node's last ``join`` / ``leave`` counts (a node
    that joined and then left is out; one that left and joins again is in). An ``evict`` counts only when
    its evidence is about ``prev_round``: evidence about an older world says nothing of the live members of
    a newer one (a node cut off by a partition must not evict the peers that re-formed without it)."""
    order: dict[str, None] = {}
    leaving: set[str] = set()
    evicted: set[str] = set()
    ports: dict[str, int] = {}
    for e in entries:
        if e.kind == JOIN:
            order.setdefault(e.node, None)
            leaving.discard(e.node)
            if e.port:
                ports[e.node] = e.port
        elif e.kind == LEAVE:
            order.pop(e.node, None)
            leaving.add(e.node)
        elif e.kind == EVICT and e.base == prev_round:
            evicted.add(e.node)
    return Wants(tuple(order), frozenset(leaving), frozenset(evicted), tuple(sorted(ports.items())))


def moved_since(entries: Iterable[Entry], round_: int) -> frozenset[str]:
    """Pure: the members of round ``round_`` that are no longer in it by the log since it was decided: a node
    that announced ``join`` (it went back to the rendezvous: its workers restarted, or it re-forms) or
    ``leave``, or that a peer evicted on evidence about ``round_`` (evidence about an older round says
    nothing of this one). torch's dynamic state drops such a node from the participants at once (its exit
    op, or the eviction): the running members see a member gone and call their workers off a collective
    that may wait for it, instead of waiting for a heartbeat to expire (test_partition at 19b2572: the
    majority's second node saw only the decider's ``join`` as a node waiting, asked for a resize at a step
    boundary its workers, stuck in a collective with the partitioned node, never reached)."""
    return frozenset(e.node for e in entries if e.kind != EVICT or e.base == round_)


def master_of(members: Sequence[str], wants: Wants) -> str:
    """Pure: ``"addr:port"`` of group rank 0 (``members[0]``; its address is the node id's, see
    :func:`node_order`) from the port its ``join`` announced; empty when it announced none."""
    if not members:
        return ""
    port = wants.port_of(members[0])
    if not port:
        return ""
    addr = members[0].rsplit("_", 2)[0] if members[0].count("_") >= 2 else ""
    if not addr:
        return ""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def heartbeat_alive(beat: float | None, now: float, interval_s: float, attempts: int) -> bool:
    """Pure: a node whose last heartbeat (its wall-clock time, seconds) is ``interval_s x attempts`` old or
    more is dead, as in torch's dynamic rendezvous (the same assumption: node clocks agree to well within
    ``interval_s x (attempts - 1)``). None (never beat) or 0 (left) is dead."""
    return bool(beat) and now - float(beat) < interval_s * attempts  # type: ignore[arg-type]


class Lease(enum.Enum):
    """What a node in the rendezvous does about the decider's lease (:func:`lease_action`)."""

    HOLD = "hold"          # it holds the lease: it decides
    TAKE = "take"          # the lease is vacant or its holder is dead: compare-and-set it to this node
    FOLLOW = "follow"      # a live node holds it: wait for ``go``


def parse_lease(raw: bytes | None) -> tuple[int, str]:
    """``(term, holder)``; holder ``""`` when vacant (never taken, or released as ``"<term> -"``)."""
    if not raw:
        return 0, ""
    term, _, holder = raw.decode(errors="replace").partition(" ")
    try:
        return int(term), ("" if holder == "-" else holder)
    except ValueError:
        return 0, ""


def lease_action(me: str, holder: str, holder_alive: bool) -> Lease:
    """Pure: take a vacant lease or one whose holder's heartbeat expired; hold one's own; else follow."""
    if holder == me:
        return Lease.HOLD
    if not holder or not holder_alive:
        return Lease.TAKE
    return Lease.FOLLOW


@dataclass(frozen=True, slots=True)
class Settings:
    min_nodes: int
    max_nodes: int
    last_call_s: float


class Action(enum.Enum):
    WAIT = "wait"
    PUBLISH = "publish"


@dataclass(frozen=True, slots=True)
class Decision:
    """:func:`decide`'s answer: publish ``members`` (by group rank) with ``spares`` carried, or wait;
    ``min_since`` is the time ``min_nodes`` were first there (the last call runs from it)."""

    action: Action
    members: tuple[str, ...] = ()
    spares: tuple[str, ...] = ()
    min_since: float | None = None
    reason: str = ""
    missing: tuple[str, ...] = field(default=())
    """Nodes expected and not there yet (for the log)."""


def decide(prev: Record, wants: Wants, alive: frozenset[str], settings: Settings, now: float,
           min_since: float | None, expect: frozenset[str] = frozenset()) -> Decision:
    """Pure: the next round from the previous record, the folded log and who is alive.

    Candidates are the previous round's spares and the nodes that announced, alive, not leaving, not
    evicted: the previous members first, then newcomers in order of announcement (who gets in when there
    are more than ``max_nodes``). The members' group ranks follow :func:`node_order`, as torch's dynamic
    rendezvous orders them (so both protocols give the same ranks). The round is published

    * at once when ``max_nodes`` candidates are there (the rest stay spares);
    * as soon as everyone *expected* is there and at least ``min_nodes``: expected are the previous
      members and ``expect`` (the decider's own plan) that are alive and neither leaving nor evicted, and
      every candidate - a planned leave, a join, a loss once the lost node's heartbeat expired: no timeout;
    * otherwise ``last_call_s`` after ``min_nodes`` candidates were first there (torch's last call).
    """
    gone = wants.leaving | wants.evicted
    prev_order = {n: i for i, n in enumerate(prev.members)}
    pool = [n for n in dict.fromkeys((*prev.spares, *wants.joined)) if n in alive and n not in gone]
    cands = sorted(pool, key=lambda n: (0, prev_order[n]) if n in prev_order else (1, 0))
    expected = ((frozenset(prev.members) | expect) & alive) - gone
    have = frozenset(cands)
    missing = tuple(sorted(expected - have))
    if len(cands) >= settings.max_nodes:
        return Decision(Action.PUBLISH, ranked(cands[:settings.max_nodes]), tuple(cands[settings.max_nodes:]),
                        min_since, "max_nodes")
    if len(cands) < settings.min_nodes:
        return Decision(Action.WAIT, min_since=None, reason="below min_nodes", missing=missing)
    since = now if min_since is None else min_since
    if expected and not missing:
        return Decision(Action.PUBLISH, ranked(cands), (), since, "everyone expected is there")
    if now - since >= settings.last_call_s:
        return Decision(Action.PUBLISH, ranked(cands), (), since, "last call")
    return Decision(Action.WAIT, min_since=since, reason="last call", missing=missing)


class Republish(enum.Enum):
    """What a member of round ``k`` does about that round in a store it reconnected to (:func:`republish_action`)."""

    PUBLISH = "publish"
    """The round is missing (a restarted ``trainguard store`` lost every key): write its record and
    assignments under the round's own term and create ``go`` (create-once: the first member wins, the
    others find :attr:`SAME`)."""
    SAME = "same"
    """The store holds exactly the round this node holds (its own republication or a peer's)."""
    CONFLICT = "conflict"
    """The store holds another world under this round number: never overwritten (nothing is republished;
    the checkpoint epochs fence the two worlds)."""
    MOVED_ON = "moved_on"
    """The store is at a later round already: nothing to republish."""


def republish_action(held: Record, held_go: Go, rec: bytes | None, go: bytes | None, cur: int) -> Republish:
    """Pure: what a member that holds round ``held`` (published with ``held_go``) does after reconnecting,
    given what the store has: ``rec`` (``r/<k>/<held term>/rec``), ``go`` (``r/<k>/go``) and ``cur``
    (-1 when absent). Republishing is only ever the same world under the same round, term and log
    position; anything else under that round number is a :attr:`Republish.CONFLICT`."""
    if cur > held.round:
        return Republish.MOVED_ON
    if go is not None:
        try:
            there_go = Go.decode(go)
        except ValueError:
            return Republish.CONFLICT
        if there_go != held_go:
            return Republish.CONFLICT
    if rec is not None:
        try:
            there = Record.decode(rec)
        except (ValueError, KeyError, TypeError):
            return Republish.CONFLICT
        if there != held:
            return Republish.CONFLICT
    return Republish.SAME if go is not None and rec is not None else Republish.PUBLISH


def floor_value(there: bytes | None, floor: int) -> bytes | None:
    """Pure: the value to compare-and-set a counter key to so that it is at least ``floor`` (``jseq``: the
    log position the held round consumed, or new announcements would sort before it and never be read;
    ``cur``: the held round), or None when it is there already. An unreadable value is replaced."""
    try:
        value = int(there) if there else None
    except ValueError:
        value = None
    if value is not None and value >= floor:
        return None
    return str(floor).encode()


def lease_floor(there: bytes | None, term: int) -> bytes | None:
    """Pure: a vacant decider's lease at ``term`` (``"<term> -"``) when the store holds none or a lower
    term, so that a decider after a store restart takes a term above the held round's (a lower term could
    reuse its keys ``r/<k>/<term>/...``); None to leave the lease as it is."""
    if there is None:
        return f"{term} -".encode()
    have, _ = parse_lease(there)
    return None if have >= term else f"{term} -".encode()


def node_order(node: str) -> tuple[str, int, int, str]:
    """Pure: the sort key of a node id ``addr_pid_n``: address, then pid and local id as numbers (torch
    sorts its ``_NodeDesc(addr, pid, local_id)`` so); an id of another shape sorts by its text."""
    addr, pid, local = (node.rsplit("_", 2) + ["", ""])[:3]
    if pid.isdigit() and local.isdigit():
        return addr, int(pid), int(local), ""
    return node, -1, -1, node


def ranked(nodes: Iterable[str]) -> tuple[str, ...]:
    """The members by group rank (:func:`node_order`)."""
    return tuple(sorted(nodes, key=node_order))


def rec_key(round_: int, term: int) -> str:
    """The key of round ``round_``'s record as published by ``term`` (read through ``go``'s term)."""
    return f"r/{round_}/{term}/rec"


def assignment(raw: bytes) -> tuple[int, int]:
    """``(group rank, world size)`` from ``r/<k>/<term>/a/<node>``."""
    rank, size = raw.decode().split()
    return int(rank), int(size)


def encode_assignment(rank: int, size: int) -> bytes:
    return f"{rank} {size}".encode()


WAKE_MARK = b"~"
"""TCPStore: the value a waiting node's own alarm writes to its wake key (:func:`wake_key`) to end its wait."""


def wake_key(t: int, node: str) -> str:
    """TCPStore: the key ``node`` blocks on while it waits for round ``t``: written by the decider after it
    published the round (:func:`encode_wake`), or by the node's own alarm (:data:`WAKE_MARK`)."""
    return f"r/{t}/w/{node}"


def encode_wake(go: bytes, mine: bytes) -> bytes:
    """Pure: a member's wake value: its assignment and ``go``, so that the wait's one read gives both."""
    return mine + b"\n" + go


def decode_wake(raw: bytes) -> tuple[Go, bytes] | None:
    """Pure: ``(go, assignment)`` of a wake value; None for the node's own mark (the round is not known)."""
    mine, sep, go = raw.partition(b"\n")
    if not sep:
        return None
    return Go.decode(go), mine


BUCKET_NODES = 16
"""etcd: about this many nodes' assignments per bucket key (:func:`buckets_for`)."""

MAX_BUCKETS = 120
"""etcd: at most this many bucket keys, so that a round's buckets, its record, ``go`` and ``cur`` fit in one
transaction under etcd's ``--max-txn-ops`` (128 by default)."""


def buckets_for(max_nodes: int) -> int:
    """Pure: how many bucket keys a round's assignments are spread over on etcd: ``max_nodes / 16``, at least
    1, at most :data:`MAX_BUCKETS`. Every node of a job computes it from the same ``max_nodes``."""
    return max(1, min(MAX_BUCKETS, -(-max_nodes // BUCKET_NODES)))


def bucket_of(node: str, buckets: int) -> int:
    """Pure: the bucket of ``node`` (CRC-32 of its id: the same in every process, unlike ``hash``)."""
    return zlib.crc32(node.encode()) % buckets


def encode_buckets(go: bytes, assignments: Sequence[tuple[str, bytes]], buckets: int) -> list[bytes]:
    """Pure: the values of the ``buckets`` keys of a round on etcd: each holds ``go`` on its first line, then
    ``"<node> <assignment>"`` for the nodes that hash to it (:func:`bucket_of`). A node watches its own bucket
    key: the one event carries the round and its rank, O(N / buckets) bytes."""
    lines: list[list[bytes]] = [[go] for _ in range(buckets)]
    for node, value in assignments:
        lines[bucket_of(node, buckets)].append(node.encode() + b" " + value)
    return [b"\n".join(x) for x in lines]


def decode_bucket(raw: bytes, node: str) -> tuple[Go, bytes | None]:
    """Pure: ``(go, node's assignment or None when the round does not name it)`` from a bucket's value."""
    first, *rest = raw.split(b"\n")
    want = node.encode() + b" "
    mine = next((line[len(want):] for line in rest if line.startswith(want)), None)
    return Go.decode(first), mine


def new_entries(consumed: int, seq: int) -> Sequence[int]:
    """The log positions not read yet: ``consumed + 1 .. seq`` (``add`` hands out 1, 2, ...)."""
    return range(consumed + 1, seq + 1)


__all__ = ["BUCKET_NODES", "CHANGE_MAX", "MAX_BUCKETS", "Action", "Change", "Decision", "EVICT", "Entry", "Go", "JOIN", "LEAVE", "Lease",
           "NO_RECORD", "Record", "Republish", "Settings", "Wants", "apply_change", "assignment", "bucket_of", "buckets_for", "change_of",
           "decide", "decode_bucket", "encode_assignment", "encode_buckets", "floor_value", "fold", "heartbeat_alive", "lease_action",
           "lease_floor", "master_of", "members_digest", "moved_since", "new_entries", "node_order", "parse_lease", "ranked", "rec_key",
           "republish_action", "WAKE_MARK", "decode_wake", "encode_wake", "wake_key"]
