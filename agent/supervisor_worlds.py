"""How the supervisor changes its node's world: re-forming it in place around parked workers (the plan
the round heads for), restarting the workers after a failure (its backoff, the short stop of workers
that may be stuck) and, for a failure in an in-place world of several nodes, leaving the round at once to
rejoin warm (:attr:`~trainguard.agent.decisions.Decision.rejoin`). A part of
:class:`~trainguard.agent.supervisor.Supervisor`."""

from __future__ import annotations

import time

from torch.distributed.elastic.agent.server.api import RunResult

from trainguard.agent.decisions import Act, Asked, Decision, Observation
from trainguard.agent.elastic import Plan, RendezvousAborted, World
from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger
from trainguard.contract.protocol import AgentState, WorkerStatus

log = get_logger("trainguard.agent.supervisor")


class Worlds:
    """Mixin of :class:`~trainguard.agent.supervisor.Supervisor` (its state and its other methods)."""

    def _plan(self, reason: str) -> Plan | None:
        """The membership a re-formation heads for (None: torch's last-call rule decides). After a
        peer was lost, the members the rendezvous still sees alive (:attr:`Plan.lost`)."""
        world = self._current
        if world is None:
            return None
        lost = reason == proto.ParkReason.PEER_LOST.value
        hangs, members = self.hangs, tuple(world.members)
        return Plan(members=frozenset(world.members), leaving=self._leaving_members(world.members), lost=lost,
                    evict=(lambda: hangs.evict(members, peer_lost=True)) if lost and hangs is not None else None,
                    round=world.round)

    def _reform(self, reason: str) -> RunResult | None:
        """Every local worker is parked alive: re-form the rendezvous and hand them their new world."""
        t0 = time.monotonic()
        plan = self._plan(reason)
        self.sm.to(AgentState.RESIZING, reason=reason, in_place=True)
        self.sm.to(AgentState.RENDEZVOUS)
        try:
            world = self.adapter.reform(plan)
        except RendezvousAborted:
            return self._leave("drained_during_rendezvous")
        except Exception as e:
            # A failure, not a planned resize: it consumes a restart and backs off (a store that stays
            # unreachable must not make the agent spin). From RENDEZVOUS straight to RESTARTING.
            log.error("reform_failed", reason=reason, error=f"{type(e).__name__}: {e}"[:500],
                      effect="restarting the workers from the last commit (fallback; consumes a restart)")
            return self._restart(Decision(Act.RESTART, "reform_failed", consume_restart=True),
                                 Observation(workers=WorkerStatus.UNKNOWN))
        t_rdzv = time.monotonic()
        lost = [n for n in getattr(self.adapter, "evicted", ()) if n not in self._frozen_evicts]
        if lost:  # a reset seen here and a missed heartbeat: removed without waiting for its keep-alive
            self._observe("evicted", proto.EvictionCause.LOST.value, len(lost))
        with self._lock:
            self._parked.clear()
        self._send_worlds(world)
        self._on_world(world)
        self._asked = Asked.NOTHING
        log.info("reformed_in_place", reason=reason, rendezvous_s=round(t_rdzv - t0, 3),
                 seconds=round(time.monotonic() - t0, 3), planned=plan is not None, **world.log_fields())
        self.sm.to(AgentState.DRAINING if self._drain else AgentState.RUNNING)
        return None

    def _send_worlds(self, world: World) -> None:
        n = self.cfg.workers.nproc_per_node
        with self._lock:
            self._joining, self._joining_since = set(range(n)), time.monotonic()
        for local_rank, rank in enumerate(world.global_ranks):
            msg = proto.Reform(rank=rank, world_size=world.world_size, local_rank=local_rank, local_world_size=n,
                               master_addr=world.master_addr, master_port=world.master_port, round=world.round,
                               group_rank=world.group_rank, nodes=world.nodes)
            if not self.control.send_to(local_rank, msg):
                log.warning("reform_send_failed", local_rank=local_rank,
                            effect="that worker times out and exits; the world restarts")

    def _stop_failed_world(self, reason: str) -> None:
        """Before a failure restart: workers still running get ``workers.failure_stop_grace_s``
        between SIGTERM and SIGKILL (not torch elastic's 30 s). One blocked in a collective whose peer
        vanished never runs its handler; waiting longer only keeps the survivors waiting."""
        grace = self.cfg.workers.failure_stop_grace_s
        log.warning("workers_terminating", reason=reason, grace_s=grace, pids=sorted(self.adapter.worker_pids().values()))
        self.adapter.terminate_workers(grace)

    def _leave_to_rejoin(self, reason: str) -> bool:
        """:attr:`Decision.rejoin`: out of the round now, before the stop and the backoff, so that the
        other nodes' next round does not wait for this one. Whether it left."""
        try:
            left = self.adapter.leave(timeout_s=self.cfg.rendezvous.close_timeout_s, rejoin=True)
        except Exception as e:  # a store that does not answer: restart the usual way (the round waits)
            log.warning("rejoin_leave_failed", reason=reason, error=f"{type(e).__name__}: {e}"[:300],
                        effect="restarting the usual way: the other nodes wait for this node's workers")
            return False
        if left:
            log.info("left_to_rejoin", reason=reason, node=self.cfg.agent.node_name,
                     effect="the other nodes re-form in place without this node; it rejoins once its new workers are warm")
        return left

    def _restart(self, d: Decision, obs: Observation) -> RunResult | None:
        left = d.rejoin and self._leave_to_rejoin(d.reason)
        if self.hangs is not None:
            self.hangs.between_worlds()
        self.control.forget_workers()
        self._workers_gone()
        with self._lock:
            self._parked.clear()
            self._joining.clear()
        self._standby_start = False
        if d.short_stop:
            self._stop_failed_world(d.reason)
        if d.consume_restart:  # a planned resize is no restart (metrics: its downtime is "resize")
            self._observe("restart", d.reason)
            restarts_left = self.adapter.consume_restart()
            self._failures_in_a_row += 1
            backoff = min(self.cfg.workers.restart_backoff_max_s,
                          self.cfg.workers.restart_backoff_s * 2 ** (self._failures_in_a_row - 1))
            self.sm.to(AgentState.RESTARTING, reason=d.reason, exit_codes=list(obs.exit_codes),
                       remaining_restarts=restarts_left, backoff_s=backoff)
            self._wake.wait(backoff)
        else:
            self._failures_in_a_row = 0
            self.sm.to(AgentState.RESIZING, reason=d.reason)
        if self._drain is not None:
            return self._leave("drained_during_restart")
        self.sm.to(AgentState.RENDEZVOUS)
        try:
            if left and self._should_warm_up():
                world = self._join_running_world()
            else:
                world = self.adapter.restart()
        except RendezvousAborted:
            return self._leave("drained_during_rendezvous")
        self._on_world(world)
        self._asked = Asked.NOTHING
        self.sm.to(AgentState.DRAINING if self._drain else AgentState.RUNNING)
        return None
