"""``tests/samples.py``'s stream check: a run longer than one epoch passes when every step trained the ids its
stream deals it (an id once per epoch), and fails on a step that trained others; steps past ``upto`` (in flight
when a harness ended the job) are returned, not judged."""

from __future__ import annotations

import json

import pytest

from tests import samples


def _stream(step: int) -> list[int]:
    """Two epochs of 4 ids in 2 steps each: steps 1-2 deal 0..3, steps 3-4 deal them again in another order."""
    return [[0, 1], [2, 3], [3, 1], [0, 2], [1, 0]][step - 1]


def _write(folder, rows: list[dict]) -> None:
    with open(folder / "samples-1.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def _attempt(step: int, ids: list[int], rnd: int = 0) -> dict:
    return {"step": step, "rank": 0, "world_size": 1, "round": rnd, "ids": ids}


def test_two_epochs_pass_the_stream_check_but_not_the_one_epoch_check(tmp_path) -> None:
    _write(tmp_path, [_attempt(s, _stream(s)) for s in range(1, 5)])
    assert samples.check_stream(str(tmp_path), _stream) == []
    with pytest.raises(AssertionError, match="used twice"):
        samples.check_exactly_once(str(tmp_path), 2)


def test_a_step_with_other_ids_fails(tmp_path) -> None:
    rows = [_attempt(s, _stream(s)) for s in range(1, 5)]
    rows[2] = _attempt(3, [0, 1])  # epoch 1 repeats epoch 0's first batch: a data-position bug
    _write(tmp_path, rows)
    with pytest.raises(AssertionError, match=r"other ids than the stream's: \[3\]"):
        samples.check_stream(str(tmp_path), _stream)


def test_steps_after_upto_are_returned_and_a_missing_step_fails(tmp_path) -> None:
    _write(tmp_path, [_attempt(s, _stream(s)) for s in range(1, 6)])
    assert samples.check_stream(str(tmp_path), _stream, upto=3) == [4, 5]
    _write(tmp_path, [_attempt(s, _stream(s)) for s in (1, 3)])
    with pytest.raises(AssertionError, match=r"a step is missing: \[2\]"):
        samples.check_stream(str(tmp_path), _stream)
