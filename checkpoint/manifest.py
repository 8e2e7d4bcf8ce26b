"""Checkpoint layout, the manifest (the commit record), fence records and discovery.

Layout under the configured ``url``::

    <url>/<run_id>/step-000000000120/__0_0.distcp      rank 0's shard (DCP)
    <url>/<run_id>/step-000000000120/__1_0.distcp      rank 1's shard
    <url>/<run_id>/step-000000000120/.metadata         DCP metadata (written by rank 0 inside dcp.save)
    <url>/<run_id>/step-000000000120/manifest.json     written LAST by rank 0: the commit point
    <url>/<run_id>/fences/fence-000000000007.json      one per rendezvous round that saved or restored

Step numbers are zero-padded to 12 digits so that a lexicographic listing sorts by step. A step
directory without a valid ``manifest.json`` does not exist for discovery.

The decisions here (which steps are committed, which are stale, what retention deletes) are pure
functions of listed state, unit-tested with tables of cases.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from trainguard.checkpoint.errors import CheckpointCorrupt
from trainguard.runtime.protocol import CheckpointKind

MANIFEST_NAME = "manifest.json"
FENCES_DIR = "fences"
FORMAT_VERSION = 1
KINDS = tuple(k.value for k in CheckpointKind)
"""Every checkpoint kind a manifest may carry (:class:`trainguard.runtime.protocol.CheckpointKind`)."""
_STEP_PREFIX = "step-"
_FENCE_PREFIX = "fence-"


def step_dir(step: int) -> str:
    """``step-000000000120`` for step 120 (zero-padded so listings sort by step)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{_STEP_PREFIX}{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-<n>`` directory name, or None for anything else."""
    name = name.rstrip("/").rsplit("/", 1)[-1]
    if not name.startswith(_STEP_PREFIX):
        return None
    digits = name[len(_STEP_PREFIX):]
    return int(digits) if digits.isdigit() else None


def fence_name(fence: int) -> str:
    """``fence-000000000007.json``."""
    return f"{_FENCE_PREFIX}{fence:012d}.json"


def parse_fence_name(name: str) -> int | None:
    """The fence of a ``fence-<n>.json`` name, or None."""
    name = name.rsplit("/", 1)[-1]
    if not (name.startswith(_FENCE_PREFIX) and name.endswith(".json")):
        return None
    digits = name[len(_FENCE_PREFIX):-len(".json")]
    return int(digits) if digits.isdigit() else None


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a step: path relative to the step directory, size in bytes, CRC32, writer rank."""

    path: str
    size: int
    crc32: int
    rank: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """The commit record of one step. Its presence (and validity) is what makes a step exist."""

    run_id: str
    step: int
    world_size: int
    strategy: str
    fence: int
    """Rendezvous round of the writer; a lower fence can never commit over a higher one."""
    kind: str
    files: tuple[FileEntry, ...]
    versions: dict[str, str] = field(default_factory=dict)
    created_unix_s: float = 0.0
    created: str = ""
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        """Sum of the file sizes, in bytes."""
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        """Serialise (sorted keys, files sorted by path) as UTF-8 JSON."""
        d = asdict(self)
        d["files"] = [asdict(f) for f in sorted(self.files, key=lambda f: f.path)]
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate; :class:`CheckpointCorrupt` naming ``where`` on anything wrong."""
        fix = (f"delete the step directory containing {where} (it will then be ignored) or restore an "
               f"earlier step")
        try:
            d: dict[str, Any] = json.loads(data)
            if d.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"unsupported format_version {d.get('format_version')!r}")
            files = tuple(FileEntry(path=str(f["path"]), size=int(f["size"]), crc32=int(f["crc32"]),
                                    rank=int(f["rank"])) for f in d["files"])
            m = cls(run_id=str(d["run_id"]), step=int(d["step"]), world_size=int(d["world_size"]),
                    strategy=str(d["strategy"]), fence=int(d["fence"]), kind=str(d["kind"]), files=files,
                    versions={str(k): str(v) for k, v in d.get("versions", {}).items()},
                    created_unix_s=float(d.get("created_unix_s", 0.0)), created=str(d.get("created", "")))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointCorrupt(f"manifest {where} is invalid: {e}. Fix: {fix}") from e
        if m.step < 0 or m.world_size < 1 or not m.files or m.kind not in KINDS:
            raise CheckpointCorrupt(f"manifest {where} is invalid: step={m.step} world_size={m.world_size} "
                                    f"files={len(m.files)} kind={m.kind!r}. Fix: {fix}")
        return m


def now_fields() -> dict[str, Any]:
    """``created_unix_s`` and ``created`` (ISO 8601, UTC) for a manifest written now."""
    t = time.time()
    return {"created_unix_s": t, "created": datetime.fromtimestamp(t, timezone.utc).isoformat()}


@dataclass(frozen=True, slots=True)
class FenceRecord:
    """A rendezvous round that has taken ownership of the run, and the step it started from.

    ``base_step`` is the step that round restored (or the newest committed step it saw when it first
    saved without restoring); -1 when there was none.
    """

    fence: int
    base_step: int
    created_unix_s: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> FenceRecord:
        d = json.loads(data)
        return cls(fence=int(d["fence"]), base_step=int(d["base_step"]),
                   created_unix_s=float(d.get("created_unix_s", 0.0)))


def stale_steps(manifests: list[Manifest], fences: list[FenceRecord]) -> set[int]:
    """Steps committed on a dead branch: by a round older than a newer round's starting point.

    A manifest with fence ``f`` and step ``s`` is stale when some registered round ``g > f`` started
    from ``base_step < s``: the newer world forked history at ``base_step``, so anything the old world
    committed after that (a race that slipped past the commit-time fence check) must not be restored.
    """
    out: set[int] = set()
    for m in manifests:
        for r in fences:
            if r.fence > m.fence and m.step > r.base_step:
                out.add(m.step)
                break
    return out


def retention_victims(committed: list[int], keep_last: int, protected: set[int]) -> list[int]:
    """Committed steps to delete so that the newest ``keep_last`` remain; never one in ``protected``."""
    ordered = sorted(set(committed))
    old = ordered[:-keep_last] if keep_last > 0 else []
    return [s for s in old if s not in protected]
