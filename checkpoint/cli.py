"""``trainguard checkpoints ls URL`` / ``show URL STEP``: inspect a run's checkpoints (read-only).

The owner's CLI calls :func:`register` with its ``add_subparsers()`` object; each command sets
``func(args) -> int`` (exit status). Only committed steps (valid manifest) are listed by default;
``ls --all`` also shows half-written, invalid and stale steps. Credentials come from the standard
provider chains (or ``--storage-options`` JSON) and are never printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, TextIO

from trainguard.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from trainguard.checkpoint.storage import Storage
# manager/manifest/storage import torch: they are imported inside the commands, so that
# `trainguard --version` and every other command start without loading torch.


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``checkpoints {ls,show}`` to an argparse subparsers object; return the ``checkpoints`` parser."""
    p = subparsers.add_parser("checkpoints", help="inspect a run's checkpoints",
                              description="List and show committed checkpoints (read-only).")
    sub = p.add_subparsers(dest="checkpoints_cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("url", help="checkpoint URL (checkpoint.url): path, file://, s3://, gs://; or one run's "
                                    "folder under it (<url>/<run_id>)")
        sp.add_argument("--run-id", default=None, help="run id (default: the only run under URL)")
        sp.add_argument("--storage-options", default="{}", metavar="JSON",
                        help='fsspec storage options as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'')
        sp.add_argument("--json", action="store_true", help="print JSON instead of a table")

    ls = sub.add_parser("ls", help="list committed steps of a run")
    common(ls)
    ls.add_argument("--all", action="store_true", help="also show half-written, invalid and stale steps")
    ls.set_defaults(func=cmd_ls)
    show = sub.add_parser("show", help="show one step's manifest")
    common(show)
    show.add_argument("step", type=int, help="step number")
    show.set_defaults(func=cmd_show)
    return p


def _storage(args: argparse.Namespace, url: str | None = None) -> Storage:
    from trainguard.checkpoint.storage import Storage

    try:
        opts = json.loads(args.storage_options)
        if not isinstance(opts, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise CheckpointError(f"--storage-options is not a JSON object ({e}). Fix: pass e.g. "
                              f"'{{\"endpoint_url\": \"http://host:port\"}}'") from e
    return Storage(url or args.url, opts, retry_attempts=3, retry_deadline_s=30.0)


def _resolve(args: argparse.Namespace) -> tuple[Storage, str]:
    """(storage of the checkpoint URL, run id). URL may also be one run's folder (``<url>/<run_id>``,
    recognised by its ``step-*`` entries): then its parent is the checkpoint URL."""
    from trainguard.checkpoint.manifest import parse_step_dir

    storage = _storage(args)
    if args.run_id:
        return storage, str(args.run_id)
    entries = storage.listdir("")
    parent, _, run = args.url.rstrip("/").rpartition("/")
    if run and parent and not parent.endswith(":/") and any(parse_step_dir(e) is not None for e in entries):
        return _storage(args, parent), run
    return storage, _run_id(storage, args, entries)


def _run_id(storage: Storage, args: argparse.Namespace, runs: list[str] | None = None) -> str:
    if args.run_id:
        return str(args.run_id)
    runs = storage.listdir("") if runs is None else runs
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise CheckpointError(f"no runs under {storage.url}. Fix: check the URL (checkpoint.url)")
    raise CheckpointError(f"several runs under {storage.url}: {', '.join(runs)}. Fix: pass --run-id")


def _human(n: int) -> str:
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if f < 1024 or unit == "GiB":
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return f"{n} B"


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def cmd_ls(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``checkpoints ls``: one row per committed step (and, with ``--all``, the others)."""
    from trainguard.checkpoint.manager import scan_run

    out = out or sys.stdout
    try:
        storage, run = _resolve(args)
        scan = scan_run(storage, run)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = [{"step": m.step, "status": "committed", "kind": m.kind, "world_size": m.world_size, "fence": m.fence,
             "strategy": m.strategy, "bytes": m.total_bytes, "files": len(m.files), "created": m.created}
            for m in scan.committed]
    if args.all:
        for status, steps in (("uncommitted", scan.uncommitted), ("invalid", scan.invalid), ("stale", scan.stale)):
            rows += [{"step": s, "status": status} for s in steps]
        rows.sort(key=lambda r: r["step"])
    if args.json:
        json.dump({"url": storage.url, "run_id": run, "steps": rows}, out, indent=1)
        out.write("\n")
        return 0
    out.write(f"run {run} at {storage.url_of(run)}\n")
    if not rows:
        out.write("no committed checkpoints\n")
        return 0
    table = [["STEP", "STATUS", "KIND", "WORLD", "FENCE", "STRATEGY", "SIZE", "FILES", "CREATED"]]
    for r in rows:
        table.append([str(r["step"]), r["status"], r.get("kind", "-"), str(r.get("world_size", "-")),
                      str(r.get("fence", "-")), r.get("strategy", "-"),
                      _human(r["bytes"]) if "bytes" in r else "-", str(r.get("files", "-")), r.get("created", "-")])
    _table(table, out)
    return 0


def cmd_show(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``checkpoints show``: the manifest of one step (files with sizes and checksums)."""
    from trainguard.checkpoint.manifest import MANIFEST_NAME, Manifest, step_dir

    out = out or sys.stdout
    try:
        storage, run = _resolve(args)
        rel = f"{run}/{step_dir(args.step)}/{MANIFEST_NAME}"
        m = Manifest.from_json(storage.read_bytes(rel), storage.url_of(rel))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        out.write(m.to_json().decode() + "\n")
        return 0
    out.write(f"step {m.step} of run {m.run_id} at {storage.url_of(f'{run}/{step_dir(m.step)}')}\n")
    for k, v in (("kind", m.kind), ("world size", m.world_size), ("fence", m.fence), ("strategy", m.strategy),
                 ("created", m.created), ("size", f"{_human(m.total_bytes)} ({m.total_bytes} bytes)"),
                 ("versions", ", ".join(f"{a} {b}" for a, b in sorted(m.versions.items())))):
        out.write(f"  {k:<11} {v}\n")
    table = [["FILE", "RANK", "SIZE", "CRC32"]]
    table += [[f.path, str(f.rank), str(f.size), f"{f.crc32:08x}"] for f in sorted(m.files, key=lambda f: f.path)]
    _table(table, out)
    return 0
