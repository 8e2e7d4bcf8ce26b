"""Whole lines from a worker's log file to the agent's output (``workers.tee``).

torch elastic tees a worker's output by tailing its log file with ``readline()`` and writing each
result behind the ``[default0]:`` header. A line the worker has only half written (an unbuffered
``print`` is two writes: the text, then ``"\\n"``; a large line is several) comes back from
``readline()`` without its newline, and torch writes it at once: the rest of the line then follows
behind a second header, ``{"event": ...}[default0]:`` + ``"\\n"``, and a JSON log line no collector can
parse. It happens on a loaded machine, where the tail catches the writer between two writes.

:func:`tail_whole_lines` replaces torch's ``tail_logfile`` (installed by
:func:`trainguard.agent.elastic.install_whole_line_tail`): it writes a line once it is whole. A
partial line that stays partial for :data:`PARTIAL_HOLD_S` (a progress bar redrawn with ``"\\r"``) or
grows past :data:`MAX_LINE_CHARS` is written as it is, ended with a newline, so nothing is hidden; so is
what is left when the worker has ended. The assembly (:class:`LineJoiner`) is pure, table-tested.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from threading import Event
from typing import TextIO

PARTIAL_HOLD_S = 1.0
"""How long a partial line waits for the rest of it before it is written as it is."""

MAX_LINE_CHARS = 1 << 20
"""A partial line this long is written without waiting for its end."""


class LineJoiner:
    """Pieces read from a file in, whole lines out (pure: the caller passes the clock)."""

    def __init__(self, hold_s: float = PARTIAL_HOLD_S, max_chars: int = MAX_LINE_CHARS) -> None:
        self.hold_s = hold_s
        self.max_chars = max_chars
        self._pending = ""
        self._since = 0.0

    @property
    def pending(self) -> str:
        return self._pending

    def feed(self, piece: str, now: float) -> list[str]:
        """``piece`` is what one ``readline()`` returned: at most one newline, at its end."""
        if not self._pending:
            self._since = now
        self._pending += piece
        if self._pending.endswith("\n") or len(self._pending) >= self.max_chars:
            return [self._take()]
        return []

    def idle(self, now: float, finished: bool) -> list[str]:
        """Nothing more to read now: a partial line held too long, or left when the writer ended, goes out."""
        if self._pending and (finished or now - self._since >= self.hold_s):
            return [self._take()]
        return []

    def _take(self) -> str:
        line, self._pending = self._pending, ""
        return line if line.endswith("\n") else line + "\n"


def tail_whole_lines(header: str, file: str, dst: TextIO, finished: Event, interval_sec: float,
                     log_line_filter: Callable[[str], bool] | None = None, **_: object) -> None:
    """torch's ``tail_logfile`` (same arguments), writing whole lines only."""
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)
    joiner = LineJoiner()

    def write(lines: list[str]) -> None:
        for line in lines:
            if log_line_filter is None or log_line_filter(line):
                dst.write(f"{header}{line}")

    with open(file, errors="replace") as fp:
        while True:
            piece = fp.readline()
            if piece:
                write(joiner.feed(piece, time.monotonic()))
                continue
            if finished.is_set():  # the worker has ended: what it wrote after the last look, then the rest
                now = time.monotonic()
                for piece in fp.read().splitlines(keepends=True):
                    write(joiner.feed(piece, now))
                write(joiner.idle(now, finished=True))
                break
            write(joiner.idle(time.monotonic(), finished=False))
            time.sleep(interval_sec)
