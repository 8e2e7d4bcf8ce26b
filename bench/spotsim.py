"""Goodput of an elastic job on a spot membership trace: a pure, seeded simulator.

Feed it a membership trace (:func:`load_trace`: ``time_ms,add|remove,node`` lines), the cost of each
step of a membership change as *distributions* measured on a replay (:class:`ChangeCosts`), how the
job reacts (:class:`JobModel`: trainguard drains on notices and takes a resize checkpoint before a
scale-up; plain torchrun elastic does neither) and a periodic checkpoint policy (fixed steps, fixed
seconds, off, or ``auto`` — the real :class:`~trainguard.checkpoint.interval.IntervalController`
in the loop, fed what the simulated job measures). :func:`simulate` returns the effective training
time ratio (ETTR: node-time spent on steps that end up in the final model / node-time available),
the waste by cause in node-seconds, and the cost per committed sample next to on-demand.

Why in ``bench/`` and not in the wheel: it sizes clusters and checks the goodput claims of the
benchmarks; nothing the agent or the runtime runs needs it. The bench (``bench/spot_trace.py``), its
tests and anyone sizing a cluster import it from a checkout (``from bench import spotsim``).

The model (fluid, event-driven; times in seconds, node-time in node-seconds):

* Available node-time is every trace node from its ``add`` to its ``remove`` (or the end).
* The job's world trains at the world size ``w`` it has; a step takes ``JobModel.step_time_s(w)``.
  Every available node not in the world is waste: ``warmup`` (a joiner starting), ``notice_lead``
  (drained, waiting for its reclaim), ``idle`` (nothing for it to do).
* An *announced* removal (a notice ``lead_s`` before the node goes): ``detect_notice_s`` later the
  world stops at a step, takes an emergency checkpoint (``checkpoint``, all old nodes), the leavers
  go, the rest re-form (``reformation``) and restart (``restore``: process start, imports, restore,
  until the first step). If the node goes before the emergency checkpoint is done, the runtime abandons
  the save at the drain deadline; in place the survivors then re-form at once from what they hold in
  memory, as after an unannounced loss without its detection (the leaver is known: it drained), where
  the state survives the loss (replicated, or tier 1 covers it); otherwise the world rolls back to the
  newest commit and restores from storage. (The runtime before 2026-11-29 made every worker exit and the
  world always restarted from storage: ``JobModel.abandon_in_place=False`` models that.)
  Without notice handling (``JobModel.notices=False``) every removal is unannounced.
  With ``JobModel.drain_lead_s`` (``preemption.train_through_notice``) a notice with a longer lead
  takes an out-of-cycle checkpoint (``periodic_checkpoint``) at once and drains ``drain_lead_s``
  before the reclaim: only that much notice lead is idle.
* An *unannounced* removal: the survivors notice after ``detect_failure_s`` (``detection``), re-form,
  restore the newest committed checkpoint; the node-time trained since it was taken is ``recompute``,
  counted when a world resumes from that checkpoint: at the end of the trace a rollback no world has
  resumed from yet is not counted (the replay's ground truth keeps a world's last steps until a later
  world re-trains them).
* An addition: the node warms up (``agent_start_s`` for a node of the first world, ``warmup_s`` for one
  joining a running world: agent start, and with in-place re-formation its workers' start in standby);
  then the world takes a resize checkpoint (``checkpoint``) and re-forms larger; without it
  (``resize_checkpoint=False``) the world restarts from its last committed checkpoint (``recompute``).
* An unannounced removal is detected by its kind (``JobModel.unannounced_kind``, :class:`FailureKind`):
  a killed process resets its sockets (``detect_failure_s``), a vanished or frozen machine only misses
  heartbeats (``detect_frozen_s``), a hung one is caught by the progress timeout (``detect_hang_s``).
* A world that lost every node restarts *cold* when nodes come back: no peer holds the state, so its
  first rendezvous (``cold_reformation_s``) and a restore of every node from durable storage
  (``cold_restore_s``), after the rollback to the newest committed checkpoint.
* In-place re-formation (``JobModel.in_place``, trainguard's worker-API path): a join takes no checkpoint
  (the joiner takes the state from a live peer) and an unannounced loss rolls back only the interrupted
  step (the survivors continue from memory); only a world that loses every node restarts from its newest
  committed checkpoint. ``restore`` is then the survivors' process-group rebuild until the next step.
  The auto controller is told what the runtime tells it: a loss the survivors held the state through
  (drained or lost, training or re-forming) is survived; a restart from storage is a restore (a rollback,
  or the emergency checkpoint after every node drained); a world of two nodes or more is survivable.
  Only replicated state (DDP) survives every unannounced loss that leaves a node; sharded state (FSDP,
  ZeRO) survives what tier 1 covers (:meth:`JobModel.survives`: no node lost with its buddy's copy, at
  most one loss per parity group); other losses roll back to the newest commit and restore from storage
  (``storage_restore_s``).
* Each kind of change may have costs of its own (``start_reformation_s``, ``join_*``, ``failure_*``; None:
  the general ``reformation_s`` / ``restore_s``): a first rendezvous waits out the last call, a join
  moves the state to the joiner, an unplanned re-formation waits until the lost node is given up.
* Plain torchrun (``JobModel.last_call_s``): torch's c10d rendezvous completes a round below
  ``max_nodes`` only when its last call expires; joiners that fill it end the wait.
* Between two steps the runtime spends ``JobModel.step_overhead_s`` outside the step itself
  (``between_steps``): productive time is the steps' own time, as the replay measures it.
* Changes while the world re-forms: a node lost re-starts the re-formation (a failure: detection
  first); a notice makes the leavers go at once; a joiner ready before the restore phase joins this
  re-formation, one ready later waits and triggers the next one right after (thrash).
* Periodic checkpoints every ``T`` seconds of training pause the world ``periodic_overhead_s``
  (``periodic_checkpoint``) and commit ``periodic_persist_s`` later; a failure before the commit rolls
  back to the previous one.
* Cost: every available node-second at the spot price; the on-demand reference trains the same kept
  steps with no interruption (``step_time_s(w) * w`` node-seconds per step) at the on-demand price.

Everything is in simulated time: the clock and the random draws (``seed``) are the only inputs.
"""

from __future__ import annotations

import collections
import heapq
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from trainguard.checkpoint.interval import AutoSettings, IntervalController, IntervalMode, IntervalPolicy

CAUSES: tuple[str, ...] = ("detection", "checkpoint", "periodic_checkpoint", "reformation", "restore", "recompute",
                           "warmup", "notice_lead", "idle", "between_steps")
"""Waste causes, in node-seconds (see the module docstring)."""


class FailureKind(str, Enum):
    """How an unannounced removal looks to the survivors, which decides how soon they notice it.

    ``KILL``: the node's processes died and its sockets reset (the replay's SIGKILL on one host):
    ``detect_failure_s``. ``FROZEN``: the machine vanished or froze (a spot VM reclaimed without notice):
    no reset, only the missed heartbeats tell (``detect_frozen_s``). ``HANG``: the node is there but
    makes no progress (a hung collective, a stuck GPU): the progress timeout (``detect_hang_s``)."""

    KILL = "kill"
    FROZEN = "frozen"
    HANG = "hang"


class StateLayout(str, Enum):
    """Where the training state lives: on every node (DDP) or split among the nodes (FSDP, ZeRO)."""

    REPLICATED = "replicated"
    SHARDED = "sharded"


class Tier1(str, Enum):
    """The in-memory copy of each node's state on other nodes (``checkpoint`` tier 1).

    ``NONE``: none; ``COPIES``: each node's snapshot also on its buddy (the next node of the world, in
    name order); ``PARITY``: parity over groups of ``JobModel.parity_group`` nodes (consecutive in name
    order), one loss per group recoverable."""

    NONE = "none"
    COPIES = "copies"
    PARITY = "parity"


class TraceError(ValueError):
    """A trace file that cannot be read as a membership trace."""


# ---- traces -----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceEvent:
    t_s: float
    kind: str
    """``add`` or ``remove``."""
    node: str


@dataclass(frozen=True, slots=True)
class Trace:
    """Membership events in time order; ``duration_s`` ends the trace (default: the last event)."""

    events: tuple[TraceEvent, ...]
    duration_s: float
    name: str = ""

    def sizes(self) -> list[tuple[float, int]]:
        """``(time, nodes present)`` after each change instant, starting with ``(0, 0)``."""
        out, n = [(0.0, 0)], 0
        for t, adds, removes in self.instants():
            n += len(adds) - len(removes)
            if t == out[-1][0]:
                out[-1] = (t, n)
            else:
                out.append((t, n))
        return out

    def instants(self) -> list[tuple[float, list[str], list[str]]]:
        """``(time, added nodes, removed nodes)`` per distinct event time."""
        out: list[tuple[float, list[str], list[str]]] = []
        for e in self.events:
            if not out or out[-1][0] != e.t_s:
                out.append((e.t_s, [], []))
            (out[-1][1] if e.kind == "add" else out[-1][2]).append(e.node)
        return out

    def available_node_s(self) -> float:
        sizes = self.sizes()
        total = 0.0
        for (t0, n), (t1, _) in zip(sizes, sizes[1:] + [(self.duration_s, 0)]):
            total += n * max(0.0, min(t1, self.duration_s) - t0)
        return total

    def removals(self) -> list[TraceEvent]:
        return [e for e in self.events if e.kind == "remove"]


def load_trace(path: str, *, name: str | None = None) -> Trace:
    """Read ``time_ms,add|remove,node`` lines (a header line and blank lines are skipped)."""
    events: list[TraceEvent] = []
    present: set[str] = set()
    with open(path, encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = [p.strip() for p in line.split(",")]
            if lineno == 1 and not parts[0].lstrip("-").isdigit():
                continue  # a header
            if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in ("add", "remove") or not parts[2]:
                raise TraceError(f"{path}:{lineno}: expected 'time_ms,add|remove,node', got {line!r}")
            t, kind, node = int(parts[0]) / 1000.0, parts[1], parts[2]
            if events and t < events[-1].t_s:
                raise TraceError(f"{path}:{lineno}: time {parts[0]} ms goes back in time; sort the trace by time")
            if kind == "add" and node in present:
                raise TraceError(f"{path}:{lineno}: {node} is added while present")
            if kind == "remove" and node not in present:
                raise TraceError(f"{path}:{lineno}: {node} is removed while absent")
            (present.add if kind == "add" else present.discard)(node)
            events.append(TraceEvent(t, kind, node))
    if not events:
        raise TraceError(f"{path}: no events")
    return Trace(tuple(events), events[-1].t_s, name or path.rsplit("/", 1)[-1])


def window(trace: Trace, start_s: float, duration_s: float) -> Trace:
    """The part of ``trace`` in ``[start_s, start_s + duration_s)``, re-based at 0: nodes present at
    ``start_s`` are added at 0."""
    end = start_s + duration_s
    present: dict[str, None] = {}
    out: list[TraceEvent] = []
    for e in trace.events:
        if e.t_s < start_s:
            if e.kind == "add":
                present[e.node] = None
            else:
                present.pop(e.node, None)
            continue
        if e.t_s >= end:
            break
        out.append(replace(e, t_s=e.t_s - start_s))
    first = [TraceEvent(0.0, "add", n) for n in present]
    return Trace(tuple(first + out), duration_s, f"{trace.name}[{start_s:g}s+{duration_s:g}s]")


def scale(trace: Trace, *, nodes_per_agent: int, max_agents: int, min_agents: int = 1, speed: float = 1.0,
          rounding: str = "nearest", prefix: str = "agent") -> Trace:
    """Map a trace onto fewer, faster "agents": ``clamp(round(n / nodes_per_agent))`` agents while the
    trace has ``n`` nodes (``rounding`` ``nearest``, halves up, or ``up``), times divided by ``speed``.
    Removals take the longest-present agents first, so churn spreads over the agents. Only changes of
    the agent count remain."""
    if nodes_per_agent < 1 or max_agents < min_agents or min_agents < 0 or speed <= 0 or rounding not in ("nearest", "up"):
        raise ValueError("scale: need nodes_per_agent >= 1, max_agents >= min_agents >= 0, speed > 0, "
                         "rounding 'nearest' or 'up'")
    agents: list[str] = []
    made = 0
    out: list[TraceEvent] = []
    for t, n in trace.sizes():
        share = math.ceil(n / nodes_per_agent) if rounding == "up" else int(math.floor(n / nodes_per_agent + 0.5))
        want = max(min_agents, min(max_agents, share)) if n else 0
        ts = t / speed
        while len(agents) > want:
            out.append(TraceEvent(ts, "remove", agents.pop(0)))
        while len(agents) < want:
            made += 1
            agents.append(f"{prefix}{made}")
            out.append(TraceEvent(ts, "add", agents[-1]))
    return Trace(tuple(out), trace.duration_s / speed, f"{trace.name} /{nodes_per_agent} x{speed:g}")


def pick_unannounced(trace: Trace, share: float, seed: int = 0) -> frozenset[int]:
    """Indices (in :meth:`Trace.removals` order) of the removals that come without notice: each with
    probability ``share``, seeded."""
    rng = random.Random(seed)
    return frozenset(i for i, _ in enumerate(trace.removals()) if rng.random() < share)


# ---- inputs --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Dist:
    """An empirical distribution: a draw is one of ``samples`` (uniformly); a constant is one sample."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples or any(not math.isfinite(x) or x < 0 for x in self.samples):
            raise ValueError(f"Dist needs finite samples >= 0, got {self.samples!r}")

    @classmethod
    def of(cls, values: Iterable[float] | float) -> Dist:
        if isinstance(values, (int, float)):
            return cls((float(values),))
        return cls(tuple(float(v) for v in values))

    def draw(self, rng: random.Random) -> float:
        return self.samples[0] if len(self.samples) == 1 else rng.choice(self.samples)

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChangeCosts:
    """Seconds each part of a membership change takes (see the module docstring)."""

    agent_start_s: Dist | None = None
    """A node of the first world: its agent's start until it waits in the rendezvous (None: ``warmup_s``)."""
    detect_notice_s: Dist = Dist.of(0.5)
    detect_failure_s: Dist = Dist.of(10.0)
    emergency_s: Dist = Dist.of(1.0)
    resize_checkpoint_s: Dist = Dist.of(1.0)
    reformation_s: Dist = Dist.of(2.0)
    restore_s: Dist = Dist.of(5.0)
    start_reformation_s: Dist | None = None
    """The first world's rendezvous, the last node ready until it completes (None: ``reformation_s``): with
    no plan to go by, it waits out the rendezvous' last call."""
    join_reformation_s: Dist | None = None
    """A scale-up's re-formation (None: ``reformation_s``); with in-place re-formation from the request to
    the workers until the world re-formed, their parking at a step boundary included."""
    join_restore_s: Dist | None = None
    """A scale-up's restore (None: ``restore_s``): in place, the joiner takes the state from a peer."""
    failure_reformation_s: Dist | None = None
    """The re-formation after an unannounced loss, from its detection (None: ``reformation_s``): the
    rendezvous waits until the lost node is given up, and a survivor blocked in a collective is restarted."""
    failure_restore_s: Dist | None = None
    """The restore after an unannounced loss the survivors held the state through (None: ``restore_s``)."""
    detect_frozen_s: Dist | None = None
    """Detection of a node that vanished or froze (:class:`FailureKind` ``FROZEN``: no socket reset, only
    missed heartbeats; None: ``detect_failure_s``)."""
    detect_hang_s: Dist | None = None
    """Detection of a node that hangs (``HANG``: the progress timeout; None: ``detect_failure_s``)."""
    storage_restore_s: Dist | None = None
    """A world with survivors that restores from durable storage: a loss in place that neither replicated
    state nor tier 1 covers (None: ``restore_s``)."""
    cold_reformation_s: Dist | None = None
    """A world restarting after it lost every node: its first rendezvous (None: ``start_reformation_s``,
    else ``reformation_s``)."""
    cold_restore_s: Dist | None = None
    """A world restarting after it lost every node: no peer holds the state, every node restores from
    durable storage, until the first step (None: ``startup_s``). The nodes' own start (boot, imports,
    model build) is their warm-up before it."""
    startup_s: Dist = Dist.of(5.0)
    warmup_s: Dist = Dist.of(3.0)
    periodic_overhead_s: Dist = Dist.of(0.05)
    periodic_persist_s: Dist = Dist.of(0.5)
    periodic_interference_s: Dist | None = None
    """Training time a periodic save's background persist takes from the steps it overlaps (its CPU work
    on the training's cores; None: none). The replay's step times already hold it, so it is not charged
    again: the interval controller sees it, as the runtime's does (``IntervalController.observe_step``),
    and counts it in the save cost that sets the auto interval."""

    def as_dict(self) -> dict[str, list[float]]:
        return {f: list(getattr(self, f).samples) for f in self.__slots__ if getattr(self, f) is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChangeCosts:
        return cls(**{k: Dist.of(v) for k, v in d.items() if k in cls.__slots__})


@dataclass(frozen=True, kw_only=True, slots=True)
class JobModel:
    """How the job behaves: trainguard by default; plain torchrun elastic with ``notices=False,
    resize_checkpoint=False``."""

    node_s_per_step: float = 1.0
    """Step time x world size (constant global batch, linear scaling) unless ``step_times`` says."""
    step_times: tuple[tuple[int, float], ...] = ()
    """Measured step time per world size, ``((w, seconds), ...)``; other sizes use the nearest."""
    samples_per_step: int = 1
    notices: bool = True
    resize_checkpoint: bool = True
    in_place: bool = False
    """Worlds re-form in place (see the module docstring): joins need no checkpoint, a node lost without
    notice costs the interrupted step, not the work since the newest commit."""
    step_overhead_s: float = 0.0
    """Seconds between two steps outside the steps themselves (``between_steps`` waste)."""
    state: StateLayout = StateLayout.REPLICATED
    """With ``in_place``: replicated state survives any loss that leaves a node; sharded state only
    what ``tier1`` covers (else the world restores from durable storage: ``storage_restore_s``)."""
    tier1: Tier1 = Tier1.NONE
    parity_group: int = 4
    """Nodes per parity group (``tier1`` ``PARITY``)."""
    unannounced_kind: FailureKind = FailureKind.KILL
    """What an unannounced removal is to the survivors (its detection cost)."""
    abandon_in_place: bool = True
    """With ``in_place``: survivors whose emergency checkpoint was abandoned at the drain deadline re-form
    in place from memory where the state survives the loss (the runtime since 'abandoned in place'); False:
    every worker exits and the world restarts from storage (the runtime before)."""
    drain_lead_s: float | None = None
    """``preemption.train_through_notice``: a notice further than this from its reclaim takes one
    out-of-cycle checkpoint (a periodic save's cost) and the world trains on until ``drain_lead_s``
    before the reclaim, then drains. None: drain at once (the default)."""
    min_nodes: int = 1
    max_nodes: int = 1 << 30
    last_call_s: float = 0.0
    """torch's c10d rendezvous (plain torchrun): a round that opens with fewer than ``max_nodes``
    participants completes only when its last call expires (``last_call_timeout``, 30 s by default,
    counted from its first participant), at once when it fills to ``max_nodes``. 0: the job's rounds do
    not wait (trainguard re-forms in place on a planned membership). The measured re-formation costs
    are those of rounds that did not wait it (the bench subtracts it from those that did)."""

    def __post_init__(self) -> None:
        if self.parity_group < 2:
            raise ValueError(f"JobModel.parity_group must be >= 2 (a group of one holds no parity), got {self.parity_group}")

    def survives(self, world: Iterable[str], lost: Iterable[str]) -> bool:
        """Whether the nodes of ``world`` left after losing ``lost`` (at once, without notice) hold the
        whole state in memory: a pure function of the layout, tier 1 and the world's names."""
        order = sorted(world)
        gone = set(lost) & set(order)
        if not self.in_place or not gone or len(gone) == len(order):
            return bool(self.in_place and len(gone) < len(order))
        if self.state is StateLayout.REPLICATED:
            return True
        if self.tier1 is Tier1.COPIES:  # node i's snapshot also lives on node i+1: both gone, it is gone
            return not any(order[i] in gone and order[(i + 1) % len(order)] in gone for i in range(len(order)))
        if self.tier1 is Tier1.PARITY:  # one loss per group is rebuilt from the others' blocks
            g = self.parity_group
            return all(len(gone & set(order[i:i + g])) <= 1 for i in range(0, len(order), g))
        return False

    def survivable(self, world_size: int) -> bool:
        """Whether some loss of one node in a world this size is survived in place (the runtime's claim to
        the interval controller)."""
        return self.in_place and world_size > 1 and (self.state is StateLayout.REPLICATED or self.tier1 is not Tier1.NONE)

    def cycle_s(self, w: int) -> float:
        """A step and the gap to the next one."""
        return self.step_time_s(w) + self.step_overhead_s

    def step_time_s(self, w: int) -> float:
        if self.step_times:
            return min(self.step_times, key=lambda ws: (abs(ws[0] - w), ws[0]))[1]
        return self.node_s_per_step / max(1, w)


@dataclass(frozen=True, kw_only=True, slots=True)
class Prices:
    spot_per_hour: float = 0.918
    on_demand_per_hour: float = 3.06


@dataclass(slots=True)
class Change:
    """One re-formation of the world, for the report."""

    t_s: float
    why: str
    size_before: int
    size_after: int = 0
    lost_node_s: dict[str, float] = field(default_factory=dict)
    recomputed_steps: float = 0.0


@dataclass(slots=True)
class SimResult:
    available_node_s: float
    productive_node_s: float
    waste_node_s: dict[str, float]
    kept_steps: float
    recomputed_steps: float
    samples_per_step: int
    changes: list[Change]
    periodic_saves: int
    failures_seen: int
    intervals: list[tuple[float, float, str]]
    """Auto: ``(time, interval, reason)`` per change of the interval."""
    cost_total: float
    on_demand_cost: float
    world_time_s: dict[int, float]
    """Seconds the world trained at each size."""

    @property
    def ettr(self) -> float:
        return self.productive_node_s / self.available_node_s if self.available_node_s > 0 else 0.0

    @property
    def waste_total_node_s(self) -> float:
        return sum(self.waste_node_s.values())

    @property
    def committed_samples(self) -> float:
        return self.kept_steps * self.samples_per_step

    @property
    def cost_per_sample(self) -> float:
        return self.cost_total / self.committed_samples if self.committed_samples > 0 else math.inf

    @property
    def on_demand_cost_per_sample(self) -> float:
        return self.on_demand_cost / self.committed_samples if self.committed_samples > 0 else math.inf

    @property
    def thrash(self) -> int:
        """Re-formations that ended at the size they started from."""
        return sum(1 for c in self.changes if c.size_after == c.size_before)

    def summary(self) -> dict[str, Any]:
        return {"ettr": self.ettr, "available_node_s": self.available_node_s, "productive_node_s": self.productive_node_s,
                "waste_node_s": dict(self.waste_node_s), "kept_steps": self.kept_steps,
                "recomputed_steps": self.recomputed_steps, "changes": len(self.changes), "thrash": self.thrash,
                "periodic_saves": self.periodic_saves, "failures_seen": self.failures_seen,
                "cost_total": self.cost_total, "cost_per_sample": self.cost_per_sample,
                "on_demand_cost_per_sample": self.on_demand_cost_per_sample,
                "world_time_s": {str(k): v for k, v in sorted(self.world_time_s.items())}}


# ---- the simulation ----------------------------------------------------------------------------------

@dataclass(slots=True)
class _Phase:
    cause: str
    end: float
    world: frozenset[str]
    commit: str = ""
    """A checkpoint of this kind commits when the phase ends (emergency/resize saves)."""
    filled_end: float | None = None
    """A re-formation waiting out a rendezvous last call: when it ends if the round fills."""


@dataclass(slots=True)
class _Piece:
    t0: float
    t1: float
    w: int


class _Sim:
    def __init__(self, trace: Trace, costs: ChangeCosts, job: JobModel, policy: IntervalPolicy,
                 settings: AutoSettings, lead_s: float, unannounced: frozenset[int], seed: int, prices: Prices) -> None:
        self.trace, self.c, self.job, self.policy = trace, costs, job, policy
        self.lead_s, self.unannounced, self.prices = lead_s, unannounced, prices
        self.rng = random.Random(seed)
        self.now = 0.0
        self.present: set[str] = set()
        self.world: frozenset[str] = frozenset()
        self.out_cause: dict[str, str] = {}
        self._ver = 0  # bumped when present / out_cause change (caches the outside counts)
        self._counts_key: tuple[int, frozenset[str]] | None = None
        self._counts: dict[str, int] = {}
        self._inside = 0
        self.phases: list[_Phase] = []
        self.resuming = False  # the phases are a periodic save's pause, not a re-formation
        self.waiting: set[str] = set()  # joiners ready while the world restores: the next re-formation
        self.waste = {c: 0.0 for c in CAUSES}
        self.productive = 0.0
        self.steps = 0.0
        self.recomputed = 0.0
        self.pieces: list[_Piece] = []  # trained since the newest commit's state
        self.commit_steps = 0.0  # steps in the newest committed checkpoint
        self.pending: tuple[float, float] | None = None  # periodic save in flight: (commits at, steps)
        self.persist_s = 0.0
        self.since_save = 0.0
        self.saves = 0
        self.new_failures = 0  # failures the next restore proves (see IntervalController.observe_restore)
        self.unrealized = (0.0, 0.0)  # a rollback's (node-s, steps) lost: counted when a world resumes
        self.reform_kind = ""  # the kind of costs of the re-formation under way (see _reform)
        self.drained_out = False  # in place: every node of the world drained, the next one restores the emergency save
        self.restore_s = 0.0
        self.changes: list[Change] = []
        self.current: Change | None = None
        self.world_time: dict[int, float] = {}
        self.ctl = IntervalController(policy, settings, world_size=1, clock=lambda: self.now, now=0.0)
        self._step_s: dict[int, float] = {}
        self.intervals: list[tuple[float, float, str]] = []
        self.started = False

    # -- accounting ---------------------------------------------------------------------------------
    def _outside(self, dt: float, world_cause: str | None = None) -> None:
        """Charge ``dt`` to every present node outside the world (and to the world's, with a cause)."""
        if dt <= 0:
            return
        key = (self._ver, self.world)
        if key != self._counts_key:  # membership changed since the last count
            counts: dict[str, int] = collections.Counter()
            inside = 0
            for n in self.present:
                if n in self.world:
                    inside += 1
                else:
                    counts[self.out_cause.get(n, "idle")] += 1
            self._counts, self._inside, self._counts_key = counts, inside, key
        for cause, k in self._counts.items():
            self.waste[cause] += dt * k
        if world_cause is not None:
            self.waste[world_cause] += dt * self._inside

    def _charge(self, cause: str, dt: float, nodes: int) -> None:
        self.waste[cause] += dt * nodes
        if self.current is not None:
            self.current.lost_node_s[cause] = self.current.lost_node_s.get(cause, 0.0) + dt * nodes

    def _interval(self) -> float:
        p = self.policy
        if p.mode is IntervalMode.OFF:
            return math.inf
        if p.mode is IntervalMode.AUTO:
            ch = self.ctl.update(self.now)
            if ch is not None:
                self.intervals.append((self.now, ch.new_s, ch.reason))
            return self.ctl.interval_s or math.inf
        w = max(1, len(self.world))
        cands = ([p.steps * self.step_s(w)] if p.steps else []) + ([p.seconds] if p.seconds else [])
        return min(cands) if cands else math.inf

    def advance(self, t: float) -> None:
        """Let time pass until ``t``: train, take periodic saves, run scheduled phases."""
        while self.now < t:
            if self.phases:
                ph = self.phases[0]
                self.world = ph.world
                t1 = min(ph.end, t)
                self._charge(ph.cause, t1 - self.now, sum(1 for n in ph.world if n in self.present))
                self._outside(t1 - self.now)
                self.now = t1
                if t1 >= ph.end:
                    self.phases.pop(0)
                    if ph.commit:
                        self._committed()
                    if not self.phases:
                        self._phases_done()
                continue
            if not self.started or len(self.world) < self.job.min_nodes:
                self._outside(t - self.now, world_cause="idle")
                self.now = t
                continue
            t_save = self.now + max(0.0, self._interval() - self.since_save)
            t_commit = self.pending[0] if self.pending else math.inf
            t1 = min(t, t_save, t_commit)
            self._train(t1)
            if self.pending and self.now >= self.pending[0]:
                self._committed(self.pending[1])
                self.ctl.observe_persist(self.persist_s)
            if t_save <= self.now < t:
                self._periodic_save()

    def step_s(self, w: int) -> float:
        """Seconds from one step's start to the next's (the step and the gap after it)."""
        v = self._step_s.get(w)
        if v is None:
            v = self._step_s[w] = self.job.cycle_s(w)
        return v

    def _share(self, w: int) -> float:
        """The productive share of training time at world size ``w``."""
        return self.job.step_time_s(w) / self.step_s(w)

    def _train(self, t1: float) -> None:
        dt = t1 - self.now
        if dt <= 0:
            return
        w = len(self.world)
        share = self._share(w)
        self.productive += dt * w * share
        self.waste["between_steps"] += dt * w * (1.0 - share)
        self.steps += dt / self.step_s(w)
        self.pieces.append(_Piece(self.now, t1, w))
        self.world_time[w] = self.world_time.get(w, 0.0) + dt
        self.since_save += dt
        self._outside(dt)
        self.now = t1

    def _committed(self, steps: float | None = None) -> None:
        """A checkpoint of the state ``steps`` (default: now) is durable: work before it is safe."""
        if steps is None or steps >= self.steps:
            self.pieces = []
        else:  # a periodic save: what was trained after its state was taken stays at risk
            at_risk = self.steps - steps
            kept: list[_Piece] = []
            for p in reversed(self.pieces):
                if at_risk <= 1e-12:
                    break
                ps = (p.t1 - p.t0) / self.step_s(p.w)
                kept.append(p if ps <= at_risk else _Piece(p.t1 - at_risk * self.step_s(p.w), p.t1, p.w))
                at_risk -= ps
            self.pieces = list(reversed(kept))
        self.commit_steps = self.steps if steps is None else steps
        self.pending = None

    def _periodic_save(self) -> None:
        if self.pending:  # at most one in flight: the previous one commits first
            self._committed(self.pending[1])
        overhead = self.c.periodic_overhead_s.draw(self.rng)
        self.persist_s = self.c.periodic_persist_s.draw(self.rng)
        self.saves += 1
        self.ctl.observe_save(overhead)
        if self.c.periodic_interference_s is not None and self.world:
            step = self.step_s(len(self.world))
            self.ctl.observe_step(step, persisting=False)
            self.ctl.observe_step(step + self.c.periodic_interference_s.draw(self.rng), persisting=True)
        self.pending = (self.now + overhead + self.persist_s, self.steps)
        self.since_save = 0.0
        self.ctl.saved(self.now + overhead)
        self.phases = [_Phase("periodic_checkpoint", self.now + overhead, self.world)]
        self.resuming = True

    def _rollback(self, *, interrupted_only: bool = False) -> None:
        """Lose what was trained since the newest committed checkpoint (a save in flight too), or with
        ``interrupted_only`` (in place) the step under way only."""
        if interrupted_only:
            lost_steps = self.steps - max(math.floor(self.steps + 1e-9), self.commit_steps)
            self._drop_latest(lost_steps)
            return
        lost_node_s = sum((p.t1 - p.t0) * p.w * self._share(p.w) for p in self.pieces)
        lost_steps = self.steps - self.commit_steps
        self.unrealized = (self.unrealized[0] + lost_node_s, self.unrealized[1] + lost_steps)
        self.steps = self.commit_steps
        self.pieces = []
        self.pending = None

    def _drop_latest(self, lost_steps: float) -> None:
        """Lose the newest ``lost_steps`` steps trained (the interrupted one), keeping the rest."""
        if lost_steps <= 1e-12:
            return
        lost_node_s, left = 0.0, lost_steps
        while left > 1e-12 and self.pieces:
            p = self.pieces[-1]
            ps = (p.t1 - p.t0) / self.step_s(p.w)
            take = min(ps, left)
            lost_node_s += take * self.step_s(p.w) * p.w * self._share(p.w)
            if take >= ps:
                self.pieces.pop()
            else:
                p.t1 -= take * self.step_s(p.w)
            left -= take
        self._lost(lost_node_s, lost_steps)
        self.steps -= lost_steps
        if self.pending and self.pending[1] > self.steps:
            self.pending = None  # its state included the lost step: it is void

    def _lost(self, lost_node_s: float, lost_steps: float) -> None:
        self.productive -= lost_node_s
        self.waste["recompute"] += lost_node_s
        self.recomputed += lost_steps
        if self.current is not None:
            self.current.lost_node_s["recompute"] = self.current.lost_node_s.get("recompute", 0.0) + lost_node_s
            self.current.recomputed_steps += lost_steps

    # -- re-formations -------------------------------------------------------------------------------
    def _begin_change(self, why: str) -> None:
        if self.current is not None and self.phases and not self.resuming:
            self.current.why += "+" + why  # the re-formation under way starts over
            return
        self.current = Change(self.now, why, len(self.world))
        self.changes.append(self.current)
        self.ctl.tick(self.now)  # the world stops training: close the exposure clock

    def _reform(self, pre: list[_Phase], new_world: frozenset[str], kind: str = "") -> None:
        """Re-form after ``pre``; ``kind`` (``join``, ``failure``) picks that kind's measured costs."""
        t = pre[-1].end if pre else self.now
        c = self.c
        self.reform_kind = kind
        reform = {"cold": c.cold_reformation_s or c.start_reformation_s, "storage": c.failure_reformation_s}.get(kind) or getattr(c, f"{kind}_reformation_s", None)
        t += (reform or c.reformation_s).draw(self.rng)
        filled = None
        if self.job.last_call_s and len(new_world) < self.job.max_nodes:  # the round waits out its last call
            filled, t = t, t + self.job.last_call_s
        phases = [*pre, _Phase("reformation", t, new_world, filled_end=filled)]
        restore = ({"cold": c.cold_restore_s or c.startup_s}.get(kind) or getattr(c, f"{kind}_restore_s", None)
                   or c.restore_s)
        self.restore_s = restore.draw(self.rng) if self.started else c.startup_s.draw(self.rng)
        phases.append(_Phase("restore", t + self.restore_s, new_world))
        self.phases = phases
        self.resuming = False
        self.world = phases[0].world

    def _phases_done(self) -> None:
        if self.resuming:
            self.resuming = False
            return
        if self.world and self.unrealized != (0.0, 0.0):  # this world resumes from the older commit
            self._lost(*self.unrealized)
            self.unrealized = (0.0, 0.0)
        self.started = True
        if self.current is not None:
            self.current.size_after = len(self.world)
        n = self.new_failures
        self.new_failures = 0
        # What the runtime tells the controller: a world restarted from storage restores (a rollback, a
        # resize checkpoint, or the emergency one after every node drained); one re-formed in place does not.
        first = self.current is not None and self.current.why.startswith("start")
        self.ctl.set_world_size(max(1, len(self.world)), self.now, survivable=self.job.survivable(len(self.world)))
        if n or (not first and (not self.job.in_place or (self.drained_out and self.world))):
            kind = "periodic" if n else "emergency" if self.job.in_place else "resize"
            self.ctl.observe_restore(self.restore_s, kind, max(0, n - 1))
        elif first:
            self.ctl.observe_restore(self.restore_s, "none")
        if self.world:
            self.drained_out = False
        self.ctl.begin(self.now)
        self.since_save = 0.0
        self.pieces = []
        if self.waiting:  # joiners that came too late for this one: re-form again at once
            self._resize(set(self.waiting))

    def _phase(self) -> str | None:
        """The re-formation phase under way (None while training or pausing for a periodic save)."""
        return None if self.resuming or not self.phases else self.phases[0].cause

    def _finish_pause(self) -> None:
        if self.phases and self.resuming:
            self.advance(self.phases[-1].end)

    def _resize(self, joiners: set[str]) -> None:
        """Joiners are ready: take a resize checkpoint (or roll back) and re-form larger."""
        self._finish_pause()
        self.waiting -= joiners
        joiners = {j for j in joiners if j in self.present}
        if not joiners:
            return
        phase = self._phase()
        if phase in ("detection", "checkpoint", "reformation"):  # in time for the re-formation under way
            new_world = self.phases[-1].world | joiners
            for ph in self.phases:
                if ph.cause in ("reformation", "restore"):
                    ph.world = new_world
            self._round_filled(len(new_world))
            return
        if phase == "restore":  # too late: the next re-formation
            self.waiting |= joiners
            return
        self._begin_change("join" if self.started else "start")
        new_world = self.world | joiners
        if not self.started:
            self._reform([], new_world, "start")
        elif not self.world:  # every node was gone: no peer holds the state, a cold start from storage
            self._reform([], new_world, "cold")
        elif self.job.in_place:  # the joiner takes the state from a live peer: no checkpoint
            self._reform([], new_world, "join")
        elif self.job.resize_checkpoint and len(self.world) >= self.job.min_nodes:
            end = self.now + self.c.resize_checkpoint_s.draw(self.rng)
            self._reform([_Phase("checkpoint", end, self.world, commit="resize")], new_world, "join")
        else:
            self._rollback()
            self._reform([], new_world, "join")

    def _round_filled(self, size: int) -> None:
        """Joiners brought a round waiting out its last call to ``max_nodes``: it completes now (or when it
        would have without the wait), the phases after it move up."""
        if size < self.job.max_nodes:
            return
        for i, ph in enumerate(self.phases):
            if ph.cause == "reformation" and ph.filled_end is not None:
                end = max(ph.filled_end, self.now)
                shift = ph.end - end
                ph.filled_end = None
                for later in self.phases[i:]:
                    later.end -= shift
                return

    def _drain(self, leavers: set[str]) -> None:
        """A notice reached ``leavers`` (after detection): emergency checkpoint, then re-form without them."""
        self._finish_pause()
        leavers = {n for n in leavers if n in self.world or any(n in ph.world for ph in self.phases)}
        if not leavers:
            return
        for n in leavers:
            self.out_cause[n] = "notice_lead"
        self._ver += 1
        phase = self._phase()
        self._begin_change("notice")
        if phase is not None:  # re-forming already: the leavers go at once, the re-formation starts over
            rest = frozenset(n for n in self.phases[-1].world if n not in leavers)
            self._reform([], rest, self.reform_kind)  # with the costs of the one under way (e.g. from storage)
            return
        end = self.now + self.c.emergency_s.draw(self.rng)
        rest = self.world - leavers
        if self.job.in_place and rest:
            self.ctl.observe_survived_loss(unannounced=False)  # the survivors keep the state in memory
        elif self.job.in_place:
            self.drained_out = True
        self._reform([_Phase("checkpoint", end, self.world, commit="emergency")], rest)

    def _gone(self, nodes: set[str]) -> None:
        lost = {n for n in nodes if n in self.world or any(n in ph.world for ph in self.phases)}
        for n in nodes:
            self.present.discard(n)
            self.out_cause.pop(n, None)
            self.waiting.discard(n)
        self._ver += 1
        self._finish_pause()
        if not lost:
            return
        phase = self._phase()
        target = self.phases[-1].world if self.phases and not self.resuming else self.world
        rest = frozenset(n for n in target if n not in lost)
        self._begin_change("failure")
        # In place the survivors hold the state, training or re-forming, unless the world is restarting
        # from storage (after a rollback, or after every node drained) or the loss took a part of sharded
        # state that tier 1 does not cover. A leaver gone before the emergency checkpoint committed: the
        # runtime abandons that save at the drain deadline (``checkpoint_abandoned``) and the survivors
        # re-form in place at once (no detection: the leaver drained); with ``abandon_in_place=False``
        # (the runtime before that) every worker exits and the world restarts from storage.
        in_memory = self.job.in_place and bool(rest) and not (self.new_failures or self.drained_out)
        abandoned = phase == "checkpoint" and self.phases[0].commit == "emergency"
        from_storage = in_memory and ((abandoned and not self.job.abandon_in_place)
                                      or not self.job.survives(self.world, lost))
        in_memory = in_memory and not from_storage
        if in_memory:
            if phase is None or phase == "checkpoint":
                self._rollback(interrupted_only=True)  # the step under way only
            self.ctl.observe_survived_loss(unannounced=True)
        elif phase is None or phase == "checkpoint":  # training, or saving: roll back to the newest commit
            self._rollback()
            self.new_failures += 1
        elif phase == "restore":  # the new world had restored: it dies without a new checkpoint
            self.new_failures += 1
        survivors = frozenset(n for n in self.world if n not in lost)
        c = self.c
        detect = {FailureKind.FROZEN: c.detect_frozen_s, FailureKind.HANG: c.detect_hang_s}.get(self.job.unannounced_kind)
        end = self.now if abandoned and self.job.abandon_in_place else self.now + (detect or c.detect_failure_s).draw(self.rng)
        # In place, a world that does not hold the state restores it from storage.
        storage = self.job.in_place and bool(rest) and not in_memory
        self._reform([_Phase("detection", end, survivors)], rest, "storage" if storage else "failure")

    def run(self, end: float) -> None:
        q: list[tuple[float, int, str, Any]] = []
        seq = 0

        def push(t: float, kind: str, payload: Any) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(q, (t, seq, kind, payload))

        removal_index = 0
        for t, adds, removes in self.trace.instants():
            if adds:
                push(t, "add", adds)
            if removes:
                announced = []
                for n in removes:
                    if self.job.notices and removal_index not in self.unannounced:
                        announced.append(n)
                    removal_index += 1
                if announced:
                    push(max(0.0, t - self.lead_s), "notice", (announced, t))
                push(t, "gone", removes)
        push(end, "end", None)
        while q:
            t, _, kind, payload = heapq.heappop(q)
            self.advance(min(t, end))
            if kind == "end":
                break
            if kind == "add":
                for n in payload:
                    self.present.add(n)
                    self.out_cause[n] = "warmup"
                self._ver += 1
                # A node of the first world starts the usual way; one joining a running world warms up.
                warm = self.c.warmup_s if self.started or self.c.agent_start_s is None else self.c.agent_start_s
                push(self.now + warm.draw(self.rng), "join", payload)
            elif kind == "join":
                self._resize(set(payload))
            elif kind == "notice":
                nodes, t_gone = payload
                t_drain = self.now + self.c.detect_notice_s.draw(self.rng)
                lead = self.job.drain_lead_s
                if lead is not None and t_gone - t_drain > lead:  # train through: a save now, the drain later
                    push(t_drain, "insure", None)
                    t_drain = t_gone - lead
                push(t_drain, "drain", (nodes, t_gone))
            elif kind == "insure":
                if not self.phases and self.started and len(self.world) >= self.job.min_nodes:
                    self._periodic_save()
            elif kind == "drain":
                nodes, t_gone = payload
                if self.now < t_gone:
                    self._drain(set(nodes))
            elif kind == "gone":
                self._gone(set(payload))

    def result(self) -> SimResult:
        available = self.trace.available_node_s()
        trained = sum(self.world_time.values())
        mean_node_s = (sum(self.job.cycle_s(w) * w * s for w, s in self.world_time.items()) / trained
                       if trained else self.job.cycle_s(1))
        return SimResult(
            available_node_s=available, productive_node_s=self.productive, waste_node_s=dict(self.waste),
            kept_steps=self.steps + self.unrealized[1], recomputed_steps=self.recomputed, samples_per_step=self.job.samples_per_step,
            changes=self.changes, periodic_saves=self.saves, failures_seen=self.ctl.stats.unannounced_failures,
            intervals=self.intervals, cost_total=available / 3600 * self.prices.spot_per_hour,
            on_demand_cost=self.steps * mean_node_s / 3600 * self.prices.on_demand_per_hour,
            world_time_s=dict(self.world_time))


def simulate(trace: Trace, costs: ChangeCosts, job: JobModel, policy: IntervalPolicy, *,
             settings: AutoSettings | None = None, lead_s: float = 120.0, unannounced: Iterable[int] = (),
             seed: int = 0, prices: Prices | None = None) -> SimResult:
    """Run the whole trace once. ``unannounced``: indices into :meth:`Trace.removals` that come
    without notice (:func:`pick_unannounced`). Deterministic for a given ``seed``."""
    sim = _Sim(trace, costs, job, policy, settings or AutoSettings(), lead_s, frozenset(unannounced), seed,
               prices or Prices())
    sim.run(trace.duration_s)
    return sim.result()


__all__ = ["CAUSES", "Change", "ChangeCosts", "Dist", "FailureKind", "JobModel", "Prices", "SimResult", "StateLayout",
           "Tier1", "Trace", "TraceError", "TraceEvent", "load_trace", "pick_unannounced", "scale", "simulate", "window"]
