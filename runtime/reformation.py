"""In-place re-formation, the worker's side: park, join the next world, hand the live state over.

A worker that survives a membership change (``workers.reform: in-process``) does not exit: at the
agreed step it tears its process groups down, reports :class:`~trainguard.contract.protocol.Parked`
and waits for the agent's :class:`~trainguard.contract.protocol.Reform` (:meth:`Reformation.park`). It
then builds the new world's groups (:meth:`Reformation.join_world`), re-wraps the model, and the ranks
that lack the state receive it from a live peer (:meth:`Reformation.sync_live_state`, checked across
ranks where the state is replicated: :meth:`Reformation.replicas_agree`); a world with no trusted live
state restores from the tiers. A standby worker joins its first world the same way
(:meth:`Reformation.wait_for_first_world`). The mechanics of a world (arrival count, process groups,
teardown, the hand-over collective) are :mod:`trainguard.runtime.reform`.

:class:`Reformation` owns what only a re-formation needs (the suspect step, the park reason during the
hand-over, the join's phases) and acts on its :class:`~trainguard.runtime.runtime.Runtime` (its model,
groups, tiers and session). Not thread-safe: the training thread runs it.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainguard.checkpoint.interval import IntervalStats
from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger
from trainguard.runtime import device as dev
from trainguard.runtime import flight
from trainguard.runtime import reform as rf
from trainguard.runtime.state import WorkerState
from trainguard.strategies.base import ReformState

if TYPE_CHECKING:
    from trainguard.runtime.runtime import Runtime

log = get_logger("trainguard.worker")

STREAM_SETTLE_S = 1.0
"""How long a rank that lost a peer on NCCL polls whether its stream finished its last step before it
aborts (a step still queued then may run on half-reduced gradients after the abort: suspect)."""
PARITY_ABANDON_S = 2.0
"""How long a worker that parks or exits waits for a parity snapshot in the background (its local write
takes milliseconds; an exchange stuck with a vanished peer is left behind after this)."""


def param_checksum(params: Any) -> torch.Tensor:
    """A cheap fingerprint of parameters on the host: ``[sum, sum of squares]`` in float64 (local shards of
    DTensors). One reduction per parameter on its device, one small copy to the host."""
    from torch.distributed.tensor import DTensor

    parts = []
    for p in params:
        t = (p.to_local() if isinstance(p, DTensor) else p).detach()
        parts.append(torch.stack([t.double().sum(), t.double().square().sum()]))
    return torch.stack(parts).sum(0).cpu() if parts else torch.zeros(2, dtype=torch.float64)


def checksums_agree(checksums: list[torch.Tensor]) -> bool:
    """Pure: whether every rank's :func:`param_checksum` is the same, bit for bit."""
    return all(torch.equal(c, checksums[0]) for c in checksums[1:])


def _is_loss(reason: proto.ParkReason) -> bool:
    """A re-formation for a member that is gone (drained after a notice, or lost unannounced)."""
    return reason in (proto.ParkReason.DRAIN, proto.ParkReason.PEER_LOST)

class Reformation:
    """The re-formation of one worker in place (see the module docstring)."""

    def __init__(self, rt: Runtime) -> None:
        # A weak reference: a strong one would make each Runtime a reference cycle, kept (with its
        # checkpoint threads) until a garbage collection instead of freed when the script drops it.
        self._rt = weakref.proxy(rt)
        self.suspect_step: int | None = None
        """A step whose update may have run on half-reduced gradients (see :meth:`park`)."""
        self.parked_for: proto.ParkReason | None = None
        """Why the world is re-forming in place, while it hands the live state over (or None)."""
        self.took_peer_stats = False
        """The last live-state sync loaded a peer's interval stats."""
        self.join_phases: dict[str, float] = {}
        """How long the last world join took: the default group (arrival, ``init_process_group``), the side group."""

    def park(self, reason: proto.ParkReason) -> None:
        """Tear the world down, tell the agent, wait for the new world and join it; on any failure,
        exit with the resize code so that the agent restarts the world (the fallback)."""
        rt = self._rt
        t0 = time.monotonic()
        rt._enter(WorkerState.PARKED)
        lost = reason is proto.ParkReason.PEER_LOST
        if lost:  # the evidence of what each group was doing, before the abort clears the groups
            dumped = flight.dump(rt.rank, rt.reformations)
            if dumped is not None:
                rt._log.info("flight_recorder_dumped", path=dumped[0], nbytes=dumped[1], step=rt.step)
        if lost and dev.backend_for(rt.device) == "nccl":
            # Only a rank whose stream finished its last step may offer that step's state: after the abort
            # an update queued behind the lost peer's all-reduce runs on half-reduced gradients.
            if not rt._timer.completed(STREAM_SETTLE_S):
                self.suspect_step = rt.step
            # Abort before anything waits on the GPU: a snapshot's or a save's copy queued behind a
            # kernel that waits for the lost peer would keep this rank here for pg_timeout_s.
            rt._log.info("world_aborted", teardown=rf.teardown_world(rt.device, peer_lost=True).value,
                         suspect_step=self.suspect_step)
        rt._tiers.settle(abandon_after=PARITY_ABANDON_S)
        if rt._metrics is not None:
            rt._metrics.flush()  # the steps counted since the last agreement
        old = (rt.rank, rt.world_size)
        base = None
        rt._tiers.replicator = None  # a transfer may be stuck with the vanished peer: left behind (daemon thread)
        try:
            if lost:
                # The world is broken: its in-flight save can never commit (do not wait for its upload),
                # and peers blocked in a collective step on this rank must fail it now, not at the
                # process-group timeout (see rf.end_world_connections).
                if rt._tiers.manager is not None:
                    rt._tiers.manager.cancel_inflight("a peer of this world is gone")
                rt._log.info("world_connections_ended", connections=rf.end_world_connections())
            assert rt._session.linked
            # This rank's state is final: the agent may re-form now. A save still persisting finishes
            # below, while the rendezvous runs (the new world waits for this rank in its arrival count);
            # reported after it, a slow commit kept the agent in the old round while its peers had left it.
            self.report_parked(reason)
            if rt._tiers.manager is not None:
                # An in-flight save finishes (or fails) on the old groups first; the garbage collection a
                # stop's save deferred is left to the next world's first commit (the new world waits for this).
                rt._tiers.manager.close(collect=False)
                base, rt._tiers.manager = rt._tiers.manager.base, None
            rt._group = None
            rt._agreement.drop()
            rf.teardown_world(rt.device, peer_lost=lost)
            while True:
                msg = rt._session.wait_for_world(rt.reform_timeout_s)
                if msg is None:
                    self.leave_if_signalled("parked")
                    raise TimeoutError(f"no new world from the agent within workers.reform_timeout_s="
                                       f"{rt.reform_timeout_s:.0f}s")
                t_world = time.monotonic()
                rt._faults.fail_at("reform")
                if self.join_world(msg):
                    break
                reason = proto.ParkReason.PEER_LOST  # nothing changed yet: park again, state intact
                self.report_parked(reason)
            t_joined = time.monotonic()
            rt._enter(WorkerState.RESUMING)
            assert rt.strategy is not None and rt._model is not None
            with rt._group_connections():
                rt._model, rt._optimizer = rt.strategy.reform(rt._model, rt._optimizer)
            rt._tiers.make_manager(base)
            rt._data_parallel()
            rt.accum_steps, _ = rt.strategy.plan(rt.global_batch, rt.dp_size, rt.micro_batch)
            t_wrapped = time.monotonic()
            outcome, live = self.resume_state(reason)
        except Exception as e:
            rt._log.error("reform_failed", reason=reason.value, error=f"{type(e).__name__}: {e}"[:500],
                          effect="exiting with the resize code: the agent restarts the world")
            rt._exit(proto.EXIT_RESIZE)
        rt._enter(WorkerState.RUNNING)
        rt.reformations += 1
        rt._step_started = time.monotonic()
        rt._timer.start()
        rt._log.info("worker_reformed", step=rt.step, reason=reason.value, old_rank=old[0], old_world_size=old[1],
                     accum_steps=rt.accum_steps, state=outcome, live_step=live,
                     parked_s=round(t_world - t0, 3), rebuild_s=round(time.monotonic() - t_world, 3),
                     join_s=round(t_joined - t_world, 3), **self.join_phases, wrap_s=round(t_wrapped - t_joined, 3),
                     sync_s=round(time.monotonic() - t_wrapped, 3), seconds=round(time.monotonic() - t0, 3),
                     pid=os.getpid(),
                     survived_losses=rt._tiers.interval.stats.survived_losses if rt._tiers.interval is not None else None)

    def resume_state(self, reason: proto.ParkReason) -> tuple[str, int | None]:
        """The re-formed world's state (:meth:`sync_live_state`), and the loss it survived counted once.

        A rank whose last step may have run on half-reduced gradients (:attr:`suspect_step`, see :meth:`park`)
        offers no live state and drops its snapshots of that step; live state the world agrees on is
        checked across ranks where it is replicated (:meth:`replicas_agree`); a world with no trusted
        live state restores from the tiers (nearest first) instead."""
        rt = self._rt
        suspect, self.suspect_step = self.suspect_step, None
        if suspect is not None:
            rt._log.warning("live_state_suspect", step=suspect, why="this rank's last step had not finished on "
                            "the GPU when its world was aborted", effect="its live state and snapshots of that "
                            "step are not used")
            if rt._tiers.memory is not None:
                rt._tiers.memory.discard_from(suspect)
        self.parked_for = reason  # while set, a restore counts as one of an in-place re-formation
        try:
            outcome, live = self.sync_live_state(None if suspect is not None else rt.step)
            if outcome == "none" and rt._tiers.manager is not None:  # no trusted live state: every rank is here
                live = rt._tiers.restore()
                outcome = "restored"
        finally:
            self.parked_for = None
        self.took_peer_stats = self.took_peer_stats and outcome != "restored"
        if (rt._tiers.interval is not None and outcome in ("agreed", "broadcast") and _is_loss(reason)
                and not self.took_peer_stats):
            # A member is gone and the state lived on in the survivors' memory: no rollback. A rank that
            # took its state from a peer took that peer's count of this loss with it.
            rt._tiers.interval.observe_survived_loss(unannounced=reason is proto.ParkReason.PEER_LOST)
        return outcome, live

    def replicas_agree(self) -> bool:
        """Whether every rank holds the same parameters (replicated state, after a re-formation): a cheap
        checksum per rank (float64 sum and sum of squares of every parameter) gathered over the gloo group
        and compared exactly (replicas are bit-identical after a broadcast or an all-reduce)."""
        rt = self._rt
        assert rt._model is not None
        n = dist.get_world_size(rt._group) if dist.is_initialized() else 1
        if n == 1:
            return True
        mine = param_checksum(rt._model.parameters())
        every = [torch.zeros_like(mine) for _ in range(n)]
        dist.all_gather(every, mine, group=rt._group)
        if checksums_agree(every):
            return True
        rt._log.error("live_state_mismatch", step=rt.step, checksums=[c.tolist() for c in every],
                      effect="the replicas differ: the world restores from the tiers instead")
        return False

    def leave_if_signalled(self, where: str) -> None:
        """Exit at once when SIGTERM ended a wait for a world: no world will come, and the agent would
        otherwise wait out its stop timeout (30 s) before a SIGKILL. Nothing to save: no world to save with."""
        rt = self._rt
        if rt._session.signalled():
            rt._log.info("worker_stopped_waiting", where=where, step=rt.step,
                         reason="SIGTERM while waiting for a world: the agent is stopping its workers")
            rt._exit(proto.EXIT_RESIZE)

    def report_parked(self, reason: proto.ParkReason) -> None:
        rt = self._rt
        rt._session.report(proto.Parked(rank=rt.rank, local_rank=rt.local_rank, step=rt.step, reason=reason))
        rt._log.info("worker_parked", step=rt.step, reason=reason.value)

    def join_world(self, msg: proto.Reform) -> bool:
        """Join the world ``msg`` describes. False when it was called off before every rank arrived
        (:class:`rf.JoinAborted`: the agent saw a member go, or this node drains): nothing of this
        worker changed, it parks again."""
        rt = self._rt
        if dev.select_device(msg.local_rank) != rt.device:  # a live process cannot move its model
            raise RuntimeError(f"the new world gives this worker local rank {msg.local_rank} ({dev.select_device(msg.local_rank)}), "
                               f"but its state lives on {rt.device}")
        link = rt._session.link
        assert link is not None
        t0 = time.monotonic()
        try:
            rf.init_world(rank=msg.rank, world_size=msg.world_size, local_rank=msg.local_rank,
                          local_world_size=msg.local_world_size, master_addr=msg.master_addr,
                          master_port=msg.master_port, device=rt.device, group_rank=msg.group_rank, nodes=msg.nodes,
                          timeout_s=rt.pg_timeout_s, aborted=lambda: link.request is not proto.StopReason.NONE)
        except rf.JoinAborted as e:
            rt._log.warning("join_aborted", round=msg.round, rank=msg.rank, world_size=msg.world_size,
                            error=str(e)[:300], effect="parked again with the same state; the agent re-forms")
            return False
        rt.rank, rt.world_size, rt.local_rank = msg.rank, msg.world_size, msg.local_rank
        rt.local_world_size = msg.local_world_size
        rt.round = msg.round
        link.report(proto.Joined(rank=rt.rank, local_rank=rt.local_rank, round=rt.round))
        t_world = time.monotonic()
        rt._group = rt._new_gloo_group()
        rt._agreement.bind(rt._group)
        self.join_phases = {"world_s": round(t_world - t0, 3), "side_group_s": round(time.monotonic() - t_world, 3)}
        rt._log = log.bind(rank=rt.rank, world_size=rt.world_size, round=rt.round)
        if rt._metrics is not None:
            rt._metrics.rank = rt.rank
        return True

    def wait_for_first_world(self) -> None:
        """A standby worker (a warmed-up joiner): report ready, then join the world the agent forms."""
        rt = self._rt
        assert rt._session.linked, "a standby worker needs its agent"
        t0 = time.monotonic()
        rt._log.info("worker_warm", warmup_s=None)
        while True:  # again after a join the agent called off
            rt._session.report(proto.Parked(rank=-1, local_rank=rt.local_rank, step=0, reason=proto.ParkReason.STANDBY))
            msg = rt._session.wait_for_world(rt.reform_timeout_s)
            if msg is None:
                self.leave_if_signalled("standby")
                rt._log.error("standby_timeout", timeout_s=rt.reform_timeout_s)
                rt._exit(proto.EXIT_RESIZE)
            if self.join_world(msg):
                break
        rt._enter(WorkerState.RUNNING)
        rt._log.info("worker_joined", waited_s=round(time.monotonic() - t0, 3), **self.join_phases)

    def agree_initial_state(self) -> None:
        """Nothing was restored and no rank holds live state (a fresh job): where the strategy skipped its
        own broadcast at construction (``init_synced`` False: ddp in a job that re-forms in place), every
        rank takes rank 0's parameters and buffers, as DDP's construction would have given them."""
        rt = self._rt
        assert rt.strategy is not None and rt._model is not None
        if rt.strategy.init_synced or rt.world_size <= 1:
            return
        with torch.no_grad():
            for t in rt.strategy.replicated_tensors(rt._model).values():
                dist.broadcast(t, group=self.tensor_group, group_src=0)

    @property
    def tensor_group(self) -> Any:
        """The group replicated tensors are broadcast over: the default one on the GPU (NCCL), the gloo
        side group on the CPU."""
        rt = self._rt
        return None if rt.device.type == "cuda" else rt._group

    def sync_live_state(self, step: int | None) -> tuple[str, int | None]:
        """Hand the newest in-memory state to the ranks that lack it (see :func:`rf.sync_live_state`)."""
        rt = self._rt
        assert rt.strategy is not None and rt._model is not None and rt.cursor is not None
        if rt.strategy.reform_state is ReformState.CHECKPOINT:
            if step is None:
                return "none", None
            restored = rt.restore()  # every rank reloads the step committed at the stop, resharded
            return "checkpoint", restored
        tensors = rt.strategy.replicated_tensors(rt._model)
        stats = None
        if rt._tiers.interval is not None:
            rt._tiers.interval.tick()
            stats = rt._tiers.interval.stats.to_dict()
            if self.parked_for is not None and _is_loss(self.parked_for):
                # Sent as it will be once this rank counts the loss it parked for (after the sync): a
                # receiver takes that count and does not count the loss again (see park).
                stats["survived_losses"] += 1
                stats["survived_failures"] += self.parked_for is proto.ParkReason.PEER_LOST
        scaler = rt.strategy.scaler

        def extra() -> dict[str, Any]:  # made on the source rank only; tensors on the host (rf.to_host)
            assert rt.cursor is not None
            return rf.to_host({"step": rt.step, "cursor": rt.cursor.state_dict(),
                               "optimizer": rt._optimizer.state_dict() if rt._optimizer is not None else None,
                               "scaler": scaler.state_dict() if scaler is not None else None, "interval": stats})
        self.took_peer_stats = False

        def load(d: dict[str, Any]) -> None:
            assert rt.cursor is not None
            rt.step = int(d["step"])
            rt.cursor.load_state_dict(d["cursor"])
            if d["optimizer"] is not None and rt._optimizer is not None:
                rt._optimizer.load_state_dict(d["optimizer"])
            if d["scaler"] is not None and rt.strategy is not None and rt.strategy.scaler is not None:
                rt.strategy.scaler.load_state_dict(d["scaler"])
            if d.get("interval") and rt._tiers.interval is not None:  # a joiner takes the job's failure history too
                rt._tiers.interval.load_stats(IntervalStats.from_dict(d["interval"]))
                self.took_peer_stats = True

        # Flags and small state over the gloo group; the tensors over the default group when they live on
        # the GPU (NCCL), over the same gloo group on the CPU.
        outcome, live = rf.sync_live_state(step, tensors, extra=extra, load_extra=load, group=rt._group,
                                           tensor_group=self.tensor_group)
        # Every rank of the world is here (a survivor through resume_state, a joiner through Runtime.restore), so
        # the check is one collective on all of them; refused, all go on to the tiers.
        if outcome in ("agreed", "broadcast") and rt._tiers.replicated and not self.replicas_agree():
            if rt._tiers.memory is not None:
                rt._tiers.memory.discard_from(rt.step)  # which rank diverged is unknown: none of this step is used
            return "none", None
        return outcome, live
