"""The end of a step (:meth:`StepEnd._end_step`, what ``rt.end_step()`` does): counting the step (or rolling it
back after a lost peer), its metrics and pace, then at an agreed boundary this rank's
:class:`~trainguard.runtime.boundary.Flags` in and the pure
:func:`~trainguard.runtime.boundary.decide_boundary` carried out: the snapshot, the periodic save, a stop or
a re-formation (:mod:`~trainguard.runtime.stopping`). A part of :class:`~trainguard.runtime.runtime.Runtime`."""

from __future__ import annotations

import time

from trainguard.contract import protocol as proto
from trainguard.runtime.boundary import BoundaryAct, Flags, SaveAsk, decide_boundary
from trainguard.runtime.state import WorkerState


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


class StepEnd:
    """Mixin of :class:`~trainguard.runtime.runtime.Runtime` (its state and its other methods)."""

    def _end_step(self) -> bool:
        """See :meth:`Runtime.end_step <trainguard.runtime.runtime.Runtime.end_step>`."""
        assert self.cursor is not None, "setup() first"
        stepped, self._stepped = self._stepped, False
        if self.worker_state is WorkerState.BROKEN:
            attempted = self.step + 1
            if stepped:  # the optimizer step ran on this rank: the step happened; the new world agrees
                self.step += 1
                self._reform.park(proto.ParkReason.PEER_LOST)
                return True
            self._roll_back_step()
            self._pace.discard_step()
            self._reform.park(proto.ParkReason.PEER_LOST)
            # The survivors agree on the newest live state (sync_live_state): a peer whose all-reduce
            # completed before the failure handed the finished step over, and it is not redone.
            if self.step < attempted:
                return False
            self._log.info("step_handed_over", step=attempted, reason="a survivor finished it before the failure")
            return True
        self.step += 1
        now = time.monotonic()
        step_s = now - self._step_started  # the step itself: what end_step does next is not part of it
        if self._tiers.manager is not None and not self._tiers.staging_ready:
            # After the first step the optimizer state exists: allocate the staging buffers now, so that
            # the first save (perhaps an emergency one, against a deadline) does not pay for them.
            self._tiers.staging_ready = True
            self._tiers.manager.prepare_staging(self._state())
        # Between two agreements nothing is exchanged or acted on; the step-time histogram waits in the process.
        between = self._agreement.between(self.step)
        # One rank per data-parallel share counts its samples, so the job's sum is the global batch.
        per_rank = self.cursor.global_batch_size // self.dp_size if self._counts_samples else 0
        if self._timer.cuda:  # host time says when work was queued: the GPU's events time the steps it finished
            self._metrics.observe_step(self.step, per_rank, per_rank * self.tokens_per_sample, None, defer=True)
            for seconds in self._timer.lap():
                self._metrics.observe_step_time(seconds, defer=True)
        else:
            self._metrics.observe_step(self.step, per_rank, per_rank * self.tokens_per_sample, step_s, defer=True)
        if not between:
            self._metrics.flush()
        self._metrics.sample_gpu_peak(now)
        self._agreement.observe_step(step_s)
        self._pace.step_done(self.step, step_s)
        if self._tiers.interval is not None and self._tiers.manager is not None:
            self._tiers.interval.observe_step(step_s, persisting=self._tiers.manager.in_flight is not None)
        if between:
            self._tiers.snapshot()
            if self._agreement.issue_due(self.step):  # the next step is the boundary: its exchange runs beside it
                self._agreement.issue(self.step, lambda ahead: self._local_flags(time.monotonic(), ahead))
            self._step_started = time.monotonic()
            return True
        # Overlapped: the exchange issued at the end of the previous step has run beside this one; read it
        # and act on it here, then schedule the next boundary (its exchange is issued at the end of the
        # step before it). Blocking, and the first boundary of a world (nothing issued yet): exchange now
        # and wait.
        try:
            with self._phase(proto.Phase.AGREEMENT):
                agreed, mine = self._agreement.await_flags(lambda ahead: self._local_flags(now, ahead))
        except Exception as e:
            if not self._peer_failed(e):
                raise
            self._reform.park(proto.ParkReason.PEER_LOST)  # the step itself completed on every survivor
            return True
        if not self._act(agreed, mine):
            return True
        pace = self._pace.report(self.rank, self.local_rank)
        if pace is not None:
            self._session.report(pace)
        if self._agreement.overlapped and self._agreement.schedule(self.step):  # a stride of 1: issued now
            self._agreement.issue(self.step, lambda ahead: self._local_flags(time.monotonic(), ahead))
        self._step_started = time.monotonic()
        return True

    def _local_flags(self, now: float, ahead: int) -> tuple[Flags, proto.StopReason]:
        """This rank's side of the step-boundary agreement (:class:`~trainguard.runtime.boundary.Flags`)
        and its own stop request in it. ``ahead``: the agreement is
        acted on that many steps later (a periodic save is asked for the step it will be taken at)."""
        due = (self._tiers.interval_step(now, ahead) if self._tiers.interval is not None and self._tiers.manager is not None
               else False)
        notice = self._session.take_checkpoint() if self._tiers.manager is not None else None
        if notice is not None:
            self._log.info("checkpoint_requested", step=self.step + ahead, reason=notice)
        due = due or self._tiers.save_deferred
        mine = self._session.request()
        # Overlapped, the flags are issued the step before the boundary that acts on them (``ahead`` 1): a
        # save still persisting then is busy. Acted on ``ahead`` > 1 steps later, a save started at this
        # very boundary would have those steps to persist, and counting it would defer every other save
        # of an interval as short as the stride.
        inflight = self._tiers.manager.in_flight if self._tiers.manager is not None else None
        overlapped = self.step_agreement == "overlapped"
        every = self._tiers.interval.policy.steps if self._tiers.interval is not None and self._tiers.manager is not None else 0
        flags = Flags(stop=mine, save=SaveAsk.NOTICE if notice is not None else SaveAsk(int(bool(due))),
                      deadline=self._session.deadline(), busy=inflight is not None and (ahead <= 1 or inflight < self.step),
                      overlapped=overlapped, blocking=not overlapped, stride=self._agreement.stride_proposal(every),
                      memory_every=self._tiers.memory_proposal())
        return flags, mine

    def _act(self, agreed: Flags, mine: proto.StopReason) -> bool:
        """Carry out what every rank agreed (the MAX of the flags) at this boundary, as
        :func:`~trainguard.runtime.boundary.decide_boundary` decides: stop or re-form, then the snapshot
        and the save. ``mine``: this rank's own stop request in that agreement. False when this worker
        parked (and re-formed) meanwhile: the step is over for the caller."""
        assert self.strategy is not None
        d = decide_boundary(agreed, mine=mine, reform_in_place=self.reform_enabled, reform_state=self.strategy.reform_state,
                            defer_when_busy=self.checkpoint_config.when_busy == "defer",
                            save_deferred=self._tiers.save_deferred, mixed=self._agreement.mixed)
        self._agreement.stride = d.stride
        if agreed.memory_every != self._tiers.memory_every and self._tiers.memory is not None:
            self._log.info("memory_interval_changed", step=self.step, interval_steps=agreed.memory_every,
                           before=self._tiers.memory_every, snapshot_ms=_ms(self._tiers.snapshot_mean_s),
                           step_ms=_ms(self._agreement.step_mean_s),
                           max_overhead=self.checkpoint_config.memory_max_overhead)
        self._tiers.memory_every = d.memory_every
        if d.mixed and not self._agreement.mixed:
            self._agreement.mixed = True
            self._log.warning("step_agreement_mixed", step=self.step, configured=self.step_agreement,
                              effect="this world agrees blocking; set workers.step_agreement alike on every node")
        if d.save_deferred and not self._tiers.save_deferred:
            self._log.info("checkpoint_deferred", step=self.step, reason="the previous save is still persisting")
        self._tiers.save_deferred = d.save_deferred
        if d.act is BoundaryAct.SURVIVE:
            # The re-formation itself saves nothing where the state is handed over in memory: the periodic
            # save agreed here is taken first, so that the step the new world continues from is durable.
            if d.save and not self._periodic_save(d.save):
                return False  # a peer vanished during it: re-formed already
            self._survive(d.stop, d.deadline)  # this node stays: park and re-form in place
            return False
        if d.act is BoundaryAct.STOP:
            self._stop(d.stop, d.deadline)  # exits with the resize code
        self._tiers.snapshot()
        if d.save:
            return self._periodic_save(d.save)
        return True

    def _periodic_save(self, save: SaveAsk) -> bool:
        """The periodic or out-of-cycle (notice) checkpoint agreed at this step.
        False when a peer vanished during it (this worker parked and re-formed meanwhile)."""
        if self._tiers.interval is not None:
            self._tiers.interval.saved()
        try:
            with self._phase(proto.Phase.SAVE):
                self._tiers.save(proto.CheckpointKind.NOTICE.value if save is SaveAsk.NOTICE else proto.CheckpointKind.PERIODIC.value)
        except Exception as e:  # staging gathers over the ranks: a peer may vanish right here
            if not self._peer_failed(e):
                raise
            self._reform.park(proto.ParkReason.PEER_LOST)
            return False
        return True

    def _roll_back_step(self) -> None:
        assert self.cursor is not None and self._optimizer is not None
        if self._cursor_at_step_start is not None:
            self.cursor.load_state_dict(self._cursor_at_step_start)
        self._optimizer.zero_grad(set_to_none=True)
        self._log.warning("step_rolled_back", step=self.step + 1, reason="peer_lost")
