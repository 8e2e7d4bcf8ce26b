"""The supervisor's actions on a hang verdict (:mod:`trainguard.agent.hang` decides, :mod:`trainguard.agent.hangwatch`
watches): log it, end the hung rank's workers, restart, leave when quarantined, or ask the workers to abort
their collectives when the culprit's node is frozen. A part of :class:`~trainguard.agent.supervisor.Supervisor`."""

from __future__ import annotations

import os
import signal

import time

from torch.distributed.elastic.agent.server.api import RunResult

from trainguard.agent.decisions import Act, Asked, Decision, Observation, rejoins
from trainguard.agent.hang import HangAct, HangAction, HangVerdict
from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger
from trainguard.contract.protocol import WorkerStatus

log = get_logger("trainguard.agent.supervisor")


class HangActions:
    """Mixin of :class:`~trainguard.agent.supervisor.Supervisor` (its state and its other methods)."""

    def _watch_hangs(self, obs: Observation) -> tuple[bool, RunResult | None]:
        """Ask the hang watch; act on a verdict this node must act on. (handled, the loop's result)."""
        if (self.hangs is None or obs.workers is not WorkerStatus.HEALTHY or self._drain is not None
                or obs.parked or self._asked is not Asked.NOTHING):
            return False, None
        self.hangs.observe_procs(self.adapter.worker_pids())
        verdict, action = self.hangs.check()
        if action is None:
            return False, None
        return True, self._on_hang(verdict, action, obs)

    def _on_hang(self, v: HangVerdict, a: HangAction, obs: Observation) -> RunResult | None:
        c = v.culprit
        local = c is not None and c.node == self.adapter.node_id
        log.error("hang_detected", rank=c.rank if c else None, node=self.hangs.name_of(c.node) if c else None,  # type: ignore[union-attr]
                  node_id=c.node if c else None, step=c.step if c else None, phase=c.phase.value if c else None,
                  where=c.where if c else None, culprit_by=v.why, node_frozen=v.node_frozen,
                  stalled_s=round(v.stalled_s, 3), threshold_s=round(v.threshold_s, 3), action=a.act.value)
        self._observe("hang_detected", c.phase.value if c else "step", v.stalled_s)
        if a.act is HangAct.WATCH:
            return None
        if a.act is HangAct.ABORT:  # the culprit's node is frozen: nobody there ends its workers
            n = self.control.broadcast(proto.Abort(f"rank {c.rank} on a frozen node made no progress for "  # type: ignore[union-attr]
                                                   f"{v.stalled_s:.1f} s"))
            log.warning("collectives_abort_requested", workers=n, evict=sorted(a.evict),
                        effect="our workers park (peer lost); the re-formation evicts the frozen node")
            self._observe("evicted", proto.EvictionCause.FROZEN.value, len(a.evict - self._frozen_evicts))
            self._frozen_evicts |= a.evict
            return None
        self._end_hung_workers(c.rank if local and c is not None else None, stopped=v.why == "process_stopped")
        if a.act is HangAct.QUARANTINE:
            self._observe("evicted", proto.EvictionCause.QUARANTINE.value)
            self._observe("set_quarantined", True)
            log.error("node_quarantined", node=self.cfg.agent.node_name, hangs=len(self.hangs.hangs),  # type: ignore[union-attr]
                      window_s=self.cfg.hang.quarantine_s,
                      effect="this node leaves the job and stays out (exit 3, drained); its peers re-form without it",
                      fix="check the node (GPU, driver, disk, network) before starting its agent again")
            return self._leave("quarantined")
        self._observe("evicted", proto.EvictionCause.HANG.value)
        if obs.remaining_restarts <= 0:  # as for any other failure with no restart left
            return self.execute(Decision(Act.FAIL, "max_restarts_exhausted"), obs, self.adapter.poll())
        return self._restart(Decision(Act.RESTART, "worker_hang", consume_restart=True, rejoin=rejoins(obs)), obs)

    def _end_hung_workers(self, rank: int | None, *, stopped: bool = False) -> None:
        """Dump the hung rank's stacks (faulthandler, when it can still run), then SIGKILL it: a
        SIGSTOPped process never runs a SIGTERM handler, and its peers fail their collectives at once
        (connection reset) and re-form in place. The node's other workers follow in the restart.
        ``stopped``: the kernel says the rank is stopped, so no dump can come; it is not waited for."""
        pids = self.adapter.worker_pids()
        local_rank = self.hangs.local_rank_of(rank) if rank is not None and self.hangs is not None else None
        targets = [pids[local_rank]] if local_rank in pids else list(pids.values())
        for pid in targets:
            try:
                os.kill(pid, proto.STACK_DUMP_SIGNAL)
            except OSError:
                pass
        if not stopped:
            time.sleep(0.2)  # the dump is written by the process itself (not at all when it is stopped)
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        log.warning("hung_workers_ended", pids=targets, rank=rank,
                    stacks="dumped to the worker's stderr (faulthandler), unless the process was stopped")
