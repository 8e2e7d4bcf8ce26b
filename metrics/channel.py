"""The one channel from worker processes to their agent: prometheus_client multiprocess mode.

Why multiprocess mode and not a local socket
--------------------------------------------
* **Nothing on the training path can block.** A worker's observation is an ``mmap`` write of a few
  bytes into a file in ``PROMETHEUS_MULTIPROC_DIR`` (about a microsecond, no syscall, no
  serialisation). A socket needs a sender thread or non-blocking writes with a drop policy, and a
  reconnect story when the agent restarts. Metrics observe the training path; they must never
  steer or stall it.
* **The agent can die and come back.** The files outlive both sides; the agent reads whatever is
  there when it is scraped. Counters of a worker that died stay in its file, so totals stay
  monotonic across worker restarts (a socket protocol would have to reimplement that).
* **It is the documented prometheus_client mechanism** (gunicorn and friends), with a merge
  (``MultiProcessCollector``) that we do not have to write or test ourselves.

Costs we accept, and how we handle them
---------------------------------------
* ``PROMETHEUS_MULTIPROC_DIR`` must be in the worker's environment *before* ``prometheus_client``
  is imported there (its value class is picked at import). The agent writes it into the worker
  environment with :func:`worker_env`; :class:`~trainguard.metrics.worker.WorkerMetrics` checks it
  and disables itself with one log line (or raises, ``strict=True``) when it is not in effect.
* The directory must be wiped when the agent starts (:func:`prepare_dir`), or totals of a previous
  agent's run leak in. Prometheus handles the resulting counter reset.
* Dead workers: the agent calls :func:`mark_dead` (``mark_process_dead``) for each exited worker
  pid, which deletes its ``live*`` gauge files. Gauge modes are chosen per metric:

  ==============================================  ==========  ======================================
  gauge                                           mode        why
  ==============================================  ==========  ======================================
  ``trainguard_step``                             livemax     current step of the *live* workers;
                                                              absent when none runs
  ``trainguard_last_step_timestamp_seconds``      max         last progress ever; must survive the
                                                              workers so "no progress" can alert
  ``trainguard_checkpoint_last_committed_step``   max         commits are monotonic within a run
  ``trainguard_checkpoint_last_commit_timestamp_  max         as above, for the staleness alert
  seconds``
  ``trainguard_gpu_allocator_peak_bytes``         livemax     a dead process holds no memory
  ==============================================  ==========  ======================================

  No ``all``/``liveall`` gauges: they add a ``pid`` label, which is unbounded across restarts.
* Files of dead workers would accumulate (a few per worker per restart) and every scrape reads them
  all. :func:`compact_dead` folds a dead worker's counter/histogram/non-live gauge files into one
  ``*_archive.db`` set (values merged key by key, as the collector would) and deletes them, so a
  scrape reads the live workers plus one archive, however many restarts happened. The agent runs
  it under the same lock as its reads, so no scrape ever sees a value twice or not at all.

Threading: every function here is safe to call from any thread; none keeps state.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterator

ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"
"""The variable prometheus_client reads (at import, in the worker) to enable multiprocess mode."""

DIR_NAME = "prometheus_multiproc"


def multiproc_dir(run_dir: str) -> str:
    """The channel directory for an agent whose run directory is ``run_dir`` (a local path)."""
    return os.path.join(run_dir, DIR_NAME)


def worker_env(run_dir: str) -> dict[str, str]:
    """Environment variables the agent must set for every worker it starts.

    The supervisor merges these into the worker environment (the one place worker env vars are
    written). They must be in place before the worker's Python imports ``prometheus_client``.
    """
    return {ENV_VAR: multiproc_dir(run_dir)}


def prepare_dir(path: str) -> str:
    """Create ``path`` and remove every ``*.db`` file left in it; return ``path``.

    Called once at agent start, before any worker exists. Only ``*.db`` files are removed so a
    misconfigured path (say, the run directory itself) loses nothing else.
    """
    os.makedirs(path, exist_ok=True)
    for f in glob.glob(os.path.join(path, "*.db")):
        try:
            os.remove(f)
        except FileNotFoundError:
            pass
    return path


def mark_dead(pid: int, path: str) -> None:
    """Forget the ``live*`` gauges of worker ``pid``; its counters and histograms stay in the totals."""
    from prometheus_client import multiprocess  # lazy: importing this package must not pick the value class

    multiprocess.mark_process_dead(pid, path)


def remove_dir(path: str) -> None:
    """Remove the channel directory (tests, or an agent that shuts down for good)."""
    shutil.rmtree(path, ignore_errors=True)


def collect_files(path: str, pattern: str | tuple[str, ...] = "*.db", exclude_pid: int | None = None) -> list:
    """Merge the worker files in ``path`` matching ``pattern`` into metric families.

    Returns prometheus_client ``Metric`` objects (histograms accumulated as on the wire). A file
    deleted between the glob and the read (a ``mark_dead`` racing a scrape) or still empty (a worker
    creating it) is skipped. Files of
    ``exclude_pid`` are left out: an agent whose own environment points ``PROMETHEUS_MULTIPROC_DIR``
    here would otherwise expose its own metrics twice.
    """
    from prometheus_client import multiprocess

    patterns = (pattern,) if isinstance(pattern, str) else pattern
    files = [f for pat in patterns for f in glob.glob(os.path.join(path, pat))]
    if exclude_pid is not None:
        files = [f for f in files if not f.endswith(f"_{exclude_pid}.db")]
    if not files:
        return []
    for attempt in range(5):
        # A worker that is creating its file right now leaves it empty for a moment; reading it
        # raises struct.error. Skip empty files, and retry once the worker has written the header.
        files = [f for f in files if _size(f) >= 8]
        try:
            return list(multiprocess.MultiProcessCollector.merge(files, accumulate=True))
        except FileNotFoundError:
            continue
        except struct.error:
            if attempt == 4:
                raise
            time.sleep(0.005)
    return []


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


ARCHIVE_ID = "archive"
"""Pseudo-pid of the files holding the merged values of compacted dead workers."""

_COMPACTABLE = ("counter", "histogram", "summary", "gauge_max", "gauge_min", "gauge_sum", "gauge_mostrecent")


def compact_dead(path: str, pid: int) -> int:
    """Fold the remaining files of dead worker ``pid`` into the archive files; return files folded.

    Call after :func:`mark_dead` (its ``live*`` gauges are already gone) and only while nothing
    else reads ``path`` (the agent holds its channel lock). Keys are identical across processes
    (gauges get their ``pid`` label from the file name), so merging is per key: sum for counters,
    histograms, summaries and ``sum`` gauges, max/min for ``max``/``min`` gauges, the newest
    timestamp for ``mostrecent``. The archive is rewritten to a temporary name and renamed.
    """
    from prometheus_client.mmap_dict import MmapedDict

    folded = 0
    for prefix in _COMPACTABLE:
        dead = os.path.join(path, f"{prefix}_{pid}.db")
        if not os.path.exists(dead):
            continue
        archive = os.path.join(path, f"{prefix}_{ARCHIVE_ID}.db")
        merged: dict[str, tuple[float, float]] = {}
        for f in (archive, dead):
            if not os.path.exists(f):
                continue
            for key, value, ts, _ in MmapedDict.read_all_values_from_file(f):
                if key not in merged:
                    merged[key] = (value, ts)
                    continue
                old, old_ts = merged[key]
                if prefix in ("gauge_max",):
                    merged[key] = (max(old, value), max(old_ts, ts))
                elif prefix == "gauge_min":
                    merged[key] = (min(old, value), max(old_ts, ts))
                elif prefix == "gauge_mostrecent":
                    merged[key] = (value, ts) if ts > old_ts else (old, old_ts)
                else:
                    merged[key] = (old + value, max(old_ts, ts))
        tmp = archive + ".tmp"  # not matched by the *.db glob of a reader
        if os.path.exists(tmp):
            os.remove(tmp)
        d = MmapedDict(tmp)
        try:
            for key, (value, ts) in merged.items():
                d.write_value(key, value, ts)
        finally:
            d.close()
        os.replace(tmp, archive)
        os.remove(dead)
        folded += 1
    return folded


class ReadWriteLock:
    """Many concurrent readers (scrapes, the sampler) or one writer (compaction of dead workers).

    Reads of the channel never wait for each other, only for a compaction, which is rare and short.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
