"""What the kernel says about a worker (agent/procstat.py): the parser and the classifier as tables, then
real processes: one SIGSTOPped, one spinning in a C call that holds the GIL (its heartbeat thread silenced),
one sleeping; and the hang watch fed by the real /proc of a stopped process."""

import os
import signal
import subprocess
import sys
import time

import pytest

from trainguard.agent.hang import HangAct, HangConfig
from trainguard.agent.hangwatch import HangWatch
from trainguard.agent.procstat import ProcSample, ProcState, classify, held_since, parse_stat, read_stat
from trainguard.contract.protocol import Phase, Progress

TAIL = " 1 2 3 4 5 6 7 8 9 10 {ut} {st} 0 0 20 0 4 0 100 0 0"


def line(name, state, ut=0, st=0):
    return f"4242 ({name}) {state}" + TAIL.format(ut=ut, st=st)


PARSE = [
    ("plain", line("python", "S", 120, 30), ProcSample("S", 150)),
    ("name_with_spaces_and_parens", line("a (b) c", "T", 7, 3), ProcSample("T", 10)),
    ("no_parens", "4242 python S 1 2", None),
    ("truncated", "4242 (python) R 1 2 3", None),
    ("utime_not_a_number", line("python", "R").replace(" 10 0 0", " 10 x 0"), None),
]


@pytest.mark.parametrize("text,want", [p[1:] for p in PARSE], ids=[p[0] for p in PARSE])
def test_parse_stat(text, want):
    assert parse_stat(text) == want


CLASSIFY = [
    # id, prev, cur, elapsed s, state (100 ticks per second)
    ("gone", ProcSample("S", 0), None, 0.5, ProcState.UNKNOWN),
    ("stopped_by_a_signal", None, ProcSample("T", 5), 0.0, ProcState.STOPPED),
    ("stopped_by_a_tracer_is_no_evidence", ProcSample("S", 0), ProcSample("t", 0), 0.5, ProcState.IDLE),
    ("running", None, ProcSample("R", 5), 0.0, ProcState.BUSY),
    ("first_read_sleeping", None, ProcSample("S", 5), 0.0, ProcState.UNKNOWN),
    ("sleeping_cpu_still", ProcSample("S", 100), ProcSample("S", 101), 0.5, ProcState.IDLE),
    ("sleeping_now_cpu_ran", ProcSample("R", 100), ProcSample("S", 130), 0.5, ProcState.BUSY),
    ("disk_wait_cpu_still", ProcSample("D", 100), ProcSample("D", 100), 0.5, ProcState.IDLE),
    ("just_under_half_a_cpu", ProcSample("S", 100), ProcSample("S", 124), 0.5, ProcState.IDLE),
]


@pytest.mark.parametrize("prev,cur,elapsed,want", [c[1:] for c in CLASSIFY], ids=[c[0] for c in CLASSIFY])
def test_classify(prev, cur, elapsed, want):
    assert classify(prev, cur, elapsed, clk_tck=100) is want


HELD = [
    # id, previous state, its since, previous sample, state now, sample now, since (now = 10.0)
    ("first_read", None, 0.0, None, ProcState.STOPPED, ProcSample("T", 5), 10.0),
    ("state_changed", ProcState.IDLE, 2.0, ProcSample("S", 5), ProcState.STOPPED, ProcSample("T", 5), 10.0),
    ("still_stopped_cpu_still", ProcState.STOPPED, 2.0, ProcSample("T", 5), ProcState.STOPPED, ProcSample("T", 5), 2.0),
    # a duty-cycle throttler's straggler: T at both reads, but it ran in between
    ("stopped_again_after_running", ProcState.STOPPED, 2.0, ProcSample("T", 5), ProcState.STOPPED, ProcSample("T", 9), 10.0),
    ("still_idle", ProcState.IDLE, 2.0, ProcSample("S", 5), ProcState.IDLE, ProcSample("S", 6), 2.0),
    ("still_busy", ProcState.BUSY, 2.0, ProcSample("R", 5), ProcState.BUSY, ProcSample("R", 90), 2.0),
]


@pytest.mark.parametrize("prev_state,prev_since,prev,state,cur,want", [h[1:] for h in HELD], ids=[h[0] for h in HELD])
def test_held_since(prev_state, prev_since, prev, state, cur, want):
    assert held_since(prev_state, prev_since, prev, state, cur, 10.0) == want


# ---- real processes -------------------------------------------------------------------------------

BEATING = """
import re, sys, threading, time
beats = open(sys.argv[1], "w")
def beat():
    n = 0
    while True:
        n += 1
        beats.seek(0); beats.write(f"{n:12d}"); beats.flush()
        time.sleep(0.02)
threading.Thread(target=beat, daemon=True).start()
time.sleep(0.5)
print("ready", flush=True)
if sys.argv[2] == "python":
    while True:  # pure Python: it runs whenever it is not stopped
        pass
elif sys.argv[2] == "spin":
    # sre's matcher is C code that never releases the GIL: exponential backtracking keeps it there for ages
    re.match(r"(a+)+$", "a" * 64 + "b")
else:
    time.sleep(120)
"""


@pytest.fixture
def child(tmp_path):
    procs = []

    def start(mode):
        beats = tmp_path / f"beats-{mode}"
        p = subprocess.Popen([sys.executable, "-c", BEATING, str(beats), mode], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p, beats

    yield start
    for p in procs:
        p.kill()
        os.kill(p.pid, signal.SIGCONT) if p.poll() is None else None
        p.wait(timeout=10)
        p.stdout.close()


def _beat(path):
    return int(path.read_text() or 0)


def _settle(read, want, timeout=10.0):
    """Sample until ``read()`` gives ``want`` (a loaded machine may take a moment to deliver a signal)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = read()
        if got == want:
            return got
        time.sleep(0.05)
    return read()


def test_a_sigstopped_process_reads_stopped_and_running_again_after_sigcont(child):
    p, beats = child("sleep")
    first = read_stat(p.pid)
    assert first is not None and first.state in "SR"
    os.kill(p.pid, signal.SIGSTOP)
    assert _settle(lambda: read_stat(p.pid).state, "T") == "T"
    stopped = _beat(beats)
    time.sleep(0.3)
    assert _beat(beats) == stopped  # its heartbeat thread is stopped too
    assert classify(first, read_stat(p.pid), 0.3) is ProcState.STOPPED
    os.kill(p.pid, signal.SIGCONT)
    assert _settle(lambda: read_stat(p.pid).state, "S") == "S"
    a = read_stat(p.pid)
    time.sleep(0.5)
    assert classify(a, read_stat(p.pid), 0.5) is ProcState.IDLE  # sleeping, its beat thread's CPU is a tick or two


def test_a_c_call_holding_the_gil_silences_the_heartbeat_but_reads_busy(child):
    p, beats = child("spin")
    end = time.monotonic() + 20  # the match has started once the beat count stands (a loaded machine: a while)
    last = _beat(beats)
    while time.monotonic() < end:
        time.sleep(0.3)
        now = _beat(beats)
        if now == last:
            break
        last = now
    a, b0, t0 = read_stat(p.pid), _beat(beats), time.monotonic()
    time.sleep(1.0)
    b, b1, t1 = read_stat(p.pid), _beat(beats), time.monotonic()
    assert b1 - b0 <= 1, "the beat thread ran: the call released the GIL"  # one beat may land as the call starts
    assert classify(a, b, t1 - t0) is ProcState.BUSY
    assert b.cpu_ticks > a.cpu_ticks  # it burns CPU (however starved this machine is)


def test_the_watch_names_a_really_stopped_worker_after_stopped_s_not_silent_s(child):
    """HangWatch on a fake clock, fed by the real /proc of a SIGSTOPped process (its local rank 0): the
    stopped rank is named by its own agent after hang.stopped_s (``process_stopped``), far below
    hang.silent_s and hang.min_s; a sleeping process with the same silent heartbeat is not."""
    cfg = HangConfig()
    t = [1000.0]
    p, _ = child("sleep")

    def run(stop):
        w = HangWatch(cfg, clock=lambda: t[0])
        w.start_world(None, "A", ("A",), thread=False)
        for i in range(1, 30):  # training: steps advance
            t[0] += 0.2
            w.on_progress(Progress(rank=0, local_rank=0, step=i, phase=Phase.STEP, beat=i, progress=i))
            w.observe_procs({0: p.pid})
            assert w.check()[1] is None
        if stop:
            os.kill(p.pid, signal.SIGSTOP)
            _settle(lambda: read_stat(p.pid).state, "T")
        stalled_at = t[0]
        for _ in range(100):  # no beat from here on
            t[0] += 0.2
            w.observe_procs({0: p.pid})
            v, act = w.check()
            if act is not None:
                return v, act, t[0] - stalled_at
        return None, None, None

    v, act, after = run(stop=False)
    assert act is not None and v.why == "heartbeat_stopped_first" and after > cfg.min_s  # as before: the threshold
    os.kill(p.pid, signal.SIGCONT)
    v, act, after = run(stop=True)
    assert act is not None and act.act is HangAct.END_WORKERS
    assert v.why == "process_stopped" and v.threshold_s == cfg.stopped_s
    assert cfg.stopped_s < after <= cfg.stopped_s + 0.5 < cfg.silent_s


def test_a_throttled_straggler_that_reads_stopped_at_every_tick_is_never_named(child):
    """A duty-cycle throttler (the straggler bench's: stopped 80 % of each 100 ms) on a busy process, read
    every 0.2 s (in step with the throttler's period, so most reads see T) while the job is stalled on a
    fake clock: the stop never holds with the CPU time standing still, so hang.stopped_s never names it;
    stopped for good, it is named."""
    from tests.fixtures.throttle import DutyCycleThrottler

    cfg = HangConfig()
    t = [1000.0]
    p, _ = child("python")
    w = HangWatch(cfg, clock=lambda: t[0])
    w.start_world(None, "A", ("A",), thread=False)
    for i in range(1, 10):
        t[0] += 0.2
        w.on_progress(Progress(rank=0, local_rank=0, step=i, phase=Phase.STEP, beat=i, progress=i))
        w.observe_procs({0: p.pid})
    stopped_reads = 0
    with DutyCycleThrottler(lambda: [p.pid], 0.8, 0.1):
        for _ in range(20):  # 4 s of real time, 4 s of fake time without a beat: the job is stalled
            for _ in range(10):  # the test's own reads, 20 ms apart: a read every 0.2 s alone can lock onto
                time.sleep(0.02)  # the throttler's 20 ms run window (seen twice in the full suite: 0 and 1 of 20)
                stopped_reads += read_stat(p.pid).state == "T"
            t[0] += 0.2
            w.observe_procs({0: p.pid})
            v, act = w.check()
            assert act is None or v.why != "process_stopped", v
    assert stopped_reads >= 50  # the reads did see it stopped, often (80 % of 200 reads unloaded)
    os.kill(p.pid, signal.SIGSTOP)
    _settle(lambda: read_stat(p.pid).state, "T")
    for _ in range(10):
        t[0] += 0.2
        w.observe_procs({0: p.pid})
        v, act = w.check()
        if act is not None:
            break
    assert act is not None and v.why == "process_stopped"


def test_the_proc_poll_wakes_the_supervisor_once_per_stop_without_waiting_for_its_tick(child):
    """``HangWatch.watch_procs``: with pids given once (the supervisor's last tick), the poll thread reads
    ``/proc`` on its own and calls ``wake`` once a stop has lasted hang.stopped_s; a running process never
    wakes it, and one stop wakes it once (the supervisor may be busy; the verdict is then its to ask)."""
    cfg = HangConfig()
    p, _ = child("sleep")
    w = HangWatch(cfg)
    w.start_world(None, "A", ("A",), thread=False)
    w.on_progress(Progress(rank=0, local_rank=0, step=1, phase=Phase.STEP, beat=1, progress=1))
    woken = []
    w.observe_procs({0: p.pid})  # the supervisor's tick: from here the poll has the pid
    w.watch_procs(lambda: woken.append(time.monotonic()))
    try:
        reads = []
        w.observe_procs({0: p.pid}, read=lambda pid: reads.append(pid))  # the poll reads alone from here:
        assert reads == []  # a second reader a millisecond after it would see a busy process idle
        time.sleep(cfg.stopped_s + 5 * cfg.proc_poll_s)
        assert woken == []  # sleeping, not stopped
        os.kill(p.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _settle(lambda: len(woken), 1)
        assert len(woken) == 1 and woken[0] - stopped_at > cfg.stopped_s
        v, act = w.check()
        assert act is not None and act.act is HangAct.END_WORKERS and v.why == "process_stopped"
        time.sleep(cfg.stopped_s + 5 * cfg.proc_poll_s)
        assert len(woken) == 1  # once per stop
    finally:
        w.close()


def test_no_proc_poll_when_set_to_zero(child):
    w = HangWatch(HangConfig(proc_poll_s=0.0))
    w.watch_procs(lambda: None)
    assert w._proc_thread is None
    w.close()
