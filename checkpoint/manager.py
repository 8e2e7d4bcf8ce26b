"""The checkpoint manager the worker runtime calls: async sharded save, commit, restore, retention.

This module orchestrates; the concepts live next to it: :mod:`~trainguard.checkpoint.epochs`
(claiming fencing epochs in the store), :mod:`~trainguard.checkpoint.discovery` (what a run holds,
lineages, what garbage collection may delete), :mod:`~trainguard.checkpoint.integrity` (proven
corrupt vs unreadable now), :mod:`~trainguard.checkpoint.restore` (verify and load one step),
:mod:`~trainguard.checkpoint.staging` (the host copy), :mod:`~trainguard.checkpoint.collective`
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

In-flight rule
    At most one save is in flight. ``save()`` (any kind, emergency included) first waits for the
    in-flight save to finish — commit or fail — then stages; it never supersedes or abandons it, so a
    save is never left half-committed and the staging buffers (one copy of the state, reused across
    saves) are free again. A previous save's failure was logged (``checkpoint_save_failed``) and
    does not stop the new save.

Commit protocol (see :mod:`trainguard.checkpoint.manifest` for the layout)
    1. rank 0 checks that this world's epoch is the newest (names only; a stale world writes nothing).
    2. every rank writes its shard with ``dcp.save`` into ``step-<s>-e<epoch>/`` (durable,
       size-verified, CRC32 computed in flight); rank 0 also writes DCP's ``.metadata``. A failing write
       is retried as a whole save on every rank (agreed collectively) with backoff.
    3. the file digests are gathered on rank 0, which re-checks the epoch and writes ``manifest.json``
       last (atomic), recording the epoch. That write is the commit; the outcome is broadcast.
    4. rank 0 garbage-collects by :func:`~trainguard.checkpoint.discovery.gc_plan`: proven-corrupt
       steps are moved into ``quarantine/`` (the newest ``quarantine_keep`` stay there); deleted are
       half-written ones older than a later commit of their epoch, and retention within the lineage of
       this epoch (branches only after ``keep_last`` newer commits). Never raises.

Restore
    Rank 0 lists the run (retrying what is unreadable now until ``restore_deadline_s``) and picks the
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
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint.collective import Group
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.discovery import Scan, StepRef, gc_plan, quarantine_expired, scan_run
from trainguard.checkpoint.epochs import EpochRecord, check_owner, claim_epoch, new_record
from trainguard.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    FencedError,
    InflightTimeout,
    SaveCancelled,
    StorageError,
)
from trainguard.checkpoint import pinned
from trainguard.checkpoint.integrity import describe, root_causes
from trainguard.checkpoint.manifest import KINDS, MANIFEST_NAME, QUARANTINE_DIR, FileEntry, Manifest, now_fields
from trainguard.checkpoint.memory import MemoryTier, SnapshotSource
from trainguard.checkpoint.nearest import NearestTiers
from trainguard.checkpoint.restore import StepLoader
from trainguard.checkpoint.staging import Stager
from trainguard.checkpoint.storage import Storage, is_transient
from trainguard.contract.log import get_logger
from trainguard.contract.protocol import CheckpointTier

log = get_logger("trainguard.checkpoint")

FaultHook = Callable[[str, int], None]
"""``hook(point, step)``, called at ``before_write``, ``before_commit`` and ``after_commit`` of a save
(every rank, on the thread that persists) and at ``before_manifest`` (rank 0, after the commit-time
epoch check, right before the manifest is written). Tests raise or kill the process there."""


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What one committed save cost this rank (what the worker's checkpoint metrics record)."""

    step: int
    epoch: int
    kind: str
    nbytes: int
    """Bytes this rank wrote (its shard; rank 0 also DCP's metadata)."""
    total_bytes: int
    """Bytes of the whole checkpoint (all ranks)."""
    stage_s: float
    """Copying the state into the staging buffers (seconds)."""
    persist_s: float
    """Writing, committing and cleaning up, from the end of staging (seconds)."""
    blocked_s: float
    """How long :meth:`CheckpointManager.save` blocked its caller: waiting for the previous save, plus
    staging (seconds)."""
    skipped: bool = False
    """True when this epoch had already committed ``step``: nothing was written."""


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


def _done(value: SaveResult) -> Future[SaveResult]:
    f: Future[SaveResult] = Future()
    f.set_result(value)
    return f


class CheckpointManager:
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
        self._corrupt: set[StepRef] = set()
        self._corrupt_why: dict[StepRef, str] = {}
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

    @property
    def staging_bytes(self) -> int:
        """Bytes held by the reusable staging buffers (about one copy of the saved tensors)."""
        return self._stager.staging_bytes

    @property
    def staging_rebuilds(self) -> int:
        """How often the staging buffers were (re)allocated."""
        return self._stager.rebuilds

    @property
    def in_flight(self) -> int | None:
        """The step being persisted in the background, if any."""
        f = self._inflight
        return self._inflight_step if f is not None and not f.done() else None

    @property
    def pending(self) -> Future[SaveResult] | None:
        """The save persisting in the background (its result: a :class:`SaveResult`; its exception:
        why it failed), or None. Callers may add done-callbacks."""
        return self._inflight

    def prepare_staging(self, state: dict[str, Any]) -> int:
        """Allocate the staging buffers for ``state`` now, without saving (call after the first step,
        once the optimizer state exists): the first save, which may be an emergency one, then does not
        pay for a multi-GB page-locked allocation. Returns the staging bytes. Not a collective."""
        self._check_open()
        if self._inflight is None or self._inflight.done():  # never re-carve buffers a persist is reading
            self._bind(state)
            self._stager.prepare(state)
        return self._stager.staging_bytes

    def save(self, step: int, state: dict[str, Any], kind: str = "periodic", *,
             block: bool | None = None, source: SnapshotSource | None = None) -> Future[SaveResult]:
        """Checkpoint ``state`` as ``step`` (a collective: call on every rank).

        Blocks while the previous save finishes (see the in-flight rule) and while ``state`` is copied
        into the staging buffers; persisting and committing then run in the background unless
        ``block`` (default: ``not config.async_save``). After return the caller may mutate the model.
        ``state`` maps names to ``Stateful`` objects or plain state dicts.

        Returns a future of the :class:`SaveResult`: already resolved when ``block`` (whose failure is
        raised here instead), else resolved by the background thread. A fenced world gets a future
        holding :class:`FencedError` (``block``: the error is raised) and nothing is written.

        ``source``: the tier-0 snapshot of this very state (:meth:`MemoryTier.lend`, taken at this step
        boundary): the tensors it holds are staged from it by the persist thread, so the caller blocks
        only for the rest (:mod:`~trainguard.checkpoint.staging`). The manager releases it in any case.
        """
        try:
            done = self._save(step, state, kind, block, source)
        except BaseException:
            if source is not None:
                source.release()  # no copy out of it runs (or it ran and released it already)
            raise
        if source is not None and self._stager.deferred is None:
            source.release()  # not used; else the copy out of it releases it
        return done

    def _save(self, step: int, state: dict[str, Any], kind: str, block: bool | None,
              source: SnapshotSource | None) -> Future[SaveResult]:
        self._stager.deferred = None
        self._check_open()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        sync = (not self.config.async_save) if block is None else block
        t0 = time.monotonic()
        self._finish_inflight()
        t_wait = time.monotonic() - t0
        if self._fenced is not None:
            self.last_blocked_s, self.last_stage_s = t_wait, 0.0
            refused = FencedError(str(self._fenced), epoch=self._fenced.epoch, newest_epoch=self._fenced.newest_epoch)
            if sync:
                raise refused
            failed: Future[SaveResult] = Future()
            failed.set_exception(refused)
            return failed
        if step in self._committed_here:
            self._log.warning("checkpoint_step_exists", step=step, kind=kind, epoch=self.epoch,
                              why="this world already committed that step; the committed copy is kept as it is")
            prev = self._committed_here[step]
            self.last_blocked_s, self.last_stage_s = t_wait, 0.0
            return _done(SaveResult(step=step, epoch=prev.epoch, kind=kind, nbytes=0, total_bytes=prev.total_bytes,
                                    stage_s=0.0, persist_s=0.0, blocked_s=t_wait, skipped=True))
        self._bind(state)
        t1 = time.monotonic()
        staged = self._stager.stage(state, source)
        ready, deferred, device = self._stager.ready, self._stager.deferred, self._stager.device
        t2 = time.monotonic()
        stage_s, blocked = t2 - t1, t2 - t0
        self._log.info("checkpoint_staged", step=step, kind=kind, blocked_s=round(blocked, 6),
                       stage_s=round(stage_s, 6), waited_inflight_s=round(t_wait, 6),
                       staging_bytes=self._stager.staging_bytes, from_snapshot=self._stager.from_snapshot)
        self.last_blocked_s, self.last_stage_s = blocked, stage_s
        if sync:
            return _done(self._persist(step, staged, kind, stage_s, blocked, ready, deferred, device))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ckpt")
        self._inflight_step = step
        self._cancel_why = None
        self._inflight = self._executor.submit(self._persist, step, staged, kind, stage_s, blocked, ready, deferred,
                                               device)
        return self._inflight

    def guard(self, optimizer: Any) -> None:
        """Let the next forward and backward run beside a save's GPU -> host copy of ``optimizer``'s
        parameters and state: only ``optimizer.step()`` waits for it (GPU-side, a step pre-hook). Call
        again when the optimizer object changes. Without it, the whole next step waits for the copy."""
        self._stager.guard.attach(optimizer)

    def order_after_copies(self) -> None:
        """Make the compute stream wait (GPU-side) for a guarded save's copies now: before anything but
        the guarded ``optimizer.step()`` changes the parameters or optimizer state (a restore, a
        re-formation). A no-op on the CPU and when no copy is pending."""
        self._stager.guard.release()

    def cancel_inflight(self, why: str) -> bool:
        """Give up the background save if its shards are still being written (thread-safe): it stops at
        the next write slice, and :meth:`close` / :meth:`wait` return without waiting for the rest of
        the upload. For a world that lost a peer: such a save can never commit (every rank writes, then
        all agree), and waiting for a slow upload would keep this worker from the new world. A save past
        its writes (rank 0 writing the manifest) is left to finish. True when a save was cancelled."""
        f = self._inflight
        if f is None or f.done():
            return False
        self._cancel_why = why
        writer = self._writer
        if writer is not None:
            writer.cancel()
        self._log.warning("checkpoint_inflight_cancelled", step=self._inflight_step, why=why,
                          effect="its shard writes stop at the next slice; the last committed step stands")
        return True

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the in-flight save; return the newest step committed by this manager (or None).

        Raises the in-flight save's error (:class:`StorageError`, :class:`FencedError`, ...) once, and
        :class:`TimeoutError` if it is still running after ``timeout`` seconds (it keeps running).
        """
        f = self._inflight
        if f is not None:
            try:
                f.result(timeout=timeout)
            except FutureTimeout as e:
                raise TimeoutError(f"checkpoint of step {self._inflight_step} to {self.url} still in flight "
                                   f"after {timeout}s") from e
            finally:
                if f.done():
                    self._inflight = None
                    self._inflight_step = None
        return self._last_committed

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
                self._corrupt.add(ref)
                self._corrupt_why[ref] = verdict.reason
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

    def close(self) -> None:
        """Wait for the in-flight save (errors logged) and stop the background thread. Idempotent."""
        if getattr(self, "_closed", True) and getattr(self, "_executor", None) is None:
            return
        stuck = False
        try:
            self._finish_inflight()
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

    def _finish_inflight(self) -> None:
        """Wait for the in-flight save, at most :attr:`inflight_timeout_s` (then :class:`InflightTimeout`;
        it keeps running and stays in flight); its failure was logged (and a fence recorded) by ``_persist``."""
        f = self._inflight
        if f is None:
            return
        try:
            f.result(timeout=self.inflight_timeout_s)
        except FutureTimeout:
            raise InflightTimeout(f"the background save of step {self._inflight_step} to {self.url} is still running "
                                  f"after {self.inflight_timeout_s:g}s (a peer gone from its collectives, or storage "
                                  f"not answering). The last committed step stands") from None
        except Exception:  # noqa: BLE001 - already logged by _persist
            pass
        self._inflight = None
        self._inflight_step = None

    def _persist(self, step: int, staged: dict[str, Any], kind: str, stage_s: float, blocked_s: float,
                 ready: Any = None, deferred: Callable[[], None] | None = None,
                 device: Any = None) -> SaveResult:
        """Claim if needed, write, commit and clean up one staged state (background thread, or caller).
        ``ready``: the event of the staging copies (GPU) on ``device`` (made this thread's current
        device first); ``deferred``: the copies out of a snapshot (:mod:`~trainguard.checkpoint.staging`),
        run here first; the buffers are read only after both."""
        t0 = time.monotonic()
        pinned.bind_thread(device)
        if ready is not None:
            ready.synchronize()  # this save's copies only: not a device-wide synchronize
        ref: StepRef | None = None
        try:
            if deferred is not None:
                deferred()  # releases the snapshot's slot, also when it fails (then the save fails)
                stage_s += time.monotonic() - t0
                t0 = time.monotonic()  # persisting starts after the staging copy
            if self._record is None:
                self._claim()
            assert self._record is not None
            ref = StepRef(step, self._record.epoch)
            self._on_rank0(self._check_owner)
            self._fault("before_write", step)
            digests = self._write_shards(ref, staged)
            gathered = self._group.all_gather((self.rank, digests))
            files = tuple(FileEntry(path=name, size=size, crc32=crc, rank=r)
                          for r, d in gathered for name, (size, crc) in sorted(d.items()))
            self._fault("before_commit", step)
            self._on_rank0(lambda: self._commit(ref, kind, files))
        except FencedError as e:
            self._set_fenced(e)
            raise
        except Exception as e:
            where = self.storage.url_of(f"{self.run_id}/{ref.name}") if ref else self.url
            self._log.error("checkpoint_save_failed", step=step, kind=kind, url=where, error=describe(e),
                            elapsed_s=round(time.monotonic() - t0, 3), last_committed=self._last_committed)
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"checkpoint of step {step} to {where} failed: {describe(e)}. "
                                  f"The previous committed step is untouched") from e
        self._last_committed = step
        self._base = ref
        nbytes = sum(size for size, _ in digests.values())
        total = sum(f.size for f in files)
        self._fault("after_commit", step)
        if self.rank == 0:
            self._cleanup(ref)
        result = SaveResult(step=step, epoch=ref.epoch, kind=kind, nbytes=nbytes, total_bytes=total, stage_s=stage_s,
                            persist_s=time.monotonic() - t0, blocked_s=blocked_s)
        self._committed_here[step] = result
        self._log.info("checkpoint_committed", step=step, kind=kind, epoch=ref.epoch,
                       url=self.storage.url_of(f"{self.run_id}/{ref.name}"), bytes=total, rank_bytes=nbytes,
                       files=len(files), stage_s=round(stage_s, 6), persist_s=round(result.persist_s, 3))
        return result

    def _write_shards(self, ref: StepRef, staged: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """``dcp.save`` with whole-save retries agreed by all ranks; return this rank's file digests."""
        rel = f"{self.run_id}/{ref.name}"
        backoff = self.storage.backoff
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            writer = self.storage.dcp_writer(rel)
            self._writer = writer
            err: BaseException | None = None
            try:
                if self._cancel_why is not None:
                    writer.cancel()
                dcp.save(staged, storage_writer=writer, process_group=self._pg, no_dist=not self._distributed)
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                err = e
            finally:
                self._writer = None
            if err is None:
                return writer.digests
            if writer.is_cancelled:  # no retry, and no collective: the world it was taken in is gone
                raise SaveCancelled(f"the save of step {ref.step} to {self.storage.url_of(rel)} was cancelled: "
                                    f"{self._cancel_why}. Nothing was committed; the previous committed step stands")
            elapsed = time.monotonic() - start
            delay = backoff.delay(attempt)
            transient = all(is_transient(c) for c in root_causes(err))
            want_retry = transient and backoff.allows(attempt, elapsed, delay)
            retry = all(self._group.all_gather(want_retry))
            self._log.warning("storage_retry", op="dcp_save", url=self.storage.url_of(rel), attempt=attempt,
                              max_attempts=backoff.attempts, elapsed_s=round(elapsed, 3), transient=transient,
                              error=describe(err)[:500], giving_up=not retry)
            if not retry:
                raise StorageError(f"writing the shards of step {ref.step} to {self.storage.url_of(rel)} failed after "
                                   f"{attempt} attempt(s) in {elapsed:.1f}s: {describe(err)}. The previous committed "
                                   f"step is untouched. Fix: check the storage endpoint and credentials; raise "
                                   f"checkpoint.retry_attempts / retry_deadline_s for flaky storage",
                                   transient=transient) from (err if isinstance(err, Exception) else None)
            time.sleep(delay)

    def _commit(self, ref: StepRef, kind: str, files: tuple[FileEntry, ...]) -> None:
        """Rank 0: re-check the epoch, then write the manifest (the commit point)."""
        self._check_owner()
        self._fault("before_manifest", ref.step)
        m = Manifest(run_id=self.run_id, step=ref.step, world_size=self.world_size, strategy=self.strategy,
                     epoch=ref.epoch, kind=kind, files=files, versions=_versions(), **now_fields())
        rel = f"{self.run_id}/{ref.name}"
        self.storage.fsync_dir(rel)
        self.storage.write_bytes_atomic(f"{rel}/{MANIFEST_NAME}", m.to_json())
        self.storage.fsync_dir(self.run_id)

    def _cleanup(self, committed: StepRef) -> None:
        """Rank 0, after a commit: delete what :func:`gc_plan` allows. Never raises. Skipped once the
        save was cancelled (:meth:`cancel_inflight`: the worker waits for it to park; the next commit
        collects what this one would have)."""
        if self._cancel_why is not None:
            self._log.info("checkpoint_gc_skipped", reason="cancelled", why=self._cancel_why)
            return
        try:
            scan = scan_run(self.storage, self.run_id)
            assert self._record is not None
            if scan.newest_epoch > self._record.epoch:
                self._log.info("checkpoint_gc_skipped", reason="a newer epoch exists", newest_epoch=scan.newest_epoch)
                return
            protected = {committed} | ({self._base} if self._base else set())
            for d in gc_plan(scan, epoch=self._record.epoch, keep_last=self.config.keep_last, protected=protected,
                             proven_corrupt=self._corrupt):
                if self._cancel_why is not None:
                    self._log.info("checkpoint_gc_skipped", reason="cancelled", why=self._cancel_why)
                    return
                rel = f"{self.run_id}/{d.ref.name}"
                if d.reason == "corrupt":
                    self._quarantine(d.ref, scan)
                    continue
                if d.ref in scan.committed:
                    # Manifest first: the step disappears from discovery atomically, then its files go.
                    self.storage.remove(f"{rel}/{MANIFEST_NAME}")
                self.storage.remove(rel, recursive=True)
                event = "checkpoint_retention_deleted" if d.reason == "retention" else "checkpoint_garbage_collected"
                self._log.info(event, step=d.ref.step, saved_epoch=d.ref.epoch, reason=d.reason,
                               keep_last=self.config.keep_last)
            for ref in quarantine_expired(scan, keep=self.config.quarantine_keep):
                self.storage.remove(f"{self.run_id}/{QUARANTINE_DIR}/{ref.name}", recursive=True)
                self._log.info("checkpoint_quarantine_expired", step=ref.step, saved_epoch=ref.epoch,
                               quarantine_keep=self.config.quarantine_keep)
        except Exception as e:  # noqa: BLE001 - a failed cleanup must not fail a committed save
            self._log.warning("checkpoint_cleanup_failed", error=describe(e))

    def _quarantine(self, ref: StepRef, scan: Scan) -> None:
        """Rank 0: move a proven-corrupt step into ``<run_id>/quarantine/`` (the evidence stays; discovery
        never restores it). Its manifest goes last, so it never looks committed in two places."""
        src = f"{self.run_id}/{ref.name}"
        dst = f"{self.run_id}/{QUARANTINE_DIR}/{ref.name}"
        self.storage.move_tree(src, dst, last=MANIFEST_NAME)
        self._corrupt.discard(ref)
        scan.quarantined = sorted({*scan.quarantined, ref})
        why = scan.invalid.get(ref) or self._corrupt_why.pop(ref, "")
        self._log.warning("checkpoint_quarantined", step=ref.step, saved_epoch=ref.epoch, reason="corrupt",
                          why=why[:1000], url=self.storage.url_of(dst), quarantine_keep=self.config.quarantine_keep,
                          verify=f"trainguard checkpoints verify {self.storage.url_of(self.run_id)} {ref.step}")

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


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        tg = version("trainguard")
    except PackageNotFoundError:
        tg = "unknown"
    return {"trainguard": tg, "torch": torch.__version__, "python": __import__("platform").python_version()}


__all__ = ["CheckpointInfo", "CheckpointManager", "FaultHook", "SaveResult", "Scan", "StepRef", "scan_run"]
