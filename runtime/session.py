"""The worker's session with its agent: the control link, SIGTERM, the reports, and the one exit.

Under a trainguard agent a worker's orders come over :class:`~trainguard.runtime.link.AgentLink`
(drain, resize, checkpoint now, the next world); under plain torchrun a SIGTERM is the only notice it
gets. :class:`AgentSession` merges both into one stop request, sends the typed reports
(:class:`~trainguard.contract.protocol.Committed`, ``Parked``, ``Restored``, ``Joined``) when there is
an agent to read them, and ends the process with one :meth:`AgentSession.exit`. Not thread-safe except
for :meth:`AgentSession.on_sigterm` (a signal handler sets one attribute).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from trainguard.checkpoint.manager import SaveResult
from trainguard.contract import protocol as proto
from trainguard.runtime.link import AgentLink


class AgentSession:
    """This worker's link to its agent (None under plain torchrun) and its SIGTERM."""

    def __init__(self, control_path: str, rank: int, local_rank: int) -> None:
        self.link: AgentLink | None = (AgentLink(control_path, rank, local_rank, os.getpid())
                                       if control_path and os.path.exists(control_path) else None)
        self.signal_request = proto.StopReason.NONE
        """Set by :meth:`on_sigterm`: a drain (the only notice under plain torchrun)."""
        if threading.current_thread() is threading.main_thread():
            # Under plain torchrun (no agent link) a SIGTERM is the only notice a worker gets.
            signal.signal(signal.SIGTERM, self.on_sigterm)

    @property
    def linked(self) -> bool:
        """Whether an agent is at the other end (in-place re-formation and standby need one)."""
        return self.link is not None

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.signal_request = proto.StopReason.DRAIN

    def request(self) -> proto.StopReason:
        """This worker's own stop request: the stronger of SIGTERM's and the agent's."""
        return max(self.signal_request, self.link.request if self.link else proto.StopReason.NONE)

    def signalled(self) -> bool:
        """This process got SIGTERM (with the agent, whose orders come over the link, that is the agent
        stopping its workers: e.g. its node drains while the world re-forms, and it left the rendezvous)."""
        return self.signal_request is proto.StopReason.DRAIN

    def deadline(self) -> float | None:
        """This node's drain deadline (epoch seconds), when its agent asked it to drain."""
        if self.link is None or self.request() is not proto.StopReason.DRAIN:
            return None
        return self.link.deadline

    def take_checkpoint(self) -> str | None:
        """The reason of an out-of-cycle checkpoint the agent asked for since the last call (or None)."""
        return self.link.take_checkpoint() if self.link is not None else None

    def report(self, msg: proto.Committed | proto.Restored | proto.Parked | proto.Joined | proto.Progress
               | proto.Pace) -> None:
        """Send ``msg`` to the agent; nothing without one."""
        if self.link is not None:
            self.link.report(msg)

    @staticmethod
    def committed(step: int, rank: int, kind: proto.CheckpointKind, seconds: float, result: SaveResult | None,
                  committed: int | None) -> proto.Committed:
        """The agent's report of this step's checkpoint, committed (one form for every kind)."""
        return proto.Committed(step=step, kind=kind, rank=rank, seconds=round(seconds, 3),
                               nbytes=result.nbytes if result else 0, stage_s=round(result.stage_s, 6) if result else 0.0,
                               persist_s=round(result.persist_s, 6) if result else 0.0, last_committed=committed)

    def wait_for_world(self, timeout_s: float) -> proto.Reform | None:
        """The next world the agent forms; None after ``timeout_s``, or at once on a SIGTERM (see
        :meth:`signalled`: no world will come)."""
        assert self.link is not None, "waiting for a world needs an agent"
        return self.link.wait_reform(timeout_s, abort=self.signalled)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

    def exit(self, code: int) -> None:
        """End the process with ``code`` now, after closing the link. The checkpoint is committed on
        every rank, or given up: a clean interpreter teardown with gloo/torch takes seconds that a drain
        deadline should not pay for."""
        self.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
