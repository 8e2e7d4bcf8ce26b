"""Hang detection as values and pure decisions: progress, not liveness.

Every worker beats :class:`~trainguard.contract.protocol.Progress` to its agent (step, phase, where;
:mod:`trainguard.runtime.progress`), every agent publishes its ranks' beats in the job's store
(:mod:`trainguard.agent.hangwatch`), and every agent folds what it sees into :class:`RankView` s with
a :class:`Tracker` (times on the *observer's* monotonic clock: no clock is compared across nodes).
This module decides, with no I/O and no clock of its own (the tests pass a fake one):

* :func:`decide_hang` -> :class:`HangVerdict`: the job is hung when none of its ranks made progress
  for ``max(hang.min_s, hang.step_factor x p99 of the recent step times)`` (``hang.warmup_s`` instead
  of the p99 term until ``hang.min_steps`` step times are known). A rank progresses when its step or
  phase changes or its main thread runs Python; one that is busy (``Runtime.busy``), saving, restoring
  or between worlds, and still beats, always does. The culprit is the rank whose heartbeat stopped
  first, else the one that sits somewhere else than the others (another phase, another frame: outside
  the collective they wait in). A rank whose process the kernel reports stopped (its own agent reads
  ``/proc``: :mod:`trainguard.agent.procstat`) for ``hang.stopped_s`` is hung at once
  (``process_stopped``: it takes part in no collective); one the kernel reports busy (running C code holding the GIL, or starved)
  is never named for its silence alone.
* :func:`hang_action` -> :class:`HangAction`: what *this* node does about a verdict: end its own
  workers (the culprit is here), stay out (the culprit is here a second time within
  ``hang.quarantine_s``), abort its workers' collectives and evict the culprit's node (that node's agent
  is frozen too: nobody there can act), or only watch (the culprit's agent acts).
* :func:`evictable`: the members a re-formation after a lost peer removes from the rendezvous at
  once, without waiting for their keep-alive to expire: their agent missed a heartbeat.
* :class:`StepTimes`: the recent step times and their p99.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from trainguard.agent.probe import Answer
from trainguard.agent.procstat import ProcState
from trainguard.contract.configbase import require, require_finite
from trainguard.contract.protocol import Phase

UNANSWERED = frozenset({Answer.SILENT, Answer.GONE})
"""Probe answers that are evidence against a node (:mod:`trainguard.agent.probe`)."""

ACTIVE_PHASES = frozenset({Phase.BUSY, Phase.SAVE, Phase.RESTORE, Phase.PARKED})
"""Phases in which a rank that still beats is progressing by definition (each has its own bound)."""


@dataclass(kw_only=True, slots=True)
class HangConfig:
    """Hang detection (``hang`` section): progress, not liveness (see :mod:`trainguard.agent.hang`)."""

    enabled: bool = True
    """Detect hung ranks and frozen nodes and re-form around them (worker-API scripts)."""

    heartbeat_interval_s: float = 0.5
    """How often each worker beats its progress to its agent and each agent publishes its node's record
    in the job's store. A rank or an agent silent for ``stale_beats`` intervals missed its heartbeat."""

    stale_beats: int = 4
    """Heartbeat intervals without a beat after which a rank (or a node's agent) counts as silent."""

    min_s: float = 6.0
    """Floor of the hang threshold: no rank progressed for at least this long. The threshold is
    ``max(min_s, step_factor x p99 step time)``."""

    silent_s: float = 6.0
    """A rank whose heartbeat stopped this long, while the job made no progress this long either, is hung
    without waiting for the threshold (past warm-up: ``min_steps`` step times known); between
    ``stale_beats`` heartbeat intervals and ``min_s`` (the default, ``min_s``, adds nothing to the
    threshold). The heartbeat comes from a thread that runs beside a step, a kernel or an evaluation, so
    a rank that cannot send it is usually stopped (SIGSTOP, a kernel or hypervisor hang). Not always: a C
    call that holds the GIL while it waits (seen: DDP's parameter-shape check waiting for a joiner) and a
    starved machine (load 6 on 2 cores) silence it too; set it below ``min_s`` only where such waits are
    shorter (the peers bench's fast row: 1 s on an idle machine)."""

    stopped_s: float = 0.3
    """A rank whose process the kernel reports stopped (state ``T`` in ``/proc/<pid>/stat``: SIGSTOP), its
    CPU time standing still, this long is hung, without waiting for ``silent_s`` or the threshold: a stopped
    process takes part in no collective, so the job stalls at its next one. (Waiting to see the stall too
    would only add the time a peer's progress takes to reach this agent, up to two heartbeat intervals.)
    Only the rank's own agent can read it (its node's ``/proc``), and that is the agent that ends the rank.
    A stopped process cannot be busy in C code or starved, so this bound holds on a loaded machine too; a
    tracer's stop (``t``: a debugger) does not count, nor a throttler's stops that the process runs between
    (its CPU time advances). At most ``silent_s``. An operator who pauses a worker with SIGSTOP on purpose
    should disable hang detection first (``hang.enabled: false``)."""

    proc_poll_s: float = 0.1
    """How often the agent reads its workers' ``/proc/<pid>/stat`` (the ``stopped_s`` evidence) between its
    supervisor ticks, and acts as soon as a stop has lasted ``stopped_s``. 0: only at the supervisor's tick
    (``workers.monitor_interval_s``). One small file read per local worker per poll."""

    frozen_s: float = 2.0
    """A node whose agent published nothing this long, its ranks silent as long, while the job made no
    progress this long either, is frozen: its peers abort their collectives and evict it without waiting
    for ``silent_s`` or the rendezvous keep-alive. The agent is a process of its own that runs no user
    code (no C call of the training script holds its GIL), so its silence is better evidence than a
    worker's. Between ``stale_beats`` heartbeat intervals and ``silent_s``."""

    probe_timeout_s: float = 0.25
    """A peer agent whose record is late (nothing new for one heartbeat interval) is asked directly
    (:mod:`trainguard.agent.probe`: one byte over TCP to its ``probe_port``). No answer within this many
    seconds, or its port refused (the agent is dead), once its record is ``probe_after_s`` (1.5 intervals)
    late and while the job makes no progress, names its node frozen (or gone) without waiting out
    ``frozen_s``; an agent that answers is alive, and its late record alone never names it. After a lost
    peer (a reset), a refused port evicts at once. 0: no probes (silence alone: ``frozen_s``, and a missed
    heartbeat for an eviction). A loaded machine answers late too: keep it well above the agents'
    scheduling delays."""

    probe_port: int = 0
    """The TCP port this agent answers probes on (every interface); 0: any free port. Its peers find it in
    the agent's record, so only a firewall needs a fixed one."""

    step_factor: float = 3.0
    """k of the hang threshold ``max(min_s, k x p99 of the recent step times)``: a 40 s step gives 120 s."""

    min_steps: int = 5
    """Step times needed before the p99 term applies; until then the threshold is ``max(min_s, warmup_s)``."""

    warmup_s: float = 300.0
    """The threshold's second term while fewer than ``min_steps`` step times are known (the first steps:
    compilation, cache warm-up): a first step slower than this with no Python running is a hang."""

    quarantine_s: float = 3600.0
    """A node whose rank hangs twice within this many seconds stays out of the job (it leaves; exit 0)."""

    def __post_init__(self) -> None:
        require_finite(self.heartbeat_interval_s, "heartbeat_interval_s", positive=True,
                       fix="use 0.5 (seconds between progress heartbeats)")
        require(self.heartbeat_interval_s <= 10, "heartbeat_interval_s",
                f"must be at most 10, got {self.heartbeat_interval_s}", "use 0.5: detection takes a few intervals")
        require(isinstance(self.stale_beats, int) and self.stale_beats >= 2, "stale_beats",
                f"must be an integer >= 2, got {self.stale_beats!r}", "use 4: one late heartbeat must not count as silence")
        require_finite(self.min_s, "min_s", positive=True, fix="use 6 (seconds)")
        require(self.min_s >= self.heartbeat_interval_s * self.stale_beats, "min_s",
                f"must be at least heartbeat_interval_s x stale_beats "
                f"({self.heartbeat_interval_s * self.stale_beats:g} s), got {self.min_s}",
                "raise hang.min_s or lower hang.heartbeat_interval_s")
        require_finite(self.silent_s, "silent_s", positive=True, fix="use 6 (= hang.min_s) or less")
        require(self.heartbeat_interval_s * self.stale_beats <= self.silent_s <= self.min_s, "silent_s",
                f"must be between heartbeat_interval_s x stale_beats ({self.heartbeat_interval_s * self.stale_beats:g} s) "
                f"and min_s ({self.min_s:g} s), got {self.silent_s}",
                "use hang.min_s (6), or raise hang.min_s / lower hang.heartbeat_interval_s")
        require_finite(self.stopped_s, "stopped_s", positive=True, fix="use 0.3 (seconds)")
        require(self.stopped_s <= self.silent_s, "stopped_s", f"must be at most silent_s ({self.silent_s:g} s), got {self.stopped_s}",
                "use 0.3: a stopped process is stronger evidence than a silent heartbeat")
        require_finite(self.proc_poll_s, "proc_poll_s", minimum=0.0, fix="use 0.1 (seconds; 0: at the supervisor's tick only)")
        require(self.proc_poll_s <= self.stopped_s, "proc_poll_s",
                f"must be at most stopped_s ({self.stopped_s:g} s), got {self.proc_poll_s}",
                "use 0.1: a stop is seen a poll after it started")
        require_finite(self.frozen_s, "frozen_s", positive=True, fix="use 2 (seconds)")
        require(self.stale_s <= self.frozen_s <= self.silent_s, "frozen_s",
                f"must be between heartbeat_interval_s x stale_beats ({self.stale_s:g} s) and silent_s "
                f"({self.silent_s:g} s), got {self.frozen_s}", "use 2, or lower hang.heartbeat_interval_s")
        require_finite(self.probe_timeout_s, "probe_timeout_s", minimum=0.0,
                       fix="use 0.25 (seconds; 0: no direct probes, silence alone)")
        require(self.probe_timeout_s <= self.frozen_s, "probe_timeout_s",
                f"must be at most frozen_s ({self.frozen_s:g} s), got {self.probe_timeout_s}",
                "use 0.25: a probe must answer sooner than the silence it replaces")
        require(isinstance(self.probe_port, int) and 0 <= self.probe_port <= 65535, "probe_port",
                f"must be an integer port 0-65535, got {self.probe_port!r}", "use 0 (any free port) or a port your firewall opens")
        require_finite(self.step_factor, "step_factor", minimum=1.0,
                       fix="use 3: a step up to 3x slower than the recent p99 is no hang")
        require(isinstance(self.min_steps, int) and self.min_steps >= 1, "min_steps",
                f"must be an integer >= 1, got {self.min_steps!r}", "use 5")
        require_finite(self.warmup_s, "warmup_s", positive=True, fix="use 300: longer than your slowest first step")
        require_finite(self.quarantine_s, "quarantine_s", minimum=0.0, fix="use 3600 (0: never quarantine)")

    @property
    def stale_s(self) -> float:
        """Silence after which a rank or an agent counts as silent (hang detection)."""
        return self.heartbeat_interval_s * self.stale_beats

    @property
    def ask_after_s(self) -> float:
        """A peer agent's record this late (one heartbeat interval without news) is asked about directly (when
        probes are on). Asking is cheap and decides nothing by itself: an alive agent answers."""
        return self.heartbeat_interval_s

    @property
    def probe_after_s(self) -> float:
        """A record this late, whose agent did not answer a probe asked since, while the job made no progress
        for ``ask_after_s``, names its node frozen: 1.5 heartbeat intervals."""
        return self.heartbeat_interval_s * 1.5

    @property
    def missed_s(self) -> float:
        """Silence after which an agent missed one heartbeat (eviction on evidence, with a reset seen)."""
        return self.heartbeat_interval_s * 2


# ---- what an observer sees ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RankView:
    """One rank as an observer sees it; times on the observer's monotonic clock."""

    rank: int
    node: str
    """The rank's node (its rendezvous id)."""
    step: int
    phase: Phase
    where: str
    beat_at: float
    """When its heartbeat counter last changed."""
    progress_at: float
    """When its progress counter last changed."""
    agent_at: float
    """When its node's agent last published (for local ranks: now)."""
    proc: ProcState = ProcState.UNKNOWN
    """What the kernel says about the rank's process (local ranks only; :mod:`trainguard.agent.procstat`)."""
    proc_since: float = 0.0
    """Since when (observer's clock) ``proc`` has been what it is, without a break."""
    agent_answer: Answer = Answer.UNKNOWN
    """What the rank's node's agent answered to a direct probe asked after its last record
    (:mod:`trainguard.agent.probe`; remote nodes only, UNKNOWN when none was asked since)."""


@dataclass(slots=True)
class _Seen:
    beat: int
    progress: int
    beat_at: float
    progress_at: float


class Tracker:
    """Folds successive beats (local, or read from the store) into :class:`RankView` s: when each
    rank's counters and each node's record last changed, on the caller's clock. Not thread-safe."""

    def __init__(self) -> None:
        self._ranks: dict[int, tuple[str, int, Phase, str]] = {}
        self._seen: dict[int, _Seen] = {}
        self._agents: dict[str, tuple[int, float]] = {}

    def reset(self) -> None:
        """A new world: forget everything (ranks are numbered anew)."""
        self._ranks.clear()
        self._seen.clear()
        self._agents.clear()

    def agent(self, node: str, seq: int, now: float) -> None:
        """Node ``node``'s agent published record number ``seq``."""
        last = self._agents.get(node)
        if last is None or last[0] != seq:
            self._agents[node] = (seq, now)

    def refresh_remote(self, me: str, now: float) -> None:
        """This node could not read the others' records for a while (it was cut off): restart the clocks of
        every other node's record and ranks at ``now``. Time this node could not observe is not their
        silence; from here on an unchanged record counts again."""
        for node, (seq, _) in list(self._agents.items()):
            if node != me:
                self._agents[node] = (seq, now)
        for rank, (node, *_rest) in self._ranks.items():
            s = self._seen.get(rank)
            if node != me and s is not None:
                s.beat_at = s.progress_at = now

    def agent_at(self, node: str) -> float | None:
        last = self._agents.get(node)
        return None if last is None else last[1]

    def beat(self, node: str, rank: int, step: int, phase: Phase, where: str, beat: int, progress: int,
             now: float) -> None:
        """One beat of ``rank`` (a repeated one, read again from an unchanged record, changes nothing)."""
        self._ranks[rank] = (node, step, phase, where)
        s = self._seen.get(rank)
        if s is None:
            self._seen[rank] = _Seen(beat, progress, now, now)
            return
        if beat != s.beat:
            s.beat, s.beat_at = beat, now
        if progress != s.progress:
            s.progress, s.progress_at = progress, now

    def views(self, now: float, local_node: str) -> list[RankView]:
        out = []
        for rank, (node, step, phase, where) in sorted(self._ranks.items()):
            s = self._seen[rank]
            agent_at = now if node == local_node else (self.agent_at(node) or s.beat_at)
            out.append(RankView(rank, node, step, phase, where, s.beat_at, s.progress_at, agent_at))
        return out


class StepTimes:
    """The recent step times of the job (seconds per step), from when the step counter advanced."""

    def __init__(self, keep: int = 200) -> None:
        self._times: deque[float] = deque(maxlen=keep)
        self._last: tuple[int, float] | None = None

    def observe(self, step: int, phase: Phase, now: float) -> None:
        """The job's step is ``step`` in ``phase`` at ``now``. A time is taken only between two steps
        trained back to back (a save, a restore, a busy block or a re-formation in between restarts the
        clock: their length is no step time)."""
        if phase in ACTIVE_PHASES:
            self._last = None
            return
        if self._last is None or step < self._last[0]:
            self._last = (step, now)
            return
        first, at = self._last
        if step > first:
            per = (now - at) / (step - first)
            self._times.extend([per] * min(step - first, 8))
            self._last = (step, now)

    @property
    def count(self) -> int:
        return len(self._times)

    def p99(self) -> float | None:
        if not self._times:
            return None
        ordered = sorted(self._times)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


# ---- the decisions ---------------------------------------------------------------------------------

def hang_threshold(cfg: HangConfig, p99: float | None, known_steps: int) -> float:
    """Pure: seconds without progress after which the job is hung."""
    if p99 is None or known_steps < cfg.min_steps:
        return max(cfg.min_s, cfg.warmup_s)
    return max(cfg.min_s, cfg.step_factor * p99)


@dataclass(frozen=True, slots=True)
class HangVerdict:
    hung: bool
    stalled_s: float = 0.0
    """Seconds since any rank of the job last progressed."""
    threshold_s: float = 0.0
    """The bound crossed: :func:`hang_threshold`, ``hang.stopped_s`` (a process the kernel reports stopped) or
    ``hang.silent_s`` (a silent rank) when one was named before it."""
    culprit: RankView | None = None
    why: str = ""
    """How the culprit was named: ``process_stopped`` (the kernel says so), ``node_silent`` (its agent and
    ranks all silent for ``hang.frozen_s``), ``agent_unanswered`` / ``agent_gone`` (its record late for
    ``hang.probe_after_s`` and its agent did not answer a direct probe / its port refused), ``heartbeat_stopped_first``, ``outside_the_collective`` (a phase or a
    frame the others are not in), or ``unknown``."""
    node_frozen: bool = False
    """The culprit's node's agent is silent too (a frozen node): nobody there can act."""


def _effective_progress(r: RankView, now: float, stale_s: float) -> float:
    if r.phase in ACTIVE_PHASES and now - r.beat_at <= stale_s:
        return now  # busy, saving, restoring or between worlds, and alive: progressing right now
    return r.progress_at


def _odd_one_out(ranks: Sequence[RankView], key: str) -> RankView | None:
    """The rank whose ``key`` (phase or where) no other rank shares while the others share one."""
    if len(ranks) < 2:
        return None
    counts: dict[object, int] = {}
    for r in ranks:
        counts[getattr(r, key)] = counts.get(getattr(r, key), 0) + 1
    alone = [r for r in ranks if counts[getattr(r, key)] == 1]
    if len(alone) == 1 and max(counts.values()) >= max(1, len(ranks) - 1):
        return alone[0]
    return None


def decide_hang(ranks: Sequence[RankView], now: float, cfg: HangConfig, p99: float | None,
                known_steps: int) -> HangVerdict:
    """Pure: whether the job whose ranks are ``ranks`` is hung at ``now``, and who the culprit is. A rank
    whose last beat said it finished (``Phase.FINISHED``) is out of it: neither the culprit nor evidence."""
    ranks = [r for r in ranks if r.phase is not Phase.FINISHED]
    if not ranks:
        return HangVerdict(False)
    stale_s = cfg.stale_s
    last = max(_effective_progress(r, now, stale_s) for r in ranks)
    stalled = max(0.0, now - last)
    threshold = hang_threshold(cfg, p99, known_steps)
    silent = [r for r in ranks if now - r.beat_at > stale_s]
    stopped = [r for r in ranks if r.proc is ProcState.STOPPED and now - r.proc_since > cfg.stopped_s]
    quiet = ({r.node for r in ranks if now - r.agent_at > cfg.frozen_s and r.agent_answer is not Answer.ALIVE}
             - {r.node for r in ranks if now - r.beat_at <= cfg.frozen_s})
    unanswered = ({r.node for r in ranks if r.agent_answer in UNANSWERED and now - r.agent_at > cfg.probe_after_s}
                  - {r.node for r in ranks if now - r.beat_at <= cfg.probe_after_s})
    frozen = [r for r in ranks if r.node in quiet]
    probed = [r for r in ranks if r.node in unanswered]
    by_frozen = False
    if stalled <= threshold:
        if stopped:
            # The kernel says a rank cannot run: the job stalls at its next collective. No need to wait out
            # a silence, nor for its peers' stall to reach this agent.
            threshold = cfg.stopped_s
        elif probed and stalled > cfg.ask_after_s:
            # Its record is late, and its agent did not answer a direct probe (or its port is closed): the
            # node is frozen or dead. No need to wait out frozen_s of silence. The job's stall only has to
            # be seen at all (a heartbeat interval without progress; it is measured at the beats, up to one
            # interval late): the probe is the evidence, the stall says the node is missed.
            threshold, by_frozen, frozen = cfg.ask_after_s, True, probed
        elif frozen and stalled > cfg.frozen_s:
            # A node's agent and its ranks all silent: the node is frozen (or cut off), nobody there acts.
            threshold, by_frozen = cfg.frozen_s, True
        elif (known_steps >= cfg.min_steps and stalled > cfg.silent_s
              and any(now - r.beat_at > cfg.silent_s and r.proc is not ProcState.BUSY for r in silent)):
            # A silent rank (no heartbeat) that stalls the job is hung without waiting out the threshold,
            # unless the kernel says it runs (C code holding the GIL, or a starved machine).
            threshold = cfg.silent_s
        else:
            return HangVerdict(False, stalled, threshold)
    culprit, why = None, "unknown"
    if stopped:
        culprit, why = min(stopped, key=lambda r: (r.proc_since, r.rank)), "process_stopped"
    elif by_frozen:
        culprit = min(frozen, key=lambda r: (r.beat_at, r.rank))
        why = {Answer.GONE: "agent_gone", Answer.SILENT: "agent_unanswered"}.get(culprit.agent_answer, "node_silent")
    elif silent:
        culprit, why = min(silent, key=lambda r: (r.proc is ProcState.BUSY, r.beat_at, r.rank)), "heartbeat_stopped_first"
    else:
        odd = _odd_one_out(ranks, "phase") or _odd_one_out(ranks, "where")
        if odd is not None:
            culprit, why = odd, "outside_the_collective"
    node_frozen = culprit is not None and (now - culprit.agent_at > stale_s or (
        culprit.agent_answer in UNANSWERED and now - culprit.agent_at > cfg.probe_after_s))
    return HangVerdict(True, stalled, threshold, culprit, why, node_frozen)


def pick_verdict(local: HangVerdict, published: HangVerdict | None, node: str) -> HangVerdict:
    """Pure: the verdict of a node that does not read every record (:mod:`trainguard.agent.hangwatch`).
    ``local`` is :func:`decide_hang` over what it sees itself (its own ranks, with what the kernel says of
    them), ``published`` the freshest verdict of a node that reads every record (None: none is fresh).
    Its own kernel evidence counts first, as when every node read every record: a rank of its own that
    the kernel reports stopped is named at ``hang.stopped_s`` by this node, the one that ends it. Anything
    else needs the whole job: the published verdict; with none, no verdict (a culprit named from a partial
    view could be the wrong one, and an unknown culprit would restart every node)."""
    if local.hung and local.culprit is not None and local.culprit.node == node and local.why == "process_stopped":
        return local
    if published is not None:
        return published
    return HangVerdict(False, local.stalled_s, local.threshold_s)


class HangAct(str, Enum):
    WATCH = "watch"
    """The culprit is on another node whose agent acts: nothing to do here (the reset of its workers'
    connections makes ours park)."""
    END_WORKERS = "end_workers"
    """The culprit is here: end this node's workers (stack dump first), restart them and rejoin."""
    QUARANTINE = "quarantine"
    """The culprit is here for the second time within ``hang.quarantine_s``: end the workers and leave."""
    ABORT = "abort"
    """The culprit's node is frozen: abort our workers' collectives; the re-formation evicts that node."""


@dataclass(frozen=True, slots=True)
class HangAction:
    act: HangAct
    evict: frozenset[str] = frozenset()
    """Rendezvous ids of the nodes a re-formation should remove at once."""


def hang_action(v: HangVerdict, *, node: str, previous_hangs: Iterable[float], now: float,
                cfg: HangConfig) -> HangAction | None:
    """Pure: what node ``node`` does about verdict ``v`` (None: not hung). ``previous_hangs``: when
    (this node's clock) its own ranks were the culprit before."""
    if not v.hung:
        return None
    c = v.culprit
    if c is None or c.node == node:
        # Unknown culprit: every node ends its own workers (the world restarts from its tiers).
        recent = [t for t in previous_hangs if now - t <= cfg.quarantine_s]
        if c is not None and recent and cfg.quarantine_s > 0:
            return HangAction(HangAct.QUARANTINE)
        return HangAction(HangAct.END_WORKERS)
    if v.node_frozen:
        return HangAction(HangAct.ABORT, evict=frozenset({c.node}))
    return HangAction(HangAct.WATCH)


def evictable(members: Iterable[str], agent_at: Mapping[str, float | None], now: float, stale_s: float,
              *, me: str, peer_lost: bool, answers: Mapping[str, Answer] | None = None,
              probe_after_s: float | None = None) -> frozenset[str]:
    """Pure: the members a re-formation removes from the rendezvous at once. Only after a lost peer
    (``peer_lost``: a worker here saw a collective fail, e.g. a connection reset): the evidence is that
    reset plus a missed heartbeat of the member's agent (silent for ``stale_s``), not the full keep-alive
    expiry; or the reset plus its agent's answer to a direct probe asked after its last record
    (``answers``): its port refused (``GONE``: the agent is dead) at once, no answer (``SILENT``) once its
    record is ``probe_after_s`` late. A member never seen publishing is left to the keep-alive (no evidence
    either way); one that answered is not evicted for a late record alone until ``stale_s``."""
    if not peer_lost:
        return frozenset()
    answers = answers or {}
    out = set()
    for m in members:
        at = agent_at.get(m)
        if m == me or at is None:
            continue
        got = answers.get(m, Answer.UNKNOWN)
        if (now - at > stale_s or got is Answer.GONE
                or (got is Answer.SILENT and probe_after_s is not None and now - at > probe_after_s)):
            out.add(m)
    return frozenset(out)


__all__ = ["ACTIVE_PHASES", "UNANSWERED", "HangAct", "HangAction", "HangConfig", "HangVerdict", "RankView", "StepTimes", "Tracker",
           "decide_hang", "evictable", "hang_action", "hang_threshold", "pick_verdict"]
