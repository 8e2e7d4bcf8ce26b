"""Epochs: the fencing tokens of a run, handed out by the checkpoint store itself.

When a world forms (its manager's first restore or save, or :meth:`CheckpointManager.new_world`),
rank 0 claims the next epoch number by creating ``<run>/epochs/epoch-<n>.json`` *only if it does not
exist* (:meth:`Storage.create_exclusive`: ``link(2)``/``O_EXCL`` on a filesystem, ``If-None-Match: *``
on S3, ``ifGenerationMatch=0`` on GCS, a lock on ``memory://``). On conflict it tries ``n + 1``.
So epochs only grow, whatever happens to the rendezvous store (whose rounds restart at 0 with every
fresh store), and two worlds never hold the same epoch. The record names the world (rendezvous id
and round, world size, a random world id) and the step its state descends from (its *base*), which
links the epochs into lineages (see :mod:`trainguard.checkpoint.discovery`).

A world may commit only while its epoch is the newest and its record is still its own
(:func:`check_owner`, run before the shards are written and again before the manifest is written).

Everything here runs on rank 0 only and does no collectives.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from trainguard.checkpoint.errors import CheckpointNotFound, FencedError, StorageError
from trainguard.checkpoint.manifest import EPOCHS_DIR, epoch_name, parse_epoch_name, parse_step_dir
from trainguard.checkpoint.storage import Storage
from trainguard.contract.log import get_logger

log = get_logger("trainguard.checkpoint")

MAX_CLAIM_CONFLICTS = 64
"""Claims lost in a row before giving up (each loss means another world claimed that number)."""


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """What ``epochs/epoch-<n>.json`` holds: who claimed epoch ``n`` and where its history starts."""

    epoch: int
    world_id: str
    """Random hex, unique per claim: tells two worlds apart (and a record taken over from its owner)."""
    base_step: int
    """The step this world's state descends from (the step it restored, or the last it committed
    before re-forming); -1 for a world that starts from scratch."""
    base_epoch: int
    """The epoch that committed ``base_step``; -1 with it."""
    world_size: int
    rdzv_id: str = ""
    """Rendezvous (run) id of the world, for people reading the record."""
    rdzv_round: int = -1
    """Rendezvous round, for people reading the record: rounds restart at 0 with a fresh store, so
    they are information, never a fence."""
    host: str = ""
    pid: int = 0
    created_unix_s: float = 0.0
    created: str = ""
    conditional_create: str = ""
    """``native`` or ``readback``: how the claim was made (see :meth:`Storage.conditional_create_mode`)."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> EpochRecord:
        """Parse strictly; ``ValueError`` on anything malformed."""
        try:
            d = json.loads(data)
            return cls(epoch=int(d["epoch"]), world_id=str(d["world_id"]), base_step=int(d["base_step"]),
                       base_epoch=int(d["base_epoch"]), world_size=int(d["world_size"]),
                       rdzv_id=str(d.get("rdzv_id", "")), rdzv_round=int(d.get("rdzv_round", -1)),
                       host=str(d.get("host", "")), pid=int(d.get("pid", 0)),
                       created_unix_s=float(d.get("created_unix_s", 0.0)), created=str(d.get("created", "")),
                       conditional_create=str(d.get("conditional_create", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed epoch record: {type(e).__name__}: {e}") from e


def epoch_rel(run_id: str, epoch: int) -> str:
    return f"{run_id}/{EPOCHS_DIR}/{epoch_name(epoch)}"


def newest_epoch(storage: Storage, run_id: str) -> int:
    """The highest epoch claimed (an epoch file) or used (a step directory name) in the run; -1 if none.

    Names only (two listings, no reads): cheap enough to run before every write and every commit.
    """
    names = [parse_epoch_name(n) for n in storage.listdir(f"{run_id}/{EPOCHS_DIR}")]
    steps = [parse_step_dir(n) for n in storage.listdir(run_id)]
    return max([e for e in names if e is not None] + [s[1] for s in steps if s is not None], default=-1)


def claim_epoch(storage: Storage, run_id: str, make_record: Callable[[int, str], EpochRecord], *,
                after: int | None = None) -> tuple[EpochRecord, int]:
    """Claim the next free epoch above ``after`` (default: :func:`newest_epoch`); return it and the
    number of numbers lost to other claimers on the way.

    ``make_record(n, mode)`` builds the record for number ``n``; its ``world_id`` must be fresh.
    """
    mode = storage.conditional_create_mode(f"{run_id}/{EPOCHS_DIR}")
    n = max((newest_epoch(storage, run_id) if after is None else after) + 1, 1)  # epochs count from 1
    for conflicts in range(MAX_CLAIM_CONFLICTS + 1):
        rec = make_record(n, mode)
        if storage.create_exclusive(epoch_rel(run_id, n), rec.to_json(), mode=mode):
            return rec, conflicts
        n += 1
    raise StorageError(f"could not claim a checkpoint epoch under {storage.url_of(run_id)}: lost "
                       f"{MAX_CLAIM_CONFLICTS + 1} claims in a row to other writers. Fix: check that only one "
                       f"world runs with this job id and checkpoint URL", transient=True)


def read_record(storage: Storage, run_id: str, epoch: int) -> EpochRecord | None:
    """The record of ``epoch``; None when it is missing or malformed (a transient read error raises)."""
    try:
        return EpochRecord.from_json(storage.read_bytes(epoch_rel(run_id, epoch)))
    except (CheckpointNotFound, ValueError):
        return None


def check_owner(storage: Storage, run_id: str, mine: EpochRecord) -> None:
    """Raise :class:`FencedError` unless ``mine`` is the newest epoch and its record is still ours."""
    url = storage.url_of(run_id)
    newest = newest_epoch(storage, run_id)
    if newest > mine.epoch:
        theirs = read_record(storage, run_id, newest)
        who = (f" (world {theirs.world_id}, rendezvous {theirs.rdzv_id or '?'} round {theirs.rdzv_round}, "
               f"{theirs.world_size} ranks on {theirs.host or '?'}, from step {theirs.base_step})") if theirs else ""
        raise FencedError(f"refusing to commit to {url}: this world's epoch {mine.epoch} is older than epoch "
                          f"{newest}{who}, which owns the run now. This world stops saving; its committed "
                          f"checkpoints are kept. Fix: if two worlds run with the same job id and checkpoint URL "
                          f"(e.g. two rendezvous stores), stop one of them; otherwise none needed — the newer world "
                          f"continues from its own checkpoints", epoch=mine.epoch, newest_epoch=newest)
    current = read_record(storage, run_id, mine.epoch)
    if current is None or current.world_id != mine.world_id:
        holder = f"world {current.world_id}" if current else "nobody (the record is gone)"
        raise FencedError(f"refusing to commit to {url}: the record of epoch {mine.epoch} now names {holder}, not "
                          f"this world ({mine.world_id}); another world claimed the same number on a store that "
                          f"does not honour conditional creates, or the record was removed. This world stops "
                          f"saving. Fix: run one world per job id and checkpoint URL; do not delete "
                          f"{storage.url_of(f'{run_id}/{EPOCHS_DIR}')}", epoch=mine.epoch,
                          newest_epoch=max(newest, mine.epoch))


def new_record(epoch: int, mode: str, *, base_step: int, base_epoch: int, world_size: int, rdzv_id: str,
               rdzv_round: int) -> EpochRecord:
    """A record for a claim made now by this process, with a fresh random world id."""
    t = time.time()
    return EpochRecord(epoch=epoch, world_id=uuid.uuid4().hex, base_step=base_step, base_epoch=base_epoch,
                       world_size=world_size, rdzv_id=rdzv_id, rdzv_round=rdzv_round, host=socket.gethostname(),
                       pid=os.getpid(), created_unix_s=t, created=datetime.fromtimestamp(t, timezone.utc).isoformat(),
                       conditional_create=mode)


__all__ = ["EpochRecord", "check_owner", "claim_epoch", "epoch_rel", "new_record", "newest_epoch", "read_record"]
