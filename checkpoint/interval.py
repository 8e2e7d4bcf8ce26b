"""When to take periodic checkpoints: a fixed interval from config, or one tuned online (Young/Daly).

``checkpoint.interval`` (:func:`parse_interval`) is ``auto``, a number of steps (``50``), a duration
(``90s``, ``5m``, ``1.5h``) or ``off``. The deprecated ``checkpoint.interval_steps`` /
``interval_s`` still work when ``interval`` is unset (:func:`policy_from_config`).

Auto (:class:`IntervalController`)
    The interval ``T`` is the training time between two periodic saves that minimises the expected
    waste, from Daly's higher-order estimate (J. T. Daly, "A higher order estimate of the optimum
    checkpoint interval for restart dumps", FGCS 22(3), 2006), which refines Young's first-order
    ``T = sqrt(2 C M)`` (J. W. Young, "A first order approximation to the optimum checkpoint
    interval", CACM 17(9), 1974)::

        T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C    for C < 2M,   else T = M

    * ``C``, the cost of one periodic save: the training time it takes. For an asynchronous save
      that is the time training blocks (staging) plus the slowdown of the steps that ran while it
      persisted (their excess over the step time without a save in flight); for a synchronous one,
      blocked + persist. Measured, exponentially averaged.
    * ``M``, the mean time between failures that roll the job back to its newest durable checkpoint.
      Only *unannounced* failures can: a notice with enough lead for an emergency checkpoint costs
      nothing a periodic checkpoint could have saved. Evidence of one: the world restored from a
      ``periodic`` checkpoint in storage (a drain or resize would have left an ``emergency`` or
      ``resize`` one); or a world restored an ``emergency``/``resize`` checkpoint that an earlier world
      had already restored (that one died before saving anything newer; the checkpoint store's fence
      records tell). Estimated as a rate per rank-second of training with a one-failure prior of
      ``checkpoint.interval_prior_mtbf_s``: ``M = (E / W + M0) / (n + 1)`` (``E`` rank-seconds
      trained, ``W`` ranks now, ``n`` rollbacks seen).

      A *survivable* world (:attr:`IntervalController.survivable`: two nodes or more whose state
      outlives the loss of one, in the survivors' memory (DDP re-formed in place) or in a buddy's
      replica (``checkpoint.memory_replica``)) is rolled back only by a loss that takes every holder
      of some state. There ``M = M_f / p``: ``M_f = (E / W + M0) / (f + 1)`` the mean time between
      unannounced failures (``f`` of them, rollbacks and the ones survived), and ``p`` the probability
      that a loss takes the state with it, estimated from the membership losses seen:
      ``p = (L + 1) / (L + S + 1)``, ``L`` the losses the state did not survive (a world restarted from
      storage: its whole membership gone, announced or not), ``S`` those it did (the world re-formed in
      place, or restored from memory). It starts at 1 (the estimate of a world that cannot survive a
      loss: until one is seen survived, a loss is assumed to take the state) and only evidence lowers it
      (the posterior mean of a Beta(1, 0) prior). A notice decides whether a loss is announced, not how
      many nodes it takes, so announced losses inform ``p`` too (that is the assumption).
    * ``R``, the restore time, does not move the optimum (Daly's wall-time model carries it as a
      constant factor ``e^(R/M)``); it is measured and exported with the others.

    Bounds: ``T`` stays within ``[max(interval_min_s, persist time), interval_max_s]`` (at most one
    save is in flight, so a shorter interval would only make training wait). Hysteresis: a new
    optimum replaces the interval in effect only when it differs by more than
    ``interval_hysteresis`` (relative), or when it crosses a bound. Until the first save has been
    measured the interval is ``interval_min_s`` (bootstrap).

What the estimate is not: it counts the rollbacks that made a world restore, so a failure while no
world was training (during a re-formation) that merely delays the next one is not counted; failures
of nodes that were never in the world (joiners) are not seen; a fence record overwritten by a
rendezvous round number reused in a fresh store hides a repeat. Training time between the last save
and a failure is not in ``E`` (it was lost with the process), which makes ``M`` slightly short (the
safe side). It is a rate per rank-second, so it assumes failures scale with the world size.

The counters and averages live in :class:`IntervalStats`, which the worker runtime carries in the
trainer state of every checkpoint, so they survive process restarts. Everything here is pure: the
clock is passed in, nothing is logged (the caller logs the :class:`IntervalChange` records).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any


class IntervalMode(str, Enum):
    """How periodic checkpoints are scheduled."""

    OFF = "off"
    FIXED = "fixed"
    """Every ``steps`` steps and/or every ``seconds`` of training (whichever comes first)."""
    AUTO = "auto"


UNPLANNED_KINDS = frozenset({"periodic", "notice"})
"""Kinds of checkpoint a world takes while it goes on training: restoring one means it died unannounced."""

REEVALUATE_S = 1.0
"""Seconds between re-evaluations of the optimum when nothing but the training exposure changed."""


@dataclass(frozen=True, slots=True)
class IntervalPolicy:
    mode: IntervalMode
    steps: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        if self.mode is not IntervalMode.FIXED:
            return self.mode.value
        parts = ([f"{self.steps} steps"] if self.steps else []) + ([f"{self.seconds:g}s"] if self.seconds else [])
        return " or ".join(parts)


_UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|sec|m|min|h)$")
_STEPS = re.compile(r"^(\d+)\s*(?:steps?)?$")
INTERVAL_SYNTAX = "'auto', a number of steps (e.g. 50), a duration (e.g. 90s, 5m, 1.5h) or 'off'"


def parse_interval(text: str) -> IntervalPolicy:
    """``checkpoint.interval`` -> policy. Raises ``ValueError`` (message without the fix) on bad input."""
    t = str(text).strip().lower()
    if t == "auto":
        return IntervalPolicy(IntervalMode.AUTO)
    if t in ("off", "0", "none", "never"):
        return IntervalPolicy(IntervalMode.OFF)
    m = _STEPS.match(t)
    if m:
        return IntervalPolicy(IntervalMode.FIXED, steps=int(m.group(1)))
    m = _DURATION.match(t)
    if m:
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
        if seconds <= 0:
            return IntervalPolicy(IntervalMode.OFF)
        return IntervalPolicy(IntervalMode.FIXED, seconds=seconds)
    raise ValueError(f"cannot read {text!r} as an interval")


def policy_from_config(interval: str, interval_steps: int = 0, interval_s: float = 0.0) -> tuple[IntervalPolicy, list[str]]:
    """The effective policy and the deprecated keys that produced it (empty when none did).

    ``interval`` set wins (the caller rejects it together with the deprecated keys); unset, the
    deprecated ``interval_steps`` / ``interval_s`` (both: whichever comes first); none: ``auto``.
    """
    if str(interval).strip():
        return parse_interval(interval), []
    deprecated = [k for k, v in (("interval_steps", interval_steps), ("interval_s", interval_s)) if v]
    if deprecated:
        return IntervalPolicy(IntervalMode.FIXED, steps=int(interval_steps), seconds=float(interval_s)), deprecated
    return IntervalPolicy(IntervalMode.AUTO), []


# ---- the optimum ----------------------------------------------------------------------------------

def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): ``sqrt(2 C M)``."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * max(mtbf_s, 0.0))


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher order: ``sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C`` for ``C < 2M``, else ``M``."""
    c, m = max(cost_s, 0.0), max(mtbf_s, 0.0)
    if m <= 0:
        return 0.0
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


# ---- measured state ---------------------------------------------------------------------------------

@dataclass(slots=True)
class IntervalStats:
    """What the controller measured; carried across process restarts in the trainer state."""

    unannounced_failures: int = 0
    """Restores from a ``periodic`` checkpoint seen by the job."""
    announced_restores: int = 0
    """Restores from an ``emergency``/``resize``/``final`` checkpoint (not failures the interval covers)."""
    exposure_rank_s: float = 0.0
    """Training time x ranks observed, in rank-seconds."""
    blocked_s: float | None = None
    """Average time a save blocks training (staging), seconds."""
    persist_s: float | None = None
    """Average time to persist and commit a staged save, seconds."""
    interference_s: float | None = None
    """Average slowdown of the steps that ran while an asynchronous save persisted, seconds per save."""
    restore_s: float | None = None
    """Average time to restore a checkpoint, seconds."""
    survived_losses: int = 0
    """Membership losses (announced or not) the job's state survived: the world re-formed in place from
    its survivors' memory or from the checkpoint taken at the stop, or restored from a snapshot in memory."""
    survived_failures: int = 0
    """Of :attr:`survived_losses`, the unannounced ones (failures that rolled back nothing durable)."""
    lost_worlds: int = 0
    """Losses the state did not survive: a world restarted from storage after an unannounced failure
    (each counted in :attr:`unannounced_failures` too) or after every node of it drained."""
    saves: int = 0
    interval_s: float | None = None
    """The auto interval in effect when the stats were saved."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> IntervalStats:
        """Tolerant: unknown keys are ignored, missing ones take their defaults."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in names})


@dataclass(frozen=True, slots=True)
class AutoSettings:
    """The auto controller's knobs (``checkpoint.interval_*`` config keys)."""

    min_s: float = 5.0
    max_s: float = 3600.0
    prior_mtbf_s: float = 3600.0
    hysteresis: float = 0.2
    alpha: float = 0.3
    """Weight of a new measurement in the exponential averages."""


@dataclass(frozen=True, slots=True)
class IntervalChange:
    """One change of the auto interval, with the inputs behind it (logged as ``checkpoint_interval_changed``)."""

    old_s: float | None
    new_s: float
    optimum_s: float
    reason: str
    bound: str | None
    inputs: dict[str, Any] = field(default_factory=dict)


MEMORY_INTERVAL_MAX = 1 << 20
"""The longest snapshot interval :func:`memory_interval` proposes (steps)."""


def memory_interval(floor: int, max_overhead: float, snapshot_s: float | None, step_s: float | None,
                    current: int, hysteresis: float = 0.8) -> int:
    """The tier-0 snapshot interval (steps) one rank proposes: the smallest ``floor * 2**k`` whose
    snapshots cost at most ``max_overhead`` of the step time (``snapshot_s / (n * step_s)``). Doublings
    nest (every multiple of ``2n`` is one of ``n``), so a change of interval never leaves a gap longer
    than the longer of the two, and a drifting cost changes it rarely. To shorten the ``current``
    interval the cost must fit ``hysteresis`` times the share. ``floor`` when ``max_overhead`` is 0 or
    nothing is measured yet."""
    if max_overhead <= 0 or not snapshot_s or not step_s or snapshot_s <= 0 or step_s <= 0 or floor <= 0:
        return floor

    def fit(share: float) -> int:
        n = floor
        while snapshot_s > share * n * step_s and n < MEMORY_INTERVAL_MAX:
            n *= 2
        return min(n, MEMORY_INTERVAL_MAX)

    need = fit(max_overhead)
    if need >= current:
        return need
    return max(need, min(current, fit(hysteresis * max_overhead)))


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class IntervalController:
    """Decides, at each step boundary, whether a periodic checkpoint is due. See the module docstring.

    ``clock`` returns monotonic seconds; every method also takes ``now`` for tests. Not thread-safe:
    the training thread owns it (feed asynchronous results from there).
    """

    def __init__(self, policy: IntervalPolicy, settings: AutoSettings | None = None, *, world_size: int = 1,
                 stats: IntervalStats | None = None, sync_saves: bool = False, survivable: bool = False,
                 clock: Callable[[], float] = time.monotonic, now: float | None = None) -> None:
        self.policy = policy
        self.settings = settings or AutoSettings()
        self.stats = stats if stats is not None else IntervalStats()
        self.sync_saves = sync_saves
        self.survivable = survivable
        """The state outlives the loss of one node (see the module docstring); set per world."""
        self._clock = clock
        self._world = max(1, int(world_size))
        t = clock() if now is None else now
        self._last_save = t
        self._last_tick = t
        self._clean_step_s: float | None = None
        self._excess_s = 0.0
        self._pending_async = False
        self._interval_s: float | None = None
        self._at_change: dict[str, Any] = {}
        self._dirty = True  # an input other than the exposure changed since the last evaluation
        self._evaluated = -math.inf
        if policy.mode is IntervalMode.FIXED and policy.seconds:
            self._interval_s = policy.seconds

    # ---- inputs -----------------------------------------------------------------------------------
    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def load_stats(self, stats: IntervalStats) -> None:
        """Continue from ``stats`` restored from a checkpoint (the auto interval it had included)."""
        self.stats = stats
        if self.policy.mode is IntervalMode.AUTO and stats.interval_s:
            self._interval_s = float(stats.interval_s)
            self._at_change = self._inputs_key()
        self._dirty = True

    def begin(self, now: float | None = None) -> None:
        """Training starts (or resumes from a restore) now: the interval and exposure clocks start here."""
        t = self._now(now)
        self._last_save = t
        self._last_tick = t

    def tick(self, now: float | None = None) -> None:
        """Account training time since the last tick as exposure (rank-seconds)."""
        t = self._now(now)
        if t > self._last_tick:
            self.stats.exposure_rank_s += (t - self._last_tick) * self._world
        self._last_tick = t

    def set_world_size(self, world_size: int, now: float | None = None, *, survivable: bool | None = None) -> None:
        self.tick(now)
        self._world = max(1, int(world_size))
        if survivable is not None:
            self.survivable = survivable
        self._dirty = True

    def observe_step(self, seconds: float, persisting: bool) -> None:
        """A step took ``seconds``; ``persisting``: an asynchronous save persisted meanwhile."""
        if seconds < 0:
            return
        if persisting and self._pending_async and self._clean_step_s is not None:
            self._excess_s += seconds - self._clean_step_s
        elif not persisting:
            self._clean_step_s = _ewma(self._clean_step_s, seconds, 0.1)

    def observe_save(self, blocked_s: float, persist_s: float | None = None) -> None:
        """A save blocked training ``blocked_s``; ``persist_s`` when it also persisted synchronously.
        An asynchronous save reports its persist time later through :meth:`observe_persist`."""
        a = self.settings.alpha
        self._dirty = True
        self.stats.blocked_s = _ewma(self.stats.blocked_s, max(0.0, blocked_s), a)
        self.stats.saves += 1
        if persist_s is not None:
            self.stats.persist_s = _ewma(self.stats.persist_s, max(0.0, persist_s), a)
        else:
            self._pending_async = True
            self._excess_s = 0.0

    def observe_persist(self, persist_s: float) -> None:
        """The asynchronous save started by the last :meth:`observe_save` committed after ``persist_s``."""
        a = self.settings.alpha
        self._dirty = True
        self.stats.persist_s = _ewma(self.stats.persist_s, max(0.0, persist_s), a)
        if self._pending_async:
            self.stats.interference_s = _ewma(self.stats.interference_s, max(0.0, self._excess_s), a)
        self._pending_async = False
        self._excess_s = 0.0

    def observe_restore(self, seconds: float | None, kind: str, repeats: int = 0, *, in_place: bool = False,
                        from_memory: bool = False) -> int:
        """This world restored a checkpoint of ``kind`` in ``seconds`` (None: there was none to restore);
        ``repeats`` earlier worlds had started from the same checkpoint (or from none). Returns the
        rollbacks this proves: the world that wrote a ``periodic`` checkpoint did not stop as
        planned (a drain or resize leaves an ``emergency`` / ``resize`` one), and every earlier world
        that started from the same point died without leaving anything newer.

        ``from_memory``: the state came from a snapshot in memory (tier 0 or a buddy's replica): the
        failure behind it is survived, not a rollback. ``in_place``: the world re-formed in place and
        reloaded the checkpoint taken at its stop (sharded state): an announced loss, survived."""
        self._dirty = True
        s = self.stats
        if seconds is not None:
            s.restore_s = _ewma(s.restore_s, max(0.0, seconds), self.settings.alpha)
        unplanned = str(kind) in UNPLANNED_KINDS
        failures = max(0, int(repeats)) + (1 if unplanned and not from_memory else 0)
        s.unannounced_failures += failures
        if from_memory:
            s.survived_losses += 1
            s.survived_failures += 1
        elif in_place and str(kind) == "emergency":  # a drain's checkpoint (a join's is a resize one)
            s.survived_losses += 1
        drained_out = str(kind) == "emergency" and not (in_place or from_memory)  # every node of the world drained
        s.lost_worlds += failures + (1 if drained_out else 0)
        if not failures and not (from_memory and unplanned):
            s.announced_restores += 1
        return failures

    def observe_survived_loss(self, unannounced: bool) -> None:
        """The world re-formed in place through the loss of a member (announced by a notice, or not),
        its state in the survivors' memory: nothing was rolled back."""
        self._dirty = True
        self.stats.survived_losses += 1
        if unannounced:
            self.stats.survived_failures += 1

    # ---- estimates --------------------------------------------------------------------------------
    @property
    def save_cost_s(self) -> float | None:
        """``C``: blocked + (persist when saves are synchronous, else the measured interference)."""
        s = self.stats
        if s.blocked_s is None:
            return None
        extra = (s.persist_s or 0.0) if self.sync_saves else (s.interference_s or 0.0)
        return s.blocked_s + extra

    @property
    def failure_mtbf_s(self) -> float:
        """``M_f``: mean time between unannounced failures of the job at its current world size (those a
        survivable world survived included)."""
        s = self.stats
        seen = s.unannounced_failures + (s.survived_failures if self.survivable else 0)
        return (s.exposure_rank_s / self._world + self.settings.prior_mtbf_s) / (seen + 1)

    @property
    def rollback_probability(self) -> float:
        """``p``: the probability that a loss takes the state with it (1 when the world cannot survive one)."""
        if not self.survivable:
            return 1.0
        s = self.stats
        return (s.lost_worlds + 1) / (s.lost_worlds + s.survived_losses + 1)

    @property
    def mtbf_s(self) -> float:
        """``M``: mean time between failures that roll the job back to its newest durable checkpoint."""
        return self.failure_mtbf_s / self.rollback_probability

    def bounds(self) -> tuple[float, float]:
        lo = max(self.settings.min_s, self.stats.persist_s or 0.0)
        return lo, max(lo, self.settings.max_s)

    def optimum(self) -> tuple[float, float, str | None]:
        """``(optimum, bounded, bound)`` for the current inputs; ``bound`` is ``min``/``max``/None."""
        lo, hi = self.bounds()
        cost = self.save_cost_s
        if cost is None:
            return lo, lo, "min"
        opt = daly_interval(cost, self.mtbf_s)
        if opt < lo:
            return opt, lo, "min"
        if opt > hi:
            return opt, hi, "max"
        return opt, opt, None

    def inputs(self) -> dict[str, Any]:
        s = self.stats
        cost = self.save_cost_s
        return {"save_cost_s": None if cost is None else round(cost, 6), "blocked_s": _r(s.blocked_s),
                "persist_s": _r(s.persist_s), "interference_s": _r(s.interference_s), "restore_s": _r(s.restore_s),
                "mtbf_s": round(self.mtbf_s, 3), "failure_mtbf_s": round(self.failure_mtbf_s, 3),
                "rollback_probability": round(self.rollback_probability, 6),
                "unannounced_failures": s.unannounced_failures, "survived_losses": s.survived_losses,
                "lost_worlds": s.lost_worlds, "exposure_rank_s": round(s.exposure_rank_s, 3), "world_size": self._world}

    # ---- decisions --------------------------------------------------------------------------------
    @property
    def interval_s(self) -> float | None:
        """Seconds of training between periodic saves (auto: in effect now; fixed: ``seconds``)."""
        return self._interval_s

    def update(self, now: float | None = None) -> IntervalChange | None:
        """Account exposure; auto: recompute the optimum and adopt it past the hysteresis band or a bound.
        Called every step: when only the exposure grew (the MTBF estimate drifts slowly), the optimum is
        recomputed at most every :data:`REEVALUATE_S` seconds; any other input change is taken at once."""
        t = self._now(now)
        self.tick(t)
        if self.policy.mode is not IntervalMode.AUTO:
            return None
        if not self._dirty and t - self._evaluated < REEVALUATE_S:
            return None
        self._dirty, self._evaluated = False, t
        opt, new, bound = self.optimum()
        old = self._interval_s
        if old is not None:
            lo, hi = self.bounds()
            if new == old or (abs(new - old) <= self.settings.hysteresis * old and lo <= old <= hi):
                return None
        reason = self._reason(old)
        self._interval_s = new
        self.stats.interval_s = new
        self._at_change = self._inputs_key()
        return IntervalChange(old_s=old, new_s=new, optimum_s=opt, reason=reason, bound=bound, inputs=self.inputs())

    def _inputs_key(self) -> dict[str, Any]:
        return {"failures": self.stats.unannounced_failures, "world": self._world, "cost": self.save_cost_s,
                "mtbf": self.mtbf_s, "survivable": self.survivable}

    def _reason(self, old: float | None) -> str:
        if self.save_cost_s is None:
            return "bootstrap"
        was = self._at_change
        if old is None or was.get("cost") is None:
            return "initial" if old is None else "save_cost_measured"
        if self.stats.unannounced_failures != was["failures"]:
            return "unannounced_failure"
        if self._world != was["world"] or self.survivable != was.get("survivable", self.survivable):
            return "world_size"
        dc = abs(math.log(max(self.save_cost_s, 1e-9) / max(was["cost"], 1e-9)))
        dm = abs(math.log(self.mtbf_s / was["mtbf"]))
        return "save_cost" if dc >= dm else "failure_rate"

    def due(self, step: int, now: float | None = None) -> bool:
        """Whether a periodic checkpoint is due after ``step`` (auto: call :meth:`update` first)."""
        p = self.policy
        if p.mode is IntervalMode.OFF:
            return False
        t = self._now(now)
        if p.mode is IntervalMode.FIXED:
            return bool((p.steps and step % p.steps == 0) or (p.seconds and t - self._last_save >= p.seconds))
        return self._interval_s is not None and t - self._last_save >= self._interval_s

    def saved(self, now: float | None = None) -> None:
        """A checkpoint was just taken: the interval restarts now."""
        self._last_save = self._now(now)


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


__all__ = ["AutoSettings", "IntervalChange", "IntervalController", "IntervalMode", "IntervalPolicy", "IntervalStats",
           "INTERVAL_SYNTAX", "daly_interval", "parse_interval", "policy_from_config",
           "young_interval"]
