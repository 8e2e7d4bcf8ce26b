"""The supervisor loop driven by a scripted elastic adapter: no processes, no rendezvous, no torch
internals (elastic's TestAgent idea; the adapter is the seam, STYLE §11)."""

import time

import pytest

from trainguard.agent.configload import load_config
from trainguard.agent.decisions import Asked
from trainguard.agent.elastic import Peek, Poll, RendezvousAborted, World
from trainguard.agent.exitcodes import ExitCode
from trainguard.agent.supervisor import DRAIN_KEY, Supervisor
from trainguard.contract.protocol import EXIT_RESIZE as RESIZE
from trainguard.contract.protocol import AgentState, CheckpointNow, Hello, WorkerStatus


class FakeStore:
    def __init__(self):
        self.keys = {}

    def add(self, k, v):
        self.keys[k] = self.keys.get(k, 0) + v

    def set(self, k, v):
        self.keys[k] = v

    def check(self, ks):
        return all(k in self.keys for k in ks)


def exited(*codes):
    return Poll(WorkerStatus.EXITED, tuple(codes))


HEALTHY = Poll(WorkerStatus.HEALTHY)


class FakeAdapter:
    """Plays back a list of polls; records what the loop asked of elastic."""

    def __init__(self, script, max_restarts=2, waiting=(), abort_start=False):
        self.script = list(script)
        self.remaining_restarts = max_restarts
        self.waiting = list(waiting)
        self.calls = []
        self.store = FakeStore()
        self.round = 0
        self.node_id = "fake_1_0"
        self.on_poll = None
        self.abort_start = abort_start
        self.closed = False
        self.left = []
        """``rejoin`` of each leave."""

    def run(self, body):
        return body()

    def world(self):
        return World(round=self.round, group_rank=0, nodes=1, world_size=1, global_ranks=(0,))

    def start(self, expected=None):
        self.calls.append("start")
        if self.abort_start:
            raise RendezvousAborted("draining")
        return self.world()

    def restart(self, expected=None):
        self.calls.append("restart")
        self.round += 1
        return self.world()

    def poll(self):
        if self.on_poll:
            self.on_poll(len(self.calls))
        return self.script.pop(0) if self.script else HEALTHY

    def worker_pids(self):
        return {0: 4242}

    def stop_workers(self):
        self.calls.append("stop")

    def terminate_workers(self, grace_s):
        self.calls.append(f"terminate({grace_s:.0f})")

    def exit_barrier(self):
        self.calls.append("exit_barrier")

    def consume_restart(self):
        self.remaining_restarts -= 1
        return self.remaining_restarts

    def members(self):
        return [self.node_id]

    def peek(self):
        return Peek(round=self.round, complete=True, participants=(self.node_id,), waiting=0,
                    this_node_participates=True)

    def round_store(self, round_):
        return self.store

    def side_store(self, round_):
        return self.store

    def endpoint_store(self):
        return None  # no census (as with etcd)

    def nodes_waiting(self):
        return self.waiting.pop(0) if self.waiting else 0

    def leave(self, timeout_s, rejoin=False):
        self.calls.append("leave")
        self.left.append(rejoin)
        return True

    def reconnect_store(self):
        return False

    def close(self):
        self.closed = True


def make(tmp_path, script, **kw):
    cfg = load_config(None, {}, {"agent.state_dir": str(tmp_path / "s"), "agent.log_dir": str(tmp_path / "l"),
                                 "workers.entrypoint": "train.py", "workers.restart_backoff_s": "0.01",
                                 "workers.monitor_interval_s": "0.001",
                                 "rendezvous.backend": "static", "preemption.term_grace_s": "7"})
    transitions = []
    fake = FakeAdapter(script, **kw)
    sup = Supervisor(cfg, handler=object(), listeners=[lambda old, new, d: transitions.append(new)],
                     adapter=lambda spec, logs, s: fake)
    return sup, fake, transitions


def test_crash_consumes_restarts_then_fails(tmp_path):
    sup, fake, tr = make(tmp_path, [HEALTHY] * 2 + [exited(1)] + [HEALTHY] + [exited(-9)] + [exited(1)], max_restarts=2)
    result = sup._loop()
    assert result.state.value == "FAILED"
    # A failure restart SIGKILLs what still runs after workers.failure_stop_grace_s (not elastic's 30 s).
    assert fake.calls == ["start", "terminate(3)", "restart", "terminate(3)", "restart", "stop"]
    assert fake.remaining_restarts == 0
    assert tr.count(AgentState.RESTARTING) == 2 and tr[-1] == AgentState.FAILED
    sup.control.close()


def test_resize_exit_does_not_consume_restarts(tmp_path):
    sup, fake, tr = make(tmp_path, [exited(RESIZE, -15)] * 5 + [exited(0, 0)], max_restarts=1)
    sup._loop()
    assert fake.calls == ["start"] + ["restart"] * 5 + ["exit_barrier"]
    assert fake.remaining_restarts == 1
    assert tr.count(AgentState.RESIZING) == 5 and AgentState.RESTARTING not in tr
    assert tr[-1] == AgentState.SUCCEEDED
    sup.control.close()


def test_scale_up_restarts_plain_workers_without_consuming(tmp_path):
    sup, fake, tr = make(tmp_path, [HEALTHY] * 3 + [exited(0)], waiting=[0, 1], max_restarts=0)
    sup._loop()
    assert fake.calls == ["start", "restart", "exit_barrier"]
    assert AgentState.RESIZING in tr
    sup.control.close()


def test_notice_terminates_plain_workers_and_leaves(tmp_path):
    sup, fake, tr = make(tmp_path, [HEALTHY] * 10)
    fake.on_poll = lambda n: sup.request_drain("aws", "termination", time.time() + 100) if n == 1 else None
    result = sup._loop()
    assert result.state.value == "SUCCEEDED"  # elastic's view; our outcome is STOPPED
    assert fake.calls == ["start", "terminate(7)", "leave", "stop"]  # leave first: the survivors go on at once
    assert tr[-2:] == [AgentState.DRAINING, AgentState.STOPPED]
    assert fake.store.check([DRAIN_KEY])  # peers learn why our workers went away
    assert sup._finish() == ExitCode.DRAINED and not fake.closed  # a drained node never closes the rendezvous


def test_drain_during_rendezvous_leaves_without_starting_workers(tmp_path):
    sup, fake, tr = make(tmp_path, [], abort_start=True)
    real_start = fake.start

    def start_interrupted_by_a_notice(expected=None):
        sup.request_drain("manual", "drain", time.time() + 30)  # lands while the join waits
        return real_start(expected)  # the adapter's join sees it and raises RendezvousAborted

    fake.start = start_interrupted_by_a_notice
    result = sup._loop()
    assert result.state.value == "SUCCEEDED"  # elastic's view of a planned leave
    assert tr[-1] == AgentState.STOPPED and AgentState.RUNNING not in tr
    assert fake.calls == ["start", "leave", "stop"]


def test_peer_drain_does_not_consume_restarts(tmp_path):
    sup, fake, tr = make(tmp_path, [exited(1), exited(0)], max_restarts=0)
    fake.store.add(DRAIN_KEY, 1)
    sup._loop()
    assert fake.calls == ["start", "restart", "exit_barrier"]
    sup.control.close()


def test_early_warning_asks_api_workers_for_one_checkpoint_and_stays(tmp_path):
    import socket

    sup, fake, tr = make(tmp_path, [HEALTHY] * 6 + [exited(0)])
    worker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    worker.connect(sup.control_path)
    from trainguard.contract.protocol import decode, encode

    assert not sup.checkpoint_supported()  # no worker has said Hello: a notice would drain at once
    worker.sendall(encode(Hello(rank=0, local_rank=0, pid=1234)))
    deadline = time.time() + 5
    while not sup.control.api_workers() and time.time() < deadline:
        time.sleep(0.01)
    assert sup.checkpoint_supported()  # a worker-API worker: a cloud notice can be trained through
    assert sup.request_checkpoint("aws_rebalance")
    sup._loop()
    worker.settimeout(1)
    data = b""
    try:
        while chunk := worker.recv(4096):
            data += chunk
    except TimeoutError:
        pass
    orders = [decode(line) for line in data.split(b"\n") if line]
    assert orders == [CheckpointNow(why="aws_rebalance")]  # one out-of-cycle checkpoint, asked once
    assert AgentState.DRAINING not in tr and tr[-1] == AgentState.SUCCEEDED
    worker.close()
    sup.control.close()


def test_success_closes_rendezvous(tmp_path):
    sup, fake, tr = make(tmp_path, [exited(0)])
    sup._loop()
    assert sup._finish() == 0 and fake.closed


@pytest.mark.parametrize("where", ["start", "restart"])
def test_a_node_joining_a_job_that_completed_exits_0_not_needed(tmp_path, where):
    """Issue 37: a spare whose agent was joining (or rejoining after a restart) when the other nodes
    finished and closed the rendezvous: exit 0 with one clear line, not supervisor_crashed / exit 1."""
    from structlog.testing import capture_logs
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    sup, fake, tr = make(tmp_path, [exited(1)] if where == "restart" else [])

    def closed(expected=None):
        fake.calls.append(where)
        raise RendezvousClosedError()

    setattr(fake, where, closed)
    with capture_logs() as logs:
        result = sup._loop()
    assert result.state.name == "SUCCEEDED"
    assert tr[-1] is AgentState.SUCCEEDED and "stop" in fake.calls
    lines = [e for e in logs if e["event"] == "job_already_complete"]
    assert len(lines) == 1 and "not needed" in lines[0]["effect"]
    assert sup._finish() == ExitCode.FINISHED == 0


def test_a_joiner_warming_up_learns_that_the_job_is_over_and_exits_0_not_needed(tmp_path):
    """Issue 37: the rendezvous closes while a joiner's standby workers warm up (seconds under load): it
    looks every second and ends then, not after its warm-up (an agent hosting the store waits for it)."""
    from structlog.testing import capture_logs

    sup, fake, tr = make(tmp_path, [])
    fake.start_standby = lambda: fake.calls.append("standby")
    fake.reform = lambda plan: fake.calls.append("reform")
    looks = []

    def peek():
        looks.append(time.monotonic())
        return Peek(round=1, complete=True, participants=("a",), waiting=0, this_node_participates=False,
                    closed=len(looks) >= 2)

    fake.peek = peek
    sup._should_warm_up = lambda: True
    with capture_logs() as logs:
        result = sup._loop()
    assert result.state.name == "SUCCEEDED" and fake.calls == ["standby", "stop"], fake.calls
    assert len(looks) == 2 and looks[1] - looks[0] >= 0.9  # one look a second, the second saw it closed
    assert [e["event"] for e in logs].count("job_already_complete") == 1
    assert sup._finish() == ExitCode.FINISHED == 0


@pytest.mark.parametrize("warm", [True, False])
def test_start_waits_hook_runs_once_after_a_joiners_standby_spawn_or_before_the_first_rendezvous(tmp_path, warm):
    """Issue 39: the daemon's informing start-up work (the foreign-runs scan, 0.4 s of a core) runs from
    ``on_start_waits``: a joiner calls it only once its standby workers are spawned (their warm-up is what the
    world waits for), any other node just before its first rendezvous; once, whatever happens after."""
    sup, fake, tr = make(tmp_path, [] if warm else [exited(0)])  # a cold start: its workers finish the job
    fake.start_standby = lambda: fake.calls.append("standby")
    fake.peek = lambda: Peek(round=1, complete=True, participants=("a",), waiting=0, this_node_participates=False,
                             closed=True)  # the job ends while the joiner warms: the quickest way out of its loop
    sup._should_warm_up = lambda: warm
    sup.on_start_waits = lambda: fake.calls.append("hook")
    sup._loop()
    if warm:
        assert fake.calls[:2] == ["standby", "hook"], fake.calls
    else:
        assert fake.calls[0] == "hook" and fake.calls[1] == "start", fake.calls
    assert fake.calls.count("hook") == 1 and sup.on_start_waits is None
    sup.control.close()


def test_a_node_that_leaves_to_rejoin_says_so_and_a_drained_one_does_not(tmp_path):
    """The rejoin mark keeps an agent that hosts the store from taking it away while this node warms up."""
    sup, fake, tr = make(tmp_path, [exited(1), exited(0)])
    fake.world = lambda: World(round=fake.round, group_rank=0, nodes=2, world_size=2, global_ranks=(0,))
    sup._loop()
    assert fake.left == [True] and fake.calls[-2:] == ["restart", "exit_barrier"], fake.calls
    sup.control.close()
    sup, fake, tr = make(tmp_path, [HEALTHY] * 3 + [exited(RESIZE)])
    sup.request_drain("manual", "drain", time.time() + 30)
    sup._loop()
    assert fake.left == [False]
    sup.control.close()


def test_a_failed_in_place_reformation_falls_back_to_a_restart_instead_of_crashing(tmp_path):
    """The rendezvous of an in-place re-formation raises (e.g. the store went away): the agent restarts
    the world from the last commit (a consumed restart), it does not crash on an illegal transition."""
    sup, fake, tr = make(tmp_path, [], max_restarts=2)

    def reform(plan):
        fake.calls.append("reform")
        raise ConnectionError("The connection to the C10d store has failed")

    fake.reform = reform
    sup.sm.to(AgentState.RENDEZVOUS)
    sup.sm.to(AgentState.RUNNING)
    assert sup._reform("drain") is None
    assert fake.calls == ["reform", "terminate(3)", "restart"]
    assert tr[-5:] == [AgentState.RESIZING, AgentState.RENDEZVOUS, AgentState.RESTARTING, AgentState.RENDEZVOUS,
                       AgentState.RUNNING], tr
    assert fake.remaining_restarts == 1
    sup.control.close()


def test_an_unreachable_store_is_logged_once_per_outage_not_per_poll(tmp_path):
    from structlog.testing import capture_logs

    sup, fake, tr = make(tmp_path, [HEALTHY] * 30 + [exited(0)])
    outage = iter([True] * 20 + [False] * 100)

    def nodes_waiting():
        if next(outage):
            raise ConnectionError("The connection to the C10d store has failed")
        return 0

    fake.nodes_waiting = nodes_waiting
    with capture_logs() as logs:
        sup._loop()
    events = [e["event"] for e in logs]
    assert events.count("rendezvous_store_unreachable") == 1, events
    back = [e for e in logs if e["event"] == "rendezvous_store_reachable"]
    assert len(back) == 1 and back[0]["failed_calls"] == 20, back
    sup.control.close()


@pytest.mark.parametrize("reason,seen", [
    ("member_lost", {"member_lost": True, "api_workers": True}),
    ("resize_overdue", {"asked": Asked.RESIZE, "resize_overdue": True, "api_workers": True}),
    ("scale_up", {"nodes_waiting": 1}),
])
def test_a_restart_whose_workers_may_be_blocked_stops_them_with_the_short_grace(tmp_path, reason, seen):
    """member_lost / resize_overdue restarts consume no restart, but the workers may sit in a collective
    with a vanished peer and never run their SIGTERM handler: they get workers.failure_stop_grace_s
    (3 s), not elastic's 30 s (chaos `sigkill_node @ allreduce` waited 32 s in that stop). A planned
    scale-up restart of running plain workers keeps elastic's stop (their handler may save)."""
    from trainguard.agent.decisions import Act, Observation, decide

    sup, fake, tr = make(tmp_path, [], max_restarts=2)
    sup.sm.to(AgentState.RENDEZVOUS)
    sup.sm.to(AgentState.RUNNING)
    obs = Observation(workers=WorkerStatus.HEALTHY, **seen)
    d = decide(obs)
    assert (d.act, d.reason, d.consume_restart) == (Act.RESTART, reason, False)
    assert sup._restart(d, obs) is None
    assert fake.calls == (["terminate(3)", "restart"] if reason != "scale_up" else ["restart"])
    assert fake.remaining_restarts == 2
    sup.control.close()


def test_workers_between_worlds_are_asked_back_not_killed_when_a_member_goes(tmp_path, monkeypatch):
    """A member of the round is gone while this node's worker was sent its new world but has not joined
    it (it still finishes the old world's save: chaos `drain @ restore`, rank 0's commit took 8 s). The
    agent asks it back (member_gone) but does not restart it after the grace period; once the worker
    says Joined, a member lost counts again (a worker inside a collective may be stuck for good)."""
    from trainguard.agent import supervisor as sup_mod
    from trainguard.contract.protocol import Joined

    monkeypatch.setattr(sup_mod, "MEMBER_LOST_GRACE_S", 0.05)
    sup, fake, _ = make(tmp_path, [])
    fake.peek = lambda: Peek(round=1, complete=True, participants=("a",), waiting=0, this_node_participates=True)
    world = World(round=1, group_rank=0, nodes=2, world_size=2, global_ranks=(0,), master_addr="127.0.0.1",
                  master_port=1, members=("a", "b"))
    sup._current = world
    sup._send_worlds(world)  # the worker is between worlds until it says Joined

    def lost():
        sup._member_check_at = 0.0
        return sup._member_lost(True)

    try:
        assert lost() is False and sup._member_lost_since is not None  # gone: asked back at once
        time.sleep(0.1)
        assert lost() is False  # past the grace, but between worlds: not restarted
        sup._on_control(Joined(rank=0, local_rank=0, round=1))
        assert lost() is True  # in its world now: the usual grace applies
    finally:
        sup.control.close()


@pytest.mark.parametrize("peek, lost", [
    (Peek(round=1, complete=True, participants=("a",), waiting=0, this_node_participates=True), False),
    # its keep-alive lapsed: the rendezvous removed it, and another node may hold a newer round
    (Peek(round=1, complete=True, participants=(), waiting=0, this_node_participates=False), True),
    (Peek(round=2, complete=True, participants=("b",), waiting=0, this_node_participates=False), True),
])
def test_a_world_of_one_notices_it_left_its_round(tmp_path, monkeypatch, peek, lost):
    """Seen with a 1 s x 2 keep-alive on a loaded machine: both nodes' keep-alives lapsed in turn, each
    formed a world of one and trained on alone, two worlds of one job; only worlds of 2+ were checked."""
    from trainguard.agent import supervisor as sup_mod

    monkeypatch.setattr(sup_mod, "MEMBER_LOST_GRACE_S", 0.0)
    sup, fake, _ = make(tmp_path, [])
    fake.peek = lambda: peek
    sup._current = World(round=1, group_rank=0, nodes=1, world_size=1, global_ranks=(0,), members=("a",))
    try:
        sup._member_check_at = 0.0
        sup._member_lost(True)
        time.sleep(0.01)
        assert sup._member_lost(True) is lost
    finally:
        sup.control.close()


class _KeyStore:
    def __init__(self, keys):
        self.keys = set(keys)

    def check(self, keys):
        return all(k in self.keys for k in keys)


@pytest.mark.parametrize("peek, api_rounds, warm", [
    # A running worker-API world (its round complete): warm up, then join as a planned change.
    (Peek(round=3, complete=True, participants=("a", "b"), waiting=0, this_node_participates=False), {3}, True),
    # A world of plain scripts: start the usual way.
    (Peek(round=3, complete=True, participants=("a", "b"), waiting=0, this_node_participates=False), set(), False),
    # A round forming after the world of round 3 (worker API) lost a member: warm up first, so that
    # the survivors do not wait for this node's cold start (the spot-trace replay's 2 s).
    (Peek(round=4, complete=False, participants=("a",), waiting=0, this_node_participates=False), {3}, True),
    # ... not when the world it replaces ran plain scripts, nor for the job's first round.
    (Peek(round=4, complete=False, participants=("a",), waiting=0, this_node_participates=False), set(), False),
    (Peek(round=0, complete=False, participants=(), waiting=0, this_node_participates=False), {0}, False),
    # This node is in the round already.
    (Peek(round=4, complete=False, participants=("n",), waiting=0, this_node_participates=True), {3, 4}, False),
])
def test_a_joiner_warms_up_for_a_running_or_re_forming_worker_api_world(tmp_path, peek, api_rounds, warm):
    from trainguard.agent.supervisor import WORKER_API_KEY

    sup, fake, _ = make(tmp_path, [])
    try:
        sup.reform_enabled = True
        fake.peek = lambda: peek
        fake.round_store = lambda r: _KeyStore({WORKER_API_KEY} if r in api_rounds else set())
        assert sup._should_warm_up() is warm
    finally:
        sup.control.close()


def _hang(node, rank=0):
    from trainguard.agent.hang import HangVerdict, RankView
    from trainguard.contract.protocol import Phase

    c = RankView(rank, node, 60, Phase.STEP, "train.py:80 main", 100.0, 100.0, 100.0)
    return HangVerdict(True, 7.0, 6.0, c, "heartbeat_stopped_first", False)


@pytest.mark.parametrize("act,restarts,outcome,calls", [
    ("end_workers", 2, AgentState.RUNNING, ["terminate(3)", "restart"]),
    ("end_workers", 0, AgentState.FAILED, ["stop"]),
    ("quarantine", 2, AgentState.STOPPED, ["leave", "stop"]),
])
def test_a_hang_here_is_dumped_killed_then_restarted_or_quarantined(tmp_path, monkeypatch, act, restarts, outcome, calls):
    """The culprit's agent: SIGUSR2 (stacks), SIGKILL, then a worker_hang restart; with no restart left
    it fails; a second hang within hang.quarantine_s leaves the job (exit 3, not restarted by systemd)."""
    import signal as sig

    from structlog.testing import capture_logs

    from trainguard.agent import supervisor as sv
    from trainguard.agent.decisions import Observation
    from trainguard.agent.hang import HangAct, HangAction
    from trainguard.contract.protocol import Phase, Progress

    kills = []
    monkeypatch.setattr(sv.os, "kill", lambda pid, s: kills.append((pid, s)))
    monkeypatch.setattr(sv.time, "sleep", lambda s: None)
    sup, fake, tr = make(tmp_path, [], max_restarts=restarts)
    sup.sm.to(AgentState.RENDEZVOUS)
    sup.sm.to(AgentState.RUNNING)
    sup.hangs.start_world(fake.store, fake.node_id, (fake.node_id,), thread=False)
    sup.hangs.on_progress(Progress(rank=0, local_rank=0, step=60, phase=Phase.STEP, beat=1, progress=1))
    with capture_logs() as logs:
        sup._on_hang(_hang(fake.node_id), HangAction(HangAct(act)),
                     Observation(workers=WorkerStatus.HEALTHY, remaining_restarts=restarts))
    assert kills == [(4242, sig.SIGUSR2), (4242, sig.SIGKILL)]
    assert sup.sm.state is outcome and [c for c in fake.calls if c in calls] == calls
    hung = [e for e in logs if e["event"] == "hang_detected"][0]
    assert (hung["rank"], hung["step"], hung["phase"], hung["action"]) == (0, 60, "step", act)
    if act == "quarantine":
        assert [e for e in logs if e["event"] == "node_quarantined"]
        assert sup._finish() == ExitCode.DRAINED == 3
    elif restarts:
        assert [e for e in logs if e["event"] == "state_change" and e["new"] == "restarting"][0]["reason"] == "worker_hang"
    sup.control.close()


def test_a_frozen_culprit_elsewhere_makes_this_node_abort_its_workers_collectives(tmp_path, monkeypatch):
    from structlog.testing import capture_logs

    from trainguard.agent import supervisor as sv
    from trainguard.agent.decisions import Observation
    from trainguard.agent.hang import HangAct, HangAction

    monkeypatch.setattr(sv.os, "kill", lambda pid, s: pytest.fail("nothing is killed here"))
    sup, fake, tr = make(tmp_path, [])
    sent = []
    monkeypatch.setattr(sup.control, "broadcast", lambda msg: sent.append(msg) or 1)
    with capture_logs() as logs:
        assert sup._on_hang(_hang("other_1_0"), HangAction(HangAct.ABORT, frozenset({"other_1_0"})),
                            Observation(workers=WorkerStatus.HEALTHY, remaining_restarts=2)) is None
    assert [type(m).__name__ for m in sent] == ["Abort"]
    assert [e for e in logs if e["event"] == "collectives_abort_requested"][0]["evict"] == ["other_1_0"]
    assert not fake.calls
    sup.control.close()
