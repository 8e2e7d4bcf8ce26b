"""The step-boundary agreement as values and a pure decision: what every rank says at a boundary
(:class:`Flags`, packed into the integers the ranks all-reduce with MAX), and what the world then
does (:func:`decide_boundary` -> :class:`BoundaryDecision`). No process group, no clock, no I/O:
the runtime issues and awaits the exchange and carries the decision out; this module only says what
the integers mean and what follows from them, so both are tested with tables
(``tests/runtime/test_boundary.py``).

A new flag is one field here (with its encoding in :meth:`Flags.pack` / :meth:`Flags.unpack`) and
its consequence in :func:`decide_boundary`; positions in the tensor are never spelled out elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import ClassVar

from trainguard.contract.protocol import StopReason
from trainguard.strategies.base import ReformState

MAX_STRIDE = 64
"""The most steps between two step agreements (``workers.step_agreement_period_s``)."""

_NO_DEADLINE = -(2**62)


class SaveAsk(IntEnum):
    """The checkpoint a rank asks for at a boundary. The integer is what ranks all-reduce (MAX): an
    out-of-cycle save asked on any node wins over a periodic one."""

    NONE = 0
    PERIODIC = 1
    """The periodic schedule says a save is due (global rank 0 decides; or a deferred one is still owed)."""
    NOTICE = 2
    """Some node's agent asked for one out of cycle (an early-warning notice)."""


@dataclass(frozen=True, slots=True)
class Flags:
    """One rank's side of the step-boundary agreement, or, unpacked from the MAX all-reduce, the world's.

    Each field is encoded so that MAX over the ranks yields what the world agrees: the most urgent
    stop, the strongest save, the earliest deadline (``-milliseconds``), any rank busy or configured
    ``overlapped`` / ``blocking``, the smallest stride (negated) and the largest snapshot interval."""

    stop: StopReason = StopReason.NONE
    """This rank's stop request (its agent's order, or SIGTERM under plain torchrun)."""
    save: SaveAsk = SaveAsk.NONE
    deadline: float | None = None
    """This node's drain deadline (epoch seconds), when it drains."""
    busy: bool = False
    """This rank's previous save still persists (when it counts: see the runtime's ``_local_flags``)."""
    overlapped: bool = False
    """This rank is configured ``workers.step_agreement: overlapped``."""
    blocking: bool = False
    """This rank is configured ``workers.step_agreement: blocking``."""
    stride: int = 1
    """Steps until the next agreement this rank proposes (the world takes the smallest)."""
    memory_every: int = 0
    """Tier-0 snapshot interval this rank proposes, in steps (the world takes the largest)."""

    WIDTH: ClassVar[int] = 8
    """How many integers :meth:`pack` gives."""

    def pack(self) -> tuple[int, ...]:
        """The integers the ranks all-reduce with MAX (:data:`WIDTH` of them, in this order)."""
        deadline = _NO_DEADLINE if self.deadline is None else -int(self.deadline * 1000)
        return (int(self.stop), int(self.save), deadline, int(self.busy), int(self.overlapped), int(self.blocking),
                -self.stride, self.memory_every)

    @classmethod
    def unpack(cls, values: Sequence[int]) -> Flags:
        """The inverse of :meth:`pack` (of one rank's values, or of the world's MAX of them)."""
        stop, save, deadline, busy, overlapped, blocking, stride, every = (int(v) for v in values)
        return cls(stop=StopReason(stop), save=SaveAsk(save), deadline=None if deadline <= _NO_DEADLINE else -deadline / 1000.0,
                   busy=bool(busy), overlapped=bool(overlapped), blocking=bool(blocking), stride=-stride, memory_every=every)


class BoundaryAct(str, Enum):
    """What a rank does with the world's flags at a boundary."""

    CONTINUE = "continue"
    """Train on: the tier-0 snapshot of this step, then the agreed save, if any."""
    STOP = "stop"
    """Save the emergency or resize checkpoint and exit with the resize code (the world restarts)."""
    SURVIVE = "survive"
    """Stay: the durable save re-formation needs, park, and re-form in place (``workers.reform: in-process``)."""


@dataclass(frozen=True, slots=True)
class BoundaryDecision:
    act: BoundaryAct
    stop: StopReason = StopReason.NONE
    deadline: float | None = None
    """The earliest drain deadline any rank knows (epoch seconds)."""
    save: SaveAsk = SaveAsk.NONE
    """The save to take at this boundary: after the snapshot (``CONTINUE``), or before parking
    (``SURVIVE``: the periodic schedule kept where the re-formation itself saves nothing)."""
    stride: int = 1
    """Steps to the next agreement, alike on every rank."""
    memory_every: int = 1
    """Tier-0 snapshot interval, alike on every rank."""
    mixed: bool = False
    """Some rank is configured ``overlapped`` and some ``blocking``: the world agrees blocking from now on."""
    save_deferred: bool = False
    """A periodic save is owed: taken at the first boundary at which no previous save persists."""


def decide_boundary(agreed: Flags, *, mine: StopReason, reform_in_place: bool, reform_state: ReformState,
                    defer_when_busy: bool, save_deferred: bool, mixed: bool) -> BoundaryDecision:
    """Pure: what this rank does with the world's flags ``agreed`` at a step boundary.

    ``mine``: this rank's own stop request in that agreement (a node that drains leaves; its peers
    stay); ``reform_in_place``: this worker re-forms in place; ``reform_state``: how its strategy's state
    reaches a re-formed world; ``defer_when_busy``: ``checkpoint.when_busy: defer``; ``save_deferred``
    and ``mixed``: what the previous boundaries left (see :class:`BoundaryDecision`).

    * A periodic save while a previous one still persists somewhere would stall every rank on it:
      deferred to the first boundary at which none does (the same durability, no stall, and no rank
      left waiting outside a collective when a peer dies). An out-of-cycle one is never deferred.
    * Ranks configured differently would act on a stop or a save at different steps: every rank sees
      the same MAX (a world's first boundary is exchanged and waited for), so all agree blocking.
    * A stop restarts the world, unless this worker re-forms in place and its own node does not drain:
      then it survives, and a periodic save agreed at the same boundary is still taken before it parks
      unless a checkpoint is taken anyway (a drain's emergency one, or a strategy that reloads one).
    """
    save = agreed.save
    if save is SaveAsk.PERIODIC and agreed.busy and defer_when_busy:
        save_deferred, save = True, SaveAsk.NONE
    elif save is not SaveAsk.NONE:
        save_deferred = False
    common = {"stop": agreed.stop, "deadline": agreed.deadline, "stride": max(1, min(MAX_STRIDE, agreed.stride)),
              "memory_every": max(1, agreed.memory_every), "mixed": mixed or (agreed.overlapped and agreed.blocking),
              "save_deferred": save_deferred}
    if agreed.stop is StopReason.NONE:
        return BoundaryDecision(BoundaryAct.CONTINUE, save=save, **common)
    if reform_in_place and mine is not StopReason.DRAIN:
        checkpointed = agreed.stop is StopReason.DRAIN or reform_state is ReformState.CHECKPOINT
        return BoundaryDecision(BoundaryAct.SURVIVE, save=SaveAsk.NONE if checkpointed else save, **common)
    return BoundaryDecision(BoundaryAct.STOP, save=save, **common)
