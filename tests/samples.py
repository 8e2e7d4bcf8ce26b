"""Read the bundled job's sample log (``examples/train_gpt_elastic.py --sample-log DIR``) and check that
every sample id was trained exactly once in the committed lineage.

Each rank writes, per step, ``{"step", "rank", "world_size", "round", "ids"}`` with the ids of the
*whole* global batch (before the step-boundary agreement: a draining rank exits inside it), and
``{"step", "rank", "round", "rolled_back": true}`` when a vanished peer interrupted the step. An
attempt is (step, round); a rolled-back attempt is void (its records, a dead rank's included, do not
count). Each step must have exactly one valid attempt, whose records all carry the same ids.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from typing import Any


def read(folder: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        with open(path) as fh:
            for line in fh:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:  # a line cut by a SIGKILL
                        pass
    return out


def committed_batches(folder: str) -> dict[int, dict[str, Any]]:
    """step -> {"ids", "world_size", "round", "ranks"} of its one valid attempt (AssertionError else)."""
    recs = read(folder)
    void = {(r["step"], r["round"]) for r in recs if r.get("rolled_back")}
    attempts: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in recs:
        if not r.get("rolled_back") and (r["step"], r["round"]) not in void:
            attempts.setdefault((r["step"], r["round"]), []).append(r)
    out: dict[int, dict[str, Any]] = {}
    for (step, rnd), rs in sorted(attempts.items()):
        assert step not in out, f"step {step} committed twice (rounds {out[step]['round']} and {rnd})"
        ids = rs[0]["ids"]
        assert all(r["ids"] == ids for r in rs), f"step {step}: ranks disagree on the global batch"
        ranks = [r["rank"] for r in rs]
        assert len(set(ranks)) == len(ranks) and all(0 <= x < rs[0]["world_size"] for x in ranks), (step, ranks)
        out[step] = {"ids": ids, "world_size": rs[0]["world_size"], "round": rnd, "ranks": sorted(ranks)}
    return out


def check_exactly_once(folder: str, global_batch: int) -> list[int]:
    """Every step 1..max committed once with a full global batch; no id trained twice. Returns the ids."""
    steps = committed_batches(folder)
    assert steps, "no step was logged"
    assert sorted(steps) == list(range(1, max(steps) + 1)), (
        f"a step is missing: {sorted(set(range(1, max(steps) + 1)) - set(steps))[:10]}")
    seen = [i for s in sorted(steps) for i in steps[s]["ids"]]
    assert all(len(steps[s]["ids"]) == global_batch for s in steps), "the global batch changed size"
    assert len(seen) == len(set(seen)), "a sample was used twice"
    return seen


def check_stream(folder: str, expected: Callable[[int], list[int]], *, upto: int | None = None) -> list[int]:
    """Every step 1..``upto`` (default: the last step logged) committed once, with exactly the ids the job's own
    sample stream gives it (``expected(step)``: the global batch of that 1-based step; a seeded permutation per
    epoch, so an id recurs once per epoch and nowhere else). :func:`check_exactly_once` asks for no id twice in
    the whole run, which holds only while a run stays in its first epoch. Attempts of steps after ``upto`` are
    left out (a job the caller stopped mid-step: those were in flight, never known committed); returns them."""
    steps = committed_batches(folder)
    assert steps, "no step was logged"
    last = max(steps) if upto is None else upto
    missing = sorted(set(range(1, last + 1)) - set(steps))
    assert not missing, f"a step is missing: {missing[:10]}"
    wrong = [s for s in range(1, last + 1) if steps[s]["ids"] != list(expected(s))]
    assert not wrong, f"steps trained other ids than the stream's: {wrong[:10]}"
    return sorted(s for s in steps if s > last)


def lineage_batches(folder: str) -> tuple[dict[int, dict[str, Any]], dict[int, list[int]]]:
    """The committed lineage after restarts from a snapshot: a world that restored step ``k`` redoes
    ``k + 1 ...`` in a later round, so for each step the attempt of the newest round is the one the job
    continued from, and the older rounds' attempts of it are abandoned work. Returns ``(step -> that
    attempt, step -> the older rounds that attempted it)``; every attempt must be internally consistent
    (AssertionError else), and a redone step must train the same ids (the cursor is restored with it)."""
    recs = read(folder)
    void = {(r["step"], r["round"]) for r in recs if r.get("rolled_back")}
    attempts: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for r in recs:
        if not r.get("rolled_back") and (r["step"], r["round"]) not in void:
            attempts.setdefault(r["step"], {}).setdefault(r["round"], []).append(r)
    out: dict[int, dict[str, Any]] = {}
    redone: dict[int, list[int]] = {}
    for step, by_round in sorted(attempts.items()):
        for rnd, rs in by_round.items():
            assert all(x["ids"] == rs[0]["ids"] for x in rs), f"step {step} round {rnd}: ranks disagree"
        newest = max(by_round)
        rs = by_round[newest]
        out[step] = {"ids": rs[0]["ids"], "world_size": rs[0]["world_size"], "round": newest,
                     "ranks": sorted(x["rank"] for x in rs)}
        if len(by_round) > 1:
            redone[step] = sorted(r for r in by_round if r != newest)
            assert all(by_round[r][0]["ids"] == rs[0]["ids"] for r in by_round), f"step {step} redone with other ids"
    return out, redone


def check_lineage_exactly_once(folder: str, global_batch: int) -> dict[int, list[int]]:
    """:func:`check_exactly_once` over the committed lineage (:func:`lineage_batches`); returns the redone
    steps (step -> the abandoned rounds)."""
    steps, redone = lineage_batches(folder)
    assert steps, "no step was logged"
    assert sorted(steps) == list(range(1, max(steps) + 1)), (
        f"a step is missing: {sorted(set(range(1, max(steps) + 1)) - set(steps))[:10]}")
    assert all(len(steps[s]["ids"]) == global_batch for s in steps), "the global batch changed size"
    seen = [i for s in sorted(steps) for i in steps[s]["ids"]]
    assert len(seen) == len(set(seen)), "a sample was used twice in the committed lineage"
    return redone
