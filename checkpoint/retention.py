"""Retention and garbage collection after a commit, and the quarantine of proven-corrupt steps.

What may go is decided by the pure :func:`~trainguard.checkpoint.discovery.gc_plan` (retention within
the newest lineage, half-written steps older than a later commit of their epoch, proven-corrupt
steps); :class:`Retention` carries it out on rank 0 after each commit: proven-corrupt steps are moved
into ``<run_id>/quarantine/`` (the newest ``checkpoint.quarantine_keep`` stay there), the rest are
deleted, a committed step's manifest first (it leaves discovery atomically, then its files go). It
never raises: a failed cleanup must not fail a committed save. The steps a restore proved corrupt are
remembered here (:meth:`Retention.mark_corrupt`) until the next commit quarantines them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.discovery import Scan, StepRef, gc_plan, quarantine_expired, scan_run
from trainguard.checkpoint.integrity import describe
from trainguard.checkpoint.manifest import MANIFEST_NAME, QUARANTINE_DIR
from trainguard.checkpoint.storage import Storage


class Retention:
    """Garbage collection of one run (``storage``/``run_id``) by ``config``'s ``keep_last`` and
    ``quarantine_keep``; it holds the steps proven corrupt and not yet quarantined."""

    def __init__(self, storage: Storage, run_id: str, config: CheckpointConfig) -> None:
        self.storage = storage
        self.run_id = run_id
        self.config = config
        self.corrupt: set[StepRef] = set()
        """Steps a restore proved corrupt (skipped), quarantined by the next commit's cleanup."""
        self._corrupt_why: dict[StepRef, str] = {}

    def mark_corrupt(self, ref: StepRef, why: str) -> None:
        """A restore proved ``ref`` corrupt (``why``): the next commit's cleanup quarantines it."""
        self.corrupt.add(ref)
        self._corrupt_why[ref] = why

    def collect(self, committed: StepRef, *, epoch: int, base: StepRef | None,
                cancelled: Callable[[], str | None], log: Any) -> None:
        """Rank 0, after ``committed`` was committed by ``epoch``: delete what :func:`gc_plan` allows
        (``base``, the step the world descends from, stays). Never raises. Skipped once ``cancelled()``
        says why the save was cancelled (the worker waits for it to park; the next commit collects what
        this one would have)."""
        if (why := cancelled()) is not None:
            log.info("checkpoint_gc_skipped", reason="cancelled", why=why)
            return
        try:
            scan = scan_run(self.storage, self.run_id)
            if scan.newest_epoch > epoch:
                log.info("checkpoint_gc_skipped", reason="a newer epoch exists", newest_epoch=scan.newest_epoch)
                return
            protected = {committed} | ({base} if base else set())
            for d in gc_plan(scan, epoch=epoch, keep_last=self.config.keep_last, protected=protected,
                             proven_corrupt=self.corrupt):
                if (why := cancelled()) is not None:
                    log.info("checkpoint_gc_skipped", reason="cancelled", why=why)
                    return
                rel = f"{self.run_id}/{d.ref.name}"
                if d.reason == "corrupt":
                    self._quarantine(d.ref, scan, log)
                    continue
                if d.ref in scan.committed:
                    # Manifest first: the step disappears from discovery atomically, then its files go.
                    self.storage.remove(f"{rel}/{MANIFEST_NAME}")
                self.storage.remove(rel, recursive=True)
                event = "checkpoint_retention_deleted" if d.reason == "retention" else "checkpoint_garbage_collected"
                log.info(event, step=d.ref.step, saved_epoch=d.ref.epoch, reason=d.reason,
                         keep_last=self.config.keep_last)
            for ref in quarantine_expired(scan, keep=self.config.quarantine_keep):
                self.storage.remove(f"{self.run_id}/{QUARANTINE_DIR}/{ref.name}", recursive=True)
                log.info("checkpoint_quarantine_expired", step=ref.step, saved_epoch=ref.epoch,
                         quarantine_keep=self.config.quarantine_keep)
        except Exception as e:  # noqa: BLE001 - a failed cleanup must not fail a committed save
            log.warning("checkpoint_cleanup_failed", error=describe(e))

    def _quarantine(self, ref: StepRef, scan: Scan, log: Any) -> None:
        """Rank 0: move a proven-corrupt step into ``<run_id>/quarantine/`` (the evidence stays; discovery
        never restores it). Its manifest goes last, so it never looks committed in two places."""
        src = f"{self.run_id}/{ref.name}"
        dst = f"{self.run_id}/{QUARANTINE_DIR}/{ref.name}"
        self.storage.move_tree(src, dst, last=MANIFEST_NAME)
        self.corrupt.discard(ref)
        scan.quarantined = sorted({*scan.quarantined, ref})
        why = scan.invalid.get(ref) or self._corrupt_why.pop(ref, "")
        log.warning("checkpoint_quarantined", step=ref.step, saved_epoch=ref.epoch, reason="corrupt",
                    why=why[:1000], url=self.storage.url_of(dst), quarantine_keep=self.config.quarantine_keep,
                    verify=f"trainguard checkpoints verify {self.storage.url_of(self.run_id)} {ref.step}")


__all__ = ["Retention"]
