"""This rank's local compute time per step, the straggler detector's input (issue 38).

**What is measured.** From the step's start (the end of the previous step boundary, so the script's data
loading counts: a slow disk under a data loader makes a straggler too) to its arrival at this step's
boundary (``rt.end_step``), minus the time this rank spent blocked on its peers inside the
step: the synchronising backward (the last micro-batch's ``rt.backward``, where DDP waits for every
rank's gradients) and ``rt.all_reduce``. A rank that computes slowly arrives late and waits little; its
healthy peers wait for it there, and that wait is what is taken out. The synchronising backward is
excluded whole (its own compute cannot be told apart from its wait without hooks in each strategy's
communication), so the value is the forward passes, the accumulating backwards and the optimizer step:
the same share of the step on every rank, which is all a *relative* score needs. Waiting for the step
agreement is never in it (a step starts after its boundary). Strategies that also wait in the forward
(FSDP's all-gathers) show some of the straggler's slowness on its peers as well: the score is then
smaller than the true ratio, never larger (the detector errs towards keeping a node).

**Where it goes.** The values (with each step's whole time and the checkpoints committed meanwhile, for
the drain lead: :mod:`trainguard.agent.lead`) are batched and sent to the agent as one
:class:`~trainguard.contract.protocol.Pace` report per step agreement (at most every
:data:`REPORT_EVERY_S`), not per step; the agents share a window of them through the rendezvous store
(:mod:`trainguard.agent.straggler` says why the store and not the flag all-reduce).

Not thread-safe: the training thread owns it. ``clock`` is injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from trainguard.contract import protocol as proto

REPORT_EVERY_S = 1.0
"""At most one report per this many seconds (one per step agreement otherwise)."""


class PaceMeter:
    """Accumulates the time blocked on peers within a step and the local compute of finished steps."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._blocked_s = 0.0
        self._pending: list[float] = []
        self._pending_step: list[float] = []
        self._checkpoints: list[float] = []  # appended by the persist thread (list.append), taken here
        self._last_step = 0
        self._sent_at = -float("inf")

    def blocked(self, seconds: float) -> None:
        """Time this rank waited on its peers within the current step (excluded from its compute)."""
        self._blocked_s += max(0.0, seconds)

    def step_done(self, step: int, step_s: float) -> float:
        """The step ``step`` took ``step_s`` from its start to the boundary: record and return its local
        compute time (that minus the blocked time), and start the next step's count."""
        compute = max(0.0, step_s - self._blocked_s)
        self._blocked_s = 0.0
        self._pending.append(compute)
        self._pending_step.append(max(0.0, step_s))
        del self._pending[:-proto.Pace.MAX_PACE]  # an agent that never reads: keep the newest
        del self._pending_step[:-proto.Pace.MAX_PACE]
        self._last_step = step
        return compute

    def checkpoint_done(self, seconds: float) -> None:
        """A checkpoint of this rank was committed after ``seconds`` of stage + persist (any thread: the
        persist thread reports a background save here)."""
        self._checkpoints.append(max(0.0, seconds))

    def discard_step(self) -> None:
        """The step in progress was rolled back (a peer vanished): its blocked time counts for nothing."""
        self._blocked_s = 0.0

    def report(self, rank: int, local_rank: int) -> proto.Pace | None:
        """The report to send now (at a step agreement), or None: nothing new, or the last one went
        less than :data:`REPORT_EVERY_S` ago."""
        now = self._clock()
        if not self._pending or now - self._sent_at < REPORT_EVERY_S:
            return None
        self._sent_at = now
        values, self._pending = tuple(round(v, 6) for v in self._pending), []
        steps, self._pending_step = tuple(round(v, 6) for v in self._pending_step), []
        taken = len(self._checkpoints)  # the persist thread may append meanwhile: those go with the next report
        checkpoints = tuple(round(v, 6) for v in self._checkpoints[:taken][-proto.Pace.MAX_PACE:])
        del self._checkpoints[:taken]
        return proto.Pace(rank=rank, local_rank=local_rank, step=self._last_step, compute_s=values, step_s=steps,
                          checkpoint_s=checkpoints)
