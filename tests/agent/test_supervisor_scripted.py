"""The supervisor loop driven by scripted worker states: no processes, no rendezvous (elastic's TestAgent idea)."""

import time
from types import SimpleNamespace

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from trainguard.agent.configload import load_config
from trainguard.runtime.protocol import EXIT_RESIZE as RESIZE
from trainguard.agent.states import AgentState
from trainguard.agent.supervisor import Supervisor


class FakeHandler:
    def __init__(self, waiting=()):
        self.waiting = list(waiting)
        self.closed = False
        self._state_holder = SimpleNamespace(state=SimpleNamespace(round=0))

    def num_nodes_waiting(self):
        return self.waiting.pop(0) if self.waiting else 0

    def shutdown(self):
        self.closed = True
        return True


class FakeStore:
    def __init__(self):
        self.keys = {}

    def add(self, k, v):
        self.keys[k] = self.keys.get(k, 0) + v

    def check(self, ks):
        return all(k in self.keys for k in ks)


def failed(*codes):
    return RunResult(state=WorkerState.FAILED, failures={
        i: ProcessFailure(local_rank=i, pid=100 + i, exitcode=c, error_file="") for i, c in enumerate(codes)})


class ScriptedAgent:
    """Plays back a list of RunResults; records what the loop asked it to do."""

    def __init__(self, script, max_restarts=2, nproc=1):
        self.script = list(script)
        self._remaining_restarts = max_restarts
        self.calls = []
        self.wg = SimpleNamespace(spec=SimpleNamespace(local_world_size=nproc, monitor_interval=0.001),
                                  store=FakeStore(), group_rank=0, group_world_size=1, workers=[])
        self.on_monitor = None

    def get_worker_group(self):
        return self.wg

    def remaining_restarts(self):
        return self._remaining_restarts

    def _initialize_workers(self, wg):
        self.calls.append("init")

    def _restart_workers(self, wg):
        self.calls.append("restart")

    def _stop_workers(self, wg):
        self.calls.append("stop")

    def _exit_barrier(self):
        self.calls.append("exit_barrier")

    def terminate_workers(self, grace):
        self.calls.append(f"terminate({grace:.0f})")

    def _monitor_workers(self, wg):
        if self.on_monitor:
            self.on_monitor(len(self.calls))
        return self.script.pop(0) if self.script else RunResult(state=WorkerState.HEALTHY)


def make(tmp_path, script, waiting=(), **kw):
    cfg = load_config(None, {}, {"agent.state_dir": str(tmp_path / "s"), "agent.log_dir": str(tmp_path / "l"),
                                 "workers.entrypoint": "train.py", "workers.restart_backoff_s": "0.01",
                                 "rendezvous.backend": "static", "preemption.term_grace_s": "7"})
    transitions = []
    sup = Supervisor(cfg, handler=FakeHandler(waiting), listeners=[lambda old, new, d: transitions.append(new)])
    agent = ScriptedAgent(script, **kw)
    return sup, agent, transitions


def healthy(n=1):
    return [RunResult(state=WorkerState.HEALTHY)] * n


def test_crash_consumes_restarts_then_fails(tmp_path):
    sup, agent, tr = make(tmp_path, healthy(2) + [failed(1)] + healthy() + [failed(-9)] + [failed(1)], max_restarts=2)
    result = sup._loop(agent)
    assert result.state == WorkerState.FAILED
    assert agent.calls == ["init", "restart", "restart", "stop"]
    assert agent.remaining_restarts() == 0
    assert tr.count(AgentState.RESTARTING) == 2 and tr[-1] == AgentState.FAILED
    sup.control.close()


def test_resize_exit_does_not_consume_restarts(tmp_path):
    sup, agent, tr = make(tmp_path, [failed(RESIZE, -15)] * 5 + [RunResult(state=WorkerState.SUCCEEDED)], max_restarts=1, nproc=2)
    result = sup._loop(agent)
    assert result.state == WorkerState.SUCCEEDED
    assert agent.calls == ["init"] + ["restart"] * 5 + ["exit_barrier"]
    assert agent.remaining_restarts() == 1
    assert tr.count(AgentState.RESIZING) == 5 and AgentState.RESTARTING not in tr
    sup.control.close()


def test_scale_up_restarts_plain_workers_without_consuming(tmp_path):
    sup, agent, tr = make(tmp_path, healthy(3) + [RunResult(state=WorkerState.SUCCEEDED)], waiting=[0, 1], max_restarts=0)
    assert sup._loop(agent).state == WorkerState.SUCCEEDED
    assert agent.calls == ["init", "restart", "exit_barrier"]
    assert AgentState.RESIZING in tr
    sup.control.close()


def test_notice_terminates_plain_workers_and_leaves(tmp_path, monkeypatch):
    left = []
    monkeypatch.setattr("trainguard.agent.rendezvous.leave_rendezvous", lambda h, timeout_s: left.append(h) or True)
    sup, agent, tr = make(tmp_path, healthy(10))
    agent.on_monitor = lambda n: sup.request_drain("aws", "termination", time.time() + 100) if n == 1 else None
    result = sup._loop(agent)
    assert result.state == WorkerState.SUCCEEDED  # elastic's view; our outcome is STOPPED
    assert agent.calls == ["init", "terminate(7)", "stop"]
    assert left == [sup.handler]
    assert tr[-2:] == [AgentState.DRAINING, AgentState.STOPPED]
    assert agent.wg.store.check(["trainguard/draining"])  # peers learn why our workers went away
    assert sup._finish() == 0 and not sup.handler.closed  # a drained node never closes the rendezvous


def test_peer_drain_does_not_consume_restarts(tmp_path):
    sup, agent, tr = make(tmp_path, [failed(1), RunResult(state=WorkerState.SUCCEEDED)], max_restarts=0)
    agent.wg.store.add("trainguard/draining", 1)
    assert sup._loop(agent).state == WorkerState.SUCCEEDED
    assert agent.calls == ["init", "restart", "exit_barrier"]
    sup.control.close()


def test_success_closes_rendezvous(tmp_path):
    sup, agent, tr = make(tmp_path, [RunResult(state=WorkerState.SUCCEEDED)])
    sup._loop(agent)
    assert sup._finish() == 0 and sup.handler.closed
