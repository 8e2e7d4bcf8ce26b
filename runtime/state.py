"""The worker's own state, explicit (as torch elastic's ``WorkerState``): one per training process."""

from __future__ import annotations

from enum import Enum


class WorkerState(str, Enum):
    """Where one worker process is between ``Runtime`` construction and its exit.

    1. ``STANDBY``: a warmed-up joiner (``TRAINGUARD_STANDBY``): its process, imports and model exist,
       no world does yet; ``setup`` reports ``Parked(standby)`` and waits for the agent's ``Reform``.
    2. ``RUNNING``: training in a world; the step boundaries agree and act
       (:func:`~trainguard.runtime.boundary.decide_boundary`).
    3. ``BROKEN``: a collective of the step in progress failed because a peer vanished (in-place
       re-formation only): the rest of the step is void (no gradient sync, no optimizer step, no
       all-reduce); ``end_step`` rolls it back and parks.
    4. ``PARKED``: the world is torn down (an agreed drain/resize this node survives, or a lost peer);
       the worker reported ``Parked`` and waits for the agent's next world. A join called off before
       every rank arrived leaves it parked with its state intact.
    5. ``RESUMING``: joined the new world; its groups, wrapped model and batch plan are rebuilt and
       its state is handed over by a live peer or restored from the tiers (the park reason tells a
       lost member from a resize).

    Transitions (:data:`TRANSITIONS`): ``STANDBY -> RUNNING`` (first world joined); ``RUNNING ->
    BROKEN`` (a peer vanished mid-step); ``RUNNING -> PARKED`` (agreed stop survived in place, or the
    exchange or a periodic save failed for a vanished peer); ``BROKEN -> PARKED`` (``end_step``);
    ``PARKED -> RESUMING`` (joined); ``RESUMING -> RUNNING`` (state resumed). Any state but
    ``RUNNING`` (and a re-formation that fails) ends the process with the resize code: the agent
    restarts the world (the fallback). A worker that does not re-form in place is only ever
    ``RUNNING`` until it exits.
    """

    STANDBY = "standby"
    RUNNING = "running"
    BROKEN = "broken"
    PARKED = "parked"
    RESUMING = "resuming"


TRANSITIONS: frozenset[tuple[WorkerState, WorkerState]] = frozenset({
    (WorkerState.STANDBY, WorkerState.RUNNING),
    (WorkerState.RUNNING, WorkerState.BROKEN),
    (WorkerState.RUNNING, WorkerState.PARKED),
    (WorkerState.BROKEN, WorkerState.PARKED),
    (WorkerState.PARKED, WorkerState.RESUMING),
    (WorkerState.RESUMING, WorkerState.RUNNING),
})
"""Every transition a worker makes (see :class:`WorkerState`)."""
