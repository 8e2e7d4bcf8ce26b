"""The agent's explicit state machine.

::

    STARTING --> RENDEZVOUS --> RUNNING --> SUCCEEDED
                    ^  |          |  |  \\--> FAILED          (crash with no restarts left)
                    |  v          |  |
                    | FAILED      |  +--> RESTARTING --> RENDEZVOUS   (crash; consumes a restart)
                    |             |
                    +-- RESIZING <+--- DRAINING -----> STOPPED   (this node leaves: notice/stop)
                                  |       |
                                  +-------+--> RESIZING   (a peer drains / a node joins)

    RENDEZVOUS --> RESTARTING   (the rendezvous of an in-place re-formation failed: restart instead)
    RENDEZVOUS --> SUCCEEDED    (the rendezvous is closed: the job completed on the other nodes; a node
                                 that was joining is not needed, exit 0)

* ``STARTING``: config loaded, watchers/exporter starting.
* ``RENDEZVOUS``: waiting for the rendezvous round to close.
* ``RUNNING``: local workers healthy.
* ``DRAINING``: a notice arrived; workers checkpoint and exit (or get SIGTERM + grace).
* ``RESIZING``: workers exited with the resize code; re-forming without consuming a restart.
* ``RESTARTING``: workers crashed; backing off, then re-forming (consumes a restart).
* ``STOPPED``: left the job on purpose (drained); exit code 0.
* ``SUCCEEDED``: the job finished. ``FAILED``: gave up.

The state values themselves are :class:`trainguard.contract.protocol.AgentState` (they reach the CLI
and the metrics labels); this module owns the transitions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard.contract.log import get_logger
from trainguard.contract.protocol import AgentState


S = AgentState
TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    S.STARTING: frozenset({S.RENDEZVOUS, S.STOPPED, S.FAILED}),
    # RESTARTING: an in-place re-formation whose rendezvous failed falls back to a restart (consumed).
    S.RENDEZVOUS: frozenset({S.RUNNING, S.DRAINING, S.RESTARTING, S.STOPPED, S.FAILED, S.SUCCEEDED}),
    S.RUNNING: frozenset({S.DRAINING, S.RESIZING, S.RESTARTING, S.SUCCEEDED, S.FAILED, S.STOPPED}),
    S.DRAINING: frozenset({S.STOPPED, S.FAILED, S.RESIZING, S.RESTARTING}),
    S.RESIZING: frozenset({S.RENDEZVOUS, S.DRAINING, S.STOPPED, S.FAILED}),
    S.RESTARTING: frozenset({S.RENDEZVOUS, S.DRAINING, S.STOPPED, S.FAILED}),
    S.STOPPED: frozenset(),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


class StateMachine:
    """Holds the current state; every transition is checked and logged as one ``state_change`` line."""

    def __init__(self, listeners: list[Callable[[AgentState, AgentState, dict[str, Any]], None]] | None = None) -> None:
        self._state = AgentState.STARTING
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._listeners = list(listeners or [])
        self._log = get_logger("trainguard.agent.state")

    @property
    def state(self) -> AgentState:
        return self._state

    def add_listener(self, fn: Callable[[AgentState, AgentState, dict[str, Any]], None]) -> None:
        self._listeners.append(fn)

    def to(self, new: AgentState, **details: Any) -> None:
        with self._lock:
            old = self._state
            if new == old:
                return
            if new not in TRANSITIONS[old]:
                raise IllegalTransition(f"{old.value} -> {new.value} is not a legal agent transition")
            now = time.monotonic()
            self._log.info("state_change", old=old.value, new=new.value, after_s=round(now - self._since, 3), **details)
            self._state, self._since = new, now
        for fn in self._listeners:
            try:
                fn(old, new, details)
            except Exception:  # a listener (metrics, sd_notify) must never break supervision
                self._log.exception("state_listener_failed", listener=repr(fn))
