"""Restore, step by step: list the run until it answers, pick the candidates, and verify and load one
step, retrying while it is unreadable now — all as collectives over the checkpoint group.

:class:`StepLoader` holds no decision about *what to do* with a verdict beyond retrying the same step
until the deadline: the manager decides whether a corrupt or unreadable step means "next older step"
or "fail", and claims the world's epoch when a step is loaded. See :mod:`trainguard.checkpoint.integrity`
for the verdicts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint.collective import Group
from trainguard.checkpoint.discovery import Scan, StepRef, scan_run
from trainguard.checkpoint.errors import CheckpointError, CheckpointNotFound
from trainguard.checkpoint.integrity import OK, Verdict, describe, load_verdict, verify_file
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.retry import Backoff, retry_call
from trainguard.checkpoint.storage import Storage, is_transient


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What rank 0 found: the steps to try, best first, with their manifests (None: another format)."""

    candidates: list[tuple[StepRef, Manifest | None]]
    invalid: list[tuple[StepRef, str]]
    """Proven-corrupt manifests and why (for the error when nothing else is left)."""
    ignored: int
    """Names that were not ours."""
    starts: dict[tuple[int, int], int]
    """(base step, base epoch) -> how many epochs claimed it as their starting point ((-1, -1): the
    empty start). An epoch that started from a step the plan picks again died without committing
    anything newer: the interval controller counts those as failures."""


class StepLoader:
    """Restore's collectives for one run (``storage``/``run_id``) over ``group``; ``log`` is a bound logger."""

    def __init__(self, storage: Storage, run_id: str, group: Group, *, verify_files: bool, log: Any) -> None:
        self.storage = storage
        self.run_id = run_id
        self.group = group
        self.verify_files = verify_files
        self.log = log

    def scan_until(self, deadline: float) -> Scan:
        """Rank 0: scan, retrying what is unreadable now (after the storage's own retries) until ``deadline``."""
        def on_failure(e: BaseException, attempt: int, elapsed: float, transient: bool, give_up: bool) -> None:
            self.log.warning("checkpoint_scan_unreadable", url=self.storage.url_of(self.run_id), attempt=attempt,
                             transient=transient, giving_up=give_up, error=describe(e)[:500])

        budget = max(0.0, deadline - time.monotonic())
        return retry_call(lambda: scan_run(self.storage, self.run_id), Backoff.until(budget),
                          transient=is_transient, on_failure=on_failure)

    def plan(self, deadline: float, step: int | None) -> RestorePlan:
        """Rank 0: scan (until ``deadline``) and pick the steps to try, best first: the restore lineage
        newest first, or the committed ``step`` (from the restore lineage if it holds it, else from the
        newest epoch that does). Small and picklable, for the broadcast."""
        scan = self.scan_until(deadline)
        line = scan.restore_lineage()
        if step is None:
            refs = list(reversed(line))
        else:
            same = [r for r in [*scan.committed, *scan.foreign] if r.step == step]
            if not same:
                url = self.storage.url_of(self.run_id)
                raise CheckpointNotFound(f"step {step} has no committed checkpoint under {url} "
                                         f"(committed: {sorted({r.step for r in scan.committed})}). Fix: pick one of "
                                         f"those or omit the step")
            in_line = [r for r in same if r in set(line)]
            refs = [max(in_line)] if in_line else [max(same)]
        starts: dict[tuple[int, int], int] = {}
        for rec in scan.epochs.values():
            if rec is not None:
                key = (rec.base_step, rec.base_epoch)
                starts[key] = starts.get(key, 0) + 1
        return RestorePlan(candidates=[(r, scan.committed.get(r)) for r in refs],
                           invalid=sorted(scan.invalid.items()), ignored=len(scan.ignored), starts=starts)

    def attempt(self, ref: StepRef, m: Manifest | None, state: dict[str, Any], deadline: float) -> Verdict:
        """Verify and load one step, retrying while it is unreadable now (a collective)."""
        backoff = Backoff.until(max(0.0, deadline - time.monotonic()))
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            if m is None:
                return Verdict("unreadable", False, (f"{ref.name} has a manifest of another format version; "
                                                      f"this trainguard cannot read it",))
            verdict = self.verify(m) if self.verify_files else OK
            if verdict.status == "ok":
                verdict = self.load(m, state)
                if verdict.status == "failed":  # intact bytes, or not? find out before deciding anything
                    proof = self.verify(m)
                    if proof.status == "ok":
                        raise CheckpointError(
                            f"step {m.step} at {self.storage.url_of(f'{self.run_id}/{ref.name}')} is intact (sizes and "
                            f"checksums match its manifest) but loading it into this job's state failed: "
                            f"{verdict.reason}. Nothing was changed. Fix: restore with the model, optimizer and "
                            f"strategy options that saved it (strategy {m.strategy}, world size {m.world_size}), "
                            f"or start a new run id")
                    verdict = proof
            if verdict.status in ("ok", "corrupt"):
                return verdict

            def decide() -> float | None:
                elapsed = time.monotonic() - start
                delay = backoff.delay(attempt)
                return delay if verdict.transient and backoff.allows(attempt, elapsed, delay) else None

            delay = self.group.broadcast(decide() if self.group.rank == 0 else None)
            if delay is None:
                return verdict
            self.log.warning("checkpoint_restore_unreadable", step=ref.step, saved_epoch=ref.epoch, attempt=attempt,
                              retry_in_s=round(delay, 2), deadline_in_s=round(deadline - time.monotonic(), 1),
                              reason=verdict.reason[:500])
            time.sleep(delay)

    def verify(self, m: Manifest) -> Verdict:
        """Check sizes and CRC32s of the step's files, split across ranks; all ranks get the verdict."""
        rel = f"{self.run_id}/{m.dir_name}"
        mine: list[Verdict] = []
        for i, f in enumerate(sorted(m.files, key=lambda f: f.path)):
            if i % self.group.world_size == self.group.rank:
                mine.append(verify_file(self.storage, f"{rel}/{f.path}", f))
        verdict = Verdict.combine(mine)
        if verdict.status != "ok":
            self.log.error("checkpoint_verify_failed", step=m.step, saved_epoch=m.epoch, status=verdict.status,
                            problems=list(verdict.problems)[:20])
        return Verdict.combine(self.group.all_gather(verdict))

    def load(self, m: Manifest, state: dict[str, Any]) -> Verdict:
        """``dcp.load`` in place (a collective); the verdicts of all ranks, combined."""
        verdict = OK
        try:
            dcp.load(state, storage_reader=self.storage.dcp_reader(f"{self.run_id}/{m.dir_name}"),
                     process_group=self.group.pg, no_dist=not self.group.distributed)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - classified, agreed, decided by the caller
            verdict = load_verdict(e)
        return Verdict.combine(self.group.all_gather(verdict))


__all__ = ["RestorePlan", "StepLoader"]
