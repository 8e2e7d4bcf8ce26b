"""A bandwidth-limited local store for the benches: fsspec's local filesystem, throttled.

Python imports this module at start-up in every process whose ``PYTHONPATH`` holds this folder
(``bench/spot_trace.py --store-bytes-per-s`` puts it there for its agents, and their workers inherit
it): in those processes fsspec's ``file`` protocol (a checkpoint URL that is a path) is replaced by a
throttled one, so the product runs unchanged (its configuration accepts only the schemes it knows).
Each process (one worker per agent in the bench: one node) reads and writes checkpoint files at most
``TG_BENCH_STORE_BYTES_PER_S`` bytes per second, shared by all its threads (a token bucket); the files
are ordinary local files. Unset or 0: nothing is registered.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

ENV = "TG_BENCH_STORE_BYTES_PER_S"


class _Bucket:
    """Bytes move at ``rate`` per second, across threads: each transfer waits for its turn."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + n / self.rate
            wait = self._free_at - now
        time.sleep(wait)


class _ThrottledFile:
    """A local file whose reads and writes pass through the bucket; everything else is the file's."""

    def __init__(self, raw: Any, bucket: _Bucket) -> None:
        self._raw, self._bucket = raw, bucket

    def write(self, data: Any) -> int:
        self._bucket.take(memoryview(data).nbytes)
        return self._raw.write(data)

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self._bucket.take(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        n = self._raw.readinto(buf)
        self._bucket.take(n or 0)
        return n

    def __enter__(self) -> _ThrottledFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._raw.close()

    def __iter__(self) -> Any:
        return iter(self._raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _register(rate: float) -> None:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    bucket = _Bucket(rate)

    class ThrottledFileSystem(LocalFileSystem):
        """Local files at a limited bandwidth (renames and fsync stay local)."""

        def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
            return _ThrottledFile(super()._open(path, mode, *args, **kwargs), bucket)

    fsspec.register_implementation("file", ThrottledFileSystem, clobber=True)
    fsspec.register_implementation("local", ThrottledFileSystem, clobber=True)


_rate = float(os.environ.get(ENV) or 0)
if _rate > 0:
    try:
        _register(_rate)
    except ImportError:  # a process without fsspec writes no checkpoint
        pass
