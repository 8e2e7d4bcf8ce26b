"""The agent's side of hang detection: local beats in, the node's record out, peers' records in.

:class:`HangWatch` is fed by the control thread (each local worker's
:class:`~trainguard.contract.protocol.Progress`) and runs one daemon thread that, every
``hang.heartbeat_interval_s``, publishes this node's record in the current round's store under
:data:`PROGRESS_KEY` + the node's rendezvous id (a sequence number, which is this agent's heartbeat,
and its ranks' last beats) and reads the records of the world's other members. A SIGSTOPped agent
publishes nothing: its sequence number stops, and that is how its peers tell a frozen node from a hung
worker whose agent still acts. The supervisor asks :meth:`HangWatch.check` each tick (the pure
:func:`~trainguard.agent.hang.decide_hang` and :func:`~trainguard.agent.hang.hang_action` over what was
seen) and :meth:`HangWatch.evict` during a re-formation after a lost peer. Between its ticks a second
thread (:meth:`HangWatch.watch_procs`) reads the local workers' ``/proc`` every ``hang.proc_poll_s`` and
wakes the supervisor the moment a stopped worker's stop has lasted ``hang.stopped_s``.

**O(N) per interval, not O(N^2)** (issue 40). Every agent publishes its record, but only the world's
first :data:`READERS` members (by group rank) read every record (one ``multi_get``), decide with
:func:`~trainguard.agent.hang.decide_hang` over the whole job as before, and publish the verdict under
:data:`VERDICT_KEY` + their id (a small record: the verdict, its culprit, and the members whose agent missed
a heartbeat in their view). Every other agent reads those :data:`READERS` verdicts and nothing else
(:func:`~trainguard.agent.hang.pick_verdict`: its own kernel evidence about its own ranks first, then the
freshest verdict). At 1,024 nodes that is ~3,000 store requests per interval instead of ~1,000,000. Two
readers, so a frozen reader is named by the other one; when neither has published for ``hang.stale_s``
(both silent: a double fault), every agent reads every record again until one does (O(N^2) for that
while, as before). A world of up to :data:`READERS` + 1 nodes is watched as before (everyone reads all).

Keys live under the round's prefix: a new world starts with no records, and a record of a node that
left is never read again. Every store call is best effort (the watch observes; the store's own
outage handling is the supervisor's).

A node that cannot reach the store (a partition cuts it off; its store calls hang) sees every peer
fall silent at once. That is its own blindness, not their silence: while its own record has not reached
the store for as long as the silence it would judge (``hang.stale_s`` for a verdict, a missed heartbeat
for an eviction) the watch gives no verdict and evicts nobody, and once the store answers
again the peers' clocks restart (``progress_view_rebased``). Before this, a node healed after a 30 s
partition named a healthy peer of the majority "frozen" (53 s without progress, action ``abort``) from
the records it had last read, and asked to evict it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from trainguard.agent.hang import (HangAction, HangConfig, HangVerdict, RankView, StepTimes, Tracker, decide_hang,
                                   evictable, hang_action, pick_verdict)
from trainguard.agent.probe import Answer, Prober, ProbeServer, format_addr
from trainguard.agent.storecall import read_many
from trainguard.agent.procstat import ProcSample, ProcState, classify, held_since, read_stat
from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.hangwatch")

PROGRESS_KEY = "trainguard/progress/"
"""+ rendezvous node id, in the round's store: that node's record (JSON: seq, ranks' last beats)."""

VERDICT_KEY = "trainguard/hangverdict/"
"""+ a reader's rendezvous node id, in the round's store: its verdict over the whole job (:func:`encode_verdict`)."""

READERS = 2
"""How many members (the first by group rank) read every record and publish a verdict."""

PROBE_LIMIT = 8
"""At most this many peers probed at once by one node (:mod:`trainguard.agent.probe`): the most silent."""


def encode_verdict(seq: int, v: HangVerdict, now: float, missed: Mapping[str, float]) -> bytes:
    """A reader's verdict: ``seq`` (its heartbeat), the verdict with ages instead of its clock's times, and
    ``missed``: member -> seconds its agent has been silent in the reader's view (only those silent for
    ``hang.missed_s`` or more: normally none)."""
    c = v.culprit
    return json.dumps({"seq": seq, "hung": v.hung, "stalled_s": round(v.stalled_s, 3), "threshold_s": round(v.threshold_s, 3),
                       "why": v.why, "node_frozen": v.node_frozen,
                       "culprit": None if c is None else {"rank": c.rank, "node": c.node, "step": c.step,
                                                          "phase": c.phase.value, "where": c.where,
                                                          "silent_s": round(now - c.beat_at, 3)},
                       "missed": {m: round(a, 3) for m, a in missed.items()}}).encode()


def decode_verdict(raw: bytes, now: float) -> tuple[int, HangVerdict, dict[str, float]] | None:
    """(seq, the verdict on the reader's ages placed on this node's clock ``now``, missed), None when malformed."""
    try:
        d = json.loads(raw)
        c = d.get("culprit")
        culprit = None
        if c is not None:
            at = now - float(c.get("silent_s", 0.0))
            culprit = RankView(int(c["rank"]), str(c["node"]), int(c["step"]), proto.Phase(c["phase"]), str(c.get("where", ""))[:200],
                               at, at, at)
        v = HangVerdict(bool(d["hung"]), float(d["stalled_s"]), float(d["threshold_s"]), culprit, str(d.get("why", "")),
                        bool(d.get("node_frozen", False)))
        return int(d["seq"]), v, {str(m): float(a) for m, a in dict(d.get("missed", {})).items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def encode_record(node: str, seq: int, beats: list[proto.Progress], name: str = "", probe: str = "") -> bytes:
    return json.dumps({"node": node, "name": name, "seq": seq, "probe": probe, "ranks": [
        {"rank": b.rank, "step": b.step, "phase": b.phase.value, "where": b.where, "beat": b.beat, "progress": b.progress}
        for b in beats]}).encode()


class Record(NamedTuple):
    seq: int
    beats: list[proto.Progress]
    name: str
    """The node's name (``agent.node_name``)."""
    probe: str
    """``host:port`` its agent answers probes on (:mod:`trainguard.agent.probe`); "" when it does not."""


def decode_record(raw: bytes) -> Record | None:
    """A record, or None when it is malformed (a newer agent's extra keys are ignored; an older agent's
    record has no probe address)."""
    try:
        d = json.loads(raw)
        beats = [proto.Progress(rank=int(r["rank"]), local_rank=0, step=int(r["step"]), phase=proto.Phase(r["phase"]),
                                beat=int(r["beat"]), progress=int(r["progress"]), where=str(r.get("where", ""))[:200])
                 for r in d["ranks"]]
        return Record(int(d["seq"]), beats, str(d.get("name", ""))[:200], str(d.get("probe", ""))[:300])
    except (ValueError, KeyError, TypeError):
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class _ProcSeen:
    pid: int
    sample: ProcSample | None
    at: float
    state: ProcState
    since: float


class HangWatch:
    """One node's view of the job's progress. Thread-safe (the control thread feeds it, its own thread
    publishes and reads, the supervisor thread asks)."""

    def __init__(self, cfg: HangConfig, *, node_name: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.node_name = node_name
        self._names: dict[str, str] = {}
        self._clock = clock
        self._lock = threading.Lock()
        self._tracker = Tracker()
        self._steps = StepTimes()
        self._local: dict[int, proto.Progress] = {}
        self._procs: dict[int, _ProcSeen] = {}
        """Local rank -> what the kernel last said about its process (:meth:`observe_procs`)."""
        self._store: Any = None
        self.node_id = ""
        self._members: tuple[str, ...] = ()
        self._seq = 0
        self._acted = False
        self._watching = False
        self._answered_at: float | None = None
        """When the store last took this node's own record (clock); None: not yet in this world."""
        self._world_at = 0.0
        self._verdicts: dict[str, tuple[int, float, HangVerdict, dict[str, float]]] = {}
        """Reader -> (its seq, when it changed on this clock, its verdict, missed) as last read."""
        self.hangs: list[float] = []
        """When (monotonic) this node's own ranks were named the culprit (quarantine counts them)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pids: dict[int, int] = {}
        """Local rank -> pid, as the supervisor last gave them (the proc poll reads these)."""
        self._woken: set[tuple[int, float]] = set()
        """(local rank, stopped since) already announced to the supervisor by the proc poll."""
        self._proc_thread: threading.Thread | None = None
        self._wake: Callable[[], None] | None = None
        """The supervisor's tick (set by :meth:`watch_procs` / :meth:`serve_probes`): a probe that was not
        answered wakes it."""
        self._addrs: dict[str, str] = {}
        """Rendezvous id -> the probe address its record gives."""
        self._probe_addr = ""
        self._probe_server: ProbeServer | None = None
        self.prober: Prober | None = (Prober(cfg.probe_timeout_s, clock=clock, on_answer=self._woken_by_probe)
                                      if cfg.enabled and cfg.probe_timeout_s > 0 else None)
        """Direct questions to peer agents whose record is late (:mod:`trainguard.agent.probe`)."""

    # ---- inputs ---------------------------------------------------------------------------------
    def on_progress(self, msg: proto.Progress) -> None:
        """A local worker's beat (control thread)."""
        now = self._clock()
        with self._lock:
            self._local[msg.local_rank] = msg
            if self._watching and msg.rank >= 0:
                self._tracker.beat(self.node_id, msg.rank, msg.step, msg.phase, msg.where, msg.beat, msg.progress, now)
            if msg.local_rank == 0:
                self._steps.observe(msg.step, msg.phase, now)

    def observe_procs(self, pids: Mapping[int, int], read: Callable[[int], ProcSample | None] = read_stat) -> None:
        """This node's workers (local rank -> pid; the supervisor, every tick). With the proc poll running
        (:meth:`watch_procs`) that thread alone reads them, at its own even pace: two readers a millisecond
        apart would see no CPU tick between their reads and call a busy process idle. Without it, read
        them now."""
        with self._lock:
            self._pids = dict(pids)
        if self._proc_thread is None:
            self._sample(pids, read)

    def _sample(self, pids: Mapping[int, int], read: Callable[[int], ProcSample | None] = read_stat) -> None:
        """Read the workers' ``/proc/<pid>/stat`` and keep each one's state and since when it has held it
        (:func:`~trainguard.agent.procstat.classify`)."""
        samples = {lr: (pid, read(pid)) for lr, pid in pids.items()}
        now = self._clock()
        with self._lock:
            for lr, (pid, cur) in samples.items():
                last = self._procs.get(lr)
                same = last is not None and last.pid == pid
                prev = last if same else None
                state = classify(prev.sample if prev else None, cur, now - prev.at if prev else 0.0)
                since = held_since(prev.state if prev else None, prev.since if prev else now, prev.sample if prev else None,
                                   state, cur, now)
                if prev is None or prev.state is not state:
                    log.debug("worker_process_state", local_rank=lr, pid=pid, state=state.value,
                              kernel_state=cur.state if cur else None)
                self._procs[lr] = _ProcSeen(pid, cur, now, state, since)
            for lr in set(self._procs) - set(pids):
                del self._procs[lr]

    def start_world(self, store: Any, node_id: str, members: tuple[str, ...], *, thread: bool = True) -> None:
        """A world formed: watch its members through ``store`` (the round's); starts the thread once
        (``thread=False``: the caller drives :meth:`exchange`, as the tests do)."""
        with self._lock:
            self._tracker.reset()
            self._local.clear()
            self._store, self.node_id, self._members = store, node_id, tuple(members)
            self._acted = False
            self._watching = True
            self._answered_at = None
            self._world_at = self._clock()
            self._verdicts.clear()
        if thread and self._thread is None and self.cfg.enabled:
            self._thread = threading.Thread(target=self._run, name="trainguard-hangwatch", daemon=True)
            self._thread.start()

    def between_worlds(self) -> None:
        """This node's workers left the world (a restart): no verdict until the next one forms. The
        node's record is still published (the agent's heartbeat: its peers must not evict a node that
        restarts its workers to rejoin), with no ranks in it."""
        with self._lock:
            self._watching = False
            self._local.clear()
            self._procs.clear()

    def watch_procs(self, wake: Callable[[], None]) -> None:
        """Read the workers' ``/proc`` every ``hang.proc_poll_s`` between the supervisor's ticks, and call
        ``wake`` (the supervisor's tick, at once) when a stop has lasted ``hang.stopped_s``: the
        ``process_stopped`` verdict then comes at that bound, not up to a tick later. Starts once; no-op
        with ``proc_poll_s`` 0, with hang detection off, or without ``/proc``."""
        self._wake = wake
        if (self._proc_thread is not None or not self.cfg.enabled or self.cfg.proc_poll_s <= 0
                or not os.path.isdir("/proc/self")):
            return
        self._proc_thread = threading.Thread(target=self._poll_procs, args=(wake,), name="trainguard-procwatch", daemon=True)
        self._proc_thread.start()

    def serve_probes(self, host: str, wake: Callable[[], None] | None = None) -> str:
        """Answer peers' probes on ``hang.probe_port`` and name ``host`` (the address peers reach this node at)
        in this node's record; ``wake``: the supervisor's tick, called when a probe of a peer is not answered.
        The address, or "" with probes off. Idempotent."""
        if wake is not None:
            self._wake = wake
        if self.prober is None:
            return ""
        if self._probe_server is None:
            try:
                self._probe_server = ProbeServer(self.cfg.probe_port)
            except OSError as e:
                log.warning("probe_port_unavailable", port=self.cfg.probe_port, error=f"{type(e).__name__}: {e}"[:300],
                            effect="peers cannot probe this agent: they wait out hang.frozen_s of silence for it",
                            fix="set hang.probe_port to a free port (0: any)")
                return ""
            self._probe_addr = format_addr(host, self._probe_server.port)
            log.info("probe_serving", addr=self._probe_addr)
        return self._probe_addr

    def _woken_by_probe(self) -> None:
        wake = self._wake
        if wake is not None:
            wake()

    def _ask(self, nodes: list[str], now: float, *, limit: int = PROBE_LIMIT, again: bool = False) -> None:
        """Probe up to ``limit`` of ``nodes`` (the most silent first) whose address is known and that were not
        asked lately (``again``: ask those too - a reset was just seen; under the lock)."""
        if self.prober is None:
            return
        known = [n for n in nodes if self._addrs.get(n) and (again or not self._answered_lately(n, now))]
        known.sort(key=lambda n: self._tracker.agent_at(n) or now)
        for n in known[:limit]:
            self.prober.ask(n, self._addrs[n])

    def _since_record(self, node: str) -> tuple[Answer, float, float] | None:
        """(answer, when asked, when answered) of the last probe of ``node`` at its record's address, if it
        was asked after its last record (under the lock)."""
        addr, at = self._addrs.get(node), self._tracker.agent_at(node)
        got = self.prober.answer(node, addr) if self.prober is not None and addr and at is not None else None
        return got if got is not None and got[1] >= at else None  # type: ignore[operator]

    def _answered_lately(self, node: str, now: float) -> bool:
        """Whether ``node`` was asked since its last record and within one heartbeat interval (no need to ask
        again yet; under the lock)."""
        got = self._since_record(node)
        return got is not None and now - got[1] < self.cfg.heartbeat_interval_s

    def _ask_late(self, now: float) -> None:
        """Probe the members whose record is ``hang.ask_after_s`` late, where this node reads every record
        (under the lock). Called after each read and, between reads, from the proc poll's thread: a record
        read late is asked about within ``hang.proc_poll_s``, not at the next exchange."""
        if self.prober is None or self._store is None or not self._reads_all(now):
            return
        late = [m for m in self._members
                if m != self.node_id and (at := self._tracker.agent_at(m)) is not None and now - at > self.cfg.ask_after_s]
        self._ask(late, now)

    def _answers(self, nodes: Any, now: float) -> dict[str, Answer]:
        """Each node's answer to a probe asked after its last record and answered within the last two
        heartbeat intervals (under the lock); nodes with none left out. An answer ages: an agent that
        answered and froze afterwards is asked again (:meth:`_ask`) and must not stay "alive"."""
        out: dict[str, Answer] = {}
        for n in nodes:
            got = self._since_record(n)
            if got is not None and now - got[2] <= 2 * self.cfg.heartbeat_interval_s:
                out[n] = got[0]
        return out

    def _poll_procs(self, wake: Callable[[], None]) -> None:
        while not self._stop.wait(self.cfg.proc_poll_s):
            try:
                with self._lock:
                    pids = dict(self._pids) if self._watching else {}
                if pids:
                    self._sample(pids)
                    if self.stop_due():
                        wake()
                with self._lock:
                    self._ask_late(self._clock())
            except Exception as e:  # noqa: BLE001 - one failed read must not end the poll
                log.debug("proc_poll_failed", error=f"{type(e).__name__}: {e}"[:300])

    def stop_due(self) -> bool:
        """Whether a local worker's stop has just lasted ``hang.stopped_s`` (True once per stop): the moment
        the supervisor should ask :meth:`check`."""
        now = self._clock()
        with self._lock:
            if not self._watching or self._acted:
                return False
            due = {(lr, seen.since) for lr, seen in self._procs.items()
                   if seen.state is ProcState.STOPPED and now - seen.since > self.cfg.stopped_s}
            new = due - self._woken
            self._woken |= new
            return bool(new)

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_interval_s):
            try:
                self.exchange()
            except Exception as e:  # noqa: BLE001 - the watch observes; one failed exchange must not end it
                log.debug("progress_exchange_failed", error=f"{type(e).__name__}: {e}"[:300])

    def readers(self) -> tuple[str, ...]:
        """The members that read every record and publish a verdict (all of them in a world of up to
        :data:`READERS` + 1 nodes)."""
        members = self._members
        return members if len(members) <= READERS + 1 else members[:READERS]

    def _fresh_verdict(self, now: float) -> tuple[HangVerdict, dict[str, float], float] | None:
        """The verdict of the reader that published last, if one did within ``hang.stale_s`` (under the lock)."""
        fresh = [(at, v, missed) for seq, at, v, missed in self._verdicts.values() if now - at <= self.cfg.stale_s]
        if not fresh:
            return None
        at, v, missed = max(fresh, key=lambda x: x[0])
        return v, missed, at

    def _reads_all(self, now: float) -> bool:
        """Whether this node reads every record this interval: it is a reader, or no reader has published a
        verdict for ``hang.stale_s`` past the world's first ``hang.stale_s`` (under the lock)."""
        if self.node_id in self.readers():
            return True
        return now - self._world_at > self.cfg.stale_s and self._fresh_verdict(now) is None

    def exchange(self) -> None:
        """Publish this node's record; a reader reads every member's and publishes its verdict, any other
        node reads the readers' verdicts (one round of the thread)."""
        with self._lock:
            store, me, members = self._store, self.node_id, self._members
            if store is None:
                return
            self._seq += 1
            seq = self._seq
            raw = encode_record(me, self._seq, sorted(self._local.values(), key=lambda b: b.rank), self.node_name,
                                self._probe_addr)
        store.set(PROGRESS_KEY + me, raw)  # hangs while this node is cut off from the store
        now = self._clock()
        with self._lock:
            if self._store is not store:
                return
            if self._answered_at is not None and now - self._answered_at > self.cfg.stale_s:
                log.info("progress_view_rebased", blind_s=round(now - self._answered_at, 3),
                         cause="this node could not reach the store", effect="its peers' silence meanwhile is not counted")
                self._tracker.refresh_remote(me, now)
            self._answered_at = now
            reader = me in self.readers()
            reads_all = self._reads_all(now)
        if not reads_all:
            self._read_verdicts(store)
            return
        others = [m for m in members if m != me]
        for m, raw_rec in zip(others, read_many(store, [PROGRESS_KEY + m for m in others])):
            rec = None if raw_rec is None else decode_record(raw_rec)
            if rec is None:
                continue
            seq_m, beats, name, probe = rec
            now = self._clock()
            with self._lock:
                self._names[m] = name
                self._addrs[m] = probe
                if self._store is not store:  # a new world formed meanwhile
                    return
                self._tracker.agent(m, seq_m, now)
                if self._watching:
                    for b in beats:  # a standby's beat (rank -1) is no rank of the world, as in on_progress
                        if b.rank >= 0:
                            self._tracker.beat(m, b.rank, b.step, b.phase, b.where, b.beat, b.progress, now)
        with self._lock:
            if self._store is not store:
                return
            self._ask_late(self._clock())
        if reader:
            now = self._clock()
            with self._lock:
                if self._store is not store:
                    return
                v = self._decide(now) if self._watching else HangVerdict(False)
                # the members a reset would evict here, published as missed: a silent one with its silence, one
                # that failed a probe with at least missed_s (the nodes that read only verdicts evict on it)
                agent_at = {m: self._tracker.agent_at(m) for m in others}
                gone = evictable(others, agent_at, now, self.cfg.missed_s, me=me, peer_lost=True,
                                 answers=self._answers(others, now), probe_after_s=self.cfg.probe_after_s)
                missed = {m: max(now - agent_at[m], self.cfg.missed_s + 0.001) for m in gone}  # type: ignore[operator]
            store.set(VERDICT_KEY + me, encode_verdict(seq, v, now, missed))
        else:
            self._read_verdicts(store)

    def _read_verdicts(self, store: Any) -> None:
        readers = [r for r in self.readers() if r != self.node_id]
        raws = read_many(store, [VERDICT_KEY + r for r in readers])
        now = self._clock()
        with self._lock:
            if self._store is not store:
                return
            for r, raw in zip(readers, raws):
                got = None if raw is None else decode_verdict(raw, now)
                if got is None:
                    continue
                seq, v, missed = got
                last = self._verdicts.get(r)
                at = now if last is None or last[0] != seq else last[1]
                self._verdicts[r] = (seq, at, v, missed)

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        for t in (self._thread, self._proc_thread):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=2 * self.cfg.heartbeat_interval_s + 1.0)
        if self._probe_server is not None:
            self._probe_server.close()

    # ---- questions ------------------------------------------------------------------------------
    def _blind(self, now: float, silence_s: float) -> bool:
        """This node's own record has not reached the store for ``silence_s``: it cannot tell a peer
        silent that long from its own blindness."""
        return self._answered_at is not None and now - self._answered_at > silence_s

    def _decide(self, now: float) -> HangVerdict:
        """decide_hang over every rank this node tracks (under the lock)."""
        views = self._with_answers(self._with_procs(self._tracker.views(now, self.node_id)), now)
        return decide_hang(views, now, self.cfg, self._steps.p99(), self._steps.count)

    def check(self) -> tuple[HangVerdict, HangAction | None]:
        """The verdict now, and what this node does about it: an action once per world (None else). No
        verdict while this node is cut off from the store (its peers' silence is then its own blindness).
        A node that does not read every record takes a reader's verdict, unless its own ranks' kernel
        evidence names one of them first (:func:`~trainguard.agent.hang.pick_verdict`)."""
        now = self._clock()
        with self._lock:
            if not self._watching or self._blind(now, self.cfg.stale_s):
                return HangVerdict(False), None
            v = self._decide(now)
            if not self._reads_all(now):
                fresh = self._fresh_verdict(now)
                v = pick_verdict(v, fresh[0] if fresh else None, self.node_id)
            if not v.hung or self._acted:
                return v, None
            a = hang_action(v, node=self.node_id, previous_hangs=self.hangs, now=now, cfg=self.cfg)
            self._acted = True
            if v.culprit is not None and v.culprit.node == self.node_id:  # an unknown culprit is nobody's hang
                self.hangs.append(now)
            return v, a

    def _with_procs(self, views: list[RankView]) -> list[RankView]:
        """The local ranks' views with what the kernel says about their processes (under the lock)."""
        local_of = {b.rank: lr for lr, b in self._local.items()}
        out = []
        for v in views:
            seen = self._procs.get(local_of.get(v.rank, -1)) if v.node == self.node_id else None
            out.append(v if seen is None else dataclasses.replace(v, proc=seen.state, proc_since=seen.since))
        return out

    def _with_answers(self, views: list[RankView], now: float) -> list[RankView]:
        """Remote ranks' views with their agent's answer to a probe asked after its last record (under the lock)."""
        answers = self._answers({v.node for v in views if v.node != self.node_id}, now)
        return [dataclasses.replace(v, agent_answer=answers[v.node]) if v.node in answers else v for v in views]

    def name_of(self, node_id: str) -> str:
        """The node name (``agent.node_name``) of a rendezvous id, as its record says (else the id)."""
        if node_id == self.node_id:
            return self.node_name or node_id
        with self._lock:
            return self._names.get(node_id) or node_id

    def local_rank_of(self, rank: int) -> int | None:
        with self._lock:
            return next((b.local_rank for b in self._local.values() if b.rank == rank), None)

    def evict(self, members: tuple[str, ...], *, peer_lost: bool) -> frozenset[str]:
        """Members a re-formation removes from the rendezvous now (see :func:`~trainguard.agent.hang.evictable`):
        from this node's own view where it reads every record, else from a reader's ``missed``."""
        now = self._clock()
        with self._lock:
            if self._blind(now, self.cfg.missed_s):  # no evidence: this node could not see anyone
                return frozenset()
            me = self.node_id
            answers: dict[str, Answer] = {}
            if self._reads_all(now):
                agent_at = {m: self._tracker.agent_at(m) for m in members}
                if peer_lost:  # a reset was seen: ask the members now (a dead agent's port refuses at once)
                    self._ask([m for m in members if m != me], now, again=True)
                    answers = self._answers(members, now)
            else:
                fresh = self._fresh_verdict(now)
                missed, seen_at = (fresh[1], fresh[2]) if fresh else ({}, now)
                agent_at = {m: seen_at - missed[m] for m in members if m in missed}
        return evictable(members, agent_at, now, self.cfg.missed_s, me=me, peer_lost=peer_lost, answers=answers,
                         probe_after_s=self.cfg.probe_after_s)


__all__ = ["PROBE_LIMIT", "PROGRESS_KEY", "READERS", "VERDICT_KEY", "HangWatch", "Record", "decode_record", "decode_verdict", "encode_record",
           "encode_verdict"]
