"""Tee'd worker output reaches the agent's in whole lines (agent/linetail.py).

The failure it fixes: torch's tail wrote a line the worker had half written, then its rest behind a
second ``[default0]:`` header, and a JSON event in the agent's log no longer parsed (seen in CI: a
``resumed`` line missing from a loaded run of tests/strategies/test_e2e_resize.py)."""

from __future__ import annotations

import io
import json
import os
import threading
import time

import pytest
from torch.distributed.elastic.multiprocessing import tail_log
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from trainguard.agent.elastic import TORCH_TAIL_LOGFILE, install_whole_line_tail
from trainguard.agent.linetail import LineJoiner, tail_whole_lines


@pytest.mark.parametrize("pieces,max_chars,expected", [
    ([("a\n", 0.0)], 100, ["a\n"]),
    ([('{"e": ', 0.0), ('1}', 0.1), ("\n", 0.2)], 100, ['{"e": 1}\n']),  # three writes, one line
    ([("x", 0.0), ("y\n", 5.0)], 100, ["xy\n"]),  # only idle() releases a held line, feed() never splits one
    ([("abcd", 0.0)], 100, []),  # held: not whole yet
    ([("ab", 0.0), ("cdef", 0.1), ("g\n", 0.2)], 6, ["abcdef\n", "g\n"]),  # max_chars: written as it is, ended
])
def test_joiner_feed(pieces, max_chars, expected):
    j = LineJoiner(hold_s=1.0, max_chars=max_chars)
    out = [line for piece, now in pieces for line in j.feed(piece, now)]
    assert out == expected


@pytest.mark.parametrize("start,now,finished,expected", [
    (0.0, 0.5, False, []),  # held less than hold_s
    (0.0, 1.0, False, ["50%\r\n"]),  # a progress bar: written, ended, after hold_s
    (0.0, 0.1, True, ["50%\r\n"]),  # the writer ended: the rest goes out
])
def test_joiner_idle(start, now, finished, expected):
    j = LineJoiner(hold_s=1.0)
    assert j.feed("50%\r", start) == []
    assert j.idle(now, finished) == expected
    assert j.pending == ("" if expected else "50%\r")


def test_idle_with_nothing_pending_writes_nothing():
    assert LineJoiner().idle(100.0, True) == []


def split_writer(path: str, n: int, stop: threading.Event) -> None:
    """A worker whose lines each arrive in two writes, far enough apart for the tail to look between."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for i in range(n):
            os.write(fd, json.dumps({"event": "train_step", "step": i}).encode())
            time.sleep(0.03)
            os.write(fd, b"\n")
    finally:
        os.close(fd)
        stop.set()


def tee(tmp_path, whole: bool) -> list[str]:
    path = str(tmp_path / "stdout.log")
    dst = io.StringIO()
    done = threading.Event()
    saved = tail_log.tail_logfile
    try:
        if whole:
            install_whole_line_tail()
        else:  # torch's own (an agent built earlier in this process installed ours)
            tail_log.tail_logfile = TORCH_TAIL_LOGFILE
        t = TailLog("default", {0: path}, dst, interval_sec=0.005).start()
        split_writer(path, 10, done)
        t.stop()
    finally:
        tail_log.tail_logfile = saved
    return dst.getvalue().splitlines()


def test_torch_tail_splits_a_line_written_in_two(tmp_path):
    """The fault as torch has it (if torch fixes it, this fails and the patch can go)."""
    lines = tee(tmp_path, whole=False)
    assert any(line.count("[default0]:") > 1 or line == "[default0]:" for line in lines), lines


def test_whole_line_tail_writes_each_line_once_whole(tmp_path):
    lines = tee(tmp_path, whole=True)
    assert [json.loads(line.split("]:", 1)[1])["step"] for line in lines] == list(range(10))
    assert all(line.startswith("[default0]:{") for line in lines)


def test_install_is_idempotent_and_replaces_torchs_tail():
    saved = tail_log.tail_logfile
    try:
        install_whole_line_tail()
        install_whole_line_tail()
        assert tail_log.tail_logfile is tail_whole_lines
    finally:
        tail_log.tail_logfile = saved


def test_the_rest_after_the_writer_ended_is_written(tmp_path):
    path = tmp_path / "out.log"
    path.write_text("one\ntwo-without-newline")
    dst = io.StringIO()
    finished = threading.Event()
    finished.set()
    tail_whole_lines("[h]:", str(path), dst, finished, 0.01)
    assert dst.getvalue() == "[h]:one\n[h]:two-without-newline\n"
