"""The worker's progress heartbeat: what hang detection knows of a rank (progress, not liveness).

A daemon thread sends :class:`~trainguard.contract.protocol.Progress` to the agent every
``hang.heartbeat_interval_s``: the last finished step, the :class:`~trainguard.contract.protocol.Phase`
the training thread set, and where the main thread is. Why a thread and not the training loop: a rank
blocked in a collective (waiting for a hung peer) keeps beating, so its agent can tell *waiting* from
*stopped*; a SIGSTOPped or frozen process sends nothing, and that silence names it.

``progress`` counts the beats at which the rank moved on: its step or phase changed, or its main thread
ran Python since the last beat (the innermost frame or its line changed). A rank-0-only evaluation
between steps therefore progresses (its frame moves) although no step finishes; a rank blocked in a C
call (a collective, a stuck data loader read) does not. :meth:`ProgressReporter.beat` builds one
message and is what the tests drive; the thread only calls it on a timer.

Stack dumps: :func:`install_stack_dump` registers faulthandler for
:data:`~trainguard.contract.protocol.STACK_DUMP_SIGNAL` (every thread's stack to stderr, which the agent
tees), so the agent can log where a hung but running rank is before it ends it.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
from collections.abc import Callable

from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger

log = get_logger("trainguard.runtime.progress")


def _where(frame: object | None) -> tuple[tuple[int, int] | None, str]:
    """(identity of the frame's position, ``file:line function``) of a frame, or (None, "")."""
    if frame is None:
        return None, ""
    code = frame.f_code  # type: ignore[attr-defined]
    line = frame.f_lineno  # type: ignore[attr-defined]
    return (id(frame), frame.f_lasti), f"{code.co_filename.rsplit('/', 1)[-1]}:{line} {code.co_name}"  # type: ignore[attr-defined]


class ProgressReporter:
    """Beats for one worker. ``rank`` and ``step`` are read from ``rank()`` and ``step()`` (both change
    with a re-formation), the phase set by the training thread
    (:meth:`set_phase`); ``send`` delivers a message (best effort). Thread-safe: the
    training thread only assigns attributes, the beat thread reads them."""

    def __init__(self, send: Callable[[proto.Progress], None], *, rank: Callable[[], int], local_rank: int,
                 step: Callable[[], int], interval_s: float, main_thread_id: int | None = None,
                 frames: Callable[[], dict[int, object]] = sys._current_frames) -> None:
        self._send = send
        self.rank, self.local_rank = rank, local_rank
        self._step = step
        self.interval_s = interval_s
        self.current = proto.Phase.STEP
        self._main = main_thread_id if main_thread_id is not None else threading.main_thread().ident
        self._frames = frames
        self._beat = 0
        self._progress = 0
        self._last: tuple[int, proto.Phase, tuple[int, int] | None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_phase(self, phase: proto.Phase) -> None:
        self.current = phase

    def beat(self) -> proto.Progress:
        """The next heartbeat (counts progress since the previous one)."""
        step, phase = max(0, int(self._step())), self.current
        pos, where = _where(self._frames().get(self._main))  # type: ignore[arg-type]
        now = (step, phase, pos)
        if now != self._last:
            self._progress += 1
        self._last = now
        self._beat += 1
        return proto.Progress(rank=max(-1, int(self.rank())), local_rank=self.local_rank, step=step, phase=phase, beat=self._beat,
                              progress=self._progress, where=where)

    def start(self) -> None:
        if self._thread is None and self.interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="trainguard-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._send(self.beat())
            except Exception as e:  # noqa: BLE001 - a heartbeat that failed once must not end the thread
                log.debug("progress_beat_failed", error=str(e)[:200])

    def close(self, final: proto.Phase | None = None) -> None:
        """Stop beating; with ``final``, send one last beat in that phase first (best effort), so that
        the agent's view of this rank ends in it rather than in whatever the last timed beat carried."""
        self._stop.set()
        if final is not None:
            self.current = final
            try:
                self._send(self.beat())
            except Exception as e:  # noqa: BLE001 - the link may be gone already
                log.debug("progress_beat_failed", error=str(e)[:200])


def install_stack_dump() -> bool:
    """Make :data:`~trainguard.contract.protocol.STACK_DUMP_SIGNAL` dump every thread's Python stack to
    stderr (chained to a handler the script installed). False where it cannot (not the main thread's
    interpreter, no such signal)."""
    try:
        # Chained only to a handler the script installed: chained to the default action, the signal
        # would also end the process.
        chain = signal.getsignal(proto.STACK_DUMP_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        faulthandler.register(proto.STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=chain)
        return True
    except (AttributeError, ValueError, RuntimeError, OSError):
        return False


__all__ = ["ProgressReporter", "install_stack_dump"]
