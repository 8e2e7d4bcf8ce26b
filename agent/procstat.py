"""What the kernel says about a local worker: ``/proc/<pid>/stat`` read, and classified by a pure function.

A worker's heartbeat comes from a Python thread, so a silent heartbeat alone cannot tell a stopped
process (SIGSTOP, a frozen container) from one that runs C code holding the GIL (a long kernel launch,
DDP's parameter-shape check waiting for a joiner) or one a loaded machine starves. The kernel can:

* state ``T`` (stopped by a signal): the process cannot run at all, whatever its threads would do;
  :data:`ProcState.STOPPED`, held with its CPU time standing still (:func:`held_since`: a duty-cycle
  throttler's straggler reads ``T`` often but runs in between), is evidence enough for
  :func:`~trainguard.agent.hang.decide_hang` to name the rank after ``hang.stopped_s`` instead of
  ``hang.silent_s``. (``t``, stopped by a tracer, is not: a
  debugger at a breakpoint is a person at work.)
* state ``R`` (running or runnable: busy in C, or starved) or CPU time advancing by at least half the
  wall time between two reads: :data:`ProcState.BUSY`, never named hung for its silence alone (the
  threshold of the whole job still bounds it).
* sleeping with its CPU time still: :data:`ProcState.IDLE`, waiting on something (its peers, a socket,
  a lock): the silence rule as before, no shorter bound.

Only a rank's own agent can read its process, so this evidence is local: peers on other nodes still
see the heartbeats alone. Linux only; elsewhere (or for a pid that is gone) the reader returns None and
the state is :data:`ProcState.UNKNOWN`, which changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100
"""Kernel clock ticks per second (utime / stime are counted in them)."""


class ProcState(str, Enum):
    STOPPED = "stopped"
    """Stopped by a signal (``T``): cannot run."""
    BUSY = "busy"
    """Running or runnable (``R``), or its CPU time advances: C code, or a starved process."""
    IDLE = "idle"
    """Sleeping, CPU time still: waiting on something."""
    UNKNOWN = "unknown"
    """Not read (another node's rank, no /proc, the process is gone, a first read)."""


@dataclass(frozen=True, slots=True)
class ProcSample:
    """One read of ``/proc/<pid>/stat``."""

    state: str
    """The kernel's one-letter state of the process's main thread (R, S, D, T, t, Z, ...)."""
    cpu_ticks: int
    """utime + stime of the whole process, in :data:`CLK_TCK` ticks."""


def parse_stat(text: str) -> ProcSample | None:
    """Pure: a ``/proc/<pid>/stat`` line -> sample (None when malformed). The command name (field 2) is in
    parentheses and may itself hold spaces and parentheses: the fields after it start after the last ``)``."""
    end = text.rfind(")")
    if end < 0:
        return None
    rest = text[end + 1:].split()
    try:
        # after the name: state (3), ppid ... utime (14), stime (15): indices 0 and 11, 12 of rest
        return ProcSample(rest[0], int(rest[11]) + int(rest[12]))
    except (IndexError, ValueError):
        return None


def read_stat(pid: int) -> ProcSample | None:
    """The process's sample now, or None (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return parse_stat(fh.read())
    except OSError:
        return None


def classify(prev: ProcSample | None, cur: ProcSample | None, elapsed_s: float, clk_tck: int = CLK_TCK) -> ProcState:
    """Pure: the process's state from two reads ``elapsed_s`` apart (``prev`` None: the first read)."""
    if cur is None:
        return ProcState.UNKNOWN
    if cur.state == "T":
        return ProcState.STOPPED
    if cur.state == "R":
        return ProcState.BUSY
    if prev is None or elapsed_s <= 0:
        return ProcState.UNKNOWN
    if (cur.cpu_ticks - prev.cpu_ticks) / clk_tck >= 0.5 * elapsed_s:
        return ProcState.BUSY
    return ProcState.IDLE


def held_since(prev_state: ProcState | None, prev_since: float, prev: ProcSample | None, state: ProcState,
               cur: ProcSample | None, now: float) -> float:
    """Pure: since when the process has held ``state`` without a break, given the previous read's state,
    its start and sample. A stop counts as unbroken only while the CPU time stands still: a process that
    a duty-cycle throttler stops and continues (a straggler) may read ``T`` at every read, but it ran in
    between, so its stop starts again at each read that shows CPU time spent."""
    if prev_state is not state:
        return now
    if state is ProcState.STOPPED and (prev is None or cur is None or cur.cpu_ticks != prev.cpu_ticks):
        return now
    return prev_since


__all__ = ["CLK_TCK", "ProcSample", "ProcState", "classify", "held_since", "parse_stat", "read_stat"]
