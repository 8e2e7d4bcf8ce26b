"""The checkpoint manager the worker runtime calls: async sharded save, commit, restore, retention.

This module orchestrates; the concepts live next to it: :mod:`~trainguard.checkpoint.epochs`
(claiming fencing epochs in the store), :mod:`~trainguard.checkpoint.discovery` (what a run holds,
lineages, what garbage collection may delete), :mod:`~trainguard.checkpoint.integrity` (proven
corrupt vs unreadable now), :mod:`~trainguard.checkpoint.restore` (verify and load one step),
:mod:`~trainguard.checkpoint.staging` (the host copy), :mod:`~trainguard.checkpoint.retention` (what
goes after a commit), :mod:`~trainguard.checkpoint.collective`
(the checkpoint group; errors reach every rank), :mod:`~trainguard.checkpoint.storage` (all I/O) and
:mod:`~trainguard.checkpoint.retry` (the one backoff policy).

Threading and collectives
    Every public method is called from the training thread, on every rank, in the same order (they
    are collectives). Persisting runs on one background thread per manager. All checkpoint
    collectives (DCP's plan/write exchange, the checksum gather, the commit broadcast, the epoch
    broadcast) go over a *separate gloo process group*: thread-based async save on the default group
    deadlocked against FSDP collectives of the training loop on CPU. The group is passed in, or
    created with ``dist.new_group(backend="gloo")`` in the constructor (itself a collective) when a
    default group exists; without ``torch.distributed`` (world size 1) nothing is collective. Every
    error on rank 0 is broadcast, so no rank is left waiting in a collective.

Epochs (fencing)
    When the world forms — its first successful restore, else its first save, or
    :meth:`CheckpointManager.new_world` / :meth:`~CheckpointManager.claim_epoch` — rank 0 claims the
    next epoch in the store with a create-exclusive write and broadcasts it. Only the newest epoch
    commits: rank 0 checks before the shards are written and again right before the manifest is
    written. A world that finds a newer epoch logs ``checkpoint_fenced`` once and from then on
    refuses every save without touching storage (it does not crash: a crash would restart it, and
    the restarted world would claim an even newer epoch and fence the other world in turn).

Saving
    The in-flight rule, the commit protocol and retention: :mod:`~trainguard.checkpoint.durablesave`
    (:class:`~trainguard.checkpoint.durablesave.DurableSave`, the save half of the manager) and
    :mod:`~trainguard.checkpoint.retention`.

Restore
    With the memory tier, the nodes' memory first (tiers 0 and 1: :mod:`~trainguard.checkpoint.nearest`),
    storage when it holds no newer complete set. From storage: rank 0 lists the run (retrying what is unreadable now until ``restore_deadline_s``) and picks the
    restore lineage, newest first. Each step is verified (sizes, CRC32s; files split across ranks) and
    loaded with ``dcp.load`` (resharding). A *proven-corrupt* step is skipped
    (``checkpoint_restore_fallback``) and quarantined after the next commit; a step that is only
    *unreadable now* is retried with backoff until the deadline, and then fails the restore
    (``checkpoint.on_unreadable: fail``) or is skipped without being marked (``fallback``). A restore
    that fails writes nothing. A restore that succeeds claims a new epoch based on the loaded step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from trainguard.checkpoint.collective import Group
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.discovery import Scan, StepRef, scan_run
from trainguard.checkpoint.durablesave import DurableSave, FaultHook, SaveResult
from trainguard.checkpoint.epochs import EpochRecord, check_owner, claim_epoch, new_record
from trainguard.checkpoint.errors import CheckpointCorrupt, CheckpointError, FencedError, InflightTimeout, StorageError
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.memory import MemoryTier
from trainguard.checkpoint.nearest import NearestTiers
from trainguard.checkpoint.restore import StepLoader
from trainguard.checkpoint.retention import Retention
from trainguard.checkpoint.staging import Stager
from trainguard.checkpoint.storage import Storage
from trainguard.contract.log import get_logger
from trainguard.contract.protocol import CheckpointTier

log = get_logger("trainguard.checkpoint")


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed step as seen by discovery (what ``list()`` and the CLI show)."""

    step: int
    epoch: int
    kind: str
    world_size: int
    strategy: str
    total_bytes: int
    num_files: int
    created: str
    url: str
    in_lineage: bool
    """Whether the step is in the restore lineage (what a restore would continue from)."""

    @classmethod
    def from_manifest(cls, m: Manifest, url: str, in_lineage: bool) -> CheckpointInfo:
        return cls(step=m.step, epoch=m.epoch, kind=m.kind, world_size=m.world_size, strategy=m.strategy,
                   total_bytes=m.total_bytes, num_files=len(m.files), created=m.created, url=url,
                   in_lineage=in_lineage)


class CheckpointManager(DurableSave):
    """Async sharded checkpoints of one run. See the module docstring for protocol and threading.

    Args:
        config: the ``checkpoint`` config section (``url`` must be set).
        run_id: the job's run id; checkpoints live under ``<url>/<run_id>/``.
        rank, world_size: this process's rank and the world size (of the checkpoint group).
        strategy: recorded in the manifest (``ddp``, ``fsdp``, ...).
        process_group: gloo group for checkpoint collectives; created when None and a default group
            exists with ``world_size > 1`` (the constructor is then a collective).
        storage: a prepared :class:`Storage` (tests); built from ``config`` when None.
        rdzv_id, rdzv_round: the rendezvous this world formed in; written into the epoch record for
            people reading it (rounds restart at 0 with a fresh store: they never fence anything).
        base: the committed step this process's state descends from when it continues a previous
            world in place (the manager of that world's :attr:`base`): the epoch this world claims
            records it, so the lineage goes on. Ranks that do not know it (joiners) pass None.
        fault_hook: see :data:`FaultHook` (tests).
        inflight_timeout_s: how long a :meth:`save`, :meth:`restore` or :meth:`close` waits for the
            previous background save (None: no bound). A persist stuck past it (a vanished peer in its
            collectives, a storage call that never returns) makes the waiting call raise
            :class:`InflightTimeout` instead of hanging; the last committed step stands.
    """

    def __init__(self, config: CheckpointConfig, run_id: str, *, rank: int, world_size: int, strategy: str = "ddp",
                 process_group: Any = None, storage: Storage | None = None, rdzv_id: str = "", rdzv_round: int = -1,
                 base: StepRef | None = None, fault_hook: FaultHook | None = None,
                 inflight_timeout_s: float | None = None) -> None:
        self._closed = True  # until fully built: close() must be safe on a half-built object
        self.inflight_timeout_s = inflight_timeout_s
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[SaveResult] | None = None
        self._writer: Any = None
        """The DCP writer of the save under way (background thread), for :meth:`cancel_inflight`."""
        self._cancel_why: str | None = None
        self.last_blocked_s = 0.0
        """Seconds the last :meth:`save` blocked its caller (waiting for the previous save + staging)."""
        self.last_stage_s = 0.0
        """Seconds the last :meth:`save` spent copying the state into the staging buffers."""
        self.last_restored: Manifest | None = None
        """Manifest of the step the last :meth:`restore` loaded, or None."""
        self.last_restored_repeats = 0
        """How many other rounds had registered the step the last :meth:`restore` loaded (or, when there
        was none, the empty start) as their starting point: each of them died without committing
        anything newer. With the manifest's ``kind`` (``periodic``: its writer died too) this tells
        failures from planned re-formations."""
        self.last_restored_tier = CheckpointTier.NONE
        """Where the last :meth:`restore` found its state: ``memory`` (tier 0), ``peer`` (some ranks got a
        buddy's replica, tier 1), ``storage``, or ``none``."""
        if not config.url:
            raise CheckpointError("checkpoint.url is empty. Fix: set YAML key `checkpoint.url` or env var "
                                  "TRAINGUARD_CHECKPOINT_URL to a path, s3://, gs:// or memory:// URL")
        if not run_id or "/" in run_id or run_id in (".", ".."):
            raise CheckpointError(f"invalid run_id {run_id!r}: it becomes one path component under "
                                  f"{config.url!r}. Fix: use a non-empty id without '/'")
        self.config = config
        self.run_id = run_id
        self.strategy = strategy
        self.rdzv_id = rdzv_id
        self.rdzv_round = rdzv_round
        self.fault_hook = fault_hook
        self.storage = storage or Storage(config.url, config.storage_options, retry_attempts=config.retry_attempts,
                                          retry_deadline_s=config.retry_deadline_s)
        self._bind_world(rank, world_size, process_group)
        self._stager = Stager()
        self._inflight_step: int | None = None
        self._last_committed: int | None = None
        self._record: EpochRecord | None = None
        self._base: StepRef | None = base
        self._fenced: FencedError | None = None
        self._retention = Retention(self.storage, run_id, config)
        self._collect_owed: StepRef | None = None
        """Rank 0: a commit whose garbage collection ``save(collect=False)`` deferred (:meth:`close` runs it)."""
        self.last_restore_corrupt = 0
        """Committed steps the last :meth:`restore` found proven corrupt (skipped; quarantined by the next
        commit's cleanup)."""
        self.last_restore_skipped: int | None = None
        """The newest committed step the last :meth:`restore` skipped (proven corrupt, or unreadable with
        ``on_unreadable: fallback``); None when it restored the newest. The steps between it and the
        restored step were committed once and are trained again."""
        self._committed_here: dict[int, SaveResult] = {}
        self._log = log.bind(run_id=run_id, rank=self.rank, world_size=self.world_size)
        self._closed = False

    def _bind_world(self, rank: int, world_size: int, process_group: Any) -> None:
        if not 0 <= rank < world_size:
            raise CheckpointError(f"rank {rank} is not in [0, world_size={world_size}). Fix: pass the worker's "
                                  f"rank and world size")
        distributed = world_size > 1
        if distributed:
            if not (dist.is_available() and dist.is_initialized()):
                raise CheckpointError(f"world_size={world_size} but torch.distributed is not initialised. Fix: "
                                      f"call init_process_group before creating the CheckpointManager")
            pg = process_group if process_group is not None else dist.new_group(backend="gloo")
            if dist.get_world_size(pg) != world_size or dist.get_rank(pg) != rank:
                raise CheckpointError(f"checkpoint process group has rank {dist.get_rank(pg)} of "
                                      f"{dist.get_world_size(pg)}, expected {rank} of {world_size}. Fix: "
                                      f"pass a group spanning all ranks of the job")
        else:
            pg = process_group
        self.rank, self.world_size, self._distributed, self._pg = rank, world_size, distributed, pg
        self._group = Group(pg, rank, world_size)

    # -- public API -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``<url>/<run_id>`` (no credentials)."""
        return self.storage.url_of(self.run_id)

    @property
    def epoch(self) -> int | None:
        """This world's epoch, once claimed (first restore or save); None before."""
        return self._record.epoch if self._record is not None else None

    @property
    def epoch_record(self) -> EpochRecord | None:
        """The record this world claimed (world id, base step, ...), or None before the claim."""
        return self._record

    @property
    def base(self) -> StepRef | None:
        """The committed step this world's state descends from: the last one it restored or committed."""
        return self._base

    @property
    def fenced(self) -> bool:
        """True once a newer epoch owns the run: this world's saves are refused until :meth:`new_world`."""
        return self._fenced is not None


    def latest(self) -> int | None:
        """The newest committed step of the restore lineage, or None (a collective when world_size > 1)."""
        line = self._on_rank0(lambda: scan_run(self.storage, self.run_id).restore_lineage())
        return line[-1].step if line else None

    def list(self) -> list[CheckpointInfo]:
        """Every committed step, oldest first (a collective when world_size > 1)."""
        def infos() -> list[CheckpointInfo]:
            scan = scan_run(self.storage, self.run_id)
            line = set(scan.restore_lineage())
            return [CheckpointInfo.from_manifest(m, self.storage.url_of(f"{self.run_id}/{m.dir_name}"),
                                                 StepRef(m.step, m.epoch) in line) for m in scan.manifests()]

        return self._on_rank0(infos)

    def claim_epoch(self) -> int:
        """Claim a new epoch for this world now (a collective); return it. This world's state is taken
        to descend from the last step it restored or committed."""
        self._check_open()
        self._finish_inflight()
        self._claim()
        assert self._record is not None
        return self._record.epoch

    def new_world(self, *, rank: int, world_size: int, process_group: Any = None, rdzv_round: int = -1,
                  rdzv_id: str | None = None) -> int:
        """The world re-formed in place (new ranks or size, live state kept): rebind and claim a new
        epoch (a collective over the *new* world; with ``world_size > 1`` and no ``process_group`` a gloo
        group is created over the new default group). Return the epoch."""
        self._check_open()
        self._finish_inflight()
        self._bind_world(rank, world_size, process_group)
        self.rdzv_round = rdzv_round
        if rdzv_id is not None:
            self.rdzv_id = rdzv_id
        self._log = log.bind(run_id=self.run_id, rank=self.rank, world_size=self.world_size)
        return self.claim_epoch()

    def restore(self, state: dict[str, Any], step: int | None = None, *, memory: MemoryTier | None = None) -> int | None:
        """Load the newest committed step of the restore lineage (or ``step``) into ``state`` in place;
        return it, or None when the run has no committed step. A collective.

        With ``memory`` (this rank's tier 0) and no ``step``: the newest step for which an intact
        in-memory snapshot of every rank exists — its own, or a buddy node's replica (tier 1), handed
        over point to point — is loaded instead, when storage holds no newer committed step
        (:func:`~trainguard.checkpoint.nearest.choose_sources`); :attr:`last_restored_tier` says which tier
        was used (``peer`` when any rank loaded a replica). The world's epoch is then based on the
        committed step that snapshot descends from.

        Reshards to the current world size. Skips a step only when it is proven corrupt; retries a
        step that is unreadable now until ``checkpoint.restore_deadline_s``, then raises
        :class:`StorageError` (or, with ``on_unreadable: fallback``, tries the next older step). Raises
        :class:`CheckpointNotFound` if ``step`` is given and not committed, :class:`CheckpointCorrupt`
        if steps exist but all are proven corrupt. Writes nothing unless it succeeds; then it claims
        this world's epoch, based on the restored step.
        """
        self._check_open()
        self._finish_inflight()
        self._bind(state)
        t_start = time.monotonic()
        deadline = t_start + self.config.restore_deadline_s
        loader = StepLoader(self.storage, self.run_id, self._group, verify_files=self.config.verify, log=self._log)
        plan = self._on_rank0(lambda: loader.plan(deadline, step))
        self.last_restored_tier = CheckpointTier.NONE
        self.last_restore_corrupt, self.last_restore_skipped = 0, None
        if memory is not None and step is None:
            got = self._restore_nearest(state, memory, plan.candidates[0][0].step if plan.candidates else None, t_start)
            if got is not None:
                return got
        candidates = [ref for ref, _ in plan.candidates]
        if not candidates:
            if plan.invalid:
                listed = "; ".join(f"{r.name}: {why}" for r, why in plan.invalid)[:2000]
                raise CheckpointCorrupt(f"no committed checkpoint under {self.url} can be restored: every step "
                                        f"directory has a corrupt manifest ({listed}). Nothing was changed. Fix: "
                                        f"delete those step directories to start the run from scratch")
            self.last_restored = None
            self.last_restored_repeats = plan.starts.get((-1, -1), 0)
            self._log.info("checkpoint_restore_none", url=self.url, ignored=plan.ignored)
            return None
        problems: list[str] = []
        all_corrupt = True
        for i, (ref, m) in enumerate(plan.candidates):
            where = self.storage.url_of(f"{self.run_id}/{ref.name}")
            t0 = time.monotonic()
            verdict = loader.attempt(ref, m, state, deadline)
            if verdict.status == "ok":
                assert m is not None
                self._base = ref
                self.last_restored = m
                self.last_restored_tier = CheckpointTier.STORAGE
                self.last_restored_repeats = plan.starts.get((ref.step, ref.epoch), 0)
                self._claim()
                self._log.info("checkpoint_restored", step=m.step, tier=CheckpointTier.STORAGE.value,
                               saved_epoch=m.epoch, epoch=self.epoch,
                               url=where, saved_world_size=m.world_size,
                               load_s=round(time.monotonic() - t0, 3), total_s=round(time.monotonic() - t_start, 3),
                               verified=self.config.verify, skipped=len(problems))
                return m.step
            problems.append(f"step {ref.step} (epoch {ref.epoch}): {verdict.reason}")
            nxt = candidates[i + 1] if i + 1 < len(candidates) else None
            if verdict.status == "corrupt":
                self._retention.mark_corrupt(ref, verdict.reason)
                self.last_restore_corrupt += 1
                self.last_restore_skipped = max(self.last_restore_skipped or 0, ref.step)
                self._log.error("checkpoint_restore_fallback", step=ref.step, saved_epoch=ref.epoch,
                                proven_corrupt=True, url=where, reason=verdict.reason[:1000],
                                next_step=nxt.step if nxt else None)
                continue
            all_corrupt = False
            what = f"step {ref.step} at {where} is unreadable{' now' if verdict.transient else ''}: {verdict.reason}"
            if self.config.on_unreadable == "fallback" and step is None:
                self._log.error("checkpoint_restore_fallback", step=ref.step, saved_epoch=ref.epoch,
                                proven_corrupt=False, url=where, reason=verdict.reason[:1000],
                                next_step=nxt.step if nxt else None, note="kept as it is; nothing marked or deleted")
                self.last_restore_skipped = max(self.last_restore_skipped or 0, ref.step)
                continue
            self._log.error("checkpoint_restore_failed", step=ref.step, saved_epoch=ref.epoch,
                            transient=verdict.transient, reason=verdict.reason[:1000],
                            waited_s=round(time.monotonic() - t_start, 1))
            fix = ("check the storage endpoint; raise checkpoint.restore_deadline_s to wait longer"
                   if verdict.transient else
                   "check that the credentials may read every object under the checkpoint URL (S3 s3:GetObject "
                   "and s3:ListBucket, GCS storage.objects.get/list)")
            raise StorageError(f"restore failed: {what}. Nothing in storage was changed. Fix: {fix}; or set "
                               f"checkpoint.on_unreadable=fallback (TRAINGUARD_CHECKPOINT_ON_UNREADABLE) to restore "
                               f"an older step instead", transient=verdict.transient)
        detail = "; ".join(problems)[:4000]
        if all_corrupt:
            raise CheckpointCorrupt(f"no committed checkpoint under {self.url} could be restored: {detail}. Nothing "
                                    f"was changed. Fix: check the storage for damaged shards; delete the damaged step "
                                    f"directories to start from an older step, or start the run from scratch")
        raise StorageError(f"no committed checkpoint under {self.url} could be restored: {detail}. Nothing was "
                           f"changed. Fix: check the storage endpoint and credentials, then restart", transient=True)

    def close(self, collect: bool = True) -> None:
        """Wait for the in-flight save (errors logged), run the garbage collection a stop's save deferred
        (rank 0; ``collect=False``: leave it to the next world's first commit, which plans from a fresh
        scan: a survivor's re-formation does not wait for it), and stop the background thread. Idempotent."""
        if getattr(self, "_closed", True) and getattr(self, "_executor", None) is None:
            return
        stuck = False
        try:
            self._finish_inflight()
            if collect:
                self._collect_deferred()
            self._collect_owed = None
        except InflightTimeout as e:
            stuck = True
            self._log.error("checkpoint_inflight_abandoned", error=str(e), effect="the manager closes without it; "
                            "the last committed step stands")
        finally:
            ex, self._executor = self._executor, None
            if ex is not None:
                ex.shutdown(wait=not stuck)
            self._closed = True

    def release_group(self) -> None:
        """After :meth:`close`, once the process groups are destroyed: drop this manager's reference
        to its checkpoint group, so that the group is freed now rather than at interpreter exit."""
        if not self._closed:
            raise CheckpointError(f"checkpoint manager for {self.url} is open: close it before releasing its group")
        self._pg = None
        self._group = Group(None, self.rank, self.world_size)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals: collectives -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.url} is closed")

    def _bind(self, state: dict[str, Any]) -> None:
        for v in state.values():
            bind = getattr(v, "bind_checkpoint_group", None)
            if callable(bind):
                bind(self._pg)

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        return self._group.on_rank0(fn, url=self.url)

    def _fault(self, point: str, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point, step)

    # -- internals: epochs ----------------------------------------------------------------------

    def _claim(self) -> None:
        """Claim a new epoch (rank 0) and give it to every rank. Clears the fenced state. The base is
        the newest any rank knows (after an in-place re-formation a joiner knows none)."""
        base = max((b for b in self._group.all_gather(self._base) if b is not None), default=None)

        def claim() -> tuple[EpochRecord, int, float]:
            t0 = time.monotonic()
            rec, conflicts = claim_epoch(self.storage, self.run_id, lambda n, mode: new_record(
                n, mode, base_step=base.step if base else -1, base_epoch=base.epoch if base else -1,
                world_size=self.world_size, rdzv_id=self.rdzv_id, rdzv_round=self.rdzv_round))
            return rec, conflicts, time.monotonic() - t0

        rec, conflicts, took = self._on_rank0(claim)
        self._record, self._fenced, self._committed_here = rec, None, {}
        self._log = log.bind(run_id=self.run_id, rank=self.rank, world_size=self.world_size, epoch=rec.epoch)
        if self.rank == 0:
            self._log.info("checkpoint_epoch_claimed", epoch=rec.epoch, world_id=rec.world_id, base_step=rec.base_step,
                           base_epoch=rec.base_epoch, rdzv_id=rec.rdzv_id, rdzv_round=rec.rdzv_round,
                           conditional_create=rec.conditional_create, conflicts=conflicts,
                           claim_ms=round(took * 1e3, 2))

    def _check_owner(self) -> None:
        assert self._record is not None
        check_owner(self.storage, self.run_id, self._record)

    def _set_fenced(self, e: FencedError) -> None:
        if self._fenced is None:
            self._fenced = e
            self._log.error("checkpoint_fenced", epoch=e.epoch, newest_epoch=e.newest_epoch,
                            last_committed=self._last_committed, error=str(e))

    # -- internals: save ------------------------------------------------------------------------

    # -- internals: restore ---------------------------------------------------------------------

    def _restore_nearest(self, state: dict[str, Any], memory: MemoryTier, newest_durable: int | None,
                         t_start: float) -> int | None:
        """Tiers 0 and 1 (a collective, :class:`~trainguard.checkpoint.nearest.NearestTiers`): when every
        rank loaded an in-memory set, the world's base is the newest committed step it descends from and
        the world claims its epoch; return the step. None: nothing was loaded (storage next)."""
        got = NearestTiers(self._group, self._log).restore(state, memory, newest_durable)
        if got.step is None:
            return None
        self._base = got.base
        self.last_restored = None
        self.last_restored_repeats = 0
        self.last_restored_tier = got.tier
        t_claim = time.monotonic()
        self._claim()
        load_s = round(got.seconds + time.monotonic() - t_claim, 3)
        base_step = self._base.step if self._base else None
        if got.resharded_from is None:
            self._log.info("checkpoint_restored", step=got.step, tier=got.tier.value, world=got.world,
                           epoch=self.epoch, from_peers=got.from_peers, replicated=got.replicated,
                           base_step=base_step, newest_durable=newest_durable,
                           load_s=load_s, total_s=round(time.monotonic() - t_start, 3))
        else:
            self._log.info("checkpoint_restored", step=got.step, tier=got.tier.value, world=got.world,
                           epoch=self.epoch, resharded_from=got.resharded_from, from_ranks=got.from_ranks,
                           needed=list(got.needed), transfers=got.transfers,
                           base_step=base_step, newest_durable=newest_durable,
                           load_s=load_s, total_s=round(time.monotonic() - t_start, 3))
        return got.step




__all__ = ["CheckpointInfo", "CheckpointManager", "FaultHook", "SaveResult", "Scan", "StepRef", "scan_run"]