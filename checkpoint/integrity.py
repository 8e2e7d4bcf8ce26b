"""Integrity: is a committed step intact, *proven corrupt*, or only *unreadable now*?

The difference decides what may happen to a step, so it is made in one place:

* **corrupt** — the store answered, and the answer is wrong: a size or CRC32 that does not match the
  manifest, or a file missing from a listing that succeeded. Restore skips such a step, and garbage
  collection moves it to the run's ``quarantine/`` (evidence, kept ``checkpoint.quarantine_keep``).
* **unreadable** — the store did not answer usefully: a timeout, a reset, HTTP 429/5xx, a short read,
  permission denied (``transient`` says whether waiting may help). Restore retries it until its
  deadline and then fails (or falls back, if configured); nothing is ever marked or deleted for it.
* **failed** — ``dcp.load`` failed for another reason: not a verdict yet; the caller verifies the
  step to find out (corrupt, or intact but not loadable into this model).

A :class:`Verdict` is small and picklable: each rank checks its share of the files and the verdicts
are gathered and combined, so every rank decides the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint.errors import CheckpointNotFound, StorageError
from trainguard.checkpoint.manifest import FileEntry
from trainguard.checkpoint.storage import Storage, is_transient


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of checking or loading (part of) one step."""

    status: str
    """``ok`` | ``corrupt`` | ``unreadable`` | ``failed`` (see the module docstring)."""
    transient: bool = False
    problems: tuple[str, ...] = field(default=())

    @staticmethod
    def combine(parts: list[Verdict]) -> Verdict:
        """One verdict for all parts: corrupt beats unreadable beats failed beats ok."""
        problems = tuple(dict.fromkeys(p for v in parts for p in v.problems))
        for status in ("corrupt", "unreadable", "failed"):
            bad = [v for v in parts if v.status == status]
            if bad:
                return Verdict(status, all(v.transient for v in bad), problems)
        return Verdict("ok")

    @property
    def reason(self) -> str:
        return "; ".join(self.problems)[:2000]


OK = Verdict("ok")


def describe(e: BaseException) -> str:
    """A one-line description; DCP's ``CheckpointException`` lists each rank's failure."""
    if isinstance(e, CheckpointException):
        parts = [f"rank {r}: {type(x[0]).__name__}: {x[0]}" if isinstance(x, tuple) else f"rank {r}: {x}"
                 for r, x in e.failures.items()]
        return "; ".join(parts)[:2000]
    return f"{type(e).__name__}: {e}"[:2000]


def root_causes(e: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside a DCP ``CheckpointException``, or ``[e]``."""
    if isinstance(e, CheckpointException):
        return [x[0] if isinstance(x, tuple) else x for x in e.failures.values()]
    return [e]


def verify_file(storage: Storage, path: str, entry: FileEntry) -> Verdict:
    """Check one file of a step (``path`` relative to the storage root) against its manifest entry."""
    url = storage.url_of(path)
    try:
        size = storage.size(path)
        if size != entry.size:
            return Verdict("corrupt", problems=(f"{url}: size {size} != {entry.size} in the manifest (truncated or "
                                                f"overwritten)",))
        n, crc = storage.crc32(path)
        if n != entry.size:
            return Verdict("unreadable", True, (f"{url}: read {n} of {entry.size} bytes",))
        if crc != entry.crc32:
            return Verdict("corrupt", problems=(f"{url}: crc32 {crc:#010x} != {entry.crc32:#010x} in the manifest "
                                                f"(corrupt)",))
        return OK
    except CheckpointNotFound:
        parent, _, name = path.rpartition("/")
        try:
            listed = storage.listdir(parent)
        except Exception as e:  # noqa: BLE001 - the listing decides between "missing" and "unreadable"
            return Verdict("unreadable", is_transient(e), (f"{url}: not found, and its directory cannot be listed "
                                                           f"now ({type(e).__name__}: {e})",))
        if name in listed:
            return Verdict("unreadable", True, (f"{url}: listed but not readable now",))
        return Verdict("corrupt", problems=(f"{url}: missing",))
    except PermissionError as e:
        return Verdict("unreadable", False, (f"{url}: permission denied ({e})",))
    except StorageError as e:
        return Verdict("unreadable", e.transient, (f"{url}: {e}",))
    except Exception as e:  # noqa: BLE001 - anything else is not a proof of corruption
        return Verdict("unreadable", is_transient(e), (f"{url}: {type(e).__name__}: {e}",))


def load_verdict(e: BaseException) -> Verdict:
    """Classify a ``dcp.load`` failure: permission and transient causes are unreadable, the rest failed."""
    causes = root_causes(e)
    if any(isinstance(c, PermissionError) for c in causes):
        return Verdict("unreadable", False, (f"load: permission denied: {describe(e)}",))
    if all(is_transient(c) for c in causes):
        return Verdict("unreadable", True, (f"load: {describe(e)}",))
    return Verdict("failed", False, (f"load failed: {describe(e)}",))


__all__ = ["OK", "Verdict", "describe", "load_verdict", "root_causes", "verify_file"]
