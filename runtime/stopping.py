"""A stop at the agreed step: the checkpoint a drain or resize needs (before its deadline, or abandoned
past it), the :class:`~trainguard.contract.protocol.Committed` report, then parking for the next world
(:meth:`Stopping._survive`) or the one exit with the resize code (:meth:`Stopping._stop`,
:meth:`Stopping._exit`). A part of :class:`~trainguard.runtime.runtime.Runtime`."""

from __future__ import annotations

import time

from trainguard.contract import protocol as proto
from trainguard.runtime.reformation import PARITY_ABANDON_S
from trainguard.runtime.tiers import SaveAbandoned
from trainguard.strategies.base import ReformState


class Stopping:
    """Mixin of :class:`~trainguard.runtime.runtime.Runtime` (its state and its other methods)."""

    def _survive(self, why: proto.StopReason, deadline: float | None = None) -> None:
        """A peer drains or a node joins: commit what durability needs, then park for the new world.
        A save still running at the drain ``deadline`` is abandoned (see :meth:`CheckpointTiers.save_by`): the
        survivors re-form in place as after an unannounced loss (:meth:`_abandoned_in_place`), keeping what
        they hold in memory; a worker with no agent to re-form with exits with the resize code and the world
        restarts from the last commit."""
        kind = why.checkpoint_kind.value
        assert self.strategy is not None
        need_checkpoint = why is proto.StopReason.DRAIN or self.strategy.reform_state is ReformState.CHECKPOINT
        if self._tiers.manager is not None and need_checkpoint:
            try:
                with self._phase(proto.Phase.SAVE):
                    seconds, result, committed = self._tiers.save_by(kind, deadline)
            except SaveAbandoned as e:
                if not self._session.linked:  # no agent to hand it the next world: restart from the last commit
                    self._abandon(why, e)
                self._abandoned_in_place(why, e)
                return
            self._log.info("checkpoint_committed", step=committed, kind=kind, seconds=round(seconds, 3),
                           before_deadline=deadline is None or time.time() <= deadline)
            self._session.report(self._session.committed(self.step, self.rank, why.checkpoint_kind, seconds, result, committed))
        self._reform.park(proto.ParkReason.DRAIN if why is proto.StopReason.DRAIN else proto.ParkReason.RESIZE)

    def _abandoned(self, why: proto.StopReason) -> int | None:
        """Count the abandoned save as a failed checkpoint; the last committed step (it stands)."""
        if self._metrics is not None:
            self._metrics.observe_checkpoint(why.checkpoint_kind.value, None, None, 0.0, 0, self.step, False)
        return self._tiers.committed

    def _abandoned_in_place(self, why: proto.StopReason, e: SaveAbandoned) -> None:
        """A survivor's save was cut off at the drain deadline (the leaving node vanished mid-save, or
        storage was too slow for the notice): the world this step ran in is treated as one that lost a
        peer. Its live state of this step is whole on every survivor (the step's collectives finished
        before the stop was agreed), so the survivors re-form in place from it (replicated state), or
        from the nearest tier that covers the lost member's shards (tier 1, else storage): nothing is
        rolled back that memory still holds, and no process restarts. The last committed step stands on
        storage; the abandoned save never commits (its world's connections end with the park)."""
        last = self._abandoned(why)
        self._log.warning("checkpoint_abandoned", step=self.step, kind=why.checkpoint_kind.value, reason=str(e),
                          last_committed=last, in_place=True,
                          effect="re-forming in place without the leaving node from the live state of this step "
                                 "(the nearest tier where memory does not cover its shards)")
        self._reform.park(proto.ParkReason.PEER_LOST)

    def _abandon(self, why: proto.StopReason, e: SaveAbandoned) -> None:
        """The deadline passed mid-save: the last committed checkpoint stands. Say how much work that
        loses, tell the agent, and exit with the resize code (no cleanup: a thread may be stuck in a
        collective with a vanished peer, and closing the manager would wait for it)."""
        last = self._abandoned(why)
        self._log.error("checkpoint_abandoned", step=self.step, kind=why.checkpoint_kind.value, reason=str(e),
                        last_committed=last, lost_steps=self.step - (last or 0),
                        effect="exiting with the resize code; the job resumes from the last committed step")
        self._session.report(proto.Committed(step=self.step, kind=why.checkpoint_kind, rank=self.rank, saved=False,
                                              last_committed=last, error=str(e)[:500]))
        self._exit(proto.EXIT_RESIZE)

    def _stop(self, why: proto.StopReason, deadline: float | None = None) -> None:
        kind = why.checkpoint_kind.value
        self._log.warning("worker_stopping", step=self.step, kind=kind,
                          deadline_in_s=round(deadline - time.time(), 1) if deadline else None)
        report = proto.Committed(step=self.step, kind=why.checkpoint_kind, rank=self.rank, saved=False)
        if self._tiers.manager is None:
            self._metrics.observe_checkpoint(kind, None, None, 0.0, 0, self.step, False)
            self._log.warning("checkpoint_not_saved", step=self.step, kind=kind, reason="checkpoint.url is not set",
                              effect="the next start begins from step 0")
        else:
            if why is proto.StopReason.DRAIN:
                self._faults.freeze_at("emergency_save")  # tests only (runtime/faults.py)
            try:
                with self._phase(proto.Phase.SAVE):
                    seconds, result, committed = self._tiers.save_by(kind, deadline)
                self._log.info("checkpoint_committed", step=committed, kind=kind, seconds=round(seconds, 3),
                               before_deadline=deadline is None or time.time() <= deadline)
                report = self._session.committed(self.step, self.rank, why.checkpoint_kind, seconds, result, committed)
            except SaveAbandoned as e:
                self._abandon(why, e)
            except Exception as e:  # the last committed checkpoint stands; say how much work that loses
                last = self._tiers.committed  # local knowledge: asking rank 0 is a collective, and a peer may be gone
                self._metrics.observe_checkpoint(kind, None, None, self._tiers.manager.last_blocked_s, 0, self.step, False)
                self._log.error("checkpoint_failed", step=self.step, kind=kind, error=str(e)[:500], last_committed=last,
                                lost_steps=self.step - (last or 0))
                report = proto.Committed(step=self.step, kind=why.checkpoint_kind, rank=self.rank, saved=False,
                                         last_committed=last, error=f"{type(e).__name__}: {e}"[:500])
        self._session.report(report)
        if self._tiers.manager is not None:
            self._tiers.manager.close()
        self._exit(proto.EXIT_RESIZE)

    def _exit(self, code: int) -> None:
        """The last local work, then :meth:`AgentSession.exit` (the process ends with ``code``)."""
        if self._tiers.memory is not None and self._tiers.memory.parity:
            self._tiers.memory.abandon(PARITY_ABANDON_S)  # a snapshot past its parity agreement finishes its local write
        if self._metrics is not None:
            self._metrics.flush()
        self._session.exit(code)
