"""Pure parts of the checkpoint protocol, tested with tables: strict names, manifest path checks,
lineages, what garbage collection may delete, the shared backoff policy."""

from __future__ import annotations

import json

import pytest

from trainguard.checkpoint.discovery import Deletion, Scan, StepRef, gc_plan, lineage_of, restore_epoch
from trainguard.checkpoint.epochs import EpochRecord
from trainguard.checkpoint.errors import CheckpointCorrupt
from trainguard.checkpoint.manifest import (
    FileEntry,
    Manifest,
    UnsupportedFormat,
    check_file_path,
    parse_epoch_name,
    parse_step_dir,
    step_dir,
)
from trainguard.checkpoint.retry import Backoff, retry_call

Z = "0" * 11


@pytest.mark.parametrize(("name", "parsed"), [
    (step_dir(120, 3), (120, 3)),
    (f"step-{Z}7-e{Z}1", (7, 1)),
    (f"step-{Z}7-e{Z}1/", (7, 1)),
    (f"run/step-{Z}7-e{Z}1", (7, 1)),
    ("step-1234567890123-e0000000000042", (1234567890123, 42)),
    ("step-²", None), ("step-abc", None), ("step-", None), (f"step-{Z}7", None),  # no epoch: not ours
    (f"step-{Z}7-e{Z}", None), (f"step-{Z}²-e{Z}1", None), (f"step-{Z}٣-e{Z}1", None),  # non-ASCII digits
    (f"step-{Z}7-e{Z}1.tmp", None), (f"xstep-{Z}7-e{Z}1", None), (f"step-{Z}7-e{Z}1-e{Z}2", None),
    (f"step--{Z}7-e{Z}1", None), (f"step-+{Z}7-e{Z}1", None), (f"step- {Z}7-e{Z}1", None),
])
def test_step_dir_names_are_parsed_strictly(name: str, parsed: tuple[int, int] | None) -> None:
    assert parse_step_dir(name) == parsed


@pytest.mark.parametrize(("name", "parsed"), [
    (f"epoch-{Z}3.json", 3), ("epoch-000000000042.json", 42), ("epoch-²²²²²²²²²²²².json", None),
    ("epoch-3.json", None), (f"epoch-{Z}3.json.tmp", None), (f".epoch-{Z}3.json.ab12.tmp", None),
    (f"epoch-{Z}3", None), ("fence-000000000003.json", None),
])
def test_epoch_names_are_parsed_strictly(name: str, parsed: int | None) -> None:
    assert parse_epoch_name(name) == parsed


def test_names_round_trip_and_sort_by_step_then_epoch() -> None:
    refs = [(10, 2), (9, 5), (10, 1), (100, 1)]
    names = sorted(step_dir(s, e) for s, e in refs)
    assert [parse_step_dir(n) for n in names] == sorted(refs)
    with pytest.raises(ValueError):
        step_dir(-1, 0)


@pytest.mark.parametrize(("path", "ok"), [
    ("__0_0.distcp", True), (".metadata", True), ("sub/__1_0.distcp", True),
    ("../escape", False), ("a/../../b", False), ("/etc/passwd", False), ("", False), ("a//b", False),
    ("./a", False), ("a\\b", False), ("C:/x", False), ("s3://bucket/x", False), ("a\x00b", False),
])
def test_manifest_file_paths_are_validated(path: str, ok: bool) -> None:
    assert (check_file_path(path) is None) is ok


def _manifest(step: int = 5, epoch: int = 1, paths: tuple[str, ...] = ("__0_0.distcp",)) -> Manifest:
    return Manifest(run_id="r", step=step, world_size=1, strategy="ddp", epoch=epoch, kind="periodic",
                    files=tuple(FileEntry(path=p, size=1, crc32=0, rank=0) for p in paths))


@pytest.mark.parametrize("bad", ["../../../etc/shadow", "/abs/path", ""])
def test_manifest_with_unsafe_path_is_corrupt_with_a_clear_message(bad: str) -> None:
    data = _manifest(paths=("__0_0.distcp", bad)).to_json()
    with pytest.raises(CheckpointCorrupt, match=r"manifest s3://b/m is invalid: .*path.*Fix: delete the step"):
        Manifest.from_json(data, "s3://b/m")


def test_manifest_parsing_corrupt_vs_foreign() -> None:
    good = _manifest()
    assert Manifest.from_json(good.to_json(), "x") == good
    for junk in (b"", b"[]", b"{", b'{"format_version": 2}', b"\xff\xfe"):
        with pytest.raises(CheckpointCorrupt) as info:
            Manifest.from_json(junk, "x")
        assert not isinstance(info.value, UnsupportedFormat)
    newer = json.loads(good.to_json())
    newer["format_version"] = 3
    with pytest.raises(UnsupportedFormat, match="format_version 3"):
        Manifest.from_json(json.dumps(newer).encode(), "x")


def _rec(epoch: int, base_step: int = -1, base_epoch: int = -1) -> EpochRecord:
    return EpochRecord(epoch=epoch, world_id=f"w{epoch}", base_step=base_step, base_epoch=base_epoch, world_size=1)


def _refs(*pairs: tuple[int, int]) -> list[StepRef]:
    return [StepRef(s, e) for s, e in pairs]


# records: epoch -> (base_step, base_epoch); None: a malformed record
LINEAGES = [
    ("one epoch", {1: (-1, -1)}, [(1, 1), (2, 1)], 1, [(1, 1), (2, 1)]),
    ("relaunch continues", {1: (-1, -1), 2: (2, 1)}, [(1, 1), (2, 1), (3, 2)], 2, [(1, 1), (2, 1), (3, 2)]),
    ("branch drops the old tail", {1: (-1, -1), 2: (1, 1)}, [(1, 1), (2, 1), (3, 1), (2, 2)], 2,
     [(1, 1), (2, 2)]),
    ("cutoff is the min over the chain", {1: (-1, -1), 2: (3, 1), 3: (2, 2)},
     [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (5, 3)], 3, [(1, 1), (2, 1), (2, 2), (5, 3)]),
    ("scratch start ignores history", {1: (-1, -1), 2: (-1, -1)}, [(5, 1), (1, 2)], 2, [(1, 2)]),
    ("malformed record ends the chain", {1: (-1, -1), 2: None}, [(1, 1), (2, 2)], 2, [(2, 2)]),
    ("unknown epoch: own steps only", {}, [(4, 7)], 7, [(4, 7)]),
    ("a base that is not older is ignored", {2: (1, 3), 3: (1, 2)}, [(1, 2), (1, 3), (2, 3)], 3,
     [(1, 2), (1, 3), (2, 3)]),
]


@pytest.mark.parametrize(("case", "recs", "refs", "epoch", "want"), LINEAGES, ids=[c[0] for c in LINEAGES])
def test_lineage(case: str, recs: dict, refs: list, epoch: int, want: list) -> None:
    records = {e: (None if v is None else _rec(e, *v)) for e, v in recs.items()}
    assert lineage_of(epoch, records, _refs(*refs)) == sorted(_refs(*want))


def test_restore_epoch_skips_epochs_that_died_before_any_commit() -> None:
    records = {1: _rec(1), 2: _rec(2, 3, 1), 3: _rec(3)}  # 3: a fresh world that claimed and died
    assert restore_epoch(records, _refs((3, 1), (4, 2))) == 2
    assert restore_epoch(records, []) is None
    assert restore_epoch({}, _refs((4, 9))) == 9  # epochs only known from step names (copied steps)


def _scan(records: dict[int, tuple[int, int]], committed: list[tuple[int, int]],
          uncommitted: list[tuple[int, int]] = (), invalid: list[tuple[int, int]] = (),
          foreign: list[tuple[int, int]] = ()) -> Scan:
    return Scan(committed={r: _manifest(r.step, r.epoch) for r in _refs(*committed)},
                uncommitted=_refs(*uncommitted), invalid={r: "bad" for r in _refs(*invalid)},
                foreign=_refs(*foreign), epochs={e: _rec(e, *v) for e, v in records.items()})


def _plan(scan: Scan, epoch: int, k: int = 2, protected=(), corrupt=()) -> list[tuple[int, int, str]]:
    return [(d.ref.step, d.ref.epoch, d.reason)
            for d in gc_plan(scan, epoch=epoch, keep_last=k, protected=_refs(*protected),
                             proven_corrupt=_refs(*corrupt))]


GC = [
    ("retention within the lineage", {1: (-1, -1)}, [(1, 1), (2, 1), (3, 1)], {}, 1, [(1, 1, "retention")]),
    ("retention counts ancestors", {1: (-1, -1), 2: (3, 1)}, [(1, 1), (2, 1), (3, 1), (4, 2)], {}, 2,
     [(1, 1, "retention"), (2, 1, "retention")]),
    ("a newer epoch exists: delete nothing", {1: (-1, -1), 2: (2, 1)}, [(1, 1), (2, 1), (3, 1)],
     {"uncommitted": [(1, 1)], "invalid": [(0, 1)]}, 1, []),
    ("branch kept until k newer commits", {1: (-1, -1), 2: (1, 1)}, [(1, 1), (2, 1), (3, 1), (2, 2)], {}, 2, []),
    ("branch dropped after k newer commits", {1: (-1, -1), 2: (1, 1)}, [(1, 1), (2, 1), (3, 1), (2, 2), (3, 2)],
     {}, 2, [(1, 1, "retention"), (2, 1, "branch"), (3, 1, "branch")]),
    ("half-written older than its epoch's newest commit", {1: (-1, -1), 2: (2, 1)}, [(2, 1), (3, 2)],
     {"uncommitted": [(1, 1), (3, 1), (2, 2), (4, 2)]}, 2, [(1, 1, "half_written"), (2, 2, "half_written")]),
    ("half-written of an epoch that never committed later is kept", {1: (-1, -1), 2: (1, 1)}, [(1, 1), (2, 2)],
     {"uncommitted": [(5, 1)]}, 2, []),
    ("invalid manifests are proven corrupt", {1: (-1, -1)}, [(1, 1)], {"invalid": [(2, 1)]}, 1,
     [(2, 1, "corrupt")]),
    ("foreign format is never deleted", {1: (-1, -1)}, [(1, 1), (2, 1), (3, 1)], {"foreign": [(0, 1)]}, 1,
     [(1, 1, "retention")]),
]


@pytest.mark.parametrize(("case", "recs", "committed", "extra", "epoch", "want"), GC, ids=[c[0] for c in GC])
def test_gc_plan(case: str, recs: dict, committed: list, extra: dict, epoch: int, want: list) -> None:
    assert _plan(_scan(recs, committed, **extra), epoch) == want


def test_gc_plan_proven_corrupt_and_protected() -> None:
    scan = _scan({1: (-1, -1), 2: (2, 1)}, [(1, 1), (2, 1), (3, 1), (4, 2)])
    # 3@e1 was proven corrupt by this world's restore (it fell back to 2): deleted as corrupt, and
    # the corrupt step does not count for retention (keep 2 good ones: 2@e1 and 4@e2).
    assert _plan(scan, 2, corrupt=[(3, 1)]) == [(3, 1, "corrupt"), (1, 1, "retention")]
    assert _plan(scan, 2, protected=[(1, 1)], corrupt=[(3, 1)]) == [(3, 1, "corrupt")]
    assert Deletion(StepRef(1, 1), "retention") in gc_plan(scan, epoch=2, keep_last=2)


def test_backoff_grows_caps_and_respects_attempts_and_deadline() -> None:
    b = Backoff(base_s=0.1, max_s=1.0, attempts=5, deadline_s=10, jitter=False)
    assert [b.delay(n) for n in range(1, 7)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.allows(4, 1.0, 1.0) and not b.allows(5, 1.0, 1.0) and not b.allows(1, 9.5, 1.0)
    jittered = Backoff(base_s=1.0, max_s=1.0)
    assert all(0.5 <= jittered.delay(3) <= 1.0 for _ in range(50))
    with pytest.raises(ValueError):
        Backoff(attempts=0)


def test_retry_call_retries_transient_only_within_the_policy() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    seen: list[tuple[int, bool]] = []
    pol = Backoff(base_s=1, max_s=8, attempts=10, deadline_s=100, jitter=False)
    assert retry_call(flaky, pol, transient=lambda e: isinstance(e, ConnectionError), sleep=sleep,
                      clock=lambda: now[0], on_failure=lambda e, a, el, t, g: seen.append((a, g))) == "ok"
    assert slept == [1, 2] and seen == [(1, False), (2, False)]
    with pytest.raises(ValueError):  # not transient: one attempt
        retry_call(lambda: (_ for _ in ()).throw(ValueError("no")), pol, transient=lambda e: False, sleep=sleep)
    slept.clear()
    with pytest.raises(ConnectionResetError):  # the deadline runs out: 1+2+4 = 7 <= 10, then 8 would pass it
        retry_call(lambda: (_ for _ in ()).throw(ConnectionResetError()),
                   Backoff(base_s=1, max_s=8, attempts=2**31, deadline_s=10, jitter=False),
                   transient=lambda e: True, sleep=sleep, clock=lambda: now[0])
    assert len(slept) == 3 and sum(slept) <= 10


def test_epoch_records_are_read_lazily_and_lineage_walks_stop_early() -> None:
    """A long job claims an epoch per re-formation; a commit must not read all of their records."""
    from trainguard.checkpoint.discovery import EpochRecords

    n = 500
    records = EpochRecords(range(1, n + 1), lambda e: _rec(e, e - 1, e - 1) if e > 1 else _rec(1))
    scan = Scan(committed={r: _manifest(r.step, r.epoch) for r in _refs((n - 1, n - 1), (n, n))}, epochs=records)
    assert scan.newest_epoch == n and records.reads == 0  # listing numbers reads nothing
    assert scan.restore_lineage() == _refs((n - 1, n - 1), (n, n))
    assert _plan(scan, n) == []
    assert records.reads <= 3, records.reads
    assert len(records) == n and 7 in records and 0 not in records
