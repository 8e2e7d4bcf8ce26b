"""The durable manager's save: stage, persist in the background, commit, collect — tier 2's write side.

:class:`DurableSave` is the save half of :class:`~trainguard.checkpoint.manager.CheckpointManager` (a
mixin: the world, the epoch and the checkpoint group it saves with are the manager's, which also
restores and claims epochs). Staging copies into reusable host buffers
(:mod:`~trainguard.checkpoint.staging`), a snapshot lent by tier 0 included; persisting runs on one
background thread per manager; the shards are written through :meth:`Storage.dcp_writer
<trainguard.checkpoint.storage.Storage.dcp_writer>`; retention is :mod:`~trainguard.checkpoint.retention`.

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
       this epoch (branches only after ``keep_last`` newer commits). Never raises. A save whose commit
       the world waits for (a stop's: ``save(collect=False)``) leaves it to the next commit or to
       :meth:`close` (a worker that exits): the collection lists the run and deletes, which on object
       storage takes its time. A survivor that re-forms in place leaves it to the next world's first
       commit. Every collection plans from a fresh scan, so a deferred one loses nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint import pinned
from trainguard.checkpoint.collective import Group
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.discovery import StepRef
from trainguard.checkpoint.epochs import EpochRecord
from trainguard.checkpoint.errors import CheckpointError, FencedError, InflightTimeout, SaveCancelled, StorageError
from trainguard.checkpoint.integrity import describe, root_causes
from trainguard.checkpoint.lending import SnapshotSource
from trainguard.checkpoint.manifest import KINDS, MANIFEST_NAME, FileEntry, Manifest, now_fields
from trainguard.checkpoint.retention import Retention
from trainguard.checkpoint.staging import Stager
from trainguard.checkpoint.storage import Storage, is_transient

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



def _done(value: SaveResult) -> Future[SaveResult]:
    f: Future[SaveResult] = Future()
    f.set_result(value)
    return f


class DurableSave:
    """The save side of :class:`~trainguard.checkpoint.manager.CheckpointManager` (a mixin: its state is
    the manager's). Every public method is a collective, called from the training thread."""

    config: CheckpointConfig
    storage: Storage
    run_id: str
    strategy: str
    rank: int
    world_size: int
    fault_hook: FaultHook | None
    inflight_timeout_s: float | None
    last_blocked_s: float
    last_stage_s: float
    _executor: ThreadPoolExecutor | None
    _inflight: Future[SaveResult] | None
    _inflight_step: int | None
    _writer: Any
    _cancel_why: str | None
    _stager: Stager
    _record: EpochRecord | None
    _base: StepRef | None
    _fenced: FencedError | None
    _last_committed: int | None
    _committed_here: dict[int, SaveResult]
    _retention: Retention
    _collect_owed: StepRef | None
    _group: Group
    _pg: Any
    _distributed: bool
    _log: Any

    if TYPE_CHECKING:
        @property
        def url(self) -> str: ...
        @property
        def epoch(self) -> int | None: ...
        def _check_open(self) -> None: ...
        def _bind(self, state: dict[str, Any]) -> None: ...
        def _on_rank0(self, fn: Callable[[], Any]) -> Any: ...
        def _fault(self, point: str, step: int) -> None: ...
        def _claim(self) -> None: ...
        def _check_owner(self) -> None: ...
        def _set_fenced(self, e: FencedError) -> None: ...

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
             block: bool | None = None, source: SnapshotSource | None = None,
             collect: bool = True) -> Future[SaveResult]:
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

        ``collect``: False leaves rank 0's garbage collection after this commit to the next commit or to
        :meth:`close` (a stop's save: the world waits for its commit, not for the collection).
        """
        try:
            done = self._save(step, state, kind, block, source, collect)
        except BaseException:
            if source is not None:
                source.release()  # no copy out of it runs (or it ran and released it already)
            raise
        if source is not None and self._stager.deferred is None:
            source.release()  # not used; else the copy out of it releases it
        return done

    def _save(self, step: int, state: dict[str, Any], kind: str, block: bool | None,
              source: SnapshotSource | None, collect: bool = True) -> Future[SaveResult]:
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
            return _done(self._persist(step, staged, kind, stage_s, blocked, ready, deferred, device, collect))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ckpt")
        self._inflight_step = step
        self._cancel_why = None
        self._inflight = self._executor.submit(self._persist, step, staged, kind, stage_s, blocked, ready, deferred,
                                               device, collect)
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

    # -- internals -----------------------------------------------------------------------------

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
                 device: Any = None, collect: bool = True) -> SaveResult:
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
            self._collect_owed = None if collect else ref  # a later commit's collection covers an owed one
            if collect:
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

    def _collect_deferred(self) -> None:
        """Rank 0, from :meth:`close`: the collection a ``save(collect=False)`` left owed. Never raises."""
        ref, self._collect_owed = self._collect_owed, None
        if ref is not None and self._record is not None:
            self._cleanup(ref)

    def _cleanup(self, committed: StepRef) -> None:
        """Rank 0, after a commit: retention and garbage collection (:class:`~.retention.Retention`).
        Never raises; skipped once the save was cancelled (:meth:`cancel_inflight`)."""
        assert self._record is not None
        self._retention.collect(committed, epoch=self._record.epoch, base=self._base,
                                cancelled=lambda: self._cancel_why, log=self._log)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        tg = version("trainguard")
    except PackageNotFoundError:
        tg = "unknown"
    return {"trainguard": tg, "torch": torch.__version__, "python": __import__("platform").python_version()}


__all__ = ["DurableSave", "FaultHook", "SaveResult"]
