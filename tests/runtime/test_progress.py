"""The worker's progress heartbeat (runtime/progress.py) and its wire messages."""

import os
import socket
import subprocess
import sys
import threading

import pytest

from trainguard.contract import protocol as proto
from trainguard.contract.protocol import Abort, Phase, Progress, ProtocolError, decode, encode
from trainguard.runtime.link import AgentLink
from trainguard.runtime.progress import ProgressReporter


class FakeFrame:
    class _Code:
        co_filename = "/x/train.py"
        co_name = "main"

    f_code = _Code()

    def __init__(self, lasti=0, line=10):
        self.f_lasti, self.f_lineno = lasti, line


def _reporter(frames, step=lambda: 5):
    return ProgressReporter(lambda m: None, rank=lambda: 3, local_rank=1, step=step, interval_s=0.0,
                            main_thread_id=1, frames=lambda: {1: frames[0]})


def test_a_rank_blocked_in_c_beats_without_progress_and_python_or_a_step_progresses():
    frame = [FakeFrame(lasti=4)]
    step = [5]
    r = _reporter(frame, step=lambda: step[0])
    first = r.beat()
    assert (first.rank, first.local_rank, first.step, first.phase, first.where) == (3, 1, 5, Phase.STEP, "train.py:10 main")
    blocked = [r.beat() for _ in range(3)]  # the same frame, the same instruction: blocked in a collective
    assert [b.beat for b in blocked] == [2, 3, 4]
    assert {b.progress for b in blocked} == {first.progress}
    frame[0].f_lasti = 8  # the main thread ran Python
    assert r.beat().progress == first.progress + 1
    step[0] = 6  # a step finished
    assert r.beat().progress == first.progress + 2
    r.set_phase(Phase.BUSY)  # the phase changed
    b = r.beat()
    assert (b.phase, b.progress) == (Phase.BUSY, first.progress + 3)


def test_the_heartbeat_thread_sends_until_closed():
    got, seen = [], threading.Event()

    def send(m):
        got.append(m)
        if len(got) >= 3:
            seen.set()

    r = ProgressReporter(send, rank=lambda: 0, local_rank=0, step=lambda: 1, interval_s=0.01)
    r.start()
    assert seen.wait(10)
    r.close()
    r._thread.join(5)
    assert not r._thread.is_alive()
    assert [m.beat for m in got[:3]] == [1, 2, 3]
    assert all(isinstance(m, Progress) for m in got)


def test_closing_with_a_final_phase_sends_one_last_beat_in_it():
    """``Runtime.finish`` closes the beats with ``finished``: the agent's last view of the rank is that it
    finished, not the phase of the last timed beat (else its silence during the interpreter's exit names
    it hung)."""
    got = []
    r = ProgressReporter(got.append, rank=lambda: 1, local_rank=0, step=lambda: 60, interval_s=3600)
    r.set_phase(Phase.BUSY)
    r.close()
    assert got == []  # closing alone sends nothing
    r.close(final=Phase.FINISHED)
    assert [(m.phase, m.step, m.rank) for m in got] == [(Phase.FINISHED, 60, 1)]


def test_progress_and_abort_round_trip_and_bad_phase_is_named():
    p = Progress(rank=0, local_rank=0, step=12, phase=Phase.AGREEMENT, beat=3, progress=2, where="a.py:1 f")
    assert decode(encode(p)) == p
    assert decode(encode(Abort("rank 1 hung"))) == Abort("rank 1 hung")
    with pytest.raises(ProtocolError, match="`phase` must be one of"):
        decode(b'{"op": "progress", "rank": 0, "local_rank": 0, "step": 1, "phase": "lunch", "beat": 1, "progress": 1}')


def test_the_link_hands_an_abort_to_its_callback(tmp_path):
    path = str(tmp_path / "a.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    link = AgentLink(path, 0, 0, os.getpid())
    conn, _ = srv.accept()
    try:
        got, done = [], threading.Event()
        link.on_abort = lambda why: (got.append(why), done.set())
        conn.sendall(encode(Abort("peer hung")))
        assert done.wait(10)
        assert got == ["peer hung"]
        link.report(Progress(rank=0, local_rank=0, step=1, phase=Phase.STEP, beat=1, progress=1))
        buf = b""
        while buf.count(b"\n") < 2:  # hello, then the progress beat
            buf += conn.recv(4096)
        assert isinstance(decode(buf.split(b"\n")[1]), Progress)
    finally:
        link.close()
        conn.close()
        srv.close()


def test_the_stack_dump_signal_writes_every_threads_stack(tmp_path):
    """install_stack_dump: the agent's signal makes a running worker print where it is (faulthandler)."""
    code = ("import os, signal, sys, time\n"
            "from trainguard.runtime.progress import install_stack_dump\n"
            "assert install_stack_dump()\n"
            "def waiting_here():\n"
            "    os.kill(os.getpid(), signal.SIGUSR2)\n"
            "    time.sleep(0.2)\n"
            "waiting_here()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert proto.STACK_DUMP_SIGNAL.name == "SIGUSR2"
    assert "waiting_here" in out.stderr and "Current thread" in out.stderr
