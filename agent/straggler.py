"""Straggler detection and eviction (issue 38): a slow node does not set the job's pace for long.

**Measure.** Every worker-API rank measures its local compute time per step (:mod:`trainguard.runtime.pace`:
step start to arrival at the step boundary, minus the time blocked on its peers) and reports the values
to its agent in batches (:class:`~trainguard.contract.protocol.Pace`). The agent keeps a window of them
per local rank (:class:`PaceWindow`); the node's value is the largest of its ranks' medians over the
window (a node is as slow as its slowest rank).

**Share.** Each agent publishes its node's value every keep-alive interval as a small JSON record in the
rendezvous store (:class:`PaceRecord`, ``trainguard/straggler/<job>/pace/<node>``), and reads the other
nodes'. Why the store and not one more field of the step agreement's ``Flags``: that all-reduce is a MAX
over a fixed number of integers, so it yields the world's *slowest* value, never each node's; a per-node
median needs every node's value (a world-sized vector would tie the flag buffers to the world size and
cost every step), and the decision is the agent's anyway (it acts through the drain path). The store
carries one record per node per keep-alive interval, nothing per step.

**Score.** A node's score is its value divided by the median of the other nodes' values (:func:`scores`).

**Decide** (:func:`decide_straggler`, pure, table-tested in ``tests/agent/test_straggler.py``): a node is a
straggler when its score exceeds ``straggler.threshold`` for ``straggler.sustain_s``; it is evicted only
when the job is projected to be faster without it with the global batch constant - N nodes at ``t_slow``
against N-1 nodes at ``t_rest x N/(N-1)`` - by ``straggler.margin``, never below ``rendezvous.min_nodes``,
at most ``straggler.max_evictions_per_hour``, and only with ``straggler.action: evict``. Otherwise it is
kept and reported. Only the agent of the node that hosts global rank 0 decides (one decider, the others
export the same scores); an eviction is one appended line in the store's eviction log, which the evicted
node's agent reads and carries out as a planned drain (:meth:`Supervisor.request_drain`, source
``straggler``): emergency checkpoint, the node leaves, the survivors re-form in place at the smaller size.

**Re-admit** (:func:`decide_admission`, pure): an evicted node's agent exits like any drained one (exit 3).
When it starts again (systemd ``systemctl restart``, or the bench), it waits as a spare before it enters
the rendezvous: out for ``straggler.cooldown_s`` after its eviction, then a self-test
(``stragglermon.selftest_in_child``: a timed fixed-size matrix-multiply micro-benchmark on each of the
node's GPUs, the slowest counting, or its CPU without GPUs; in a child process) that must be
within ``straggler.readmit_ratio`` of the fastest of the other nodes' self-test times; failed, it waits another cool-down and
tries again. A node evicted ``straggler.quarantine_after`` times within ``straggler.quarantine_window_s``
is quarantined: the agent refuses to start (``straggler_quarantined``, an error line naming it).

Logs: one line per state change (``straggler_suspected``, ``straggler_detected``, ``straggler_kept``,
``straggler_evicted``, ``straggler_cleared``, ``straggler_eviction_received``).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from trainguard.contract import protocol as proto
from trainguard.contract.configbase import require
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.straggler")

ACTIONS = ("report", "evict")
KEY_PREFIX = "trainguard/straggler/"
HOUR_S = 3600.0


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    enabled: bool = True
    """Measure and score every node's pace (worker-API scripts only; needs the ``c10d`` rendezvous backend,
    whose store carries the records)."""

    action: str = "report"
    """``report`` (log and export a straggler, keep it) or ``evict`` (drain it when the job is projected
    to be faster without it). ``report`` by default: an evicted node's agent exits like a drained one, and
    under the shipped systemd unit nothing restarts it, so eviction takes capacity away until an operator
    (or automation) restarts the agent for its re-admission. Turn it on where that loop exists."""

    threshold: float = 1.3
    """Score (node's compute time / the other nodes' median) above which a node is a straggler."""

    sustain_s: float = 20.0
    """How long a node's score must stay above the threshold before it counts as a straggler."""

    window_s: float = 30.0
    """Window of per-step compute times the node's median is taken over."""

    min_samples: int = 5
    """Fewest steps in the window before a node publishes a value."""

    margin: float = 0.05
    """Evict only when the projected throughput without the node exceeds the current one by this ratio."""

    max_evictions_per_hour: int = 2
    """At most this many straggler evictions per job in any hour."""

    cooldown_s: float = 120.0
    """How long an evicted node stays out before its self-test (and again after a failed one)."""

    quarantine_after: int = 3
    """Evictions of one node within ``quarantine_window_s`` after which it is quarantined (refuses to start)."""

    quarantine_window_s: float = 24 * HOUR_S
    """The window of ``quarantine_after``."""

    selftest_reps: int = 200
    """Size of the self-test: 256x256 float32 multiplies per timed run (five runs; their median is what is
    compared). The same on every node of a job, so that the times compare (about 0.1 s a run on one CPU
    core; milliseconds on a GPU)."""

    readmit_ratio: float = 1.3
    """An evicted node is re-admitted when its self-test time is at most this ratio of the fastest of the
    other nodes' self-test times (taken when they started)."""

    def __post_init__(self) -> None:
        require(self.action in ACTIONS, "action", f"must be one of {list(ACTIONS)}, got {self.action!r}",
                "use 'report' (log and export stragglers) or 'evict' (drain them when the job is faster without)")
        require(self.threshold > 1.0, "threshold", f"must be > 1 (a ratio to the other nodes), got {self.threshold}",
                "e.g. 1.3: 30 % slower than the others' median")
        require(0 <= self.sustain_s <= HOUR_S, "sustain_s", f"must be within 0..3600 s, got {self.sustain_s}", "e.g. 20")
        require(1 <= self.window_s <= HOUR_S, "window_s", f"must be within 1..3600 s, got {self.window_s}", "e.g. 30")
        require(self.min_samples >= 1, "min_samples", f"must be >= 1, got {self.min_samples}", "e.g. 5")
        require(0 <= self.margin < 1, "margin", f"must be within [0, 1), got {self.margin}", "e.g. 0.05 (5 %)")
        require(self.max_evictions_per_hour >= 0, "max_evictions_per_hour",
                f"must be >= 0, got {self.max_evictions_per_hour}", "e.g. 2; 0 never evicts")
        require(0 <= self.cooldown_s <= 7 * 24 * HOUR_S, "cooldown_s", f"must be within 0..604800 s, got {self.cooldown_s}",
                "e.g. 120")
        require(self.quarantine_after >= 1, "quarantine_after", f"must be >= 1, got {self.quarantine_after}", "e.g. 3")
        require(self.quarantine_window_s > 0, "quarantine_window_s", f"must be > 0, got {self.quarantine_window_s}",
                "e.g. 86400 (a day)")
        require(1 <= self.selftest_reps <= 1_000_000, "selftest_reps", f"must be within 1..1000000, got {self.selftest_reps}",
                "e.g. 200; the same on every node")
        require(self.readmit_ratio > 1.0, "readmit_ratio", f"must be > 1, got {self.readmit_ratio}", "e.g. 1.3")


# ---- measure ----------------------------------------------------------------------------------

class PaceWindow:
    """The node's per-step compute times over the last ``window_s`` (per local rank). Thread-safe: the
    control thread adds, the supervisor thread reads."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._ranks: dict[int, deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def add(self, msg: proto.Pace) -> None:
        now = self._clock()
        with self._lock:
            q = self._ranks.setdefault(msg.local_rank, deque())
            q.extend((now, v) for v in msg.compute_s)

    def clear(self) -> None:
        """A new world: the old one's pace says nothing about it (per-rank batch sizes changed)."""
        with self._lock:
            self._ranks.clear()

    def node_value(self, min_samples: int) -> tuple[float, int] | None:
        """(the largest of the local ranks' medians, the fewest samples of a rank), or None when a rank
        has fewer than ``min_samples`` in the window."""
        now = self._clock()
        with self._lock:
            meds: list[tuple[float, int]] = []
            for q in self._ranks.values():
                while q and now - q[0][0] > self.window_s:
                    q.popleft()
                if len(q) < min_samples:
                    return None
                meds.append((statistics.median(v for _, v in q), len(q)))
        if not meds:
            return None
        return max(m for m, _ in meds), min(n for _, n in meds)


@dataclass(frozen=True, slots=True)
class PaceRecord:
    """One node's pace as published in the store."""

    node: str
    median_s: float
    samples: int
    round: int
    unix_s: float

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> PaceRecord | None:
        try:
            d = json.loads(data)
            return cls(node=str(d["node"]), median_s=float(d["median_s"]), samples=int(d["samples"]),
                       round=int(d["round"]), unix_s=float(d["unix_s"]))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True, slots=True)
class Eviction:
    """One line of the job's eviction log."""

    node: str
    unix_s: float
    cause: str = "straggler"
    score: float | None = None

    def to_line(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()

    @classmethod
    def parse_log(cls, data: bytes) -> list[Eviction]:
        out = []
        for line in data.decode(errors="replace").splitlines():
            try:
                d = json.loads(line)
                out.append(cls(node=str(d["node"]), unix_s=float(d["unix_s"]), cause=str(d.get("cause", "straggler")),
                               score=None if d.get("score") is None else float(d["score"])))
            except (ValueError, KeyError, TypeError):
                continue
        return out


# ---- decide (pure) ----------------------------------------------------------------------------

def scores(values: Mapping[str, float]) -> dict[str, float]:
    """Each node's value over the median of the *other* nodes' values (empty with fewer than 2 nodes)."""
    if len(values) < 2:
        return {}
    out = {}
    for node, v in values.items():
        rest = statistics.median(x for n, x in values.items() if n != node)
        out[node] = v / rest if rest > 0 else float("inf") if v > 0 else 1.0
    return out


class Verdict(str, Enum):
    NONE = "none"
    """No node above the threshold."""
    SUSPECT = "suspect"
    """A node above the threshold, not yet for ``sustain_s``."""
    KEEP = "keep"
    """A straggler, kept (``reason`` says why) and reported."""
    EVICT = "evict"
    """A straggler the job is faster without: drain it."""


class KeepReason(str, Enum):
    NOT_FASTER = "not_faster_without"
    MIN_NODES = "min_nodes"
    RATE_LIMITED = "rate_limited"
    ACTION_REPORT = "action_report"


@dataclass(frozen=True, slots=True)
class StragglerDecision:
    verdict: Verdict
    node: str | None = None
    score: float | None = None
    reason: str = ""
    gain: float | None = None
    """Projected throughput without the node over the current one (N nodes at ``t_slow`` vs N-1 at
    ``t_rest x N/(N-1)``)."""
    above_since: Mapping[str, float] = field(default_factory=dict)
    """The state to pass to the next call: when each node above the threshold first was (seconds)."""
    scores: Mapping[str, float] = field(default_factory=dict)


def projected_gain(t_slow: float, t_rest: float, nodes: int) -> float:
    """Throughput of N-1 nodes (``t_rest x N/(N-1)`` per step: the same global batch over fewer nodes)
    over that of N nodes paced by the straggler (``t_slow`` per step)."""
    if nodes < 2 or t_rest <= 0:
        return 0.0
    return t_slow / (t_rest * nodes / (nodes - 1))


def decide_straggler(values: Mapping[str, float], *, now: float, above_since: Mapping[str, float],
                     evictions: Sequence[float], nodes: int, min_nodes: int, cfg: StragglerConfig) -> StragglerDecision:
    """Pure: what to do about the nodes' paces ``values`` (node -> median local compute seconds per step).

    ``now``: seconds on the clock of ``above_since`` (the previous decision's) and ``evictions`` (the
    times of the job's straggler evictions, same clock); ``nodes``: nodes in the world."""
    sc = scores(values)
    above = {n: s for n, s in sc.items() if s > cfg.threshold}
    since = {n: above_since.get(n, now) for n in above}
    if not above:
        return StragglerDecision(Verdict.NONE, scores=sc)
    node = max(above, key=lambda n: (above[n], n))
    common = {"node": node, "score": above[node], "above_since": since, "scores": sc}
    if now - since[node] < cfg.sustain_s:
        return StragglerDecision(Verdict.SUSPECT, **common)
    t_rest = statistics.median(v for n, v in values.items() if n != node)
    gain = projected_gain(values[node], t_rest, nodes)
    common["gain"] = gain
    if gain <= 1.0 + cfg.margin:
        return StragglerDecision(Verdict.KEEP, reason=KeepReason.NOT_FASTER.value, **common)
    if nodes - 1 < min_nodes:
        return StragglerDecision(Verdict.KEEP, reason=KeepReason.MIN_NODES.value, **common)
    if sum(1 for t in evictions if now - t < HOUR_S) >= cfg.max_evictions_per_hour:
        return StragglerDecision(Verdict.KEEP, reason=KeepReason.RATE_LIMITED.value, **common)
    if cfg.action != "evict":
        return StragglerDecision(Verdict.KEEP, reason=KeepReason.ACTION_REPORT.value, **common)
    return StragglerDecision(Verdict.EVICT, reason="faster_without", **common)


class AdmissionAct(str, Enum):
    ADMIT = "admit"
    WAIT = "wait"
    """Cool-down not over (or the self-test failed: wait another one)."""
    SELFTEST = "selftest"
    """Run the self-test, then decide again with its result."""
    QUARANTINE = "quarantine"


@dataclass(frozen=True, slots=True)
class Admission:
    act: AdmissionAct
    reason: str
    wait_s: float = 0.0


def decide_admission(*, now: float, evicted_at: Sequence[float], selftest_s: float | None, reference_s: float | None,
                     failed_at: float | None, cfg: StragglerConfig) -> Admission:
    """Pure: may this node (evicted as a straggler at ``evicted_at``, unix seconds) enter a world now?

    ``selftest_s``: its self-test time this start (None: not run yet); ``reference_s``: the fastest of the
    other nodes' self-test times (None: none known, the self-test passes); ``failed_at``: when its last
    self-test failed (None: none did)."""
    recent = [t for t in evicted_at if now - t < cfg.quarantine_window_s]
    if len(recent) >= cfg.quarantine_after:
        return Admission(AdmissionAct.QUARANTINE, f"evicted {len(recent)} times within {cfg.quarantine_window_s:.0f} s")
    if not evicted_at:
        return Admission(AdmissionAct.ADMIT, "never_evicted")
    start = max(max(evicted_at), failed_at or 0.0)
    if now < start + cfg.cooldown_s:
        return Admission(AdmissionAct.WAIT, "cooldown" if failed_at is None or failed_at < max(evicted_at) else "selftest_failed",
                         wait_s=start + cfg.cooldown_s - now)
    if selftest_s is None:
        return Admission(AdmissionAct.SELFTEST, "cooldown_over")
    if reference_s is not None and selftest_s > reference_s * cfg.readmit_ratio:
        return Admission(AdmissionAct.WAIT, "selftest_failed", wait_s=cfg.cooldown_s)
    return Admission(AdmissionAct.ADMIT, "selftest_passed")
