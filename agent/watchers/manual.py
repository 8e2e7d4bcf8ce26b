"""Manual drain: ``trainguard drain [--deadline 30s]`` through the agent's control socket.

The control-socket server (owner: ``agent/control.py``) calls :meth:`ManualWatcher.trigger` from its
own thread; the notice is delivered on the watcher thread like every other notice, so the drain
coordinator sees one uniform stream.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from trainguard.agent.watchers.base import Notice, QueueWatcher
from trainguard.agent.watchers.config import PreemptionConfig


class ManualWatcher(QueueWatcher):
    """Always present in :func:`~trainguard.agent.watchers.build_watchers`; passive until triggered."""

    source = "manual"

    def __init__(self, *, default_deadline_s: float = 30.0, poll_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="manual", poll_interval_s=poll_interval_s, clock=clock)
        self.default_deadline_s = default_deadline_s
        self._ids = itertools.count(1)

    @classmethod
    def from_config(cls, cfg: PreemptionConfig, **kw: Any) -> ManualWatcher:
        return cls(default_deadline_s=cfg.default_deadline_s, **kw)

    def trigger(self, deadline_s: float | None = None, reason: str = "manual") -> Notice:
        """Request a drain of this node within ``deadline_s`` seconds from now. Thread-safe.

        ``deadline_s`` None means ``preemption.default_deadline_s``. Returns the notice (also
        delivered to ``on_notice`` on the watcher thread; queued if the watcher is not started yet).
        Every call is a new event (not deduplicated). ``ValueError`` for a non-positive deadline.
        """
        d = self.default_deadline_s if deadline_s is None else float(deadline_s)
        if not math.isfinite(d) or d <= 0:
            raise ValueError(f"drain deadline must be a positive number of seconds, got {deadline_s!r}; "
                             "e.g. `trainguard drain --deadline 30s`")
        now = self.clock()
        notice = Notice(source=self.source, kind="drain", deadline=now + d, received_at=now,
                        detail={"reason": str(reason)[:200], "deadline_s": d}, event_id=f"drain#{next(self._ids)}")
        self.push(notice)
        return notice
