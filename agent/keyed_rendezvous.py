"""``rendezvous.protocol: keyed``: trainguard's own rendezvous handler, O(N) store bytes per membership change.

The keys and why: :mod:`trainguard.agent.membership` (the decisions, pure); the store I/O:
:mod:`trainguard.agent.membership_kv`. This module is the executor: a torch ``RendezvousHandler`` whose
:meth:`KeyedRendezvousHandler.next_round` does, on every node,

1. heartbeat (a thread writes ``hb/<node>`` every ``keep_alive_interval_s``; on etcd it renews the
   node's lease on an open gRPC stream, :mod:`~trainguard.agent.etcd_lease`) and announce ``join`` in the
   log with a free port of its own, reading at once (etcd: in the same transaction) the close mark, the
   newest round ``cur`` and the decider's lease ``lead``;
2. wait for round ``cur + 1`` (TCPStore: one blocking read of the node's wake key, which the decider writes
   with ``go`` and the node's assignment, and the node's alarm ends when no round came (:meth:`~.membership_kv.
   TcpKv.wait_round`); etcd: a watch on the node's own bucket key on gRPC, whose one event carries ``go`` and
   its rank), every
   ``keep_alive_interval_s x (keep_alive_max_attempts - 1)`` looking at ``lead`` (one key, and its holder's
   heartbeat): vacant or its holder dead -> take it (compare-and-set, a new term);
3. as the decider (the lease holder), every :data:`~trainguard.agent.elastic_types.POLL_INTERVAL_S`:
   read the new log entries and the candidates' heartbeats, :func:`~trainguard.agent.membership.decide`;
   to publish (:meth:`~trainguard.agent.membership_kv.Kv.publish_round`): TCPStore: each member's
   assignment and the round's record under the round and term (the record created once: a term is never
   reused), then ``go`` (compare-and-set against absent: two deciders can never publish the same round; the
   loser's assignments and record, under another term, are never read: the record is read through ``go``'s
   term); etcd: one transaction, if ``go`` is absent and ``lead`` still this decider's, of the bucket keys
   (``max_nodes / 16``, at most 120: each holds ``go`` and its nodes' assignments), the record, ``go`` and
   ``cur``; then release the lease. ``go`` names rank 0's address and announced port: the workers'
   ``MASTER_ADDR`` / ``MASTER_PORT``, so no member reads them from the round's store;
4. with the round: its assignment there -> its group rank and the world size; absent -> it did not fit or
   came late: it announces again for the next round (spares that did not fit ``max_nodes`` are carried by
   the record).

A restarted ``trainguard store`` (:mod:`~trainguard.agent.keyed_restart`: ``reconnect``, called by the supervisor when
its store calls fail) lost every key: the node opens new connections, writes its heartbeat at once and,
as a member of round ``k``, republishes what it holds of that round: first the floors (the lease's term
at the round's, so that a decider after the restart takes a newer term and never reuses the round's keys;
the log position ``jseq`` at the round's, so that new announcements come after it), then the round's
assignments and record under its term and ``go``, each created once
(:func:`~trainguard.agent.membership.republish_action`): the first member's copy wins, the others find
the same round; a different world under that round number is never overwritten (``conflict``).

A planned leave (:meth:`~KeyedRendezvousHandler.leave`) is one ``leave`` entry and a dead heartbeat: the
decider completes the survivors' round without waiting for a timeout. Evidence that a member is gone
(``Plan.evict``) is an ``evict`` entry about the round it was gathered in. A round's agents share the
store under ``torch.rendezvous.<run_id>.<round>`` as with torch's handler (``MASTER_ADDR``/``PORT``,
elastic's rank assignment, trainguard's drain record); fencing of checkpoints stays with the epochs
claimed in the checkpoint store, independent of rounds.

Log events: ``rendezvous_decider`` (this node took the lease: term), ``rendezvous_round_published``
(round, nodes, reason, seconds), ``rendezvous_publish_lost`` (another decider's term published the round),
``rendezvous_store_reconnected`` (round, republished: publish / same / conflict / moved_on / none),
``rendezvous_heartbeat_failed`` / ``rendezvous_heartbeat_resumed`` (one line each per outage).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError
from torch.distributed.elastic.utils.distributed import get_free_port

from trainguard.agent import storecall
from trainguard.agent.elastic_types import POLL_INTERVAL_S, Peek, Plan, RendezvousAborted
from trainguard.agent.exitbarrier import RoundView
from trainguard.agent.membership import (
    EVICT,
    JOIN,
    LEAVE,
    NO_RECORD,
    Action,
    Entry,
    Go,
    Lease,
    Record,
    Settings,
    apply_change,
    assignment,
    change_of,
    decide,
    encode_assignment,
    fold,
    lease_action,
    master_of,
    moved_since,
    parse_lease,
    rec_key,
)
from trainguard.agent.keyed_restart import StoreRestart
from trainguard.agent.membership_kv import Kv
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.rendezvous")

FIRST_TAKERS = 4
"""At its first look in a round, only a node of group rank below this in the previous round (or a node with no
round yet) takes a vacant decider's lease; the others look again ``interval x (attempts - 1)`` later. At 1,024
nodes on etcd, every node taking it at once cost ~150 lost compare-and-sets per change."""

ALIVE_EVERY_S = 0.5
"""The decider re-reads the candidates' heartbeats at most this often (and whenever the log grew)."""

_local_ids = itertools.count()


def node_id(addr: str) -> str:
    """``addr_pid_n``: the shape of torch's node descriptors, unique per handler in a process."""
    return f"{addr}_{os.getpid()}_{next(_local_ids)}"


class _Decider:
    """The decider's memory across polls of one round: the previous record, the log read so far."""

    def __init__(self, target: int, prev: Record) -> None:
        self.target, self.prev = target, prev
        self.pos = prev.consumed
        self.entries: list[Entry] = []
        self.min_since: float | None = None
        self.alive: frozenset[str] = frozenset()
        self.alive_at = -1e9
        self.started = time.monotonic()


class KeyedRendezvousHandler(StoreRestart, RendezvousHandler):
    """See the module docstring. ``make_kv()`` builds one :class:`Kv` per thread that talks to the store
    (this handler's calls, the heartbeat thread); ``store`` is the job's ``torch.distributed.Store`` under
    which each round's store lives. Methods are called from one thread at a time (the supervisor's), except
    :meth:`leave` and :meth:`stop_heartbeats`."""

    def __init__(self, *, run_id: str, addr: str, settings: Settings, keep_alive_s: float, join_timeout_s: float,
                 make_kv: Callable[[], Kv], store: Any, backend: str, poll_s: float = POLL_INTERVAL_S,
                 look_s: float | None = None, attempts: int = 3,
                 reconnect: tuple[Callable[[], Any], Callable[[Any], Kv], Callable[[Any], Kv]] | None = None) -> None:
        self._run_id, self._addr, self._limits = run_id, addr, settings
        self._keep_alive_s, self._join_timeout_s, self._poll_s = keep_alive_s, join_timeout_s, poll_s
        self._look_s = keep_alive_s if look_s is None else look_s
        """How often a node waiting in the rendezvous looks at the lease, ``cur``, the close mark and its
        evidence (between looks it only waits for ``go``)."""
        self._make_kv, self._store, self._backend = make_kv, store, backend
        self._attempts = attempts
        self._reconnect = reconnect
        """``(connect, kv_main, kv_beat)``: a new client to the store, the handler's :class:`Kv` on it and the
        heartbeat thread's (TCPStore only; etcd keeps its keys across its own restarts)."""
        self.node = node_id(addr)
        self._kv = make_kv()
        self.round = -1
        self._rank = -1
        """This node's group rank in ``round`` (-1: none yet)."""
        self._looked: tuple[int, Record | None] = (-2, None)
        """``(cur, the record of round cur or None)`` as this node's first look in a round read them."""
        self.consumed = 0
        self._go: Go | None = None
        """``go`` of ``round`` (its term names the round's record)."""
        self._held: Record | None = None
        """The record of ``round`` once read (:meth:`members`): what this node republishes after a restart."""
        self._before: Record | None = None
        """The record this node held when it joined ``round``: the base of ``go``'s change (:meth:`members`)."""
        self.record_reads = 0
        """Rounds whose members this node read as a whole record (the others it derived from ``go``'s change)."""
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._hb_kv: Kv = make_kv()  # made now: TCPStore clients connecting while others call stalled those 5 s
        self._lease_raw: bytes | None = None
        self._renewed = False
        """Set by the guard of the handler's connection after it renewed it by itself (``tcp_handler``): the store
        may have restarted empty, so the next :meth:`peek` / :meth:`num_nodes_waiting` restores this node's
        heartbeat and round there (:meth:`_restore`) before it reads."""

    # -- RendezvousHandler ---------------------------------------------------------------------------
    def get_backend(self) -> str:  # See base class.
        return self._backend

    def get_run_id(self) -> str:  # See base class.
        return self._run_id

    def next_rendezvous(self) -> RendezvousInfo:  # See base class.
        return self.next_round(lambda: False, None)

    def is_closed(self) -> bool:  # See base class.
        return self._kv.get("closed") is not None

    def set_closed(self) -> None:  # See base class.
        self._kv.set("closed", b"1")

    def num_nodes_waiting(self) -> int:  # See base class.
        """Nodes that announced a ``join`` since the current round was decided and did not leave again:
        newcomers, or members that went back to the rendezvous (torch's wait list). A ``leave`` (a drained
        member) or an ``evict`` is no node waiting: counting them made the survivors of a planned leave
        decide ``scale_up`` instead of ``peer_drain``. A member of the current round that announced ``join``
        went back to the rendezvous: it left this world (:meth:`peek` drops it from the participants, the
        running members call their workers off the collectives it no longer takes part in), it is no
        newcomer to scale up for (counted as one, the members asked their workers for a resize at a step
        boundary they never reached, stuck in a collective with a partitioned node: test_partition on keyed
        at 19b2572). One small read while the log did not move, else the new entries."""
        if self._renewed_read(lambda: self._kv.pending(self.consumed)) == 0:
            return 0
        entries, _ = self._kv.announcements(self.consumed)
        return self._newcomers(entries)

    def _newcomers(self, entries: list[Entry]) -> int:
        """Nodes that want into the next round by ``entries`` and are no member of this node's round."""
        members = set(self.members())
        return sum(1 for n in fold(entries, self.round).joined if n not in members)

    def shutdown(self) -> bool:  # See base class.
        self.set_closed()
        self.stop_heartbeats()
        return True

    # -- heartbeats ----------------------------------------------------------------------------------
    def start_heartbeats(self) -> None:
        if self._hb_thread is not None and self._hb_thread.is_alive():
            return
        self._hb_stop.clear()
        self._hb_kv.beat(self.node)
        self._hb_thread = threading.Thread(target=self._beat, name=f"keyed-rdzv-hb-{self.node}", daemon=True)
        self._hb_thread.start()

    def _beat(self) -> None:
        failed = 0
        while not self._hb_stop.wait(self._keep_alive_s):
            try:
                self._hb_kv.beat(self.node)  # (read each time: :meth:`reconnect` replaces it)
            except Exception as e:  # noqa: BLE001 - a missed beat is what the timeout is for; keep beating
                failed += 1
                if failed == 1:  # one line per outage (a restarted store failed every beat until the reconnect)
                    log.warning("rendezvous_heartbeat_failed", node=self.node, error=f"{type(e).__name__}: {e}"[:200])
                continue
            if failed:
                log.info("rendezvous_heartbeat_resumed", node=self.node, missed=failed)
                failed = 0

    def stop_heartbeats(self) -> None:
        self._hb_stop.set()
        t, self._hb_thread = self._hb_thread, None
        if t is not None and t is not threading.current_thread():
            t.join(self._keep_alive_s + 5)
        try:
            self._hb_kv.close()  # etcd: its lease stream (reopened by the next beat)
        except Exception:  # noqa: BLE001 - best effort
            pass

    # -- leaving -------------------------------------------------------------------------------------
    def leave(self) -> None:
        """The planned leave: one ``leave`` entry and a dead heartbeat; the rendezvous stays open."""
        self.stop_heartbeats()
        # On the heartbeat's connection, idle now: the handler's may be in a wait for a round (TCPStore: a
        # blocking read, up to half the call bound) when a drain arrives during the rendezvous.
        self._hb_kv.announce(Entry(self.node, LEAVE, self.round))
        self._hb_kv.unbeat(self.node)

    # -- the round -----------------------------------------------------------------------------------
    def _cur(self) -> int:
        raw = self._kv.get("cur")
        return int(raw) if raw else -1

    def next_round(self, abort: Callable[[], bool], plan: Plan | None, evicted: list[str] | None = None) -> RendezvousInfo:
        """Join the next round (see the module docstring); :class:`RendezvousAborted` when ``abort()``
        turns true first, ``RendezvousClosedError`` / ``RendezvousTimeoutError`` as torch's handler."""
        self.start_heartbeats()
        deadline = time.monotonic() + self._join_timeout_s
        # The announcement and the first look in one request on etcd: the newest round, the lease, and the round
        # this node expects next (so that its wait needs no read of it first). (A join's base is only for the
        # log's reader: this node's last round.)
        # A node that may take a vacant lease at once (below) reads its round's record in the same request:
        # as the decider it needs it, and a read of its own then would wait behind every node's announcement.
        # (Its own round's record is usually held already: members() read it when the round was joined.)
        takes = self._rank < FIRST_TAKERS and self.round >= 0
        read_rec = takes and self._held is None and self._go is not None
        keys = ["closed", "cur", "lead", f"r/{self.round + 1}/go"] + ([rec_key(self.round, self._go.term)]  # type: ignore[union-attr]
                                                                        if read_rec else [])
        closed, cur_raw, lead_raw, got, *rec = self._kv.enter(Entry(self.node, JOIN, self.round, get_free_port()), keys)
        if rec and rec[0] is not None:
            self._held = Record.decode(rec[0])
        cur_seen = int(cur_raw) if cur_raw else -1
        # The record is this node's round's: it stands for cur's only when cur is that round.
        self._looked = (cur_seen, self._held if takes and self._held is not None and self._held.round == cur_seen else None)
        if closed is not None:
            raise RendezvousClosedError
        target = (int(cur_raw) if cur_raw else -1) + 1
        if target != self.round + 1:
            got = None
        expect = (plan.members - plan.leaving) if plan is not None else frozenset()
        reported: set[str] = set()
        dec: _Decider | None = None
        if self._rank < FIRST_TAKERS:
            self._lease_from(lead_raw, check_holder=False)
        next_look = time.monotonic() + self._look_s
        mine: bytes | None = None
        try:
            while True:
                now = time.monotonic()
                if abort():
                    self._kv.announce(Entry(self.node, LEAVE, target - 1))
                    raise RendezvousAborted("left the rendezvous before the round completed (draining)")
                if got is None:
                    # Evidence that a member is gone (Plan.evict: this node's own reads) is announced as soon as
                    # it is there, as dynamic's join evicts before each of its steps: reported only at a look,
                    # every keep_alive_interval_s x (attempts - 1), the frozen member's heartbeat could expire
                    # first, and the survivors waited for it (test_hang's frozen node, keep-alive 5 s x 3).
                    self._report_evictions(plan, target, reported, evicted)
                if got is None and now >= next_look:
                    # One look (one round trip on etcd): the close mark, the newest round, the lease, the round.
                    next_look = now + self._look_s
                    closed, cur_raw, lead_raw, got = self._kv.get_many(["closed", "cur", "lead", f"r/{target}/go"])
                    if got is None:
                        if closed is not None:
                            raise RendezvousClosedError
                        cur = int(cur_raw) if cur_raw else -1
                        if cur >= target:  # a round was published while this node looked elsewhere
                            target = cur
                            continue
                        self._lease_from(lead_raw)
                if got is not None:
                    go = Go.decode(got)
                    got = None
                    if mine is None:  # seen by a look: read this node's assignment
                        _, mine = self._kv.wait_round(target, self.node, 0.0) or (go, None)
                    if mine is not None and assignment(mine)[0] >= 0:
                        return self._joined(target, go, mine)
                    target += 1
                    if mine is None:  # came late, or was thought dead: announce again for the next round
                        self._announce_join(target - 1)
                    mine = None
                    # (a spare that did not fit max_nodes is carried by the record: no announcement, so the
                    # running world does not see it as a node waiting to join)
                    dec = None
                    continue
                if now >= deadline:
                    raise RendezvousTimeoutError(f"no round within rendezvous.join_timeout_s={self._join_timeout_s:g} s")
                if self._lease_raw is not None:
                    if dec is None or dec.target != target:
                        dec = self._decider(target)
                    if dec is not None and self._decide(dec, expect):
                        continue
                    got, mine = self._wait_round(target, self._poll_s)
                else:
                    got, mine = self._wait_round(target, max(0.01, next_look - time.monotonic()))
        finally:
            self._release_lease()

    def _wait_round(self, target: int, timeout_s: float) -> tuple[bytes | None, bytes | None]:
        """``(go, this node's assignment)`` of round ``target`` once published; ``(None, None)`` on timeout."""
        out = self._kv.wait_round(target, self.node, timeout_s)
        if out is None:
            return None, None
        return out[0].encode(), out[1]

    def _announce_join(self, base: int) -> None:
        """``join`` for the round after ``base``, with a free port of this node's for its workers' rank 0."""
        self._kv.announce(Entry(self.node, JOIN, base, get_free_port()))

    def _report_evictions(self, plan: Plan | None, target: int, reported: set[str], evicted: list[str] | None) -> None:
        if plan is None or plan.evict is None or not (plan.round is None or plan.round == target - 1):
            return
        for victim in sorted(plan.evict() - {self.node} - reported):
            reported.add(victim)
            self._kv.announce(Entry(victim, EVICT, target - 1))
            if evicted is not None:
                evicted.append(victim)
            log.warning("member_evicted", nodes=[victim], round=target - 1,
                        cause="a collective failed here and the member's agent missed its heartbeat",
                        effect="announced as gone: the decider leaves it out of the next round")

    def _joined(self, target: int, go: Go, mine: bytes) -> RendezvousInfo:
        rank, size = assignment(mine)
        self._before = self._held
        self.round, self._rank, self.consumed, self._go, self._held = target, rank, go.consumed, go, None
        store = dist.PrefixStore(f"torch.rendezvous.{self._run_id}.{target}", self._store)
        master = go.master_addr_port
        if master is None:  # rank 0 announced no port (an older agent): read them from the store, as torch does
            info = RendezvousStoreInfo.build(rank, store, local_addr=self._addr)
        else:
            # The decider named rank 0's address and the port it announced: nobody waits on the store for them.
            # Rank 0 still writes them there (one node, two keys), for whatever reads the round's store.
            if rank == 0:
                store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, master[0].encode())
                store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(master[1]).encode())
            info = RendezvousStoreInfo(master[0], master[1])
        return RendezvousInfo(store, rank, size, info)

    def _look_at_lease(self) -> None:
        self._lease_from(self._kv.get("lead"))

    def _lease_from(self, raw: bytes | None, *, check_holder: bool = True) -> None:
        """Take, hold or follow the decider's lease, whose value (read in this look) is ``raw``.
        ``check_holder=False`` (a node's first look in a round): a holder is taken to be alive without reading
        its heartbeat, one request less per node and change (on etcd at 1,024 nodes, ~1,000 of ~4,000); a
        holder that died is seen at the next look, ``keep_alive_interval_s x (attempts - 1)`` later, when
        its heartbeat has expired anyway."""
        term, holder = parse_lease(raw)
        if not check_holder:  # (only nodes of group rank < FIRST_TAKERS get here: see next_round)
            alive = bool(holder) and holder != self.node
        else:
            alive = bool(holder) and holder != self.node and holder in self._kv.alive([holder])
        act = lease_action(self.node, holder, alive)
        if act is Lease.HOLD:
            self._lease_raw = raw
        elif act is Lease.TAKE:
            want = f"{term + 1} {self.node}".encode()
            got = self._kv.create("lead", want) if raw is None else self._kv.swap("lead", raw, want)
            self._lease_raw = want if got == want else None
            if self._lease_raw is not None:
                log.info("rendezvous_decider", node=self.node, term=term + 1, previous=holder or None)
        else:
            self._lease_raw = None

    def _release_lease(self) -> None:
        if self._lease_raw is None:
            return
        term, _ = parse_lease(self._lease_raw)
        try:
            self._kv.swap("lead", self._lease_raw, f"{term} -".encode())
        except Exception:  # noqa: BLE001 - unreleased, the lease passes on once this node's heartbeat expires
            pass
        self._lease_raw = None

    def _decider(self, target: int) -> _Decider | None:
        # The newest round and its record as this node's first look read them, when they are the round before
        # ``target`` (a round published since is fenced off anyway: its go exists, so this decider's publish
        # loses); else read now.
        seen_cur, seen_rec = self._looked
        if seen_cur == target - 1 and (seen_cur < 0 or (seen_rec is not None and seen_rec.round == seen_cur)):
            self._looked = (-2, None)  # once: a later decider's poll reads afresh
            return _Decider(target, NO_RECORD if seen_rec is None else seen_rec)
        cur = self._cur()
        if cur >= target:
            return None
        if cur < 0:
            return _Decider(target, NO_RECORD)
        prev = self._record_at(cur)
        if prev is None:
            return None
        return _Decider(cur + 1, prev) if cur + 1 == target else None

    def _record_at(self, round_: int) -> Record | None:
        """Round ``round_``'s record as published (under ``go``'s term), None when not (yet) there: the one
        this node holds, else ``go`` and the record read (the record alone when ``go`` is this node's)."""
        if round_ < 0:
            return None
        if round_ == self.round and self._held is not None and self._held.round == round_:
            return self._held
        if round_ == self.round and self._go is not None:
            term = self._go.term
        else:
            go = self._kv.get(f"r/{round_}/go")
            if go is None:
                return None
            term = Go.decode(go).term
        raw = self._kv.get(rec_key(round_, term))
        return Record.decode(raw) if raw else None

    def _decide(self, dec: _Decider, expect: frozenset[str]) -> bool:
        """One poll of the decider; True when the round was published (by this node or another)."""
        entries, dec.pos = self._kv.announcements(dec.pos)
        dec.entries += entries
        wants = fold(dec.entries, dec.prev.round)
        now = time.monotonic()
        if entries or now - dec.alive_at >= ALIVE_EVERY_S:
            pool = set(dec.prev.members) | set(dec.prev.spares) | set(wants.joined) | set(expect)
            dec.alive, dec.alive_at = self._kv.alive(pool), now
        d = decide(dec.prev, wants, dec.alive, self._limits, now, dec.min_since, expect)
        dec.min_since = d.min_since
        if d.action is not Action.PUBLISH:
            return False
        term, _ = parse_lease(self._lease_raw)
        t = dec.target
        assigned = ([(n, encode_assignment(i, len(d.members))) for i, n in enumerate(d.members)]
                    + [(n, encode_assignment(-1, len(d.members))) for n in d.spares])
        go = Go(term, len(d.members), dec.pos, master_of(d.members, wants), change_of(dec.prev, d.members, d.spares)).encode()
        assert self._lease_raw is not None
        if self._kv.publish_round(t, term, self._lease_raw, assigned, Record(t, d.members, d.spares, dec.pos, term).encode(),
                                  go) == go:
            log.info("rendezvous_round_published", round=t, nodes=len(d.members), spares=len(d.spares),
                     reason=d.reason, term=term, seconds=round(now - dec.started, 3))
        else:
            log.warning("rendezvous_publish_lost", round=t, term=term,
                        effect="another decider's term published this round; its assignments stand")
        self._release_lease()
        return True

    # -- what the agent reads ------------------------------------------------------------------------
    @property
    def endpoint_store(self) -> Any:
        """The ``TCPStore`` at the endpoint (keyed on ``c10d``; census and straggler keys), else None; its calls
        bounded through the handler's guard as :meth:`round_store`'s (unbounded, the cut-off node's supervisor
        hung ~23 s past the heal in a straggler-key call on the dead connection: the e2e run at 172b51e)."""
        if not isinstance(self._store, dist.TCPStore):
            return None
        guard = getattr(self._kv, "guard", None)
        return storecall.BoundedStore(guard) if guard is not None else self._store

    def round_store(self, round_: int) -> Any:
        """The store of round ``round_``'s agents (the prefix torch's handler uses, too). On a ``TCPStore``
        its calls run through the handler's :class:`~trainguard.agent.storecall.ClientGuard` (bounded by the
        keep-alive window; the client renewed after one gave up): the supervisor's drain and worker-API marks
        must not hang its loop under a partition. (The round's store handed to torch elastic for its rank
        assignment, whose ``get`` waits for rank 0, stays unbounded, as with ``dynamic``.)"""
        prefix = f"torch.rendezvous.{self._run_id}.{round_}"
        guard = getattr(self._kv, "guard", None)
        if guard is not None:
            return storecall.BoundedStore(guard, lambda c: dist.PrefixStore(prefix, c))
        return dist.PrefixStore(prefix, self._store)

    def side_store(self, round_: int) -> Any:
        """:meth:`round_store` for another thread: on a ``TCPStore``, a connection of its own (a client is not
        safe to share between threads), with a short timeout, its calls bounded by the keep-alive window and
        the connection renewed after one gave up or failed (a partition, a restarted store:
        :class:`~trainguard.agent.storecall.ClientGuard`); the etcd store is thread-safe."""
        if not isinstance(self._store, dist.TCPStore):
            return self.round_store(round_)
        host, port = self._store.host, self._store.port

        def connect() -> Any:
            return dist.TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=5))
        slot = [connect()]

        def renew() -> None:
            slot[0] = connect()
        guard = storecall.ClientGuard(lambda: slot[0], renew, bound_s=self.keep_alive_window_s,
                                      interval_s=self._keep_alive_s, name="side")
        return storecall.BoundedStore(guard, lambda c: dist.PrefixStore(f"torch.rendezvous.{self._run_id}.{round_}", c))

    def peek(self) -> Peek:
        """The newest round, its members and the announcements since this node's round, without joining:
        O(1) reads while the newest round is this node's (its members are cached), else one record.

        Liveness in a running world is watched as a ring: each member reads the heartbeat of the next one
        by rank (one key) and, when it expired, marks it in ``r/<round>/lost``; every member reads that
        mark. So a member whose agent died is missing from ``participants`` here on every node within a
        keep-alive interval of its expiry, for O(1) reads per node (torch's state holds every heartbeat).
        A member that announced since the round (went back to the rendezvous, left, or was evicted about it:
        :func:`~trainguard.agent.membership.moved_since`) is missing at once, as torch's state drops it."""
        cur = self._renewed_read(self._cur)
        if cur == self.round and cur >= 0:
            members = tuple(self.members())
            if self.node in members and len(members) > 1:
                nxt = members[(members.index(self.node) + 1) % len(members)]
                if not self._kv.alive([nxt]):
                    self._kv.set(f"r/{cur}/lost", nxt.encode())
            lost = self._kv.get(f"r/{cur}/lost")
            if lost:
                members = tuple(m for m in members if m != lost.decode())
        elif cur >= 0:
            rec = self._record_at(cur)
            members = rec.members if rec is not None else ()
        else:
            members = ()
        waiting = 0
        if self._kv.pending(self.consumed) > 0:  # (one small read while the log did not move)
            entries, _ = self._kv.announcements(self.consumed)
            waiting = self._newcomers(entries)
            if cur == self.round:  # members that went back to the rendezvous, left, or were evicted since
                moved = moved_since(entries, cur)
                members = tuple(m for m in members if m not in moved)
        return Peek(round=cur, complete=cur >= 0, participants=members, waiting=waiting,
                    this_node_participates=self.node in members)

    def members(self) -> list[str]:
        """The node ids of the current round by group rank, then held: derived from the round this node held
        before and ``go``'s :class:`~trainguard.agent.membership.Change` (no read), else one read of the
        round's record under its ``go``'s term (a newcomer, a big change)."""
        if self.round < 0:
            return []
        if self._held is None or self._held.round != self.round:
            derived = self._derived()
            if derived is None:
                self.record_reads += 1
            self._held = derived or self._record_at(self.round)
        return list(self._held.members) if self._held is not None else []

    def _derived(self) -> Record | None:
        """This round's record from the one held before it and ``go``'s change, without a read (None: no
        change, another base, or a digest mismatch)."""
        go, before = self._go, self._before
        if go is None or go.change is None or before is None:
            return None
        members = apply_change(before, go.change)
        return None if members is None else Record(self.round, members, go.change.spares, go.consumed, go.term)
    @property
    def keep_alive_window_s(self) -> float:
        """``keep_alive_interval_s x keep_alive_max_attempts``: a heartbeat this old is expired."""
        return float(self._keep_alive_s * self._attempts)

    def round_view(self) -> RoundView:
        """The exit barrier's and the store host's read (:mod:`trainguard.agent.exitbarrier`): the newest round,
        whether the rendezvous is closed, the round's members still in it and every node with a live heartbeat.

        A member is out of the round once its heartbeat expired (or it left: a dead heartbeat), it was marked
        lost or evicted about this round, or it announced since the round was decided (``join``: it went back
        to the rendezvous, as a node whose workers restarted; ``leave``), as torch's state drops it from the
        participants. ``known`` also holds the nodes waiting for a next round (their ``join`` since). Reads:
        the close mark, ``cur``, the log since the round (usually empty), its lost mark, the heartbeats."""
        closed = self.is_closed()
        cur = self._cur()
        rec = self._record_at(cur)
        if rec is None:
            return RoundView(round=cur, closed=closed, participants=frozenset())
        entries, _ = self._kv.announcements(rec.consumed)
        moved = moved_since(entries, rec.round)
        waiting = {e.node for e in entries if e.kind == JOIN}
        lost = self._kv.get(f"r/{rec.round}/lost")
        alive = self._kv.alive(set(rec.members) | set(rec.spares) | waiting)
        out = frozenset(m for m in rec.members if m in alive and m not in moved and (not lost or m != lost.decode()))
        return RoundView(round=rec.round, closed=closed, participants=out, known=alive)


__all__ = ["ALIVE_EVERY_S", "FIRST_TAKERS", "KeyedRendezvousHandler", "node_id"]
