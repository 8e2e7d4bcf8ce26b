"""The checkpoint subsystem's exception tree.

Every message names the URL or file concerned and the fix. None of these is raised after a
committed checkpoint has been modified: a failing save leaves the previous committed step as it was.

``CheckpointError``
    ├── ``CheckpointNotFound``  the requested step (or any step) has no committed manifest
    ├── ``CheckpointCorrupt``   a manifest or shard fails validation (size, checksum, parse)
    ├── ``StorageError``        the storage backend failed (after retries, or a non-transient error):
    │                           "unreadable now" — never a reason to skip or delete a step
    └── ``FencedError``         this world's epoch is no longer the newest: it may not commit
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of all checkpoint errors."""


class CheckpointNotFound(CheckpointError):
    """No committed checkpoint (with a valid manifest) exists where one was asked for."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint's manifest or shards are *proven* bad: read fine, but a checksum or
    size does not match, a file is missing from a readable listing, or the manifest does not parse."""


class StorageError(CheckpointError):
    """The storage backend failed; ``transient`` says whether retrying later may help."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class InflightTimeout(CheckpointError):
    """The previous background save is still running past the manager's ``inflight_timeout_s``."""


class SaveCancelled(CheckpointError):
    """The in-flight save was given up before its shards were all written: the world it was taken in
    lost a peer, so it could never commit (every rank must write and agree). Nothing was committed;
    the last committed step stands."""


class FencedError(CheckpointError):
    """This world's epoch is older than the newest claimed one (or its epoch record was taken over).

    The stale world must stop writing: a newer world owns the run. Its checkpoint manager refuses
    every further save without touching storage, until the world re-forms and claims a new epoch.
    """

    def __init__(self, message: str, *, epoch: int, newest_epoch: int) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.newest_epoch = newest_epoch
