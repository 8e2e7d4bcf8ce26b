"""The end of training: the ``final`` checkpoint, then closing the tiers, the agent link and the process groups
(:meth:`Finishing.finish`). A part of :class:`~trainguard.runtime.runtime.Runtime`."""

from __future__ import annotations

import torch.distributed as dist

from trainguard.contract import protocol as proto
from trainguard.runtime import device as dev


class Finishing:
    """Mixin of :class:`~trainguard.runtime.runtime.Runtime` (its state and its other methods)."""

    def finish(self, barrier: bool = True) -> None:
        """End of training: save the last step as a ``final`` checkpoint (every rank saves the same
        step; skipped when that step is already saved or was just restored), wait for it and any
        in-flight save, then close the agent link and the process group. A failed final save raises
        after logging ``checkpoint_failed`` (the agent restarts the workers from the last commit)."""
        self._tiers.settle()
        if self._tiers.replicator is not None:  # its transfer runs on a group destroyed below
            self._tiers.replicator.settle()
        if self._metrics is not None:
            self._metrics.flush()
        failed = self._agreement.complete()  # every rank issued it at the same step (a boundary or the one before)
        if failed is not None:
            self._log.warning("step_agreement_failed", step=self.step, error=str(failed)[:300],
                              effect="ignored at the end of training; the final save says whether the world is whole")
        if self._tiers.manager is not None and self.strategy is not None and self.step > 0 and self._tiers.saved_step != self.step:
            kind = proto.CheckpointKind.FINAL
            try:
                seconds, result = self._tiers.save(kind.value)
                committed = self._tiers.note_committed(self._tiers.manager.wait())
            except Exception as e:
                self._metrics.observe_checkpoint(kind.value, None, None, 0.0, 0, self.step, False)
                self._log.error("checkpoint_failed", step=self.step, kind=kind.value, error=str(e)[:500])
                raise
            self._log.info("checkpoint_committed", step=committed, kind=kind.value, seconds=round(seconds, 3))
            self._session.report(self._session.committed(self.step, self.rank, kind, seconds, result, committed))
        if self._tiers.manager is not None:
            self._tiers.manager.close()
        if self._tiers.memory is not None:
            self._tiers.memory.close()  # its commit thread; the slot files stay (the agent owns them)
        if self._progress is not None:
            # Training is over: the teardown waits on the peers (their final saves, the barrier), then the
            # beats stop and the interpreter exits (over 6 s on a loaded machine). A finished rank is never
            # named hung (the agent ended workers that had finished their training, and quarantined a node
            # for it): say so now, and once more as the beats stop.
            self._progress.set_phase(proto.Phase.FINISHED)
            self._session.report(self._progress.beat())
        if self.strategy is not None:
            self.strategy.teardown()
        if dist.is_initialized():
            if barrier:
                dist.barrier(**dev.barrier_kwargs(self.device))
            dist.destroy_process_group()
        self._release_groups()
        if self._progress is not None:
            self._progress.close(final=proto.Phase.FINISHED)
        self._session.close()

    def _release_groups(self) -> None:
        """Drop this runtime's references to its process groups once they are destroyed, so that each
        gloo group is freed here, its worker threads joined, while the interpreter is whole. Kept
        until interpreter exit (a runtime object that outlives ``finish``), those threads were torn
        down during finalization: a rank once aborted there after a clean finish ("terminate called
        without an active exception", exit -6), most likely a worker releasing a finished exchange
        whose tensor came from Python."""
        self._group, self._tiers.replicator = None, None  # the pending exchange went at the start of finish
        self._agreement.drop()
        self._trainer.bind_checkpoint_group(None)
        if self._tiers.manager is not None:
            self._tiers.manager.release_group()
        if self._tiers.memory is not None:
            self._tiers.memory.release_parity()  # its exchange group (closed above: no exchange is running)
