"""The checkpoint tiers of one world, for one worker: the durable manager (tier 2), the memory tier
(tier 0: this rank's snapshots in its agent's node folder), replicas or XOR parity on other nodes
(tier 1) and the interval controller that schedules the periodic saves.

:class:`CheckpointTiers` builds them for each world (:meth:`~CheckpointTiers.make_manager`), takes the
snapshots (:meth:`~CheckpointTiers.snapshot`) and the saves (:meth:`~CheckpointTiers.save`,
:meth:`~CheckpointTiers.save_by` against a drain deadline), restores from the nearest tier that holds
the newest complete step (:meth:`~CheckpointTiers.restore`) and settles the background copies
(:meth:`~CheckpointTiers.settle`). It acts on its :class:`~trainguard.runtime.runtime.Runtime` (model,
optimizer, cursor, session, metrics). Not thread-safe: the training thread runs it, except what a
save's callback records from the persist thread (``persisted``, ``committed``).
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from trainguard.checkpoint import parity
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import CheckpointError
from trainguard.checkpoint.interval import IntervalController, IntervalMode, IntervalStats, memory_interval
from trainguard.checkpoint.manager import CheckpointManager, SaveResult, StepRef
from trainguard.checkpoint.memory import MemoryTier, MemoryTierError
from trainguard.checkpoint.memory import parity_buffers as memory_parity_buffers
from trainguard.checkpoint.replica import Replicator
from trainguard.contract import protocol as proto
from trainguard.runtime import device as dev
from trainguard.strategies.base import ReformState

if TYPE_CHECKING:
    from trainguard.runtime.runtime import Runtime


class SaveAbandoned(CheckpointError):
    """An emergency or resize checkpoint still running at the drain deadline was given up; the last
    committed step stands."""


def tier0_wanted(cfg: CheckpointConfig, *, replicated: bool, in_place: bool) -> bool:
    """Whether a worker takes in-memory snapshots: ``checkpoint.memory_interval_steps`` > 0, except for
    replicated state (DDP) re-forming in place, where every live peer holds any rank's state and the
    snapshots would only cost step time (unless ``checkpoint.memory_replicated_in_place``)."""
    if cfg.memory_interval_steps <= 0:
        return False
    return cfg.memory_replicated_in_place or not (replicated and in_place)


class CheckpointTiers:
    """The checkpoint tiers of one worker's current world (see the module docstring)."""

    def __init__(self, rt: Runtime, memory_dir: str) -> None:
        # A weak reference: a strong one would make each Runtime a reference cycle, kept (with its
        # checkpoint threads) until a garbage collection instead of freed when the script drops it.
        self._rt = weakref.proxy(rt)
        self.manager: CheckpointManager | None = None
        self.memory_dir = memory_dir if rt.checkpoint_config.memory_interval_steps > 0 else ""
        self.memory: MemoryTier | None = None
        """Tier 0: this rank's in-memory snapshots in its agent's node folder (None: off)."""
        self.replicator: Replicator | None = None
        """Tier 1: copies of the snapshots to the buddy rank on the next node (None: off)."""
        self.staging_ready = False
        self.committed: int | None = None
        """The newest step known committed on this rank (restored, or saved and waited for): what a
        failed or abandoned save falls back to. Local knowledge, no collective."""
        self.saved_step: int | None = None
        """The newest step saved or restored (identical on every rank: saves are agreed collectively)."""
        self.memory_every = rt.checkpoint_config.memory_interval_steps
        """Tier 0: steps between two snapshots, as agreed by the world at its last boundary (at least
        ``checkpoint.memory_interval_steps``; longer when ``memory_max_overhead`` asks)."""
        self.snapshot_mean_s: float | None = None
        self._waited_seen = 0.0  # the tier's waited_s when the last snapshot was booked
        self._unpinned_logged = False
        """Moving average of what this rank's snapshots block the training loop for."""
        self.interval: IntervalController | None = None
        self.persisted: list[tuple[float, bool]] = []  # (persist seconds, ok) of async saves, from their callbacks
        self.save_deferred = False
        """A periodic save was agreed while a previous one still persisted: taken at the first boundary
        at which none does (rank 0 keeps asking for it)."""
        self.interval_exported = 0.0

    def make_manager(self, base: StepRef | None = None) -> None:
        """``base``: the committed step this process's live state descends from, when it continues a
        previous world in place (the next checkpoint epoch records it: the lineage goes on)."""
        rt = self._rt
        if rt.checkpoint_config.url:
            # The manager makes its own gloo group: its background persist thread runs collectives that
            # must never interleave with the step-flag all-reduce the training thread runs on ours.
            # Built here (not by the manager) so that it gets workers.pg_timeout_s; the same one collective.
            group = rt._new_gloo_group() if rt.world_size > 1 else None
            cfg = rt.checkpoint_config
            # Tier 1's transfers get their own group; made on every rank alike (by config and strategy,
            # not by state).
            replica_group = (rt._new_gloo_group() if rt.world_size > 1 and cfg.memory_interval_steps > 0
                             and self.replicas_wanted else None)
            self.staging_ready = False
            self.manager = CheckpointManager(rt.checkpoint_config, rt.job_id, rank=rt.rank, world_size=rt.world_size,
                                             strategy=rt.strategy_name, process_group=group,
                                             rdzv_id=rt.rdzv_id, rdzv_round=rt.round, base=base,
                                             inflight_timeout_s=rt.inflight_timeout_s)
            if self.interval is None:  # one schedule for the process: it survives in-place re-formations
                self.interval = self.make_interval()
            self.bind_memory(replica_group)
            self.interval.set_world_size(rt.world_size, survivable=self.survivable())

    def bind_memory(self, replica_group: Any = None) -> None:
        """Tier 0 for this rank of the current world (a new world invalidates what its rank's files held),
        and tier 1 when a replica group was made."""
        rt = self._rt
        self.replicator = None
        if self.memory_dir and self.tier0_wanted:
            if self.memory is not None:
                assert rt.strategy is not None
                self.memory.rebind(rt.rank, rt.world_size, keep=rt.strategy.reform_state is ReformState.CHECKPOINT)
            else:
                try:
                    assert rt.strategy is not None
                    self.memory = MemoryTier(self.memory_dir, rank=rt.rank, world_size=rt.world_size,
                                             local_world_size=rt.local_world_size,
                                             max_bytes=rt.checkpoint_config.memory_max_bytes,
                                             copies=2 if self.replicas_wanted else 1,
                                             replicated=self.replicated)
                    self.memory.parity_restore = self.parity_wanted
                    self._waited_seen = 0.0
                except MemoryTierError as e:
                    self.memory_refused(e)
                hook = rt._faults.snapshot_written()
                if self.memory is not None and hook is not None:
                    self.memory.fault_hook = hook
        if replica_group is not None and self.parity_wanted:  # a collective: every rank, with or without tier 0
            self.bind_parity(replica_group)
        elif replica_group is not None:
            self.replicator = Replicator.create(self.memory, replica_group, rank=rt.rank,
                                                world_size=rt.world_size, local_world_size=rt.local_world_size,
                                                domain=rt.checkpoint_config.memory_failure_domain)

    def bind_parity(self, group: Any) -> None:
        """Tier 1 as XOR parity in this world (a collective): every rank's tier 0 exchanges its snapshots'
        parity with its group (:func:`~trainguard.checkpoint.parity.group_of`), when every rank has tier 0
        and the world has two nodes or more."""
        rt = self._rt
        table: list[Any] = [None] * rt.world_size
        dist.all_gather_object(table, self.memory is not None, group=group)
        got = parity.group_of(rt.rank, rt.world_size, rt.local_world_size)
        if not all(table) or got is None:
            if rt.rank == 0:
                rt._log.warning("memory_parity_off", ranks_without_tier0=[i for i, has in enumerate(table) if not has],
                                nodes=rt.world_size // max(1, rt.local_world_size),
                                effect="no parity in this world: two own slots per rank, a lost node restores from storage")
            return
        assert self.memory is not None
        members, index = got
        self.memory.set_parity(group, members, index)
        if rt.rank == 0:
            rt._log.info("memory_parity_groups", groups=len(parity.parity_groups(rt.world_size // max(1, rt.local_world_size))),
                         members=members, buffers_per_rank=round(memory_parity_buffers(len(members)), 3))

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole state (DDP: the strategy's ``reform_state`` is ``REPLICATED``)."""
        rt = self._rt
        return rt.strategy is not None and rt.strategy.reform_state is ReformState.REPLICATED

    @property
    def tier0_wanted(self) -> bool:
        """Whether tier 0 runs (given ``checkpoint.memory_interval_steps`` and an agent's folder): see
        :func:`tier0_wanted` (:meth:`Runtime.setup` logs ``memory_tier_redundant`` once where it does not)."""
        rt = self._rt
        return tier0_wanted(rt.checkpoint_config, replicated=self.replicated, in_place=rt.reform_enabled)

    @property
    def parity_wanted(self) -> bool:
        """Tier 1 as XOR parity (``checkpoint.memory_replica_parity``) where tier 1 runs."""
        rt = self._rt
        return self.replicas_wanted and rt.checkpoint_config.memory_replica_parity

    @property
    def replicas_wanted(self) -> bool:
        """Whether tier 1 runs: ``checkpoint.memory_replica``, except where the state is replicated (DDP):
        every rank's snapshot then restores any rank, so the survivors' own snapshots already outlive a
        lost node, and buddy replicas would only double the memory (:meth:`Runtime.setup` says so once)."""
        rt = self._rt
        return rt.checkpoint_config.memory_replica and not self.replicated

    def memory_refused(self, e: MemoryTierError) -> None:
        """Tier 0 cannot work as configured: say why and how to fix it, and go on without it (training and
        the durable checkpoints are not stopped for it)."""
        rt = self._rt
        rt._log.error("memory_tier_refused", error=str(e), effect="no in-memory snapshots in this worker; "
                      "an unannounced failure restores from storage")
        if self.memory is not None:
            self.memory.invalidate()
            self.memory.close()
        self.memory, self.memory_dir, self.replicator = None, "", None
        rt._metrics.observe_memory(None, 0)

    def survivable(self) -> bool:
        """Whether the state of this world outlives the loss of one node (the interval controller's
        rollback model): two nodes or more, and the survivors hold it (DDP re-formed in place, or DDP
        with tier 0: every rank's snapshot restores any rank) or a buddy on another node does (tier 1)."""
        rt = self._rt
        nodes = rt.world_size // max(1, rt.local_world_size)
        in_memory = self.replicated and (rt.reform_enabled or self.memory is not None)
        parity_on = self.memory is not None and self.memory.parity
        return nodes >= 2 and (in_memory or self.replicator is not None or parity_on)

    def make_interval(self) -> IntervalController:
        """The periodic checkpoint schedule (``checkpoint.interval``). Global rank 0 decides; the step
        flag all-reduce tells every other rank."""
        rt = self._rt
        cfg = rt.checkpoint_config
        policy, deprecated = cfg.interval_policy()
        if deprecated and rt.rank == 0:
            rt._log.warning("checkpoint_config_deprecated", keys=[f"checkpoint.{k}" for k in deprecated],
                            fix="use `checkpoint.interval: <steps>` / `<duration>` (or `auto`) instead")
        return IntervalController(policy, cfg.auto_settings(), world_size=rt.world_size, sync_saves=not cfg.async_save)

    def restore(self, step: int | None = None) -> int:
        """:meth:`Runtime.restore` without the live hand-over: the nearest tier that holds the newest
        complete step (a collective on every rank of the world, as ``Runtime.restore`` is)."""
        rt = self._rt
        if self.manager is None:
            rt._reform.agree_initial_state()
            return rt.step
        state = rt._state()
        t0 = time.monotonic()
        step = self.manager.restore(state, step, memory=self.memory)
        seconds = time.monotonic() - t0
        tier = self.manager.last_restored_tier
        in_memory = tier in (proto.CheckpointTier.MEMORY, proto.CheckpointTier.PEER)
        if self.memory is not None and not in_memory:
            self.memory.invalidate_all()  # what the node's folder held is not what the job continues from
        rt._metrics.observe_restore_tier(tier.value)
        ctl = self.interval
        if step is not None:
            rt.step = rt._trainer.step
            if tier is proto.CheckpointTier.STORAGE:  # a snapshot in memory is not durable: finish() saves it
                self.saved_step = rt.step
                self.note_committed(step)
            assert rt.cursor is not None
            rt.cursor.load_state_dict(rt._trainer.cursor)
            restored = self.manager.last_restored
            # A snapshot in memory (or a buddy's replica) is the periodic state of a world that died without notice.
            kind = (restored.kind if restored is not None else
                    proto.CheckpointKind.PERIODIC.value if in_memory else "other")
            if ctl is not None:
                ctl.load_stats(IntervalStats.from_dict(rt._trainer.extras.get("interval")))
                ctl.observe_restore(seconds, kind, self.manager.last_restored_repeats,
                                    in_place=rt._reform.parked_for is not None, from_memory=in_memory)
            rt._metrics.observe_restore(step, kind, skipped=self.manager.last_restore_skipped,
                                        corrupt=self.manager.last_restore_corrupt)
            rt._log.info("worker_restored", step=step, kind=kind, source=tier.value, restore_s=round(seconds, 3),
                         saved_world_size=rt._trainer.saved_world_size, epoch=rt.cursor.epoch,
                         consumed=rt.cursor.consumed,
                         unannounced_failures=ctl.stats.unannounced_failures if ctl is not None else None)
            rt._session.report(proto.Restored(step=step, rank=rt.rank))
        else:
            # Nothing committed yet: the run starts at step 0. Tell the agent (work a world that died
            # before its first checkpoint trained is lost) and count that world as a failure.
            if ctl is not None and self.manager.last_restored_repeats:
                ctl.observe_restore(None, "none", self.manager.last_restored_repeats)
            rt._metrics.observe_restore(0, "other")
            rt._reform.agree_initial_state()
        if self.interval is not None:
            self.interval.begin()
        rt._step_started = time.monotonic()
        rt._timer.start()
        return rt.step

    def save(self, kind: str) -> tuple[float, SaveResult | None]:
        """Save the current step; return the seconds ``save`` took and its result when it is committed
        already (emergency/resize saves block), None while it persists in the background."""
        rt = self._rt
        assert self.manager is not None
        t0 = time.monotonic()
        self.saved_step = rt.step
        background = kind in (proto.CheckpointKind.PERIODIC.value, proto.CheckpointKind.NOTICE.value)
        # Tier 2 fed from tier 0: a snapshot taken at this very boundary holds this state already (lend()
        # hands out none taken before the state last changed otherwise than by a step), so the persist
        # thread stages from it and this thread copies nothing (only in the background: a blocking save
        # waits for its copies either way).
        source = self.memory.lend(rt.step) if background and self.memory is not None else None
        self.manager.guard(rt._optimizer)  # a GPU copy of its state holds back its step only, not the forward
        # A stop's save: the world waits for its commit (the survivors re-form after it, the leaver leaves),
        # not for rank 0's garbage collection: a worker that exits runs it at the manager's close, one that
        # re-forms in place leaves it to the next world's first commit.
        stop = kind in (proto.CheckpointKind.EMERGENCY.value, proto.CheckpointKind.RESIZE.value)
        done = self.manager.save(rt.step, rt._state(), kind=kind, block=not background, source=source, collect=not stop)
        seconds = time.monotonic() - t0
        stage, blocked, step = self.manager.last_stage_s, self.manager.last_blocked_s, rt.step
        persisted = self.persisted  # list.append from the persist thread; drained by the training thread

        def record(f: Future[SaveResult]) -> None:  # the persist thread, or here
            r = None if f.cancelled() or f.exception() is not None else f.result()
            if r is not None:
                self.note_committed(r.step)
            if r is None:
                rt._metrics.observe_checkpoint(kind, stage, None, blocked, 0, step, False)
            elif not r.skipped:
                rt._metrics.observe_checkpoint(kind, r.stage_s, r.persist_s, r.blocked_s, r.nbytes, r.step, True)
                rt._pace.checkpoint_done(r.stage_s + r.persist_s)  # reported to the agent (its drain lead)
            if background:
                persisted.append((r.persist_s if r is not None else 0.0, r is not None and not r.skipped))

        committed_now = done.done()
        if self.interval is not None:
            self.interval.observe_save(blocked, seconds - blocked if committed_now else None)
        done.add_done_callback(record)
        return seconds, (done.result() if committed_now and done.exception() is None else None)

    def interval_step(self, now: float, ahead: int = 0) -> bool:
        """Update the interval controller (its steps are fed by :meth:`Runtime.end_step`); return
        whether this rank says a periodic save is due after the step ``ahead`` steps on (the one the
        agreement will be acted on at)."""
        rt = self._rt
        ctl = self.interval
        assert ctl is not None
        fresh = bool(self.persisted)
        while self.persisted:
            persist_s, ok = self.persisted.pop(0)
            if ok:
                ctl.observe_persist(persist_s)
        change = ctl.update(now)
        if rt.rank != 0:
            return False
        if change is not None:
            rt._log.info("checkpoint_interval_changed", old_s=None if change.old_s is None else round(change.old_s, 3),
                         new_s=round(change.new_s, 3), optimum_s=round(change.optimum_s, 3), reason=change.reason,
                         bound=change.bound, **change.inputs)
        if change is not None or fresh or now - self.interval_exported >= 5.0:
            self.interval_exported = now
            opt, _, _ = ctl.optimum()
            rt._metrics.observe_interval({
                "interval_s": ctl.interval_s if ctl.policy.mode is IntervalMode.AUTO else None, "optimum_s": opt,
                "save_cost_s": ctl.save_cost_s, "persist_s": ctl.stats.persist_s, "restore_s": ctl.stats.restore_s,
                "mtbf_s": ctl.mtbf_s, "rollback_probability": ctl.rollback_probability,
                "unannounced_failures": ctl.stats.unannounced_failures, "survived_losses": ctl.stats.survived_losses})
        return ctl.due(rt.step + ahead, now)

    def memory_proposal(self) -> int:
        """This rank's tier-0 snapshot interval: see :func:`~trainguard.checkpoint.interval.memory_interval`."""
        rt = self._rt
        cfg = rt.checkpoint_config
        return memory_interval(cfg.memory_interval_steps, cfg.memory_max_overhead, self.snapshot_mean_s,
                               rt._agreement.step_mean_s, self.memory_every)

    def snapshot(self) -> None:
        """Tier 0: copy this step's checkpoint state into the agent's shared memory, every
        ``checkpoint.memory_interval_steps`` steps. No collective: completeness is agreed at restore."""
        rt = self._rt
        mem = self.memory
        if mem is None or self.manager is None or rt.step % self.memory_every:
            return
        rep = self.replicator
        if rep is not None:
            rep.settle()  # the slot about to be written may be the one the buddy transfer reads
        if mem.parity and mem.parity_failed is not None:
            return  # the exchange failed in this world (a peer is gone): the next world binds parity again
        mem.guard(rt._optimizer)  # its parameters and state are copied beside the next forward/backward
        try:
            r = mem.snapshot(rt.step, rt._state(), world=f"{rt.rdzv_id}/{rt.round}",
                             extra={"base": self.manager.base})
        except MemoryTierError as e:
            self.memory_refused(e)
            return
        if rep is not None and self.replicator is not None:  # all ranks alike: every rank reached this step
            rep.replicate()
            if rep.failed is not None:
                self.replicator = None
        if mem.pin_error is not None and not self._unpinned_logged:
            self._unpinned_logged = True
            rt._log.warning("memory_tier_unpinned", reason=mem.pin_error,
                            effect="tier-0 copies from the GPU go through pageable memory (slower, blocking)")
        # The cost: the call, plus what the optimizer's step waited for the previous snapshot's copies
        # (the guard; on a GPU the copy of the whole state runs beside forward and backward).
        waited, self._waited_seen = mem.waited_s - self._waited_seen, mem.waited_s
        cost = r.seconds + max(0.0, waited)
        m = self.snapshot_mean_s
        self.snapshot_mean_s = cost if m is None else 0.9 * m + 0.1 * cost
        done = rep.last_step if rep is not None else mem.parity_step if mem.parity else None
        lag = rt.step - done if done is not None else None
        rt._metrics.observe_memory(r.seconds, mem.nbytes + mem.replica_bytes, lag, self.memory_every)

    def settle(self, abandon_after: float | None = None) -> None:
        """Wait for the tier-0 snapshot still copying in the background (before anything but the
        guarded ``optimizer.step()`` changes parameters or optimizer state). ``abandon_after`` (parity: an
        exchange may be stuck with a vanished peer): wait at most that long, then leave it behind (it
        writes nothing after that; the previous snapshot stands)."""
        rt = self._rt
        if self.manager is not None:
            self.manager.order_after_copies()  # a GPU save's copy of what is about to change (GPU-side)
        if self.memory is not None:
            if abandon_after is not None and self.memory.parity:
                if not self.memory.abandon(abandon_after):
                    rt._log.warning("memory_parity_abandoned", step=rt.step, waited_s=abandon_after,
                                    effect="this snapshot is not written; the previous one stands")
                return
            self.memory.settle()

    def save_by(self, kind: str, deadline: float | None) -> tuple[float, SaveResult | None, int | None]:
        """Save this step and wait for its commit; return ``(seconds, its result, committed step)``.

        With a ``deadline`` (epoch seconds: the earliest drain deadline any rank knows, agreed at the
        step boundary) the save runs in a helper thread and is abandoned when the deadline passes
        (:class:`SaveAbandoned`): a peer that vanished without a TCP reset leaves the save's gloo
        collectives waiting for ``workers.pg_timeout_s`` (torch's gloo default: 30 minutes), far past
        any notice. The thread stays blocked; the caller exits the process. Without a deadline (a
        resize), the process groups' timeout bounds the wait."""
        rt = self._rt
        assert self.manager is not None
        manager = self.manager
        if deadline is None:
            seconds, result = self.save(kind)
            return seconds, result, self.note_committed(manager.wait())
        box: dict[str, Any] = {}

        def run() -> None:
            dev.bind(rt.device)  # CUDA's current device is per thread: not device 0 for this one
            try:
                seconds, result = self.save(kind)
                box["ok"] = (seconds, result, self.note_committed(manager.wait()))
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                box["err"] = e

        t = threading.Thread(target=run, name="trainguard-emergency-save", daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.time()))
        if t.is_alive():
            raise SaveAbandoned(f"the {kind} checkpoint of step {rt.step} was still running at the drain deadline")
        if "err" in box:
            raise box["err"]
        return box["ok"]

    def note_committed(self, step: int | None) -> int | None:
        if step is not None and (self.committed is None or step > self.committed):
            self.committed = step
        return step
