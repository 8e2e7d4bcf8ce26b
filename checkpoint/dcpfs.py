"""DCP's fsspec reader and writer over our :class:`~trainguard.checkpoint.storage.Storage`: durable,
verified, checksummed shard writes (the only import of torch's private ``_fsspec_filesystem``).

``torch.distributed.checkpoint._fsspec_filesystem`` is private in torch 2.13, so it is imported here
and nowhere else; everything else reaches it through :meth:`Storage.dcp_writer
<trainguard.checkpoint.storage.Storage.dcp_writer>` / :meth:`~trainguard.checkpoint.storage.Storage.dcp_reader`.
Two DCP-over-fsspec bugs are worked around in :class:`_DurableFileSystem`:

* pytorch#142396 — s3fs/gcsfs file objects have ``fileno`` but calling it raises
  ``io.UnsupportedOperation``. torch 2.13 catches it and falls back to ``os.sync()``, which flushes
  every disk of the host and does nothing for a remote object. We build the writer with
  ``sync_files=False`` so DCP never calls ``fileno``/``os.sync``, and do durability ourselves.
* pytorch#183878 — data buffered in the fsspec file object is not guaranteed to be on the remote
  side after DCP's "sync". Our stream wrapper (:class:`_DigestWriter`), on close, flushes the fsspec
  buffer (``flush(force=True)`` through ``close()``), ``fsync``s local files, and then *checks* that
  the stored object has exactly the number of bytes written (``fs.info``); a short object raises
  :class:`StorageError` instead of being committed. It also computes each file's CRC32 while the
  bytes pass, so the manifest's checksums cost no second read.

A save is cancelled (:meth:`DCPWriter.cancel`) within one :data:`WRITE_SLICE` of every open stream.
"""

from __future__ import annotations

import io
import os
import threading
import zlib
from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint._fsspec_filesystem import (
    FileSystem as _TorchFsspecFileSystem,
    FsspecReader as _TorchFsspecReader,
    FsspecWriter as _TorchFsspecWriter,
)

from trainguard.checkpoint.errors import SaveCancelled, StorageError

if TYPE_CHECKING:
    from trainguard.checkpoint.storage import Storage


WRITE_SLICE = 8 << 20
"""Bytes handed to the backend per call: a cancelled save stops within one slice (object stores upload
a part whenever their buffer fills, inside ``write``)."""


class _DigestWriter(io.RawIOBase):
    """Write-only stream over an fsspec file: counts bytes, computes CRC32, commits durably on close.

    ``close()`` is the commit: flush the fsspec buffer (pytorch#183878), ``fsync`` if local, close
    (which uploads the last part on object stores), then verify the stored size. ``fileno`` is not
    offered (pytorch#142396). Once ``cancelled`` is set, the next write or the commit raises
    :class:`SaveCancelled` (the caller aborts the file).
    """

    def __init__(self, raw: Any, path: str, storage: Storage, local: bool,
                 cancelled: threading.Event | None = None) -> None:
        super().__init__()
        self._raw = raw
        self._path = path
        self._storage = storage
        self._local = local
        self._cancelled = cancelled
        self.size = 0
        self.crc = 0
        self._committed = False

    def _check_cancelled(self) -> None:
        if self._cancelled is not None and self._cancelled.is_set():
            raise SaveCancelled(f"{self._path}: the save was cancelled (its world lost a peer); the file is dropped")

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        for start in range(0, len(mv), WRITE_SLICE):
            self._check_cancelled()
            part = mv[start:start + WRITE_SLICE]
            n = self._raw.write(part)
            n = len(part) if n is None else n
            if n != len(part):
                raise StorageError(f"short write to {self._path}: {n} of {len(part)} bytes", transient=True)
            self.crc = zlib.crc32(part, self.crc)
            self.size += n
        return len(mv)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        if not self._committed and not self._raw.closed:
            self._raw.flush()

    def close(self) -> None:
        if self._committed or self.closed:
            super().close()
            return
        self._check_cancelled()  # before the commit: the caller aborts the file
        self._committed = True
        try:
            if self._local:
                self._raw.flush()
                os.fsync(self._raw.fileno())
            self._raw.close()  # object stores: flush(force=True) uploads the final part here
            fs = self._storage.fs
            fs.invalidate_cache(self._path)
            stored = int(fs.info(self._path)["size"])
            if stored != self.size:
                raise StorageError(
                    f"{self._path}: storage holds {stored} bytes after {self.size} were written (unflushed or "
                    f"dropped buffer, pytorch#183878). Fix: retry; check the storage backend", transient=True)
        finally:
            super().close()

    def __del__(self) -> None:
        # Never commit from the garbage collector: an unclosed stream is an aborted one.
        pass

    def abort(self) -> None:
        """Drop the file without committing it (object stores: abort the multipart upload)."""
        self._committed = True
        try:
            if hasattr(self._raw, "discard") and not self._local:
                self._raw.discard()
            self._raw.close()
        except Exception:  # noqa: BLE001 - best effort on an already failing path
            pass
        super().close()


class _DurableFileSystem(_TorchFsspecFileSystem):
    """DCP's fsspec ``FileSystem`` with durable, verified, checksummed writes. See the module docstring."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self.storage = storage
        self.fs = storage.fs
        self.local = storage.is_local
        self.digests: dict[str, tuple[int, int]] = {}
        self._digest_lock = threading.Lock()
        self.cancelled = threading.Event()
        """Set by :meth:`DCPWriter.cancel`: every open stream stops at its next slice."""

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        return path

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        if not any(ch in mode for ch in "w+a"):
            f = self.storage.retry("open", path, lambda: self.fs.open(path, mode))
            with f:
                yield f
            return
        raw = self.fs.open(path, mode)
        stream = _DigestWriter(raw, path, self.storage, self.local, self.cancelled)
        try:
            yield stream
            stream.close()
        except BaseException:
            stream.abort()
            try:
                self.fs.rm(path)
            except Exception:  # noqa: BLE001 - the file may never have been created
                pass
            raise
        with self._digest_lock:
            self.digests[path.rsplit("/", 1)[-1]] = (stream.size, stream.crc)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        path, new_path = os.fspath(path), os.fspath(new_path)
        if self.local:
            os.replace(path, new_path)
        else:
            # Copy + delete rather than fs.mv: gcsfs tries the moveTo API first, which emulators (and
            # some buckets) refuse with 501 after ~30 s of retries. DCP only renames its small
            # ``.metadata`` file; our manifest, not this rename, is the commit point.
            self.storage.retry("copy", path, lambda: self.fs.copy(path, new_path))
            self.storage.retry("remove", path, lambda: self.fs.rm(path))
        with self._digest_lock:
            d = self.digests.pop(path.rsplit("/", 1)[-1], None)
            if d is not None:
                self.digests[new_path.rsplit("/", 1)[-1]] = d

    def mkdir(self, path: str | os.PathLike) -> None:
        if self.local:
            os.makedirs(os.fspath(path), exist_ok=True)
        # Object stores have no directories; creating a "directory" marker would only cost a request.

    def exists(self, path: str | os.PathLike) -> bool:
        self.fs.invalidate_cache(os.fspath(path))
        return bool(self.fs.exists(os.fspath(path)))


class DCPWriter(_TorchFsspecWriter):
    """DCP ``StorageWriter`` over :class:`Storage`: one file per rank, ``sync_files=False`` (we sync).

    After ``dcp.save`` returns, :attr:`digests` maps each file *this rank* wrote (name -> (size,
    crc32)); on the coordinator it includes DCP's ``.metadata``.
    """

    def __init__(self, storage: Storage, rel_dir: str) -> None:
        path = storage.path(rel_dir)
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
        self.fs = _DurableFileSystem(storage)
        self.path = path

    @property
    def digests(self) -> dict[str, tuple[int, int]]:
        return dict(self.fs.digests)

    def cancel(self) -> None:
        """Stop writing (thread-safe): the streams raise :class:`SaveCancelled` at their next slice or
        commit and drop their files; ``dcp.save`` then fails on every rank that was cancelled."""
        self.fs.cancelled.set()

    @property
    def is_cancelled(self) -> bool:
        return self.fs.cancelled.is_set()


class DCPReader(_TorchFsspecReader):
    """DCP ``StorageReader`` over :class:`Storage` (opens retried)."""

    def __init__(self, storage: Storage, rel_dir: str) -> None:
        path = storage.path(rel_dir)
        super().__init__(path)
        self.fs = _DurableFileSystem(storage)
        self.path = path


__all__ = ["DCPReader", "DCPWriter", "WRITE_SLICE"]
