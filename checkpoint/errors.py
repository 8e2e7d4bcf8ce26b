"""The checkpoint subsystem's exception tree.

Every message names the URL or file concerned and the fix. None of these is raised after a
committed checkpoint has been modified: a failing save leaves the previous committed step as it was.

``CheckpointError``
    ├── ``CheckpointNotFound``  the requested step (or any step) has no committed manifest
    ├── ``CheckpointCorrupt``   a manifest or shard fails validation (size, checksum, parse)
    ├── ``StorageError``        the storage backend failed (after retries, or a non-transient error)
    └── ``FencedError``         a writer from an older rendezvous round tried to commit
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of all checkpoint errors."""


class CheckpointNotFound(CheckpointError):
    """No committed checkpoint (with a valid manifest) exists where one was asked for."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint's manifest or shards fail validation."""


class StorageError(CheckpointError):
    """The storage backend failed; ``transient`` says whether retrying later may help."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class InflightTimeout(CheckpointError):
    """The previous background save is still running past the manager's ``inflight_timeout_s``."""


class FencedError(CheckpointError):
    """A writer whose fence (rendezvous round) is older than the newest registered one tried to commit.

    The stale world must stop writing: a newer world has restored and owns the run.
    """

    def __init__(self, message: str, *, fence: int, newest_fence: int) -> None:
        super().__init__(message)
        self.fence = fence
        self.newest_fence = newest_fence
