"""Checkpoint layout, strict names, and the manifest (the commit record).

Layout under the configured ``url``::

    <url>/<run_id>/epochs/epoch-000000000003.json                      claimed create-exclusive, one per world
    <url>/<run_id>/step-000000000120-e000000000003/__0_0.distcp        rank 0's shard (DCP)
    <url>/<run_id>/step-000000000120-e000000000003/__1_0.distcp        rank 1's shard
    <url>/<run_id>/step-000000000120-e000000000003/.metadata           DCP metadata (rank 0, inside dcp.save)
    <url>/<run_id>/step-000000000120-e000000000003/manifest.json       written LAST by rank 0: the commit

A step directory is named by its step *and the epoch that wrote it*, so two worlds (or two branches of
history) never write into the same directory. Numbers are zero-padded to 12 digits so that a
lexicographic listing sorts by step, then epoch. Names are parsed strictly (ASCII digits only): any
other entry is ignored, never guessed at. A step directory without a valid ``manifest.json`` does not
exist for discovery.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from trainguard.checkpoint.errors import CheckpointCorrupt
from trainguard.contract.protocol import CheckpointKind

MANIFEST_NAME = "manifest.json"
EPOCHS_DIR = "epochs"
QUARANTINE_DIR = "quarantine"
"""``<url>/<run_id>/quarantine/``: proven-corrupt step directories moved aside as evidence (never restored)."""
FORMAT_VERSION = 2
KINDS = tuple(k.value for k in CheckpointKind)
"""Every checkpoint kind a manifest may carry (:class:`trainguard.contract.protocol.CheckpointKind`)."""
_STEP_RE = re.compile(r"step-([0-9]{12,})-e([0-9]{12,})", re.ASCII)
_EPOCH_RE = re.compile(r"epoch-([0-9]{12,})\.json", re.ASCII)


def step_dir(step: int, epoch: int) -> str:
    """``step-000000000120-e000000000003``: step 120 written by epoch 3."""
    if step < 0 or epoch < 0:
        raise ValueError(f"step and epoch must be >= 0, got step={step} epoch={epoch}")
    return f"step-{step:012d}-e{epoch:012d}"


def parse_step_dir(name: str) -> tuple[int, int] | None:
    """``(step, epoch)`` of a step directory name (a trailing ``/`` or a parent path allowed), else None.

    Strict: ``step-`` + at least 12 ASCII digits + ``-e`` + at least 12 ASCII digits, nothing else
    (``step-²``, ``step-abc`` or ``step-12`` are not step directories).
    """
    name = name.rstrip("/").rsplit("/", 1)[-1]
    m = _STEP_RE.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def epoch_name(epoch: int) -> str:
    """``epoch-000000000003.json``."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    return f"epoch-{epoch:012d}.json"


def parse_epoch_name(name: str) -> int | None:
    """The epoch of an ``epoch-<n>.json`` name (strict, as :func:`parse_step_dir`), or None."""
    m = _EPOCH_RE.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def check_file_path(path: str) -> str | None:
    """Why a manifest ``files[].path`` is unsafe to join to the step directory, or None if it is fine.

    A path is relative, ``/``-separated, with no empty, ``.`` or ``..`` component, no backslash and
    no NUL: a manifest can never make a reader open anything outside its own step directory.
    """
    if not path:
        return "empty path"
    if "\x00" in path or "\\" in path:
        return f"path {path!r} contains a NUL or a backslash"
    if path.startswith("/") or re.match(r"[A-Za-z]:", path) or "://" in path:
        return f"path {path!r} is absolute"
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return f"path {path!r} has an empty, '.' or '..' component"
    return None


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
    epoch: int
    """The epoch of the world that committed it (see :mod:`trainguard.checkpoint.epochs`)."""
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
                raise UnsupportedFormat(f"manifest {where} has format_version {d.get('format_version')!r}; this "
                                        f"trainguard reads version {FORMAT_VERSION}. Fix: restore with the trainguard "
                                        f"version that wrote it, or delete that step directory")
            files = tuple(FileEntry(path=str(f["path"]), size=int(f["size"]), crc32=int(f["crc32"]),
                                    rank=int(f["rank"])) for f in d["files"])
            m = cls(run_id=str(d["run_id"]), step=int(d["step"]), world_size=int(d["world_size"]),
                    strategy=str(d["strategy"]), epoch=int(d["epoch"]), kind=str(d["kind"]), files=files,
                    versions={str(k): str(v) for k, v in d.get("versions", {}).items()},
                    created_unix_s=float(d.get("created_unix_s", 0.0)), created=str(d.get("created", "")))
        except UnsupportedFormat:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorrupt(f"manifest {where} is invalid: {type(e).__name__}: {e}. Fix: {fix}") from e
        if m.step < 0 or m.epoch < 0 or m.world_size < 1 or not m.files or m.kind not in KINDS:
            raise CheckpointCorrupt(f"manifest {where} is invalid: step={m.step} epoch={m.epoch} "
                                    f"world_size={m.world_size} files={len(m.files)} kind={m.kind!r}. Fix: {fix}")
        for fe in m.files:
            why = check_file_path(fe.path)
            if why is not None:
                raise CheckpointCorrupt(f"manifest {where} is invalid: {why}. Fix: {fix}")
            if fe.size < 0:
                raise CheckpointCorrupt(f"manifest {where} is invalid: negative size for {fe.path!r}. Fix: {fix}")
        return m

    @property
    def dir_name(self) -> str:
        """The step directory this manifest commits."""
        return step_dir(self.step, self.epoch)


def now_fields() -> dict[str, Any]:
    """``created_unix_s`` and ``created`` (ISO 8601, UTC) for a manifest written now."""
    t = time.time()
    return {"created_unix_s": t, "created": datetime.fromtimestamp(t, timezone.utc).isoformat()}


class UnsupportedFormat(CheckpointCorrupt):
    """A manifest written by another format version: readable, not corrupt, but not for this reader.

    Never garbage-collected (a newer trainguard may own it), never restored by this version.
    """
