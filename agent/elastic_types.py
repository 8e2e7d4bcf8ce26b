"""The values the agent's adapter over torch elastic (:mod:`trainguard.agent.elastic`) hands the
supervisor: a round's :class:`World`, the :class:`Plan` a re-formation heads for, a :class:`Peek` at the
shared rendezvous state, a :class:`Poll` of the local workers. No torch elastic internals here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.contract.protocol import WorkerStatus

POLL_INTERVAL_S = 0.1
"""How often a node waiting in the rendezvous re-reads the shared state (torch: 1 s)."""


class RendezvousAborted(Exception):
    """The node left the rendezvous before the round completed because it is draining."""


@dataclass(frozen=True, slots=True)
class World:
    """What one rendezvous round gave this node."""

    round: int
    group_rank: int
    nodes: int
    world_size: int
    global_ranks: tuple[int, ...]
    master_addr: str = ""
    master_port: int = 0
    members: tuple[str, ...] = ()
    """The rendezvous ids of the round's nodes, ordered by group rank."""

    def log_fields(self) -> dict[str, Any]:
        return {"round": self.round, "group_rank": self.group_rank, "nodes": self.nodes,
                "world_size": self.world_size, "global_ranks": list(self.global_ranks)}


@dataclass(frozen=True, slots=True)
class Plan:
    """The world a re-formation starts from: its members and those announced as leaving."""

    members: frozenset[str]
    leaving: frozenset[str] = frozenset()
    lost: bool = False
    """A member vanished (which one, nobody said): only the members the rendezvous still sees alive
    (a keep-alive heartbeat in its state; the lost node's is dropped when it expires) are expected."""
    evict: Callable[[], frozenset[str]] | None = field(default=None, compare=False)
    """Asked at every poll of the join: rendezvous ids of nodes to remove from the rendezvous state now
    (evidence that they are gone: :func:`trainguard.agent.hang.evictable`), instead of waiting for their
    keep-alive to expire."""
    round: int | None = None
    """The rendezvous round of the world the evidence is about: :attr:`evict` applies only while the
    shared state is still at that round. A node cut off from the job (a partition) whose peers re-formed
    without it must not remove them from their newer round on its stale view when it reconnects."""


@dataclass(frozen=True, slots=True)
class Peek:
    """The shared rendezvous state as this node last synced it (no change to it)."""

    round: int
    complete: bool
    participants: tuple[str, ...]
    waiting: int
    this_node_participates: bool
    closed: bool = False
    """The rendezvous is closed: the job is over (a node joining now is not needed)."""


@dataclass(frozen=True, slots=True)
class Poll:
    """One look at the local workers."""

    status: WorkerStatus
    exit_codes: tuple[int, ...] = ()
    """Per local worker, when ``status`` is ``EXITED`` (0 for workers that succeeded)."""
    failures: dict[int, Any] = field(default_factory=dict)
    """Global rank -> elastic's ``ProcessFailure`` (for the failure summary)."""
    result: Any = None
    """Elastic's ``RunResult`` (returned from the run when the job ends)."""
