"""Our one wrapper over fsspec: every operation the checkpoint subsystem does to storage.

Everything the checkpoint subsystem does to storage goes through :class:`Storage`: small retried
operations (list, read, atomic write, remove, checksum, create-exclusive) and the DCP
``StorageWriter`` / ``StorageReader`` (:meth:`Storage.dcp_writer`, :meth:`Storage.dcp_reader`), built
in :mod:`~trainguard.checkpoint.dcpfs` on ``torch.distributed.checkpoint._fsspec_filesystem`` (private
in torch 2.13, imported there and nowhere else; it also holds the workarounds for pytorch#142396 and
pytorch#183878 and the streaming CRC32 of the shards).

URLs stay ``str`` (``pathlib.Path`` collapses the ``//`` in ``gs://``). Supported: plain paths,
``file://``, ``s3://`` (s3fs), ``gs://``/``gcs://`` (gcsfs) and ``memory://`` (tests). Backends are
imported lazily by fsspec. ``storage_options`` go to fsspec and are never logged.

Create-exclusive writes (:meth:`Storage.create_exclusive`, the epoch claims): ``link(2)`` of a fully
written temp file locally, ``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS, a lock on
``memory://``; object stores are probed once, and one that ignores the condition gets a write, wait,
read-back-and-compare fallback (logged as ``storage_conditional_create`` with ``mode=readback``).

Retries: transient errors (connection resets, timeouts, HTTP 429/5xx) are retried with exponential
backoff and jitter (:class:`~trainguard.checkpoint.retry.Backoff`, the policy shared with the manager)
until ``retry_attempts`` or ``retry_deadline_s`` runs out; every failed attempt is logged as
``storage_retry``. Threading: a :class:`Storage` may be used from the training thread and
the checkpoint thread at once; fsspec filesystems are thread-safe for these operations.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

from trainguard.checkpoint.dcpfs import (  # noqa: F401 - the DCP reader/writer's names, re-exported here
    WRITE_SLICE, DCPReader, DCPWriter, _DigestWriter, _DurableFileSystem)
from trainguard.checkpoint.errors import CheckpointNotFound, StorageError
from trainguard.checkpoint.retry import Backoff, retry_call
from trainguard.contract.log import get_logger

log = get_logger("trainguard.checkpoint.storage")

T = TypeVar("T")

_CHUNK = 8 * 1024 * 1024
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
_TRANSIENT_NAMES = ("Timeout", "Connection", "ServerDisconnected", "ClientOSError", "ClientPayloadError",
                    "IncompleteRead", "ProtocolError", "EndpointConnection", "ResponseStreamingError")


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the operation that raised ``exc`` may succeed (a pure function, unit-tested)."""
    if isinstance(exc, StorageError):
        return exc.transient
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    name = type(exc).__name__
    if any(k in name for k in _TRANSIENT_NAMES):
        return True
    code = getattr(exc, "code", None) or getattr(exc, "status", None)
    if isinstance(code, int) and (code == 429 or 500 <= code < 600):
        return True
    # s3fs/gcsfs translate most network failures into a bare OSError (errno None or EIO/ECONNRESET).
    if type(exc) is OSError:
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def split_scheme(url: str) -> str:
    """The URL's scheme (``file`` for plain paths)."""
    return url.split("://", 1)[0] if "://" in url else "file"


class Storage:
    """A checkpoint root (``url``) on some fsspec backend, with retried operations.

    Paths given to methods are relative to the root, ``/``-separated (``run/step-000000000010/x``).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, retry_attempts: int = 5,
                 retry_deadline_s: float = 120.0, backoff_base_s: float = 0.1, backoff_max_s: float = 5.0) -> None:
        if not url:
            raise StorageError("checkpoint url is empty. Fix: set checkpoint.url (TRAINGUARD_CHECKPOINT_URL)")
        self.url = url.rstrip("/") if url.rstrip("/") else url
        self._options = dict(storage_options or {})
        self.retry_attempts = retry_attempts
        self.retry_deadline_s = retry_deadline_s
        self.backoff = Backoff(base_s=backoff_base_s, max_s=backoff_max_s, attempts=retry_attempts,
                               deadline_s=retry_deadline_s)
        """The retry policy of every operation (and of the manager's collective save retries)."""
        self._cc_mode: str | None = None
        self._fs: Any = None
        self._root = ""
        self._lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------------

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (created on first use, so importing s3fs/gcsfs happens lazily)."""
        with self._lock:
            if self._fs is None:
                from fsspec.core import url_to_fs

                try:
                    self._fs, root = url_to_fs(self.url, **self._options)
                except (ImportError, ValueError) as e:
                    raise StorageError(
                        f"cannot open checkpoint storage {self.url!r}: {e}. Fix: install the backend "
                        f"(the `s3` / `gcs` extra: `pip install '<checkout>[s3]'`, or s3fs / gcsfs) and check checkpoint.storage_options") from e
                self._root = root.rstrip("/") if root not in ("/", "") else root
            return self._fs

    @property
    def is_local(self) -> bool:
        """Whether the backend is the local filesystem (``fsync`` and ``os.replace`` apply)."""
        return "file" in _protocols(self.fs) or "local" in _protocols(self.fs)

    def path(self, rel: str = "") -> str:
        """The backend path (no scheme) of ``rel``."""
        _ = self.fs
        if not rel:
            return self._root
        return f"{self._root.rstrip('/')}/{rel.lstrip('/')}" if self._root else rel

    def url_of(self, rel: str = "") -> str:
        """The user-facing URL of ``rel`` (for messages and logs; carries no credentials)."""
        return f"{self.url}/{rel}" if rel else self.url

    def retry(self, op: str, rel: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries on transient errors; raise :class:`StorageError` when they run out.

        Permanent errors (not found, permission) are re-raised as they are after one attempt, so
        callers can tell "missing" from "broken". The policy is :attr:`backoff` (shared helper
        :mod:`trainguard.checkpoint.retry`).
        """
        attempts = [0]

        def on_failure(e: BaseException, attempt: int, elapsed: float, transient: bool, give_up: bool) -> None:
            attempts[0] = attempt
            if attempt == 1 and not transient and isinstance(e, _PERMANENT):
                return  # an answer ("not found"), not a failure: nothing to retry or log
            log.warning("storage_retry", op=op, url=self.url_of(rel), attempt=attempt,
                        max_attempts=self.retry_attempts, elapsed_s=round(elapsed, 3), transient=transient,
                        error=f"{type(e).__name__}: {e}"[:500], giving_up=give_up)

        start = time.monotonic()
        try:
            return retry_call(fn, self.backoff, transient=is_transient, on_failure=on_failure)
        except Exception as e:
            if not is_transient(e) and isinstance(e, (_PERMANENT, StorageError)):
                raise
            elapsed = time.monotonic() - start
            raise StorageError(
                f"{op} {self.url_of(rel)} failed after {attempts[0]} attempt(s) in {elapsed:.1f}s: "
                f"{type(e).__name__}: {e}. Fix: check that the storage endpoint is reachable and the "
                f"credentials are valid; raise checkpoint.retry_attempts / retry_deadline_s for flaky "
                f"storage", transient=is_transient(e)) from e

    # -- small retried operations ---------------------------------------------------------------

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""
        p = self.path(rel)

        def op() -> list[str]:
            self.fs.invalidate_cache(p)
            try:
                entries = self.fs.ls(p, detail=False)
            except FileNotFoundError:
                return []
            return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != p.rstrip("/")})

        return self.retry("list", rel, op)

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists."""
        p = self.path(rel)

        def op() -> bool:
            self.fs.invalidate_cache(p)
            return bool(self.fs.exists(p))

        return self.retry("exists", rel, op)

    def read_bytes(self, rel: str) -> bytes:
        """The whole content of ``rel``; :class:`CheckpointNotFound` when missing."""
        p = self.path(rel)
        try:
            return self.retry("read", rel, lambda: self.fs.cat_file(p))
        except FileNotFoundError as e:
            raise CheckpointNotFound(f"{self.url_of(rel)} does not exist") from e

    def size(self, rel: str) -> int:
        """Size of ``rel`` in bytes."""
        p = self.path(rel)

        def op() -> int:
            self.fs.invalidate_cache(p)
            return int(self.fs.info(p)["size"])

        try:
            return self.retry("stat", rel, op)
        except FileNotFoundError as e:
            raise CheckpointNotFound(f"{self.url_of(rel)} does not exist") from e

    def crc32(self, rel: str) -> tuple[int, int]:
        """``(size, crc32)`` of ``rel``, streamed in 8 MiB chunks (whole read retried on failure)."""
        p = self.path(rel)

        def op() -> tuple[int, int]:
            crc, n = 0, 0
            with self.fs.open(p, "rb") as f:
                while chunk := f.read(_CHUNK):
                    crc = zlib.crc32(chunk, crc)
                    n += len(chunk)
            return n, crc

        try:
            return self.retry("checksum", rel, op)
        except FileNotFoundError as e:
            raise CheckpointNotFound(f"{self.url_of(rel)} does not exist") from e

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``rel`` so that readers see either nothing or all of it, durably.

        Local: temp file, ``fsync``, ``os.replace``, ``fsync`` of the directory. Object stores: one PUT
        (atomic by the store's contract), then the stored size is checked.
        """
        p = self.path(rel)

        def op() -> None:
            if self.is_local:
                d = os.path.dirname(p)
                os.makedirs(d, exist_ok=True)
                tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, p)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                fsync_dir(d)
            else:
                self.fs.pipe_file(p, data)
                self.fs.invalidate_cache(p)
                got = int(self.fs.info(p)["size"])
                if got != len(data):
                    raise StorageError(f"{self.url_of(rel)} holds {got} bytes after writing {len(data)}",
                                       transient=True)

        self.retry("write", rel, op)

    # -- create-exclusive ---------------------------------------------------------------------------

    @property
    def protocol(self) -> str:
        """The backend's main protocol name (``file``, ``s3``, ``gcs``, ``memory``, ...)."""
        protos = _protocols(self.fs)
        if "file" in protos or "local" in protos:
            return "file"
        if "s3" in protos or "s3a" in protos:
            return "s3"
        if "gs" in protos or "gcs" in protos:
            return "gcs"
        return protos[0]

    def conditional_create_mode(self, probe_dir: str) -> str:
        """``native`` when the backend refuses to create an object that exists, else ``readback``.

        ``file``: ``link(2)`` of a fully written temp file (or ``O_CREAT|O_EXCL``); ``memory``: a
        process-wide lock. S3 (``PutObject`` with ``If-None-Match: *``) and GCS (``ifGenerationMatch=0``)
        are *probed* once per :class:`Storage` under ``probe_dir``, because emulators and some
        S3-compatible stores ignore the condition; a backend that ignores it is logged
        (``storage_conditional_create``, warning) and gets the write-then-read-back fallback.
        """
        if self._cc_mode is not None:
            return self._cc_mode
        proto = self.protocol
        if proto in ("file", "memory"):
            mode = "native"
        elif proto in ("s3", "gcs"):
            mode = self._probe_conditional_create(probe_dir)
        else:
            mode = "readback"
        self._cc_mode = mode
        level = log.info if mode == "native" else log.warning
        level("storage_conditional_create", url=self.url, backend=proto, mode=mode,
              **({} if mode == "native" else {"consequence": (
                  "this store ignores conditional creates (S3 If-None-Match: * / GCS ifGenerationMatch=0): "
                  "checkpoint epochs are claimed by write, wait, read back and compare, which two perfectly "
                  "simultaneous claims can both pass; the commit-time epoch check then refuses the one whose "
                  "record was overwritten. Real AWS S3 and GCS honour the condition")}))
        return mode

    def _probe_conditional_create(self, probe_dir: str) -> str:
        p = self.path(f"{probe_dir}/.probe-{uuid.uuid4().hex[:12]}")
        try:
            self.retry("probe", probe_dir, lambda: self.fs.pipe_file(p, b"1", mode="create"))
            try:
                self.fs.pipe_file(p, b"2", mode="create")
            except FileExistsError:
                return "native"
            except Exception as e:  # noqa: BLE001 - an unexpected answer means: do not rely on it
                log.warning("storage_conditional_create_probe_failed", url=self.url,
                            error=f"{type(e).__name__}: {e}"[:300])
            return "readback"
        except (TypeError, NotImplementedError, ValueError):
            return "readback"  # the fsspec backend has no mode="create"
        finally:
            try:
                self.fs.rm(p)
            except Exception:  # noqa: BLE001 - a leftover probe object is harmless (dot-names are ignored)
                pass

    def create_exclusive(self, rel: str, data: bytes, *, mode: str | None = None,
                         settle_s: float = 0.05) -> bool:
        """Create ``rel`` holding ``data`` unless it exists; True if this call created it.

        ``data`` must be unique to the caller (it carries a random token): after an ambiguous retry,
        or in ``readback`` mode, an existing object with exactly ``data`` is ours. ``mode`` is
        :meth:`conditional_create_mode` of ``rel``'s directory unless given. Readback: refuse if the
        object exists, write, wait ``settle_s``, read back and compare.
        """
        p = self.path(rel)
        mode = mode or self.conditional_create_mode(rel.rsplit("/", 1)[0] if "/" in rel else "")
        proto = self.protocol

        def ours() -> bool:
            try:
                return self.read_bytes(rel) == data
            except CheckpointNotFound:
                return False

        # An existing object holding exactly ``data`` is ours: a retried create whose first attempt did
        # land (a PUT whose answer was lost; NFS answering EEXIST to a retried link) still succeeded.
        if proto == "file":
            return self.retry("create", rel, lambda: _create_local_exclusive(p, data)) or ours()
        if proto == "memory":
            with _MEMORY_CREATE_LOCK:
                if not self.fs.exists(p):
                    self.fs.pipe_file(p, data)
                    return True
            return ours()
        if mode == "native":
            try:
                self.retry("create", rel, lambda: self.fs.pipe_file(p, data, mode="create"))
                return True
            except FileExistsError:
                return ours()
        if self.exists(rel):
            return ours()
        self.retry("create", rel, lambda: self.fs.pipe_file(p, data))
        time.sleep(settle_s)
        return ours()

    def remove(self, rel: str, *, recursive: bool = False) -> None:
        """Remove ``rel`` (a file, or a whole directory with ``recursive``); missing is not an error."""
        p = self.path(rel)

        def op() -> None:
            try:
                self.fs.rm(p, recursive=recursive)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(p)

        self.retry("remove", rel, op)

    def move_tree(self, src: str, dst: str, *, last: str) -> None:
        """Move the directory ``src`` to ``dst`` (``dst``'s parent is created; a stale ``dst`` of the
        same name is replaced). Local: one ``os.replace`` (atomic). Object stores: every file is copied,
        the file named ``last`` after the others; then ``src/last`` is removed first, so that ``src``
        stops being what it was (e.g. committed) before the rest of it goes. Interrupted, ``src`` is left
        whole or without ``last``, never ``dst`` without ``last`` and ``src`` gone."""
        if self.is_local:
            ps, pd = self.path(src), self.path(dst)

            def op() -> None:
                os.makedirs(os.path.dirname(pd), exist_ok=True)
                if os.path.isdir(pd):
                    shutil.rmtree(pd)
                os.replace(ps, pd)
                fsync_dir(os.path.dirname(pd))
                fsync_dir(os.path.dirname(ps))

            self.retry("move", src, op)
            return
        base = self.path(src).rstrip("/")

        def files() -> list[str]:
            self.fs.invalidate_cache(base)
            return sorted(f[len(base) + 1:] for f in self.fs.find(base))

        names = self.retry("list", src, files)
        for name in sorted(names, key=lambda n: n == last):
            self.retry("copy", f"{src}/{name}", lambda n=name: self.fs.copy(self.path(f"{src}/{n}"),
                                                                              self.path(f"{dst}/{n}")))
        if last in names:
            self.remove(f"{src}/{last}")
        self.remove(src, recursive=True)

    def fsync_dir(self, rel: str) -> None:
        """Make a local directory's entries durable; no-op on object stores."""
        if self.is_local:
            fsync_dir(self.path(rel))

    # -- DCP --------------------------------------------------------------------------------------

    def dcp_writer(self, rel_dir: str) -> DCPWriter:
        """A DCP ``StorageWriter`` for the directory ``rel_dir`` (one file per rank, durable writes)."""
        return DCPWriter(self, rel_dir)

    def dcp_reader(self, rel_dir: str) -> DCPReader:
        """A DCP ``StorageReader`` for the directory ``rel_dir``."""
        return DCPReader(self, rel_dir)


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


_MEMORY_CREATE_LOCK = threading.Lock()
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


def _create_local_exclusive(path: str, data: bytes) -> bool:
    """Create ``path`` with ``data`` unless it exists, atomically and durably (local filesystem).

    A temp file is written and fsync'd, then hard-linked to ``path``: ``link(2)`` fails with EEXIST
    if ``path`` exists, and readers never see a partial record (also safe on NFS, where O_EXCL was
    not always atomic). Filesystems without hard links get ``O_CREAT|O_EXCL`` + write + fsync.
    The directory is fsync'd either way.
    """
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_LINK:
                raise
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        fsync_dir(d)


def fsync_dir(path: str) -> None:
    """``fsync`` a local directory so that renames/creations in it survive a crash."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
