"""How the supervisor enters a job: the first rendezvous (waiting first as a straggler spare when
``straggler.action`` is ``evict``), joining a running world (warming its workers up before it enters), and
exiting 0 when the job completed while it joined. A part of :class:`~trainguard.agent.supervisor.Supervisor`."""

from __future__ import annotations

import time

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from trainguard.agent import torchlogs
from trainguard.agent.decisions import Act, decide
from trainguard.agent.elastic import RendezvousAborted, RendezvousClosedError, World
from trainguard.agent.straggler import AdmissionAct
from trainguard.agent.stragglermon import wait_as_spare
from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger
from trainguard.contract.protocol import AgentState, WorkerStatus

log = get_logger("trainguard.agent.supervisor")
WORKER_API_KEY = "trainguard/worker_api"
"""Set in the round store once the round's workers use the worker API: a joining node then warms its
workers up before it enters the rendezvous."""


class Joining:
    """Mixin of :class:`~trainguard.agent.supervisor.Supervisor` (its state and its other methods)."""

    def _not_needed(self) -> RunResult:
        """The rendezvous is closed: the job completed on its other nodes while this one was joining
        (a spare, a node back from a preemption). Nothing failed: exit 0, or systemd restarts a node
        into a job that is over, again and again."""
        with torchlogs.expected_stop():
            self.adapter.stop_workers()  # a joiner's standby workers, if any
        self._workers_gone()
        self._outcome = AgentState.SUCCEEDED
        log.info("job_already_complete", node=self.cfg.agent.node_name, state=self.sm.state.value,
                 effect="this node is not needed: the rendezvous is closed (the job completed on its other nodes); "
                        "exit 0")
        self.sm.to(AgentState.SUCCEEDED, reason="not_needed")
        try:
            ranks = self.adapter.world().global_ranks
        except Exception:  # noqa: BLE001 - no world ever formed here
            ranks = ()
        return RunResult(state=WorkerState.SUCCEEDED, return_values={r: None for r in ranks})

    def _run_loop(self) -> RunResult:
        self.sm.to(AgentState.RENDEZVOUS)
        if self._drain is not None:
            return self._leave("drained_before_start")
        if self.cfg.straggler.enabled and self.cfg.straggler.action == "evict":  # an evicted node waits as a spare
            self._waiting_for = "straggler re-admission (cool-down and self-test)"
            admitted = wait_as_spare(self.adapter.endpoint_store(), self.cfg.straggler, job_id=self.cfg.agent.job_id,
                                     node=self.cfg.agent.node_name, stop=lambda: self._drain is not None,
                                     observer=self.observer)
            self._waiting_for = None
            if admitted is not AdmissionAct.ADMIT:
                self._outcome = AgentState.STOPPED
                self.sm.to(AgentState.STOPPED, reason="straggler_quarantined" if admitted is AdmissionAct.QUARANTINE else "drained")
                return RunResult(state=WorkerState.SUCCEEDED, return_values={r: None for r in self.adapter.world().global_ranks})
        try:
            if self._should_warm_up():
                world = self._join_running_world()
            else:
                self._start_waits()
                world = self.adapter.start()
        except RendezvousAborted:
            return self._leave("drained_during_rendezvous")
        self._on_world(world)
        self.sm.to(AgentState.DRAINING if self._drain else AgentState.RUNNING)
        interval = self.cfg.workers.monitor_interval_s
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            self._share_interval()
            if self.straggler is not None and self._current is not None and self._drain is None:
                w = self._current
                self.straggler.tick(self.adapter.endpoint_store(), round_=w.round, nodes=w.nodes, decides=0 in w.global_ranks)
            obs, poll = self.observe()
            handled, result = self._watch_hangs(obs)
            if handled:
                if result is not None:
                    return result
                continue
            d = decide(obs)
            if d.act is Act.WAIT:
                continue
            result = self.execute(d, obs, poll)
            if result is not None:
                return result

    def _should_warm_up(self) -> bool:
        """Whether this node joins a world of worker-API workers that runs, or re-forms (so that its
        workers warm up first). A round still forming (the running world lost a member and its
        survivors wait out the lost node's keep-alive) replaces a world whose workers used the worker
        API when the round before it says so: a node that joined that round cold would make the
        survivors wait for its workers' start, imports and model build (2 s in the spot-trace replay);
        warm, it joins the round if it is still open, else the world it formed, as a planned join."""
        if not self.reform_enabled or not hasattr(self.adapter, "peek"):
            return False
        try:
            peek = self.adapter.peek()
            if peek.this_node_participates:
                return False
            if peek.complete:
                return bool(peek.participants) and self.adapter.round_store(peek.round).check([WORKER_API_KEY])
            return peek.round > 0 and self.adapter.round_store(peek.round - 1).check([WORKER_API_KEY])
        except Exception as e:  # a static handler, an unreachable store: start the usual way
            log.info("warm_up_skipped", error=f"{type(e).__name__}: {e}"[:200])
            return False

    def _start_waits(self) -> None:
        """Run :attr:`on_start_waits` once (it must not break supervision)."""
        fn, self.on_start_waits = self.on_start_waits, None
        if fn is not None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                log.warning("start_hook_failed", error=f"{type(e).__name__}: {e}"[:300])

    def _job_closed(self) -> bool:
        """Whether the rendezvous is closed (the job is over); False when it cannot be read."""
        try:
            return bool(self.adapter.peek().closed)
        except Exception:  # noqa: BLE001 - a static handler, a store that does not answer: the join will tell
            return False

    def _join_running_world(self) -> World:
        """Start the workers in standby, wait until they are warm, then join (the running world
        pauses for this node only now)."""
        t0 = time.monotonic()
        self._standby_start = True
        self.adapter.start_standby()
        self._start_waits()  # the workers warm up: what informs may run beside them now
        deadline = t0 + self.cfg.workers.reform_timeout_s
        n = self.cfg.workers.nproc_per_node
        look_at = t0 + 1.0
        while time.monotonic() < deadline and self._drain is None:
            with self._lock:
                ready = sum(p.reason is proto.ParkReason.STANDBY for p in self._parked.values())
            if ready >= n or self.adapter.poll().status is not WorkerStatus.HEALTHY:
                break
            if time.monotonic() >= look_at:  # the job may end meanwhile: then this node is not needed
                look_at = time.monotonic() + 1.0
                if self._job_closed():
                    raise RendezvousClosedError("the rendezvous closed while this node's workers warmed up")
            self._wake.wait(0.05)
            self._wake.clear()
        warm_s = time.monotonic() - t0
        if self._drain is not None:
            raise RendezvousAborted("a drain arrived while the workers warmed up")
        if self.adapter.poll().status is not WorkerStatus.HEALTHY or ready < n:
            log.warning("warm_up_failed", ready=ready, nproc=n, seconds=round(warm_s, 3),
                        effect="starting the workers the usual way")
            self.adapter.stop_workers()
            self._standby_start = False
            with self._lock:
                self._parked.clear()
            return self.adapter.start()
        log.info("joiner_warm", seconds=round(warm_s, 3), workers=n)
        world = self.adapter.reform(None)
        with self._lock:
            self._parked.clear()
        self._standby_start = False
        self._send_worlds(world)
        log.info("joined_running_world", warm_s=round(warm_s, 3), seconds=round(time.monotonic() - t0, 3),
                 **world.log_fields())
        return world
