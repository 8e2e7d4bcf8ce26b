"""``trainguard checkpoints ls URL`` / ``show URL STEP`` / ``verify URL [STEP]``: inspect a run's
checkpoints (read-only).

The owner's CLI calls :func:`register` with its ``add_subparsers()`` object; each command sets
``func(args) -> int`` (exit status). ``ls`` shows the run's epochs (who claimed each, and the step it
descends from), the restore lineage, and the committed steps with their epoch and whether they are in
that lineage; ``ls --all`` also shows half-written, invalid (proven corrupt) and foreign-format steps
and ignored names, and the quarantined (proven-corrupt, moved aside) steps. ``verify`` reads every file of
the committed steps (or one) and checks its size and CRC32 against the manifest, offline, as a restore
would: exit 0 all intact, 1 damaged (proven corrupt), 2 could not be verified (unreadable now, no such
step). Credentials come from the standard provider chains (or ``--storage-options``
JSON) and are never printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, TextIO

from trainguard.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from trainguard.checkpoint.storage import Storage
# discovery/manifest/storage import torch: they are imported inside the commands, so that
# `trainguard --version` and every other command start without loading torch.


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``checkpoints {ls,show,verify}`` to an argparse subparsers object; return the ``checkpoints`` parser."""
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
    ls.add_argument("--all", action="store_true",
                    help="also show half-written, invalid and foreign-format steps, and ignored names")
    ls.set_defaults(func=cmd_ls)
    show = sub.add_parser("show", help="show one step's manifest")
    common(show)
    show.add_argument("step", type=int, help="step number")
    show.add_argument("--epoch", type=int, default=None,
                      help="the epoch that wrote the step (default: the restore lineage's, else the newest)")
    show.set_defaults(func=cmd_show)
    verify = sub.add_parser("verify", help="check the sizes and CRC32s of committed steps against their manifests",
                            description="Read every file of the run's committed steps (or of STEP) and compare its size "
                                        "and CRC32 with the manifest, as a restore does. Exit 0: all intact; 1: damaged "
                                        "(proven corrupt: a restore skips it); 2: could not be verified.")
    common(verify)
    verify.add_argument("step", type=int, nargs="?", default=None, help="step number (default: every committed step)")
    verify.add_argument("--epoch", type=int, default=None, help="the epoch that wrote the step (default: any)")
    verify.set_defaults(func=cmd_verify)
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


def _scan(args: argparse.Namespace) -> tuple[Storage, str, Any] | None:
    """(storage, run id, :class:`~trainguard.checkpoint.discovery.Scan`), or None after printing the error."""
    from trainguard.checkpoint.discovery import scan_run

    try:
        storage, run = _resolve(args)
        return storage, run, scan_run(storage, run, warn=False)
    except (CheckpointError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


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


def _epoch_rows(scan: Any) -> list[dict[str, Any]]:
    commits: dict[int, int] = {}
    for r in scan.committed:
        commits[r.epoch] = commits.get(r.epoch, 0) + 1
    newest = scan.newest_epoch
    rows = []
    for e in sorted({*scan.epochs, *commits}, reverse=True):
        rec = scan.epochs.get(e)
        row: dict[str, Any] = {"epoch": e, "status": "owner" if e == newest else "fenced", "commits": commits.get(e, 0)}
        if rec is None:
            row["record"] = "missing" if e not in scan.epochs else "malformed"
        else:
            row.update(base_step=rec.base_step, base_epoch=rec.base_epoch, world_size=rec.world_size,
                       world_id=rec.world_id, rdzv_id=rec.rdzv_id, rdzv_round=rec.rdzv_round, host=rec.host,
                       created=rec.created, conditional_create=rec.conditional_create)
        rows.append(row)
    return rows


def cmd_ls(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``checkpoints ls``: epochs, the restore lineage, and one row per committed step (``--all``: every step)."""
    from trainguard.checkpoint.discovery import StepRef

    out = out or sys.stdout
    got = _scan(args)
    if got is None:
        return 1
    storage, run, scan = got
    line = scan.restore_lineage()
    in_line = set(line)
    rows = [{"step": m.step, "epoch": m.epoch, "status": "committed",
             "lineage": "restore" if StepRef(m.step, m.epoch) in in_line else "branch",
             "kind": m.kind, "world_size": m.world_size, "strategy": m.strategy, "bytes": m.total_bytes,
             "files": len(m.files), "created": m.created} for m in scan.manifests()]
    if args.all:
        for status, refs in (("uncommitted", scan.uncommitted), ("invalid", sorted(scan.invalid)),
                             ("foreign", scan.foreign), ("quarantined", scan.quarantined)):
            rows += [{"step": r.step, "epoch": r.epoch, "status": status,
                      "lineage": "restore" if r in in_line else "-"} for r in refs]
        rows.sort(key=lambda r: (r["step"], r["epoch"]))
    epochs = _epoch_rows(scan)
    if args.json:
        doc = {"url": storage.url, "run_id": run, "newest_epoch": scan.newest_epoch,
               "restore_epoch": scan.restore_epoch(), "lineage": [{"step": r.step, "epoch": r.epoch} for r in line],
               "epochs": epochs, "steps": rows}
        if args.all:
            doc["ignored"] = sorted(scan.ignored)
        json.dump(doc, out, indent=1)
        out.write("\n")
        return 0
    out.write(f"run {run} at {storage.url_of(run)}\n")
    if epochs:
        out.write("\nepochs (newest first; only the owner may commit):\n")
        table = [["EPOCH", "STATUS", "BASE", "COMMITS", "WORLD", "RENDEZVOUS", "HOST", "CLAIM", "CREATED"]]
        for e in epochs:
            if "record" in e:
                table.append([str(e["epoch"]), e["status"], "?", str(e["commits"]), f"record {e['record']}",
                              "-", "-", "-", "-"])
                continue
            base = f"{e['base_step']}@e{e['base_epoch']}" if e["base_step"] >= 0 else "scratch"
            table.append([str(e["epoch"]), e["status"], base, str(e["commits"]),
                          f"{e['world_size']} ranks {e['world_id'][:8]}",
                          f"{e['rdzv_id'] or '-'} round {e['rdzv_round']}", e["host"] or "-",
                          e["conditional_create"] or "-", e["created"] or "-"])
        _table(table, out)
        restore = scan.restore_epoch()
        if line:
            out.write(f"restore lineage (epoch {restore}): " + " -> ".join(f"{r.step}@e{r.epoch}" for r in line) + "\n")
    out.write("\n")
    if not rows:
        out.write("no committed checkpoints\n")
        return 0
    table = [["STEP", "EPOCH", "STATUS", "LINEAGE", "KIND", "WORLD", "STRATEGY", "SIZE", "FILES", "CREATED"]]
    for r in rows:
        table.append([str(r["step"]), str(r["epoch"]), r["status"], r["lineage"], r.get("kind", "-"),
                      str(r.get("world_size", "-")), r.get("strategy", "-"),
                      _human(r["bytes"]) if "bytes" in r else "-", str(r.get("files", "-")), r.get("created", "-")])
    _table(table, out)
    if args.all and scan.ignored:
        out.write("ignored (not ours, never touched): " + ", ".join(sorted(scan.ignored)) + "\n")
    return 0


def cmd_show(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``checkpoints show``: the manifest of one step (files with sizes and checksums)."""
    from trainguard.checkpoint.discovery import scan_run
    from trainguard.checkpoint.manifest import MANIFEST_NAME, Manifest, step_dir

    out = out or sys.stdout
    try:
        storage, run = _resolve(args)
        if args.epoch is not None:
            epoch = args.epoch
        else:
            scan = scan_run(storage, run, warn=False)
            every = [*scan.committed, *scan.uncommitted, *scan.invalid, *scan.foreign]
            same = [r for r in every if r.step == args.step]
            if not same:
                raise CheckpointError(f"step {args.step} does not exist under {storage.url_of(run)}. Fix: pick a step "
                                      f"from `trainguard checkpoints ls --all`")
            line = set(scan.restore_lineage())
            epoch = max([r for r in same if r in line] or same).epoch
        rel = f"{run}/{step_dir(args.step, epoch)}/{MANIFEST_NAME}"
        m = Manifest.from_json(storage.read_bytes(rel), storage.url_of(rel))
    except (CheckpointError, PermissionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        out.write(m.to_json().decode() + "\n")
        return 0
    out.write(f"step {m.step} of run {m.run_id} at {storage.url_of(f'{run}/{m.dir_name}')}\n")
    for k, v in (("epoch", m.epoch), ("kind", m.kind), ("world size", m.world_size), ("strategy", m.strategy),
                 ("created", m.created), ("size", f"{_human(m.total_bytes)} ({m.total_bytes} bytes)"),
                 ("versions", ", ".join(f"{a} {b}" for a, b in sorted(m.versions.items())))):
        out.write(f"  {k:<11} {v}\n")
    table = [["FILE", "RANK", "SIZE", "CRC32"]]
    table += [[f.path, str(f.rank), str(f.size), f"{f.crc32:08x}"] for f in sorted(m.files, key=lambda f: f.path)]
    _table(table, out)
    return 0


VERIFY_EXIT = {"ok": 0, "corrupt": 1, "unreadable": 2}
"""``checkpoints verify`` exit status by the worst verdict (a step that is not there: 2)."""


def cmd_verify(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``checkpoints verify``: size and CRC32 of every file of the committed steps (or one), offline."""
    from trainguard.checkpoint.integrity import Verdict, verify_file

    out = out or sys.stdout
    got = _scan(args)
    if got is None:
        return VERIFY_EXIT["unreadable"]
    storage, run, scan = got

    def wanted(step: int, epoch: int) -> bool:
        return (args.step is None or step == args.step) and (args.epoch is None or epoch == args.epoch)

    results: list[tuple[int, int, Verdict, int]] = []  # (step, epoch, verdict, files)
    for ref, why in sorted(scan.invalid.items()):
        if wanted(ref.step, ref.epoch):
            results.append((ref.step, ref.epoch, Verdict("corrupt", problems=(f"manifest: {why}",)), 0))
    for m in scan.manifests():
        if not wanted(m.step, m.epoch):
            continue
        parts = [verify_file(storage, f"{run}/{m.dir_name}/{f.path}", f) for f in m.files]
        results.append((m.step, m.epoch, Verdict.combine(parts), len(m.files)))
    results.sort(key=lambda r: (r[0], r[1]))
    where = storage.url_of(run)
    if not results:
        what = "no committed steps" if args.step is None else f"no committed step {args.step}"
        print(f"error: {what} under {where}. Fix: pick a step from `trainguard checkpoints ls --all`", file=sys.stderr)
        return VERIFY_EXIT["unreadable"]
    worst = max((r[2].status for r in results), key=lambda st: VERIFY_EXIT.get(st, 2))
    code = VERIFY_EXIT.get(worst, 2)
    if args.json:
        json.dump({"url": where, "run_id": run, "exit": code,
                   "steps": [{"step": st, "epoch": ep, "result": v.status, "files": n, "problems": list(v.problems)}
                             for st, ep, v, n in results]}, out, indent=1)
        out.write("\n")
        return code
    out.write(f"run {run} at {where}\n")
    table = [["STEP", "EPOCH", "RESULT", "FILES"]]
    table += [[str(st), str(ep), "intact" if v.status == "ok" else v.status.upper(), str(n)] for st, ep, v, n in results]
    _table(table, out)
    for st, ep, v, _ in results:
        for problem in v.problems:
            out.write(f"  step {st}@e{ep}: {problem}\n")
    bad = [r for r in results if r[2].status != "ok"]
    if not bad:
        out.write(f"all {len(results)} step(s) intact\n")
    elif code == VERIFY_EXIT["corrupt"]:
        out.write(f"{sum(r[2].status == 'corrupt' for r in bad)} of {len(results)} step(s) damaged: a restore skips "
                  f"them and falls back to an older step; the next commit moves them to {where}/quarantine/\n")
    else:
        out.write(f"{len(bad)} of {len(results)} step(s) could not be read now: not a proof of damage; check the "
                  f"storage endpoint and credentials, then run verify again\n")
    return code
