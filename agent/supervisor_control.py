"""The supervisor's answers on its control socket (``trainguard drain``, ``status``, the workers' reports:
committed checkpoints, restores, progress, pace). A part of :class:`~trainguard.agent.supervisor.Supervisor`."""

from __future__ import annotations

import os

import time

from typing import Any

from trainguard.agent import exitcodes
from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger


log = get_logger("trainguard.agent.supervisor")


class ControlOps:
    """Mixin of :class:`~trainguard.agent.supervisor.Supervisor` (its state and its other methods)."""

    def _on_control(self, msg: proto.Message) -> proto.Reply | None:
        if isinstance(msg, proto.DrainRequest):
            already = self._drain is not None
            if self.on_manual_drain is not None:
                self.on_manual_drain(msg.deadline_s, msg.reason)
            else:
                deadline_s = msg.deadline_s or self.cfg.preemption.default_deadline_s
                self.request_drain("manual", "drain", time.time() + deadline_s, msg.reason)
            return proto.Reply(ok=True, data={"already_draining": already})
        if isinstance(msg, proto.StatusRequest):
            return proto.Reply(ok=True, data=self.status())
        if isinstance(msg, proto.Committed):
            if not msg.saved and msg.rank == 0:
                log.warning("checkpoint_not_saved", **exitcodes.not_saved_fields(msg, checkpoint_url=self.cfg.checkpoint.url))
            if not msg.saved and msg.error and msg.kind is proto.CheckpointKind.EMERGENCY:
                self._emergency_error = self._emergency_error or msg.error
            log.info("checkpoint_committed_by_worker", step=msg.step, kind=msg.kind.value, rank=msg.rank, saved=msg.saved,
                     bytes=msg.nbytes)
            if msg.kind is proto.CheckpointKind.EMERGENCY and msg.saved:
                self._emergency_step = msg.step
            if msg.kind is proto.CheckpointKind.EMERGENCY and self._drain is not None:
                self._emergency_committed = True
                self._wake.set()
            if msg.kind is proto.CheckpointKind.EMERGENCY and msg.saved and self.on_emergency_commit is not None:
                self.on_emergency_commit()
            return None
        if isinstance(msg, proto.Parked):
            with self._lock:
                self._parked[msg.local_rank] = msg
            log.info("worker_parked", local_rank=msg.local_rank, rank=msg.rank, step=msg.step, reason=msg.reason.value)
            self._wake.set()
            return None
        if isinstance(msg, proto.Joined):
            with self._lock:
                self._joining.discard(msg.local_rank)
            return None
        if isinstance(msg, proto.Restored):
            if msg.rank == self._world.get("first_rank"):  # one report per node
                self._observe("restored", msg.step)
            return None
        if isinstance(msg, proto.Progress):
            if self.hangs is not None:
                self.hangs.on_progress(msg)
            return None
        if isinstance(msg, proto.Hello):
            return None
        if isinstance(msg, proto.Pace):
            if self.straggler is not None:
                self.straggler.observe(msg)
            return None
        return proto.Reply(ok=False, error=f"op {msg.OP!r} is not a request to the agent")

    def status(self) -> dict[str, Any]:
        d = self._drain
        return {
            "state": self.sm.state.value,
            "node": self.cfg.agent.node_name,
            "job_id": self.cfg.agent.job_id,
            **{k: v for k, v in self._world.items() if k != "first_rank"},
            "remaining_restarts": self.adapter.remaining_restarts if hasattr(self, "adapter") else None,
            "draining": d is not None,
            "drain_deadline": d.deadline if d else None,
            "waiting_for": self._waiting_for,
            "pid": os.getpid(),
            "emergency_step": self._emergency_step,
            "emergency_error": self._emergency_error or None,
        }
