"""The worker's liveness for hang detection: its progress heartbeats to the agent (:mod:`~trainguard.runtime.progress`),
the phase it is in, ``rt.busy()``, and the agent's ``Abort`` (a peer is hung or frozen). A part of
:class:`~trainguard.runtime.runtime.Runtime`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from trainguard.contract import protocol as proto
from trainguard.runtime import reform as rf
from trainguard.runtime.progress import ProgressReporter, install_stack_dump
from trainguard.runtime.state import WorkerState

_PHASE_OF_STATE = {WorkerState.PARKED: proto.Phase.PARKED, WorkerState.RESUMING: proto.Phase.RESTORE,
                   WorkerState.STANDBY: proto.Phase.PARKED}
"""The progress phase of a worker state (any other: ``step``)."""


class Liveness:
    """Mixin of :class:`~trainguard.runtime.runtime.Runtime` (its state and its other methods)."""

    def _start_progress(self, interval_s: float) -> ProgressReporter | None:
        """Beat :class:`~trainguard.contract.protocol.Progress` to the agent (hang detection) and answer
        its :class:`~trainguard.contract.protocol.Abort` (see :mod:`~trainguard.runtime.progress`)."""
        link = self._session.link
        if link is None or interval_s <= 0:
            return None
        link.on_abort = self._abort_collectives
        install_stack_dump()
        reporter = ProgressReporter(self._session.report, rank=lambda: self.rank, local_rank=self.local_rank,
                                    step=lambda: self.step, interval_s=interval_s)
        reporter.set_phase(_PHASE_OF_STATE.get(self.worker_state, proto.Phase.STEP))
        reporter.start()
        return reporter

    def _abort_collectives(self, why: str) -> None:
        """The agent's :class:`~trainguard.contract.protocol.Abort` (listener thread): a peer is hung or
        frozen; the collective the training thread waits in fails now and it parks (``peer_lost``)."""
        self._log.warning("collectives_aborted", step=self.step, why=why, done=rf.abort_collectives(self.device))

    @contextlib.contextmanager
    def _phase(self, phase: proto.Phase) -> Iterator[None]:
        """``phase`` while the block runs, then the phase of the worker's state at its end (a block may
        change the state: a restore that joins a world, a save during which a peer is lost)."""
        if self._progress is None:
            yield
            return
        self._progress.set_phase(phase)
        try:
            yield
        finally:
            self._progress.set_phase(_PHASE_OF_STATE.get(self.worker_state, proto.Phase.STEP))

    def busy(self, why: str = "") -> contextlib.AbstractContextManager[None]:
        """Mark the block as legitimately long work outside the training step, e.g. an evaluation or a
        save that only rank 0 runs between two steps (its peers wait in the next collective meanwhile)::

            if rt.rank == 0:
                with rt.busy("evaluation"):
                    evaluate(model)

        Hang detection never counts a rank that is busy (and still beats) as hung. Without it, a rank
        whose main thread keeps running Python is busy too; this says so also while it waits in C code
        (a long device sync, a blocking read). ``why`` is for the logs."""
        if why and self._progress is not None:
            self._log.info("busy", step=self.step, why=why)
        return self._phase(proto.Phase.BUSY)
