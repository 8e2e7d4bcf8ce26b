"""Discovery: list a run, classify what is there, follow lineages, and plan garbage collection.

:func:`scan_run` is the only I/O here (listings and small reads, no collectives; rank 0 and the CLI
use it). Everything else is a pure function of a :class:`Scan`, unit-tested with tables of cases.

Classification of a step directory ``step-<s>-e<e>``:

* **committed** — its ``manifest.json`` reads and validates (and names step ``s``, epoch ``e``);
* **uncommitted** — no manifest (a save in progress, or one that died half-way);
* **invalid** — the manifest was *read* and is malformed: proven corrupt;
* **foreign** — the manifest has another ``format_version`` (a newer trainguard): kept, never restored
  by this version (restore treats it as unreadable).

Proven-corrupt steps are not deleted: garbage collection moves them into ``<run_id>/quarantine/`` (the
evidence of what went wrong), which discovery lists apart (:attr:`Scan.quarantined`) and never restores;
:func:`quarantine_expired` keeps the newest ``checkpoint.quarantine_keep`` of them.

A manifest that cannot be *read* right now (timeout, 5xx, permission) fails the scan: "unreadable now"
never makes a step look absent.

Lineage
    Epoch ``n`` descends from ``(base_epoch, base_step)`` of its record. ``lineage(n)`` is every step
    epoch ``n`` committed, plus the lineage of its base epoch up to ``base_step``, recursively. The
    *restore lineage* is the lineage of the newest epoch that has any step in its lineage (an epoch
    that claimed and died before its first commit, from scratch, does not hide older history).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from trainguard.checkpoint.epochs import EpochRecord, read_record
from trainguard.checkpoint.errors import CheckpointCorrupt, CheckpointNotFound
from trainguard.checkpoint.manifest import (
    EPOCHS_DIR,
    MANIFEST_NAME,
    QUARANTINE_DIR,
    Manifest,
    UnsupportedFormat,
    parse_epoch_name,
    parse_step_dir,
    step_dir,
)
from trainguard.checkpoint.storage import Storage
from trainguard.contract.log import get_logger

log = get_logger("trainguard.checkpoint")


@dataclass(frozen=True, slots=True, order=True)
class StepRef:
    """One step directory: ``(step, epoch)``; orders by step, then epoch."""

    step: int
    epoch: int

    @property
    def name(self) -> str:
        return step_dir(self.step, self.epoch)

    def __str__(self) -> str:
        return f"{self.step}@e{self.epoch}"


class EpochRecords(Mapping[int, "EpochRecord | None"]):
    """The claimed epochs of a run, each record read on first use (and once).

    A long job claims an epoch per re-formation — hundreds a day on spot capacity — while a lineage
    walk or a restore needs only the newest few: listing the numbers is one request; reading every
    record at every commit would not scale. Iterating yields the numbers without reading anything.
    """

    def __init__(self, numbers: Iterable[int], load: Callable[[int], EpochRecord | None]) -> None:
        self._numbers = frozenset(numbers)
        self._load = load
        self._cache: dict[int, EpochRecord | None] = {}
        self.reads = 0

    def __getitem__(self, epoch: int) -> EpochRecord | None:
        if epoch not in self._numbers:
            raise KeyError(epoch)
        if epoch not in self._cache:
            self.reads += 1
            self._cache[epoch] = self._load(epoch)
        return self._cache[epoch]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._numbers))

    def __len__(self) -> int:
        return len(self._numbers)

    def __contains__(self, epoch: object) -> bool:
        return epoch in self._numbers


@dataclass(slots=True)
class Scan:
    """One listing of a run. See the module docstring for the classes of step directories."""

    committed: dict[StepRef, Manifest] = field(default_factory=dict)
    uncommitted: list[StepRef] = field(default_factory=list)
    invalid: dict[StepRef, str] = field(default_factory=dict)
    """Proven-corrupt manifests and why."""
    foreign: list[StepRef] = field(default_factory=list)
    epochs: Mapping[int, EpochRecord | None] = field(default_factory=dict)
    """Claimed epochs (an ``epochs/epoch-<n>.json`` exists); None when its record is malformed. From
    :func:`scan_run`: an :class:`EpochRecords`, read lazily."""
    quarantined: list[StepRef] = field(default_factory=list)
    """Step directories in ``quarantine/`` (proven corrupt, moved aside; never restored), oldest first."""
    ignored: list[str] = field(default_factory=list)
    """Entries whose names are not ours (``step-abc``, ``step-²``, stray files): never touched."""

    @property
    def newest_epoch(self) -> int:
        """The highest epoch claimed or used by a step directory; -1 if none."""
        used = [r.epoch for r in [*self.committed, *self.uncommitted, *self.invalid, *self.foreign]]
        return max([*self.epochs, *used], default=-1)

    def manifests(self) -> list[Manifest]:
        """Committed manifests, oldest first (by step, then epoch)."""
        return [self.committed[r] for r in sorted(self.committed)]

    def lineage(self, epoch: int) -> list[StepRef]:
        """Committed (and foreign) steps in the lineage of ``epoch``, oldest first."""
        return lineage_of(epoch, self.epochs, [*self.committed, *self.foreign])

    def restore_epoch(self) -> int | None:
        """The newest epoch with a non-empty lineage (the history a restore continues), or None."""
        return restore_epoch(self.epochs, [*self.committed, *self.foreign])

    def restore_lineage(self) -> list[StepRef]:
        """The restore lineage, oldest first (empty when nothing is committed)."""
        e = self.restore_epoch()
        return [] if e is None else self.lineage(e)


def lineage_of(epoch: int, records: Mapping[int, EpochRecord | None], refs: Iterable[StepRef]) -> list[StepRef]:
    """Steps of ``refs`` in the lineage of ``epoch`` (pure). Unknown or malformed records end the
    chain there (only that epoch's own steps count); a base epoch that is not older ends it too."""
    by_epoch: dict[int, list[StepRef]] = {}
    for r in refs:
        by_epoch.setdefault(r.epoch, []).append(r)
    lowest = min((r.step for rs in by_epoch.values() for r in rs), default=-1)
    out: list[StepRef] = []
    cutoff: int | None = None
    e = epoch
    while e >= 0 and (cutoff is None or cutoff >= lowest):  # below every step: nothing left to find
        out += [r for r in by_epoch.get(e, []) if cutoff is None or r.step <= cutoff]
        rec = records.get(e)
        if rec is None or rec.base_epoch < 0 or rec.base_epoch >= e or rec.base_step < 0:
            break
        cutoff = rec.base_step if cutoff is None else min(cutoff, rec.base_step)
        e = rec.base_epoch
    return sorted(out)


def restore_epoch(records: Mapping[int, EpochRecord | None], refs: Iterable[StepRef]) -> int | None:
    """The newest epoch (claimed or used) whose lineage is not empty (pure)."""
    refs = list(refs)
    for e in sorted({*records, *(r.epoch for r in refs)}, reverse=True):
        if lineage_of(e, records, refs):
            return e
    return None


@dataclass(frozen=True, slots=True)
class Deletion:
    """One step directory garbage collection removes, and why."""

    ref: StepRef
    reason: str
    """``corrupt`` (moved to ``quarantine/``, not deleted) | ``half_written`` | ``retention`` | ``branch``."""


def gc_plan(scan: Scan, *, epoch: int, keep_last: int, protected: Iterable[StepRef] = (),
            proven_corrupt: Iterable[StepRef] = ()) -> list[Deletion]:
    """What the owner of ``epoch`` may delete after a commit (pure). Nothing unless ``epoch`` is the
    newest. Deleted are only:

    (a) ``corrupt``: proven-corrupt steps (an invalid manifest, or ``proven_corrupt``: checksums or
        sizes this world found wrong, or a file missing from a readable listing);
    (b) ``half_written``: a directory without a manifest, of an epoch that has since committed a
        later step (that epoch moved on: the save died);
    (c) ``retention``: steps of the lineage of ``epoch`` beyond its newest ``keep_last``;
    and ``branch``: a committed step outside that lineage (history a newer epoch branched away from,
    or a commit of a stale world that slipped past its fence) once the lineage holds ``keep_last``
    commits by epochs newer than the one that wrote it.

    A ``corrupt`` step is *moved* into ``quarantine/`` by the caller, not deleted (see
    :func:`quarantine_expired` for how long it stays there).

    Never deleted: anything in ``protected``, foreign-format steps, half-written directories of an
    epoch that never committed later, and anything at all when a newer epoch exists.
    """
    if scan.newest_epoch > epoch:
        return []
    keep = set(protected)
    corrupt = set(proven_corrupt)
    out: list[Deletion] = []
    for r in sorted(set(scan.invalid) | (corrupt & (set(scan.committed) | set(scan.invalid)))):
        if r not in keep:
            out.append(Deletion(r, "corrupt"))
    newest_commit: dict[int, int] = {}
    for r in scan.committed:
        newest_commit[r.epoch] = max(newest_commit.get(r.epoch, -1), r.step)
    for r in sorted(scan.uncommitted):
        if r not in keep and newest_commit.get(r.epoch, -1) > r.step:
            out.append(Deletion(r, "half_written"))
    line = [r for r in scan.lineage(epoch) if r in scan.committed and r not in corrupt]
    old = line[:-keep_last] if keep_last > 0 else []
    out += [Deletion(r, "retention") for r in old if r not in keep]
    in_line = set(line)
    for r in sorted(scan.committed):
        if r in in_line or r in corrupt or r in keep:
            continue
        if sum(1 for x in line if x.epoch > r.epoch) >= keep_last:
            out.append(Deletion(r, "branch"))
    return out


def quarantine_expired(scan: Scan, *, keep: int) -> list[StepRef]:
    """Quarantined steps beyond the newest ``keep`` (by step, then epoch), which may now be deleted
    (pure). ``keep`` 0: none (the quarantine is kept whole)."""
    if keep <= 0:
        return []
    return sorted(scan.quarantined)[:-keep]


def scan_run(storage: Storage, run_id: str, *, warn: bool = True) -> Scan:
    """List ``<url>/<run_id>`` and classify its steps and epochs (rank 0 and the CLI; no collectives).

    ``warn``: log invalid manifests and ignored names (the CLI shows them itself instead). Raises
    :class:`~trainguard.checkpoint.errors.StorageError` (or ``PermissionError``) when a listing
    or a manifest cannot be read now.
    """
    scan = Scan()
    numbers: list[int] = []
    for name in storage.listdir(run_id):
        if name == EPOCHS_DIR:
            for ename in storage.listdir(f"{run_id}/{EPOCHS_DIR}"):
                e = parse_epoch_name(ename)
                if e is None:
                    if not ename.startswith("."):  # dot-names: claim temp files, conditional-create probes
                        scan.ignored.append(f"{EPOCHS_DIR}/{ename}")
                    continue
                numbers.append(e)
            continue
        if name == QUARANTINE_DIR:
            for qname in storage.listdir(f"{run_id}/{QUARANTINE_DIR}"):
                q = parse_step_dir(qname)
                if q is None:
                    scan.ignored.append(f"{QUARANTINE_DIR}/{qname}")
                else:
                    scan.quarantined.append(StepRef(*q))
            continue
        parsed = parse_step_dir(name)
        if parsed is None:
            scan.ignored.append(name)
            continue
        ref = StepRef(*parsed)
        rel = f"{run_id}/{name}/{MANIFEST_NAME}"
        try:
            m = Manifest.from_json(storage.read_bytes(rel), storage.url_of(rel))
        except CheckpointNotFound:
            scan.uncommitted.append(ref)
            continue
        except NotADirectoryError:  # a stray *file* with a step-like name
            scan.ignored.append(name)
            continue
        except UnsupportedFormat as e:
            if warn:
                log.warning("checkpoint_manifest_foreign", url=storage.url_of(rel), error=str(e))
            scan.foreign.append(ref)
            continue
        except CheckpointCorrupt as e:
            if warn:
                log.warning("checkpoint_manifest_invalid", url=storage.url_of(rel), error=str(e))
            scan.invalid[ref] = str(e)
            continue
        if (m.step, m.epoch) != parsed:
            why = f"manifest {storage.url_of(rel)} says step {m.step} epoch {m.epoch}, its directory {name}"
            if warn:
                log.warning("checkpoint_manifest_invalid", url=storage.url_of(rel), error=why)
            scan.invalid[ref] = why
            continue
        scan.committed[ref] = m
    if scan.ignored and warn:
        log.warning("checkpoint_names_ignored", url=storage.url_of(run_id), names=sorted(scan.ignored)[:20],
                    count=len(scan.ignored), why="not a step directory (step-<12+ digits>-e<12+ digits>) or an "
                    "epoch record: never read, restored or deleted")
    scan.uncommitted.sort()
    scan.foreign.sort()
    scan.quarantined.sort()
    scan.epochs = EpochRecords(numbers, lambda e: read_record(storage, run_id, e))
    return scan


def newest_commits(storage: Storage, *, limit: int = 50) -> dict[str, Manifest]:
    """``{run_id: manifest of its newest committed step}`` (by step, then epoch) of the runs under the
    checkpoint URL that have a committed step (at most ``limit`` run folders are scanned; a listing
    error raises as in :func:`scan_run`)."""
    out: dict[str, Manifest] = {}
    for run in sorted(storage.listdir(""))[:limit]:
        if run.startswith("."):
            continue
        try:
            scan = scan_run(storage, run, warn=False)
        except NotADirectoryError:  # a stray file beside the run folders
            continue
        if scan.committed:
            out[run] = scan.committed[max(scan.committed)]
    return out


__all__ = ["Deletion", "EpochRecords", "Scan", "StepRef", "gc_plan", "lineage_of", "newest_commits", "quarantine_expired", "restore_epoch",
           "scan_run"]
