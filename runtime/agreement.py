"""The step agreement of one world: every rank's :class:`~trainguard.runtime.boundary.Flags`
MAX-all-reduced over the world's gloo side group at a step boundary.

**Issue and await.** By default (``workers.step_agreement: overlapped``) the exchange a boundary acts on
is issued at the end of the step before it (:meth:`StepAgreement.issue`), runs beside the boundary's own
step and is awaited and acted on at its end (:meth:`StepAgreement.await_flags`): no rank waits on the
wire per step, and a stop or an out-of-cycle save takes effect one step after the exchange that carries
it (a periodic save is asked for the step it is due at). The first boundary of a world, with nothing
issued yet, exchanges and waits; a world whose ranks are configured differently (both ``overlapped``
and ``blocking`` set there) agrees blocking (:attr:`StepAgreement.mixed`). ``blocking`` exchanges and
acts at N: one round trip per step.

**Stride.** Overlapped, the ranks agree only every ``stride`` steps: at the steps that are multiples of
it (and at a world's first boundary). ``Flags.stride`` carries each rank's proposal
(:meth:`StepAgreement.stride_proposal`: the most whole steps that fit in
``workers.step_agreement_period_s`` by its mean step time, 1 when a step is longer; a divisor of
``checkpoint.interval_steps`` when that is set, so that periodic saves keep their steps), and the world
takes the smallest. Every rank reads the same agreed stride at the same boundary, so all compute the
same next one (:meth:`StepAgreement.schedule`). Between two boundaries (:meth:`StepAgreement.between`)
a step only counts and snapshots; the last of them issues the next boundary's exchange
(:meth:`StepAgreement.issue_due`). Issued there, not at the boundary before (where it was until
2026-11-29), the flags are one step old when they are acted on, not a stride: a stop asked for
mid-stride takes effect at the next boundary, within ``step_agreement_period_s`` plus a step, not at the
one after it (twice that); the exchange still costs once per stride and still runs beside a step.

Not thread-safe: the training thread owns it. What the agreed flags mean is
:func:`~trainguard.runtime.boundary.decide_boundary` (pure); the runtime fills and acts on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainguard.contract import protocol as proto
from trainguard.runtime.boundary import MAX_STRIDE, Flags

_MAX = dist.AllreduceOptions()
_MAX.reduceOp = dist.ReduceOp.MAX

LocalFlags = Callable[[int], tuple[Flags, proto.StopReason]]
"""This rank's flags and its own stop request in them, for a boundary ``ahead`` steps on."""


class _FlagBuffers:
    """The step-boundary flags (:meth:`Flags.pack`) in two preallocated int64 tensors, filled in turn
    through a NumPy view (a new ``torch.tensor`` per boundary cost more than the rest of the fill). Two:
    the overlapped agreement has one exchange in flight while the next boundary's flags are written."""

    def __init__(self) -> None:
        self._bufs = [torch.zeros(Flags.WIDTH, dtype=torch.int64) for _ in range(2)]
        self._views = [b.numpy() for b in self._bufs]
        self._next = 0

    def fill(self, flags: Flags) -> torch.Tensor:
        i, self._next = self._next, 1 - self._next
        self._views[i][:] = flags.pack()
        return self._bufs[i]


class StepAgreement:
    """The exchange of the step-boundary flags on one world's gloo side group (None: a world of one
    rank without in-place re-formation; nothing is exchanged, every boundary acts on its own flags)."""

    def __init__(self, mode: str, period_s: float) -> None:
        if mode not in proto.STEP_AGREEMENTS:
            raise ValueError(f"step_agreement must be one of {', '.join(proto.STEP_AGREEMENTS)}, got {mode!r}")
        self.mode = mode
        """``overlapped``: the flags exchanged at step N are acted on at N+1 (no blocking all-reduce per
        step); ``blocking``: at N (``workers.step_agreement``)."""
        self.period_s = max(0.0, float(period_s))
        """``workers.step_agreement_period_s``: overlapped, the ranks agree about this often (in whole
        steps, at least every step); 0: every step."""
        self.group: Any = None
        self.pending: tuple[Any, torch.Tensor, proto.StopReason] | None = None
        """The overlapped exchange in flight on :attr:`group`: (work, flags, this rank's stop request in them)."""
        self._bufs = _FlagBuffers()
        self.stride = 1
        """Steps between two agreements, as agreed by the world at its last boundary."""
        self.next_boundary = 0
        """The step whose end is the next boundary (0: none scheduled; the next step's end is one: a world's
        first, or every step when not overlapped). Its exchange is issued at the end of the step before it."""
        self.step_mean_s: float | None = None
        """Moving average of this rank's step time: its stride proposal."""
        self.mixed = False
        """Some rank of this world is configured ``blocking`` and some ``overlapped`` (seen at the world's
        first boundary, which every rank exchanges and waits for): the world agrees blocking."""

    def bind(self, group: Any) -> None:
        """A new world's side group: its first boundary exchanges and waits."""
        self.group, self.mixed, self.next_boundary = group, False, 0

    def drop(self) -> None:
        """The world is gone: a pending exchange dies with its group, and its buffer is not reused (the
        dead work may still write it)."""
        self.group, self.pending, self._bufs, self.next_boundary = None, None, _FlagBuffers(), 0

    @property
    def overlapped(self) -> bool:
        """Whether the next boundary's exchange is issued now and acted on later."""
        return self.group is not None and self.mode == "overlapped" and not self.mixed

    def observe_step(self, step_s: float) -> None:
        """One step's time (the stride proposal's input)."""
        m = self.step_mean_s
        self.step_mean_s = step_s if m is None else 0.9 * m + 0.1 * step_s

    def between(self, step: int) -> bool:
        """Whether ``step`` ends between two agreements: nothing is acted on there (the last such step
        issues the next boundary's exchange: :meth:`issue_due`)."""
        return step < self.next_boundary

    def schedule(self, step: int) -> bool:
        """Overlapped, at the boundary ``step`` once its flags are acted on: the next boundary is the next
        multiple of the agreed stride. Whether its exchange is due now (a stride of 1: the next step is
        the boundary); otherwise :meth:`issue_due` says when."""
        self.next_boundary = step + self.stride - step % self.stride
        return self.issue_due(step)

    def issue_due(self, step: int) -> bool:
        """Whether the end of ``step`` issues the next boundary's exchange: it is the step before it."""
        return self.pending is None and step == self.next_boundary - 1

    def exchange(self, flags: torch.Tensor) -> Any:
        """Start the MAX all-reduce of the flags on the gloo side group (its work). Called on the group
        itself: ``dist.all_reduce``'s checks and logging wrapper cost more than the exchange at every step."""
        return self.group.allreduce([flags], _MAX)

    def await_flags(self, local: LocalFlags) -> tuple[Flags, proto.StopReason]:
        """The flags every rank agreed for this boundary and this rank's own stop request in them: the
        exchange issued at the end of the step before, or (blocking, a world's first boundary) one made and
        waited for now. Raises what the exchange raises (a vanished peer)."""
        pending, self.pending = self.pending, None
        if pending is None:
            flags, mine = local(0)
            buf = self._bufs.fill(flags)
            work = self.exchange(buf) if self.group is not None else None
        else:
            work, buf, mine = pending
        if work is not None:
            work.wait()
        return Flags.unpack(buf.tolist()), mine  # one conversion

    def issue(self, step: int, local: LocalFlags) -> None:
        """Overlapped: issue the exchange the next boundary (:meth:`schedule`) acts on, one step on."""
        flags, mine = local(self.next_boundary - step)
        buf = self._bufs.fill(flags)
        self.pending = (self.exchange(buf), buf, mine)

    def stride_proposal(self, interval_steps: int) -> int:
        """This rank's agreement stride: the whole steps of its mean step time that fit in
        ``step_agreement_period_s`` (1 to :data:`MAX_STRIDE`), reduced to a divisor of a fixed
        ``checkpoint.interval_steps`` (``interval_steps``; 0: none), so that the boundaries fall on the
        steps periodic saves are due at."""
        mean = self.step_mean_s
        if self.mode != "overlapped" or self.period_s <= 0 or not mean or mean <= 0:
            return 1
        n = max(1, min(MAX_STRIDE, int(self.period_s / mean)))
        if interval_steps:
            n = max(d for d in range(1, n + 1) if interval_steps % d == 0)
        return n

    def complete(self) -> BaseException | None:
        """End of training: complete the exchange every rank issued at its last boundary (what it says
        is moot now); what it raised, if it failed."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            pending[0].wait()
        except Exception as e:  # noqa: BLE001 - the caller logs it
            return e
        return None
