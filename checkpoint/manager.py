"""The checkpoint manager the worker runtime calls: async sharded save, commit, restore, retention.

Threading and collectives
    Every public method is called from the training thread, on every rank, in the same order (they
    are collectives). Persisting runs on one background thread per manager. All checkpoint
    collectives (DCP's plan/write exchange, the checksum gather, the commit broadcast) go over a
    *separate gloo process group*: thread-based async save on the default group deadlocked against
    FSDP collectives of the training loop on CPU. The group is passed in, or created with
    ``dist.new_group(backend="gloo")`` in the constructor (itself a collective) when a default group
    exists; without ``torch.distributed`` (world size 1) nothing is collective.

In-flight rule
    At most one save is in flight. ``save()`` (any kind, emergency included) first waits for the
    in-flight save to finish — commit or fail — then stages; it never supersedes or abandons it, so a
    save is never left half-committed and the staging buffers (one copy of the state, reused across
    saves) are free again. A previous save's failure is logged (``checkpoint_save_failed``) and does
    not stop the new save, except :class:`FencedError`, which is raised: a stale world must stop.

Commit protocol (see :mod:`trainguard.checkpoint.manifest` for the layout)
    1. rank 0 checks the fence: it registers its round (write-once ``fences/fence-<n>.json``) and
       refuses (:class:`FencedError`, on every rank) if a newer round exists; nothing is written then.
    2. every rank writes its shard with ``dcp.save`` (durable, size-verified, CRC32 computed in
       flight); rank 0 also writes DCP's ``.metadata``. A failing write is retried as a whole save on
       every rank (agreed collectively) with backoff, within ``retry_attempts``/``retry_deadline_s``.
    3. the file digests are gathered on rank 0, which re-checks the fence and writes
       ``manifest.json`` last (atomic). That write is the commit; the outcome is broadcast.
    4. rank 0 garbage-collects step directories without a manifest (never the one in flight) and
       applies retention: keep the newest ``keep_last`` committed steps, never deleting a step that a
       newer round registered as its starting point, nor the one this process is restoring.

Restore
    Discovers committed steps (rank 0, broadcast), newest first; verifies sizes and CRC32s (files
    split across ranks) when ``config.verify``; loads in place with ``dcp.load`` (resharding to the
    current world size). A corrupt or missing shard, or a failing load, is logged
    (``checkpoint_restore_fallback``) and the previous committed step is tried.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import (
    CompanionMismatch,
    _copy_state_dict,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.runtime.log import get_logger
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.pinned import CopyStream, HostArena, build, cuda_device_of, layout_bytes
from trainguard.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    FencedError,
    InflightTimeout,
    StorageError,
)
from trainguard.checkpoint.manifest import (
    FENCES_DIR,
    KINDS,
    MANIFEST_NAME,
    FenceRecord,
    FileEntry,
    Manifest,
    fence_name,
    now_fields,
    parse_fence_name,
    parse_step_dir,
    retention_victims,
    stale_steps,
    step_dir,
)
from trainguard.checkpoint.storage import Storage, is_transient

log = get_logger("trainguard.checkpoint")


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed step as seen by discovery (what ``list()`` and the CLI show)."""

    step: int
    kind: str
    world_size: int
    fence: int
    strategy: str
    total_bytes: int
    num_files: int
    created: str
    url: str

    @classmethod
    def from_manifest(cls, m: Manifest, url: str) -> CheckpointInfo:
        return cls(step=m.step, kind=m.kind, world_size=m.world_size, fence=m.fence, strategy=m.strategy,
                   total_bytes=m.total_bytes, num_files=len(m.files), created=m.created, url=url)


@dataclass(slots=True)
class Scan:
    """One listing of a run: committed manifests (ascending), step dirs without one, stale, fences."""

    committed: list[Manifest]
    uncommitted: list[int]
    invalid: list[int]
    stale: list[int]
    fences: list[FenceRecord]


def scan_run(storage: Storage, run_id: str) -> Scan:
    """List ``<url>/<run_id>`` and classify its steps (no collectives; used by rank 0 and the CLI)."""
    manifests: list[Manifest] = []
    uncommitted: list[int] = []
    invalid: list[int] = []
    fences: list[FenceRecord] = []
    for name in storage.listdir(run_id):
        if name == FENCES_DIR:
            for fname in storage.listdir(f"{run_id}/{FENCES_DIR}"):
                if parse_fence_name(fname) is None:
                    continue
                try:
                    fences.append(FenceRecord.from_json(storage.read_bytes(f"{run_id}/{FENCES_DIR}/{fname}")))
                except (CheckpointNotFound, ValueError, KeyError) as e:
                    log.warning("checkpoint_fence_unreadable", url=storage.url_of(f"{run_id}/{FENCES_DIR}/{fname}"),
                                error=str(e))
            continue
        step = parse_step_dir(name)
        if step is None:
            continue
        rel = f"{run_id}/{name}/{MANIFEST_NAME}"
        try:
            m = Manifest.from_json(storage.read_bytes(rel), storage.url_of(rel))
        except CheckpointNotFound:
            uncommitted.append(step)
            continue
        except CheckpointCorrupt as e:
            log.warning("checkpoint_manifest_invalid", url=storage.url_of(rel), error=str(e))
            invalid.append(step)
            continue
        if m.step != step or m.run_id != run_id:
            log.warning("checkpoint_manifest_invalid", url=storage.url_of(rel),
                        error=f"manifest says run {m.run_id!r} step {m.step}")
            invalid.append(step)
            continue
        manifests.append(m)
    manifests.sort(key=lambda m: m.step)
    stale = stale_steps(manifests, fences)
    return Scan(committed=[m for m in manifests if m.step not in stale], uncommitted=sorted(uncommitted),
                invalid=sorted(invalid), stale=sorted(stale), fences=sorted(fences, key=lambda f: f.fence))


class _Stager:
    """Copies a state dict into reusable host buffers (one copy of the state, allocated once).

    The buffers are views into one exact-size :class:`~trainguard.checkpoint.pinned.HostArena`
    (page-locked in place when the state is on a GPU), rebuilt only when the state's structure,
    shapes or dtypes change (e.g. optimizer state appearing after the first step);
    :attr:`staging_bytes` is the arena's size: what was allocated. From a GPU the copies run on a
    side stream (:class:`~trainguard.checkpoint.pinned.CopyStream`) and :attr:`ready` is the event the
    persist thread waits on; on the CPU they are plain and :attr:`ready` is None.
    """

    def __init__(self, cuda: Any = None) -> None:
        self._buffers: dict[str, Any] | None = None
        self._arena: HostArena | None = None
        self._copier: CopyStream | None = None
        self._cuda = cuda
        self.staging_bytes = 0
        self.rebuilds = 0
        self.ready: Any = None

    @staticmethod
    def _materialise(state: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}

    def _rebuild(self, sd: dict[str, Any]) -> None:
        if self._arena is not None:  # free (and unregister) the old buffers before allocating new ones
            self._arena.release()
        self._buffers = self._arena = None
        device = cuda_device_of(sd)
        self._arena = HostArena(layout_bytes(sd), pin=device is not None)
        self._buffers = build(sd, self._arena)
        self.staging_bytes = self._arena.nbytes
        self.rebuilds += 1
        if device is None:
            self._copier = None
        elif self._copier is None or self._copier.device != device:
            self._copier = CopyStream(device, self._cuda)

    @torch.no_grad()
    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate the buffers for ``state`` now (no copy), so that the first save does not pay for it."""
        sd = self._materialise(state)
        if self._buffers is None or not _same_layout(sd, self._buffers):
            self._rebuild(sd)

    @torch.no_grad()
    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        sd = self._materialise(state)
        if self._buffers is None or not _same_layout(sd, self._buffers):
            self._rebuild(sd)
        try:
            return self._copy(sd)
        except CompanionMismatch:
            self._rebuild(sd)
            return self._copy(sd)

    def _copy(self, sd: dict[str, Any]) -> dict[str, Any]:
        assert self._buffers is not None
        buffers = self._buffers
        if self._copier is None:
            self.ready = None
            return _copy_state_dict(sd, buffers, non_blocking=False, type_check=False)
        out, self.ready = self._copier.copy(_walk_tensors(sd), lambda: _copy_state_dict(
            sd, buffers, non_blocking=True, type_check=False))
        return out


def _same_layout(a: Any, b: Any) -> bool:
    """Same structure, and tensors of the same shape and dtype (no copying).

    torch's ``_check_state_dict_similarity`` is not used: it walks with a companion object and so
    also *copies* every tensor, which doubled the staging time.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor):
        return isinstance(b, DTensor) and _same_layout(a._local_tensor, b._local_tensor)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and not isinstance(b, DTensor) and a.shape == b.shape
                and a.dtype == b.dtype)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_layout(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    return not isinstance(b, (torch.Tensor, dict, list, tuple))


def _walk_tensors(obj: Any) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out: list[torch.Tensor] = []
    if isinstance(obj, DTensor):
        out.append(obj._local_tensor)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out.extend(_walk_tensors(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(_walk_tensors(v))
    return out


def _describe(e: BaseException) -> str:
    if isinstance(e, CheckpointException):
        parts = [f"rank {r}: {type(x[0]).__name__}: {x[0]}" if isinstance(x, tuple) else f"rank {r}: {x}"
                 for r, x in e.failures.items()]
        return "; ".join(parts)[:2000]
    return f"{type(e).__name__}: {e}"[:2000]


def _root_causes(e: BaseException) -> list[BaseException]:
    if isinstance(e, CheckpointException):
        return [x[0] if isinstance(x, tuple) else x for x in e.failures.values()]
    return [e]


def _pack_error(e: BaseException) -> tuple[str, str, dict[str, Any]]:
    extra: dict[str, Any] = {}
    if isinstance(e, FencedError):
        extra = {"fence": e.fence, "newest_fence": e.newest_fence}
    elif isinstance(e, StorageError):
        extra = {"transient": e.transient}
    return type(e).__name__, str(e), extra


def _unpack_error(kind: str, msg: str, extra: dict[str, Any]) -> CheckpointError:
    if kind == "FencedError":
        return FencedError(msg, fence=extra["fence"], newest_fence=extra["newest_fence"])
    if kind == "StorageError":
        return StorageError(msg, transient=extra.get("transient", False))
    if kind == "CheckpointNotFound":
        return CheckpointNotFound(msg)
    if kind == "CheckpointCorrupt":
        return CheckpointCorrupt(msg)
    return CheckpointError(f"{kind}: {msg}")


class CheckpointManager:
    """Async sharded checkpoints of one run. See the module docstring for protocol and threading.

    Args:
        config: the ``checkpoint`` config section (``url`` must be set).
        run_id: the job's run id; checkpoints live under ``<url>/<run_id>/``.
        rank, world_size: this process's rank and the world size (of the checkpoint group).
        fence: the rendezvous round; a commit is refused if a newer round has registered.
        strategy: recorded in the manifest (``ddp``, ``fsdp``, ...).
        process_group: gloo group for checkpoint collectives; created when None and a default group
            exists with ``world_size > 1`` (the constructor is then a collective).
        storage: a prepared :class:`Storage` (tests); built from ``config`` when None.
        inflight_timeout_s: how long a :meth:`save`, :meth:`restore` or :meth:`close` waits for the
            previous background save (None: no bound). A persist stuck past it (a vanished peer in its
            collectives, a storage call that never returns) makes the waiting call raise
            :class:`CheckpointError` instead of hanging; the last committed step stands.
    """

    def __init__(self, config: CheckpointConfig, run_id: str, *, rank: int, world_size: int, fence: int = 0,
                 strategy: str = "ddp", process_group: Any = None, storage: Storage | None = None,
                 inflight_timeout_s: float | None = None) -> None:
        self._closed = True  # until fully built: close() must be safe on a half-built object
        self.inflight_timeout_s = inflight_timeout_s
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[int] | None = None
        self.last_blocked_s = 0.0
        """Seconds the last :meth:`save` blocked its caller (waiting for the previous save + staging)."""
        if not config.url:
            raise CheckpointError("checkpoint.url is empty. Fix: set YAML key `checkpoint.url` or env var "
                                  "TRAINGUARD_CHECKPOINT_URL to a path, s3://, gs:// or memory:// URL")
        if not run_id or "/" in run_id or run_id in (".", ".."):
            raise CheckpointError(f"invalid run_id {run_id!r}: it becomes one path component under "
                                  f"{config.url!r}. Fix: use a non-empty id without '/'")
        if not 0 <= rank < world_size:
            raise CheckpointError(f"rank {rank} is not in [0, world_size={world_size}). Fix: pass the worker's "
                                  f"rank and world size")
        self.config = config
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.fence = fence
        self.strategy = strategy
        self.storage = storage or Storage(config.url, config.storage_options, retry_attempts=config.retry_attempts,
                                          retry_deadline_s=config.retry_deadline_s)
        self._distributed = world_size > 1
        if self._distributed:
            if not (dist.is_available() and dist.is_initialized()):
                raise CheckpointError(f"world_size={world_size} but torch.distributed is not initialised. Fix: "
                                      f"call init_process_group before creating the CheckpointManager")
            self._pg = process_group if process_group is not None else dist.new_group(backend="gloo")
            if dist.get_world_size(self._pg) != world_size or dist.get_rank(self._pg) != rank:
                raise CheckpointError(f"checkpoint process group has rank {dist.get_rank(self._pg)} of "
                                      f"{dist.get_world_size(self._pg)}, expected {rank} of {world_size}. Fix: "
                                      f"pass a group spanning all ranks of the job")
        else:
            self._pg = process_group
        self._stager = _Stager()
        self._inflight_step: int | None = None
        self._last_committed: int | None = None
        self._fence_registered = False
        self._restoring: int | None = None
        self._lock = threading.Lock()
        self._log = log.bind(run_id=run_id, rank=rank, world_size=world_size, fence=fence)
        self._closed = False

    # -- public API -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``<url>/<run_id>`` (no credentials)."""
        return self.storage.url_of(self.run_id)

    @property
    def staging_bytes(self) -> int:
        """Bytes held by the reusable staging buffers (about one copy of the saved tensors)."""
        return self._stager.staging_bytes

    @property
    def in_flight(self) -> int | None:
        """The step being persisted in the background, if any."""
        f = self._inflight
        return self._inflight_step if f is not None and not f.done() else None

    @property
    def pending(self) -> Future[int] | None:
        """The save persisting in the background (its result: the committed step; its exception: why it
        failed), or None when the last :meth:`save` returned committed. Callers may add done-callbacks."""
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

    def save(self, step: int, state: dict[str, Any], kind: str = "periodic", *, block: bool | None = None) -> None:
        """Checkpoint ``state`` as ``step`` (a collective: call on every rank).

        Blocks while the previous save finishes (see the in-flight rule) and while ``state`` is copied
        into the staging buffers; persisting and committing then run in the background unless
        ``block`` (default: ``not config.async_save``). After return the caller may mutate the model.
        ``state`` maps names to ``Stateful`` objects or plain state dicts.
        """
        self._check_open()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        t0 = time.monotonic()
        self._finish_inflight(reraise_fenced=True)
        t_wait = time.monotonic() - t0
        self._bind(state)
        staged = self._stager.stage(state)
        ready = self._stager.ready
        blocked = time.monotonic() - t0
        self._log.info("checkpoint_staged", step=step, kind=kind, blocked_s=round(blocked, 6),
                       waited_inflight_s=round(t_wait, 6), staging_bytes=self._stager.staging_bytes)
        self.last_blocked_s = blocked
        sync = (not self.config.async_save) if block is None else block
        if sync:
            self._persist(step, staged, kind, ready)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ckpt")
        self._inflight_step = step
        self._inflight = self._executor.submit(self._persist, step, staged, kind, ready)

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
        """The newest committed step of the run, or None (a collective when world_size > 1)."""
        committed = self._on_rank0(lambda: [m.step for m in scan_run(self.storage, self.run_id).committed])
        return committed[-1] if committed else None

    def list(self) -> list[CheckpointInfo]:
        """Committed steps, oldest first (a collective when world_size > 1)."""
        scan = self._on_rank0(lambda: scan_run(self.storage, self.run_id))
        return [CheckpointInfo.from_manifest(m, self.storage.url_of(f"{self.run_id}/{step_dir(m.step)}"))
                for m in scan.committed]

    def restore(self, state: dict[str, Any], step: int | None = None) -> int | None:
        """Load the newest committed step (or ``step``) into ``state`` in place; return it, or None.

        Reshards to the current world size. Falls back to older committed steps when a shard is
        missing or corrupt (each fallback logged). Raises :class:`CheckpointNotFound` if ``step`` is
        given and not committed, :class:`CheckpointCorrupt` if steps exist but none can be loaded.
        A collective.
        """
        self._check_open()
        self._finish_inflight(reraise_fenced=False)
        self._bind(state)
        scan = self._on_rank0(lambda: scan_run(self.storage, self.run_id))
        candidates = [m for m in reversed(scan.committed) if step is None or m.step <= step]
        if step is not None and not any(m.step == step for m in candidates):
            raise CheckpointNotFound(f"step {step} has no committed checkpoint under {self.url} (committed: "
                                     f"{[m.step for m in scan.committed]}). Fix: pick one of those or omit the step")
        if not candidates:
            self._log.info("checkpoint_restore_none", url=self.url)
            self._on_rank0(lambda: self._register_fence(-1, overwrite=False))
            return None
        problems: list[str] = []
        for i, m in enumerate(candidates):
            self._restoring = m.step
            try:
                # Register before loading: an older round's retention must not delete what we load.
                self._on_rank0(lambda m=m: self._register_fence(m.step, overwrite=True))
                ok, reason = self._verify(m) if self.config.verify else (True, "")
                t0 = time.monotonic()
                if ok:
                    ok, reason = self._load(m, state)
                if ok:
                    self._log.info("checkpoint_restored", step=m.step, url=self.storage.url_of(self._rel(m.step)),
                                   saved_world_size=m.world_size, saved_fence=m.fence, load_s=round(time.monotonic() - t0, 3),
                                   verified=self.config.verify)
                    return m.step
                problems.append(f"step {m.step}: {reason}")
                nxt = candidates[i + 1].step if i + 1 < len(candidates) else None
                self._log.error("checkpoint_restore_fallback", step=m.step,
                                url=self.storage.url_of(self._rel(m.step)), reason=reason[:1000], next_step=nxt)
            finally:
                self._restoring = None
        raise CheckpointCorrupt(f"no committed checkpoint under {self.url} could be restored: {'; '.join(problems)}. "
                                f"Fix: check the storage for damaged shards; delete the damaged step directories "
                                f"to start from an older step, or start the run from scratch")

    def close(self) -> None:
        """Wait for the in-flight save (errors logged) and stop the background thread. Idempotent."""
        if getattr(self, "_closed", True) and getattr(self, "_executor", None) is None:
            return
        stuck = False
        try:
            self._finish_inflight(reraise_fenced=False)
        except InflightTimeout as e:
            stuck = True
            self._log.error("checkpoint_inflight_abandoned", error=str(e), effect="the manager closes without it; "
                            "the last committed step stands")
        finally:
            ex, self._executor = self._executor, None
            if ex is not None:
                ex.shutdown(wait=not stuck)
            self._closed = True

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

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self._pg, group_src=0)
        return box[0]

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._pg)
        return out

    def _on_rank0(self, fn: Any) -> Any:
        """Run ``fn`` on rank 0 only and give every rank its result or the same exception."""
        res: Any = None
        if self.rank == 0:
            try:
                res = ("ok", fn())
            except CheckpointError as e:
                res = ("err", *_pack_error(e))
            except Exception as e:  # noqa: BLE001 - must reach the other ranks, not hang them
                res = ("err", "CheckpointError", f"{type(e).__name__}: {e}", {})
        res = self._broadcast(res)
        if res[0] == "ok":
            return res[1]
        raise _unpack_error(res[1], res[2], res[3])

    # -- internals: save ------------------------------------------------------------------------

    def _rel(self, step: int) -> str:
        return f"{self.run_id}/{step_dir(step)}"

    def _finish_inflight(self, *, reraise_fenced: bool) -> None:
        """Wait for the background save, at most :attr:`inflight_timeout_s` (then
        :class:`InflightTimeout`; it keeps running and stays in flight)."""
        f = self._inflight
        if f is None:
            return
        try:
            f.result(timeout=self.inflight_timeout_s)
        except FutureTimeout:
            raise InflightTimeout(f"the background save of step {self._inflight_step} to {self.url} is still running "
                                  f"after {self.inflight_timeout_s:g}s (a peer gone from its collectives, or storage "
                                  f"not answering). The last committed step stands") from None
        except FencedError:
            self._inflight = None
            self._inflight_step = None
            if reraise_fenced:
                raise
        except Exception:  # noqa: BLE001 - already logged as checkpoint_save_failed by _persist
            pass
        self._inflight = None
        self._inflight_step = None

    def _persist(self, step: int, staged: dict[str, Any], kind: str, ready: Any = None) -> int:
        """Write, commit and clean up one staged state (background thread, or caller when sync).
        ``ready``: the event of the staging copies (GPU); the buffers are read only after it."""
        t0 = time.monotonic()
        if ready is not None:
            ready.synchronize()  # this save's copies only: not a device-wide synchronize
        rel = self._rel(step)
        try:
            self._on_rank0(lambda: self._check_fence(register=True))
            digests = self._write_shards(step, staged)
            gathered = self._all_gather((self.rank, digests))
            files = tuple(FileEntry(path=name, size=size, crc32=crc, rank=r)
                          for r, d in gathered for name, (size, crc) in sorted(d.items()))
            self._on_rank0(lambda: self._commit(step, kind, files))
        except Exception as e:
            self._log.error("checkpoint_save_failed", step=step, kind=kind, url=self.storage.url_of(rel),
                            error=_describe(e), elapsed_s=round(time.monotonic() - t0, 3),
                            last_committed=self._last_committed)
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"checkpoint of step {step} to {self.storage.url_of(rel)} failed: {_describe(e)}. "
                                  f"The previous committed step is untouched") from e
        self._last_committed = step
        self._log.info("checkpoint_committed", step=step, kind=kind, url=self.storage.url_of(rel),
                       bytes=sum(f.size for f in files), files=len(files), persist_s=round(time.monotonic() - t0, 3))
        if self.rank == 0:
            self._cleanup(step)
        return step

    def _write_shards(self, step: int, staged: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """``dcp.save`` with whole-save retries agreed by all ranks; return this rank's file digests."""
        rel = self._rel(step)
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            writer = self.storage.dcp_writer(rel)
            err: BaseException | None = None
            try:
                dcp.save(staged, storage_writer=writer, process_group=self._pg, no_dist=not self._distributed)
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                err = e
            if err is None:
                return writer.digests
            elapsed = time.monotonic() - start
            delay = min(self.storage.backoff_max_s, self.storage.backoff_base_s * 2 ** (attempt - 1))
            transient = all(is_transient(c) for c in _root_causes(err))
            want_retry = (transient and attempt < self.config.retry_attempts
                          and elapsed + delay <= self.config.retry_deadline_s)
            retry = all(self._all_gather(want_retry))
            self._log.warning("storage_retry", op="dcp_save", url=self.storage.url_of(rel), attempt=attempt,
                              max_attempts=self.config.retry_attempts, elapsed_s=round(elapsed, 3),
                              transient=transient, error=_describe(err)[:500], giving_up=not retry)
            if not retry:
                raise StorageError(f"writing the shards of step {step} to {self.storage.url_of(rel)} failed after "
                                   f"{attempt} attempt(s) in {elapsed:.1f}s: {_describe(err)}. The previous committed "
                                   f"step is untouched. Fix: check the storage endpoint and credentials; raise "
                                   f"checkpoint.retry_attempts / retry_deadline_s for flaky storage",
                                   transient=transient) from (err if isinstance(err, Exception) else None)
            time.sleep(delay)

    def _fence_rel(self, fence: int) -> str:
        return f"{self.run_id}/{FENCES_DIR}/{fence_name(fence)}"

    def _register_fence(self, base_step: int, *, overwrite: bool) -> None:
        """Record (rank 0) that this round owns the run from ``base_step`` on."""
        rel = self._fence_rel(self.fence)
        if not overwrite and (self._fence_registered or self.storage.exists(rel)):
            self._fence_registered = True
            return
        self.storage.write_bytes_atomic(rel, FenceRecord(self.fence, base_step, time.time()).to_json())
        self._fence_registered = True
        self._log.info("checkpoint_fence_registered", fence=self.fence, base_step=base_step)

    def _check_fence(self, *, register: bool) -> Scan:
        scan = scan_run(self.storage, self.run_id)
        newest = max([f.fence for f in scan.fences] + [m.fence for m in scan.committed] + [self.fence])
        if newest > self.fence:
            raise FencedError(f"refusing to commit to {self.url}: this writer's fence (rendezvous round) "
                              f"{self.fence} is older than round {newest}, which owns the run now. Fix: none "
                              f"needed for this stale worker — stop it; the newer world continues from its own "
                              f"checkpoints", fence=self.fence, newest_fence=newest)
        if register and not self._fence_registered:
            base = scan.committed[-1].step if scan.committed else -1
            self._register_fence(base, overwrite=False)
        return scan

    def _commit(self, step: int, kind: str, files: tuple[FileEntry, ...]) -> None:
        """Rank 0: re-check the fence, then write the manifest (the commit point)."""
        self._check_fence(register=False)
        m = Manifest(run_id=self.run_id, step=step, world_size=self.world_size, strategy=self.strategy,
                     fence=self.fence, kind=kind, files=files, versions=_versions(), **now_fields())
        rel = self._rel(step)
        self.storage.fsync_dir(rel)
        self.storage.write_bytes_atomic(f"{rel}/{MANIFEST_NAME}", m.to_json())
        self.storage.fsync_dir(self.run_id)

    def _cleanup(self, committed_step: int) -> None:
        """Rank 0, after a commit: collect half-written/stale steps and apply retention. Never raises."""
        try:
            scan = scan_run(self.storage, self.run_id)
            if any(f.fence > self.fence for f in scan.fences):
                self._log.info("checkpoint_cleanup_skipped", reason="a newer round registered")
                return
            protected = {committed_step, self._restoring} - {None}
            inflight = self.in_flight
            for s in scan.uncommitted + scan.stale:
                if s in protected or s == inflight:
                    continue
                self.storage.remove(self._rel(s), recursive=True)
                self._log.info("checkpoint_garbage_collected", step=s,
                               reason="stale branch" if s in scan.stale else "no manifest")
            victims = retention_victims([m.step for m in scan.committed], self.config.keep_last,
                                        protected | {f.base_step for f in scan.fences if f.fence > self.fence})
            for s in victims:
                # Manifest first: the step disappears from discovery atomically, then its shards go.
                self.storage.remove(f"{self._rel(s)}/{MANIFEST_NAME}")
                self.storage.remove(self._rel(s), recursive=True)
                self._log.info("checkpoint_retention_deleted", step=s, keep_last=self.config.keep_last)
        except Exception as e:  # noqa: BLE001 - a failed cleanup must not fail a committed save
            self._log.warning("checkpoint_cleanup_failed", error=_describe(e))

    # -- internals: restore ---------------------------------------------------------------------

    def _verify(self, m: Manifest) -> tuple[bool, str]:
        """Check sizes and CRC32s of the step's files, split across ranks; agree on the result."""
        rel = self._rel(m.step)
        problems: list[str] = []
        for i, f in enumerate(sorted(m.files, key=lambda f: f.path)):
            if i % self.world_size != self.rank:
                continue
            url = self.storage.url_of(f"{rel}/{f.path}")
            try:
                size = self.storage.size(f"{rel}/{f.path}")
                if size != f.size:
                    problems.append(f"{url}: size {size} != {f.size} in the manifest (truncated or overwritten)")
                    continue
                n, crc = self.storage.crc32(f"{rel}/{f.path}")
                if n != f.size or crc != f.crc32:
                    problems.append(f"{url}: crc32 {crc:#010x} != {f.crc32:#010x} in the manifest (corrupt)")
            except CheckpointNotFound:
                problems.append(f"{url}: missing")
            except CheckpointError as e:
                problems.append(f"{url}: {e}")
        if problems:
            self._log.error("checkpoint_verify_failed", step=m.step, problems=problems)
        all_problems = [p for ps in self._all_gather(problems) for p in ps]
        return (not all_problems), "; ".join(all_problems)

    def _load(self, m: Manifest, state: dict[str, Any]) -> tuple[bool, str]:
        reason = ""
        try:
            dcp.load(state, storage_reader=self.storage.dcp_reader(self._rel(m.step)), process_group=self._pg,
                     no_dist=not self._distributed)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - turned into a fallback
            reason = f"load failed: {_describe(e)}"
        results = self._all_gather(reason)
        bad = [r for r in results if r]
        return (not bad), "; ".join(dict.fromkeys(bad))


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        tg = version("trainguard")
    except PackageNotFoundError:
        tg = "unknown"
    return {"trainguard": tg, "torch": torch.__version__, "python": __import__("platform").python_version()}


__all__ = ["CheckpointInfo", "CheckpointManager", "Scan", "scan_run"]
