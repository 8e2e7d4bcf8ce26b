"""The exit barrier that waits only for the members still in the round (issue 37), and the linger of an
agent that hosts the store: the pure decisions as tables, the wait loops over fake stores and a fake
clock, and how an agent knows it hosts the store (a real socket of this process)."""

from __future__ import annotations

import socket

import pytest
import structlog

from trainguard.agent.exitbarrier import (
    ExitReason,
    LingerReason,
    RoundView,
    decide_exit,
    decide_linger,
    listening_inodes,
    listens_here,
    wait_for_exits,
    wait_for_members,
)

ABC = frozenset({"a", "b", "c"})
F = frozenset


def view(parts, round_=3, closed=False, known=None):
    return RoundView(round=round_, closed=closed, participants=F(parts), known=F(known if known is not None else parts))


# me = "a", finished in round 3 with members a, b, c; timeout 120 s, keep-alive window 3 s.
EXIT_CASES = [
    # name, finished, view, elapsed, unreachable_s -> done, reason, waiting_for, left
    ("everyone still running", F(), view("abc"), 1.0, None, False, None, F("bc"), F()),
    ("one finished, one running", F("b"), view("abc"), 1.0, None, False, None, F("c"), F()),
    ("all finished", F("bc"), view("abc"), 1.0, None, True, ExitReason.MEMBERS_DONE, F(), F()),
    ("c restarted: left the participants", F("b"), view("ab"), 1.0, None, True, ExitReason.MEMBERS_DONE, F(), F("c")),
    ("c left, b still running: wait for b only", F(), view("ab"), 1.0, None, False, None, F("b"), F("c")),
    ("b and c both left (keep-alive expired, evicted)", F(), view("a"), 1.0, None, True, ExitReason.MEMBERS_DONE, F(),
     F("bc")),
    ("a finished member that exited since is no leaver", F("bc"), view("a"), 1.0, None, True, ExitReason.MEMBERS_DONE,
     F(), F()),
    ("closed by another node", F(), view("abc", closed=True), 1.0, None, True, ExitReason.CLOSED, F(), F()),
    ("closed, c had left", F("b"), view("ab", closed=True), 1.0, None, True, ExitReason.CLOSED, F(), F("c")),
    ("the round moved on", F(), view("bc", round_=4), 1.0, None, True, ExitReason.ROUND_MOVED_ON, F(), F()),
    ("this node was dropped from the round", F(), view("bc"), 1.0, None, True, ExitReason.LEFT_ROUND, F(), F()),
    ("bound reached with c running", F("b"), view("abc"), 120.0, None, True, ExitReason.TIMED_OUT, F("c"), F()),
    ("store not answering, within the window", F("b"), None, 2.0, 2.0, False, None, F("c"), F()),
    ("store not answering past the window", F("b"), None, 4.0, 3.0, True, ExitReason.STORE_UNREACHABLE, F("c"), F()),
    ("store not answering, bound first", F(), None, 120.0, 1.0, True, ExitReason.TIMED_OUT, F("bc"), F()),
]


@pytest.mark.parametrize("name,finished,v,elapsed,unreachable,done,reason,waiting,left", EXIT_CASES,
                         ids=[c[0] for c in EXIT_CASES])
def test_decide_exit(name, finished, v, elapsed, unreachable, done, reason, waiting, left):
    verdict = decide_exit("a", 3, ABC, finished, v, elapsed, 120.0, unreachable, 3.0)
    assert (verdict.done, verdict.reason, verdict.waiting_for, verdict.left) == (done, reason, waiting, left)


def test_a_node_alone_in_its_round_waits_for_nobody():
    verdict = decide_exit("a", 0, F("a"), F(), view("a", round_=0), 0.0, 120.0, None, 3.0)
    assert verdict.done and verdict.reason is ExitReason.MEMBERS_DONE


LINGER_CASES = [
    # name, known, exited, elapsed, unreachable, left (grace 3 s; "c" rejoining in the cases that say so)
    #   -> done, reason, waiting_for
    ("nobody else known", F("a"), F(), 0.0, None, F(), True, LingerReason.ALL_EXITED, F()),
    ("b and c still there", F("abc"), F(), 1.0, None, F(), False, None, F("bc")),
    ("b exited, c (a joiner) still there", F("abc"), F("b"), 1.0, None, F(), False, None, F("c")),
    ("both exited", F("abc"), F("bc"), 1.0, None, F(), True, LingerReason.ALL_EXITED, F()),
    ("c's keep-alive expired", F("ab"), F("b"), 1.0, None, F(), True, LingerReason.ALL_EXITED, F()),
    ("bound reached", F("abc"), F("b"), 120.0, None, F(), True, LingerReason.TIMED_OUT, F("c")),
    ("c left the round, in its restart backoff: wait", F("ab"), F("b"), 1.0, None, F("c"), False, None, F("c")),
    ("c left the round and exited", F("ab"), F("bc"), 1.0, None, F("c"), True, LingerReason.ALL_EXITED, F()),
    ("c left and never came back: one keep-alive window", F("ab"), F("b"), 3.0, None, F("c"), True,
     LingerReason.ALL_EXITED, F()),
    ("c left and came back (waiting in the next round)", F("abc"), F("b"), 3.0, None, F("c"), False, None, F("c")),
    ("c left to rejoin, still warming up past the window", F("ab"), F("b"), 30.0, None, F("c"), False, None, F("c")),
    ("c left to rejoin and exited", F("ab"), F("bc"), 30.0, None, F("c"), True, LingerReason.ALL_EXITED, F()),
    ("c left to rejoin, bound reached", F("ab"), F("b"), 120.0, None, F("c"), True, LingerReason.TIMED_OUT, F("c")),
    ("unreadable, within the window", None, F(), 1.0, 1.0, F(), False, None, F()),
    ("unreadable past the window", None, F(), 4.0, 3.0, F(), True, LingerReason.STORE_UNREACHABLE, F()),
]


@pytest.mark.parametrize("name,known,exited,elapsed,unreachable,left,done,reason,waiting", LINGER_CASES,
                         ids=[c[0] for c in LINGER_CASES])
def test_decide_linger(name, known, exited, elapsed, unreachable, left, done, reason, waiting):
    rejoining = F("c") if "to rejoin" in name else F()
    verdict = decide_linger("a", known, exited, elapsed, 120.0, unreachable, 3.0, left, 3.0, rejoining)
    assert (verdict.done, verdict.reason, verdict.waiting_for) == (done, reason, waiting)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


class FakeRound:
    """A scripted round: ``script[i]`` is (participants, finished marks, closed) at poll i (the last repeats);
    a value ``"error"`` makes that poll's read fail."""

    def __init__(self, script):
        self.script = script
        self.poll = -1
        self.marked = []
        self.asked = []

    def read(self):
        self.poll += 1
        step = self.script[min(self.poll, len(self.script) - 1)]
        if step == "error":
            raise ConnectionResetError("store gone")
        parts, _, closed = step
        return view(parts, closed=closed)

    def finished(self, nodes):
        self.asked.append(nodes)
        _, marks, _ = self.script[min(self.poll, len(self.script) - 1)]
        return F(n for n in nodes if n in marks)


def run_barrier(fake, timeout_s=120.0):
    clock = FakeClock()
    with structlog.testing.capture_logs() as logs:
        out = wait_for_members("a", 3, ABC, mark_finished=lambda: fake.marked.append("a"), read=fake.read,
                               finished=fake.finished, timeout_s=timeout_s, unreachable_limit_s=3.0, poll_s=0.25,
                               clock=clock, sleep=clock.sleep)
    return out, [e for e in logs if e["event"] == "exit_barrier_done"]


def test_the_barrier_waits_for_a_running_member_and_not_for_one_that_left():
    # poll 0: all running; 1: c restarted (left the participants); 2: b still running; 3: b finished
    fake = FakeRound([("abc", "", False), ("ab", "", False), ("ab", "", False), ("ab", "b", False)])
    out, lines = run_barrier(fake)
    assert fake.marked == ["a"]
    assert out.reason is ExitReason.MEMBERS_DONE and fake.poll == 3
    assert out.finished == ("b",) and out.left == ("c",) and out.waited_for == ("b", "c") and out.pending == ()
    assert out.seconds == 0.75  # three polls of 0.25 s on the fake clock
    assert len(lines) == 1 and lines[0]["left"] == ["c"] and lines[0]["finished"] == ["b"]
    assert lines[0]["reason"] == "members_done" and lines[0]["seconds"] == 0.75
    assert F("b") not in fake.asked[4:]  # a member seen finished is not asked again


def test_the_barrier_stops_at_the_bound_naming_who_still_runs():
    fake = FakeRound([("abc", "b", False)])
    out, lines = run_barrier(fake, timeout_s=2.0)
    assert out.reason is ExitReason.TIMED_OUT and out.pending == ("c",) and out.seconds == 2.0
    assert lines[0]["log_level"] == "warning" and lines[0]["still_running"] == ["c"]


def test_the_barrier_stops_when_the_rendezvous_is_closed():
    fake = FakeRound([("abc", "", False), ("abc", "b", True)])
    out, _ = run_barrier(fake)
    assert out.reason is ExitReason.CLOSED and out.finished == ("b",) and out.left == ()


def test_a_store_that_comes_back_is_waited_for_and_one_that_does_not_ends_the_barrier():
    back = FakeRound([("abc", "", False), "error", "error", ("abc", "bc", False)])
    out, _ = run_barrier(back)
    assert out.reason is ExitReason.MEMBERS_DONE
    gone = FakeRound([("abc", "", False)] + ["error"] * 100)
    out, lines = run_barrier(gone)
    assert out.reason is ExitReason.STORE_UNREACHABLE and out.pending == ("b", "c")
    assert out.seconds == pytest.approx(0.25 + 3.0)  # the keep-alive window after the first failed read


def test_the_host_lingers_until_the_others_exited():
    clock = FakeClock()
    polls = iter([F("abc"), F("abc"), F("abc"), F("ab")])
    exited_at = {"b": 2}  # b marks itself exited at the third poll; c never does, its keep-alive expires
    n = {"poll": -1}

    def read():
        n["poll"] += 1
        return RoundView(round=3, closed=True, participants=F(), known=next(polls))

    with structlog.testing.capture_logs() as logs:
        out = wait_for_exits("a", read=read, exited=lambda nodes: F(x for x in nodes if exited_at.get(x, 99) <= n["poll"]),
                             timeout_s=120.0, unreachable_limit_s=3.0, clock=clock, sleep=clock.sleep)
    assert out.reason is LingerReason.ALL_EXITED and out.exited == ("b",) and out.waited_for == ("b", "c")
    assert n["poll"] == 3 and out.seconds == 0.75
    assert [e["reason"] for e in logs if e["event"] == "store_host_lingered"] == ["all_exited"]


def test_the_host_waits_for_a_member_that_left_while_it_is_out_of_the_rendezvous_state():
    """c left the round to restart its workers (no keep-alive during its backoff), joins the next round
    at the third poll, sees the rendezvous closed and marks itself exited at the fourth."""
    clock = FakeClock()
    known = [F("ab"), F("ab"), F("abc"), F("abc")]
    n = {"poll": -1}

    def read():
        n["poll"] += 1
        return RoundView(round=3, closed=True, participants=F(), known=known[min(n["poll"], 3)])

    out = wait_for_exits("a", read=read, exited=lambda nodes: F(x for x in nodes if x == "b" or n["poll"] >= 3),
                         timeout_s=120.0, unreachable_limit_s=3.0, left=F("c"), clock=clock, sleep=clock.sleep)
    assert out.reason is LingerReason.ALL_EXITED and out.exited == ("b", "c") and n["poll"] == 3


TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:7530 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1 0
   1: 0100007F:7530 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 222 1 0
   2: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 333 1 0
"""


@pytest.mark.parametrize("port,inodes", [(30000, {"111"}), (8080, {"333"}), (40000, set())])
def test_listening_inodes_reads_only_listening_sockets_on_the_port(port, inodes):
    assert listening_inodes([TCP], port) == inodes


def test_listens_here_sees_a_socket_this_process_listens_on():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert not listens_here(port)  # bound, not listening
        s.listen()
        assert listens_here(port)
    with socket.socket() as other:  # a port nobody here listens on
        other.bind(("127.0.0.1", 0))
        assert not listens_here(other.getsockname()[1])


def test_the_host_waits_for_a_member_that_left_to_rejoin_past_the_keep_alive_window():
    """c left to rejoin warm (its mark says so): out of the rendezvous state for 5 s of warm-up, longer than
    the keep-alive window; then it joins, sees the rendezvous closed and exits."""
    clock = FakeClock()

    def read():
        return RoundView(round=3, closed=True, participants=F(), known=F("ab") if clock.t < 105.0 else F("abc"))

    out = wait_for_exits("a", read=read, exited=lambda nodes: F(x for x in nodes if x == "b" or clock.t >= 105.5),
                         rejoining=lambda nodes: nodes & F("c"), timeout_s=120.0, unreachable_limit_s=3.0,
                         left=F("c"), clock=clock, sleep=clock.sleep)
    assert out.reason is LingerReason.ALL_EXITED and out.exited == ("b", "c") and out.seconds == 5.5
