"""The rendezvous join of torch's dynamic rendezvous, interruptible and with a planned size (a part of
the adapter over torch elastic internals, :mod:`trainguard.agent.elastic`; what each change does is in that
module's docstring): :class:`_JoinOp`, the pure :func:`planned_complete`, eviction on evidence
(:func:`evict_nodes`), the op executor that polls every :data:`POLL_INTERVAL_S` (every
:data:`LEAVER_POLL_S` while only announced leavers hold the round up: :func:`waits_for_leavers`) and
:func:`next_round`."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _Action,
    _DistributedRendezvousOpExecutor,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
    _remove_participant_epilogue,
)

from trainguard.agent.elastic_types import POLL_INTERVAL_S, Plan, RendezvousAborted
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.elastic")

LEAVER_POLL_S = 0.01
"""How often a node re-reads the rendezvous state while the round it re-forms from waits only for nodes
announced as leaving (:func:`waits_for_leavers`): they leave right after their workers' emergency
checkpoint commits, which is also when the survivors' workers park, so the two race; a 0.1 s poll
(:data:`POLL_INTERVAL_S`) lost up to that much of every drain that the leaver's leave came second in."""
LEAVER_FAST_S = 2.0
"""The most seconds one operation polls every :data:`LEAVER_POLL_S` (a leaver that never leaves is
removed by its keep-alive expiry; the poll is back to :data:`POLL_INTERVAL_S` meanwhile)."""

# ---- the rendezvous join, interruptible and with a planned size ----------------------------------

def planned_complete(plan: Plan, participants: set[str], waiting: set[str], min_nodes: int, max_nodes: int,
                     alive: set[str] | None = None) -> bool:
    """Pure: whether a round being formed from ``plan`` has everyone it expects: the plan's members
    that are not leaving (and, for a plan after a loss, that are ``alive``: a heartbeat in the
    rendezvous state), plus every newcomer (a participant or waiting node that was no member)."""
    members = plan.members & alive if plan.lost and alive is not None else plan.members
    expected = (members - plan.leaving) | ((participants | waiting) - plan.members)
    return min_nodes <= len(participants) <= max_nodes and bool(expected) and expected <= participants


class _JoinOp(_RendezvousJoinOp):
    """torch's join operation, plus: leave when ``abort()`` says so; complete as soon as ``plan``
    is satisfied (:func:`planned_complete`)."""

    def __init__(self, abort: Callable[[], bool], plan: Plan | None) -> None:
        self.abort = abort
        self.plan = plan

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        state = ctx.state
        if self.abort():
            if ctx.node in state.participants and not state.complete:
                return _Action.REMOVE_FROM_PARTICIPANTS
            if ctx.node in state.wait_list:
                return _Action.REMOVE_FROM_WAIT_LIST
            if ctx.node in state.redundancy_list:
                return _Action.REMOVE_FROM_REDUNDANCY_LIST
            if ctx.node not in state.participants:
                raise RendezvousAborted("left the rendezvous before the round completed (draining)")
        if self.plan is not None and not state.complete and ctx.node in state.participants and planned_complete(
                self.plan, {str(n) for n in state.participants}, {str(n) for n in state.wait_list},
                ctx.settings.min_nodes, ctx.settings.max_nodes,
                alive={str(n) for n in state.last_heartbeats} if self.plan.lost else None):
            return _Action.MARK_RENDEZVOUS_COMPLETE
        return super().__call__(ctx, deadline)


def waits_for_leavers(plan: Plan | None, round_: int, complete: bool, participants: set[str]) -> bool:
    """Pure: whether the shared state holds this node's re-formation up only for members announced as
    leaving: the round ``plan`` re-forms from is still the current one, complete, and every node still
    in it is leaving (this node left it already and waits for the next round, which starts the moment
    the last one leaves)."""
    return (plan is not None and plan.round == round_ and complete and bool(participants)
            and participants <= plan.leaving)


def evict_nodes(state: Any, settings: Any, nodes: frozenset[str]) -> list[str]:
    """Remove ``nodes`` (rendezvous ids) from the rendezvous ``state`` as torch's sanitizer removes a
    node whose keep-alive expired (heartbeat, participant, wait and redundancy lists, then the epilogue
    that advances a completed round nobody is left in). Returns the ids removed."""
    removed, participant_removed = [], False
    for node in [n for n in list(state.last_heartbeats) + list(state.participants) if str(n) in nodes]:
        if node in state.last_heartbeats:
            del state.last_heartbeats[node]
        if node in state.participants:
            del state.participants[node]
            participant_removed = True
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
        if str(node) not in removed:
            removed.append(str(node))
    if participant_removed:
        _remove_participant_epilogue(state, settings)
    return removed


class _Executor(_DistributedRendezvousOpExecutor):
    """torch's op executor with a configurable poll interval (its loop, less the event records), and
    evictions on evidence (:attr:`Plan.evict`) before each step of the operation."""

    def __init__(self, base: _DistributedRendezvousOpExecutor, poll_s: float,
                 evict: Callable[[], frozenset[str]] | None = None, evict_round: int | None = None,
                 plan: Plan | None = None) -> None:
        super().__init__(base._node, base._state_holder, base._settings)
        self.poll_s = poll_s
        self.evict = evict
        self.evict_round = evict_round
        self.plan = plan
        """The re-formation's plan: its announced leavers make the poll fast (:func:`waits_for_leavers`)."""
        self.evicted: list[str] = []
        self.rejoining = False
        """Set for the exit operation that precedes this node's join: it leaves the completed round but keeps
        its heartbeat in the state (see :meth:`_remove_from_participants`)."""
        self._stale_noted = False
        self._fast_until: float | None = None

    def _remove_from_participants(self) -> None:
        """torch's removal, which also deletes the node's heartbeat; a node that leaves the completed round
        only to join the next one at once (:attr:`rejoining`) keeps a fresh one. Without it, a survivor of a
        loss was not alive in the state between its exit and its join, and another survivor's round after
        the loss (:func:`planned_complete`: the members alive in the state) completed without it: one
        node formed a world alone in 30 ms, its peer joined a round later (3 -> 1 -> 2 in
        tests/e2e/test_etcd_rendezvous.py, CI on c801b6b). A node that dies after its exit loses the
        heartbeat at the keep-alive expiry, as any node does."""
        super()._remove_from_participants()
        if self.rejoining:
            self._state.last_heartbeats[self._node] = datetime.now(timezone.utc)

    def _sync_wait_s(self) -> float:
        """How long to wait before the next read of the state: :data:`LEAVER_POLL_S` while only leavers
        hold the round up (for at most :data:`LEAVER_FAST_S` per operation), else :attr:`poll_s`."""
        st = self._state
        if not waits_for_leavers(self.plan, st.round, st.complete, {str(n) for n in st.participants}):
            return self.poll_s
        now = time.monotonic()
        if self._fast_until is None:
            self._fast_until = now + LEAVER_FAST_S
        return LEAVER_POLL_S if now < self._fast_until else self.poll_s

    def _evict(self) -> bool:
        if self.evict is None:
            return False
        if self.evict_round is not None and self._state.round != self.evict_round:
            # The job moved on to another round (without this node, which was cut off): the evidence is
            # about a world that no longer exists, and its members may be the live ones of the new round.
            if not self._stale_noted:
                self._stale_noted = True
                log.info("eviction_skipped", evidence_round=self.evict_round, round=self._state.round,
                         reason="the rendezvous moved on to another round since the evidence was gathered",
                         effect="nobody is removed on this node's view; keep-alive expiry decides")
            return False
        nodes = self.evict() - {str(self._node)}
        if not nodes:
            return False
        removed = evict_nodes(self._state, self._settings, nodes)
        if removed:
            self.evicted += removed
            log.warning("member_evicted", nodes=removed, round=self._state.round,
                        cause="a collective failed here and the member's agent missed its heartbeat",
                        effect="removed from the rendezvous now instead of after its keep-alive expiry")
            self._state_holder.mark_dirty()
        return bool(removed)

    def run(self, state_handler: Callable[[_RendezvousContext, float], _Action], deadline: float,
            update_deadline: Callable[[timedelta], float] | None = None) -> None:
        action = None
        while action != _Action.FINISH:
            self._state_holder.sync()
            self._state = self._state_holder.state
            if self._evict():
                continue  # written back (compare-and-set) by the next sync, then the operation goes on
            action = state_handler(_RendezvousContext(self._node, self._state, self._settings), deadline)
            if action == _Action.FINISH:
                continue
            if action == _Action.ERROR_CLOSED:
                raise RendezvousClosedError
            if action == _Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError
            if action == _Action.SYNC:
                wait = self._sync_wait_s()
                time.sleep(wait)
                if wait < self.poll_s and hasattr(self._state_holder, "_last_sync_time"):
                    self._state_holder._last_sync_time = -1.0  # read it afresh: torch caches it for poll_s
                continue
            if action == _Action.KEEP_ALIVE:
                self._keep_alive()
            elif action == _Action.ADD_TO_PARTICIPANTS:
                self._add_to_participants()
            elif action == _Action.ADD_TO_WAIT_LIST:
                self._add_to_wait_list()
            elif action == _Action.ADD_TO_REDUNDANCY_LIST:
                self._add_to_redundancy_list()
            elif action == _Action.REMOVE_FROM_PARTICIPANTS:
                self._remove_from_participants()
            elif action == _Action.REMOVE_FROM_WAIT_LIST:
                self._remove_from_wait_list()
            elif action == _Action.REMOVE_FROM_REDUNDANCY_LIST:
                self._remove_from_redundancy_list()
                if update_deadline:
                    deadline = update_deadline(self._settings.timeout.join)
            elif action == _Action.MARK_RENDEZVOUS_COMPLETE:
                self._mark_rendezvous_complete()
            elif action == _Action.MARK_RENDEZVOUS_CLOSED:
                self._mark_rendezvous_closed()
            self._state_holder.mark_dirty()


def fresh_reads(handler: Any) -> None:
    """torch serves the shared state from a 1 s cache between its own writes; a node polling every
    :data:`POLL_INTERVAL_S` for a planned round must read fresh state (also used by
    ``bench/control_plane.py``, which drives handlers as the agents do)."""
    holder = getattr(handler, "_state_holder", None)
    if holder is not None and getattr(holder, "_cache_duration", 0) > POLL_INTERVAL_S:
        holder._cache_duration = POLL_INTERVAL_S


def next_round(handler: Any, abort: Callable[[], bool], plan: Plan | None,
               evicted: list[str] | None = None) -> RendezvousInfo:
    """``DynamicRendezvousHandler.next_rendezvous`` with :class:`_JoinOp` and :class:`_Executor`.

    Same sequence as torch 2.13 (stop heartbeats, exit op, join op, start heartbeats, world, store),
    for the store-sharing-disabled case trainguard runs in (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
    see :mod:`trainguard.agent.supervisor`): rank 0 picks a fresh worker store port each round.
    """
    handler._stop_heartbeats()
    executor = _Executor(handler._op_executor, POLL_INTERVAL_S, plan.evict if plan is not None else None,
                         plan.round if plan is not None else None, plan)
    deadline = handler._get_deadline(handler._settings.timeout.join)
    executor.rejoining = True
    executor.run(_RendezvousExitOp(), deadline)
    executor.rejoining = False
    try:
        executor.run(_JoinOp(abort, plan), deadline, handler._get_deadline)
    finally:
        if evicted is not None:
            evicted[:] = executor.evicted
    handler._start_heartbeats()
    rank, world_size = handler._get_world()
    store = handler._get_store()
    info = RendezvousStoreInfo.build(rank, store, local_addr=handler._this_node.addr)
    return RendezvousInfo(store, rank, world_size, info)
