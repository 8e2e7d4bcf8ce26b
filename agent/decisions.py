"""What the agent does next: a pure function of what it observes (no I/O, no clocks).

Kept apart from the executor (:mod:`trainguard.agent.supervisor`) in the style of
``dynamic_rendezvous._RendezvousJoinOp``, so the whole policy is unit-tested with tables of cases.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from trainguard.contract.protocol import ExitKind, ParkReason, WorkerStatus, classify_exit


class Act(str, Enum):
    WAIT = "wait"
    ASK_DRAIN = "ask_drain"  # tell API workers: checkpoint at an agreed step, exit RESIZE
    ASK_RESIZE = "ask_resize"  # tell API workers: checkpoint at an agreed step for a scale-up, exit RESIZE
    CHECKPOINT = "checkpoint"  # tell API workers: one out-of-cycle checkpoint (early warning), keep training
    TERMINATE = "terminate"  # SIGTERM the workers with the grace period (scripts without the API, or deadline hit)
    RESTART = "restart"  # stop, re-rendezvous, start
    REFORM = "reform"  # the local workers are parked alive: re-rendezvous and hand them their new world
    LEAVE = "leave"  # leave the rendezvous (without closing it) and stop: this node drained
    SUCCEED = "succeed"
    FAIL = "fail"


class Asked(str, Enum):
    """What the agent already asked its workers over the control socket (reset when a new world forms)."""

    NOTHING = "nothing"
    DRAIN = "drain"
    """:class:`~trainguard.contract.protocol.Stop` with reason drain: checkpoint, then exit (this node leaves)."""
    RESIZE = "resize"
    """:class:`~trainguard.contract.protocol.Stop` with reason resize: checkpoint, then re-form."""


PARK_PRECEDENCE: tuple[ParkReason, ...] = (ParkReason.STANDBY, ParkReason.RESIZE, ParkReason.PEER_LOST, ParkReason.DRAIN)
"""Which reason a node's re-formation takes when its local workers parked for different ones, first
wins. The order is the one the supervisor had (the largest value, alphabetically); of the reasons only
``PEER_LOST`` changes what the re-formation does (:attr:`~trainguard.agent.elastic.Plan.lost`)."""


def park_reason(reasons: Iterable[ParkReason]) -> ParkReason | None:
    """Pure: the reason of a node's re-formation from its parked workers' (:data:`PARK_PRECEDENCE`)."""
    present = set(reasons)
    return next((r for r in PARK_PRECEDENCE if r in present), None)


@dataclass(frozen=True, slots=True)
class Observation:
    workers: WorkerStatus
    exit_codes: tuple[int, ...] = ()
    remaining_restarts: int = 0
    nodes_waiting: int = 0
    """Nodes waiting to join (scale-up)."""
    draining: bool = False
    """This node has a notice and is leaving."""
    drain_deadline_passed: bool = False
    asked: Asked = Asked.NOTHING
    """What the workers were already asked."""
    api_workers: bool = False
    """The local workers use the worker API (they registered on the control socket)."""
    peer_draining: bool = False
    """Another node announced a drain; a crash of our non-API workers is then its consequence."""
    checkpoint_requested: bool = False
    """An early warning asked for an out-of-cycle checkpoint (this node stays in the job)."""
    nproc: int = 1
    """Local workers this node runs."""
    parked: int = 0
    """Local workers alive and parked for an in-place re-formation."""
    park_reason: ParkReason | None = None
    """Why they parked (:func:`park_reason` of their reasons)."""
    emergency_committed: bool = False
    """This node's workers reported the emergency checkpoint committed (they exit right after)."""
    resize_overdue: bool = False
    """The workers were asked to resize longer ago than they can take (a step and a save, each bounded
    by ``workers.pg_timeout_s``): one may be stuck in a collective; restart the world instead."""
    member_lost: bool = False
    """A member of the current world is gone (keep-alive expired) while our workers run on: they may
    be blocked in a collective with it (or in their start-up) and never notice."""
    member_gone: bool = False
    """A member of the current world is missing from the round, not yet for the grace period."""
    reform_in_place: bool = False
    """The workers re-form in place (``workers.reform: in-process``)."""
    world_nodes: int = 1
    """Nodes in this node's current world, itself included."""


@dataclass(frozen=True, slots=True)
class Decision:
    act: Act
    reason: str = ""
    consume_restart: bool = False
    workers_may_be_stuck: bool = False
    """A restart whose running workers may sit blocked in a collective and never run their SIGTERM
    handler: stop them with ``workers.failure_stop_grace_s``, not elastic's 30 s (a failure restart,
    one that consumes a restart, always does)."""

    rejoin: bool = False
    """A failure of this node's workers in a world of several nodes that re-form in place: leave the
    round at once, so that the other nodes re-form without this one (their workers keep running), then
    come back as a joiner whose new workers warm up before it enters; the others pause for it only then.
    Otherwise they wait in the next round for this node's backoff and its new workers' start-up."""

    @property
    def short_stop(self) -> bool:
        """Stop the workers still running with the short grace before this restart."""
        return self.consume_restart or self.workers_may_be_stuck


def rejoins(o: Observation) -> bool:
    """Pure: whether a failure of this node's workers is handled by leaving and rejoining warm
    (:attr:`Decision.rejoin`): the world re-forms in place and has other nodes to go on without it."""
    return o.reform_in_place and o.world_nodes > 1 and not o.draining


def decide(o: Observation) -> Decision:
    """Map one observation to one action. See tests/agent/test_decisions.py for the full table."""
    if o.workers is not WorkerStatus.HEALTHY:
        kind = classify_exit(o.exit_codes) if o.workers is WorkerStatus.EXITED else ExitKind.CRASH
        if kind is ExitKind.SUCCESS:
            return Decision(Act.SUCCEED, "workers_finished")
        if o.draining:
            return Decision(Act.LEAVE, "drained" if kind is ExitKind.RESIZE else "drained_workers_failed")
        if kind is ExitKind.RESIZE:
            return Decision(Act.RESTART, "drain" if o.asked is Asked.DRAIN else "resize", consume_restart=False)
        if o.peer_draining and not o.api_workers:
            return Decision(Act.RESTART, "peer_drain", consume_restart=False)
        if o.remaining_restarts > 0:
            return Decision(Act.RESTART, "worker_failure", consume_restart=True, rejoin=rejoins(o))
        return Decision(Act.FAIL, "max_restarts_exhausted")

    # workers are running (or parked alive)
    if o.parked and o.draining:
        return Decision(Act.LEAVE, "drained")
    if o.parked >= o.nproc > 0:
        return Decision(Act.REFORM, o.park_reason.value if o.park_reason is not None else "reform")
    if o.member_lost and not o.draining:
        # (a member that announced its drain left: the same restart, named for what it is - its workers
        # may be stuck in a collective with the leaver, e.g. a script without trainguard's runtime whose
        # worker is slow to exit on its peer's reset)
        return Decision(Act.RESTART, "peer_drain" if o.peer_draining else "member_lost", consume_restart=False,
                        workers_may_be_stuck=True)
    if o.member_gone and o.api_workers and o.reform_in_place and o.asked is Asked.NOTHING and not o.draining:
        # Workers joining a world that lost a member wait in its arrival count and go back to the agent
        # alive; workers training park at their next step boundary. Those that cannot (blocked in a
        # collective) are restarted once the grace period is over (member_lost above).
        return Decision(Act.ASK_RESIZE, "member_lost")
    if o.draining:
        if o.drain_deadline_passed:
            return Decision(Act.TERMINATE, "drain_deadline_passed")
        if o.asked is not Asked.DRAIN:
            return Decision(Act.ASK_DRAIN, "notice") if o.api_workers else Decision(Act.TERMINATE, "notice")
        if o.emergency_committed:  # leave at once: the survivors re-form as soon as this node is out
            return Decision(Act.LEAVE, "drained")
        return Decision(Act.WAIT, "draining")
    if o.asked is Asked.RESIZE and o.resize_overdue:
        return Decision(Act.RESTART, "resize_overdue", consume_restart=False, workers_may_be_stuck=True)
    if o.nodes_waiting > 0:
        if not o.api_workers:
            return Decision(Act.RESTART, "scale_up", consume_restart=False)
        if o.asked is Asked.NOTHING:
            return Decision(Act.ASK_RESIZE, "scale_up")
    if o.checkpoint_requested:
        return Decision(Act.CHECKPOINT, "early_warning")
    return Decision(Act.WAIT)
