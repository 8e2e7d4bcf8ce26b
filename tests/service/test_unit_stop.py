"""``systemctl stop trainguard-agent`` on one node of a running job, with the shipped unit's exact kill
semantics: the agent drains, its workers get the drain (here a plain gloo script: SIGTERM *from the
agent*, with ``preemption.term_grace_s``), and the other node sees a *planned* leave (no restart spent).

systemd is not PID 1 in CI containers, so ``systemd-run`` cannot start a unit; instead :func:`stop`
applies what ``systemd.kill(5)`` documents for the unit's ``KillMode=``/``KillSignal=``/
``TimeoutStopSec=``/``SendSIGKILL=`` to the agent's process tree (its cgroup):

* ``control-group``: ``KillSignal`` to every process of the cgroup at once;
* ``mixed``: ``KillSignal`` to the main process only;
* ``process``: ``KillSignal`` to the main process only; ``none``: nothing;
* then, after ``TimeoutStopSec``, ``SIGKILL`` to what is left (main only for ``process``) when
  ``SendSIGKILL=yes``.

The values are read from ``systemd/trainguard-agent.service``, so changing the unit changes what
this test does: with ``control-group`` systemd itself SIGTERMs the worker (the probe script records
the sender's pid) before the agent can drain, and the test fails.
"""

from __future__ import annotations

import configparser
import json
import os
import signal
import time

import pytest

from tests.harness import REPO, Node, alive, children, free_port, wait_listening, wait_until
from trainguard.agent.exitcodes import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
GRACE_S = 5


def unit_kill_settings() -> dict[str, str]:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read(os.path.join(REPO, "systemd", "trainguard-agent.service"))
    s = cp["Service"]
    return {"KillMode": s.get("KillMode", "control-group"), "KillSignal": s.get("KillSignal", "SIGTERM"),
            "TimeoutStopSec": s.get("TimeoutStopSec", "90"), "SendSIGKILL": s.get("SendSIGKILL", "yes")}


def cgroup(main_pid: int) -> list[int]:
    """The main process and all its descendants (what the unit's cgroup holds)."""
    out, todo = [], [main_pid]
    while todo:
        p = todo.pop()
        if alive(p):
            out.append(p)
            todo += children(p)
    return out


def first_signal_targets(kill_mode: str, main_pid: int) -> list[int]:
    """Pure: who gets ``KillSignal`` when the unit stops (``systemd.kill(5)``)."""
    if kill_mode == "control-group":
        return cgroup(main_pid)
    if kill_mode in ("mixed", "process"):
        return [main_pid]
    if kill_mode == "none":
        return []
    raise ValueError(f"unknown KillMode {kill_mode!r}")


def stop(main_pid: int, settings: dict[str, str], wait_main) -> tuple[float, list[int]]:
    """Stop like systemd: returns (seconds until the main process exited, pids SIGKILLed at the end)."""
    sig = signal.Signals[settings["KillSignal"]]
    timeout = float(settings["TimeoutStopSec"].rstrip("s"))
    t0 = time.monotonic()
    for pid in first_signal_targets(settings["KillMode"], main_pid):
        os.kill(pid, sig)
    exited = wait_main(timeout)
    took = time.monotonic() - t0
    killed: list[int] = []
    if settings["SendSIGKILL"] == "yes":
        rest = cgroup(main_pid) if settings["KillMode"] != "process" else [main_pid]
        for pid in rest:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    assert exited or killed, "main process neither exited nor was killed"
    return took, killed


def test_first_signal_targets_follow_systemd_kill():
    me = os.getpid()
    assert first_signal_targets("mixed", me) == [me] and first_signal_targets("process", me) == [me]
    assert first_signal_targets("none", me) == []
    assert me in first_signal_targets("control-group", me)


def test_systemctl_stop_drains_the_node_and_the_peer_sees_a_planned_leave(tmp_path):
    settings = unit_kill_settings()
    tmp = str(tmp_path)
    script = os.path.join(os.path.dirname(__file__), "_sigterm_probe.py")
    record = os.path.join(tmp, "sigterm.jsonl")
    args = [record]
    common = ["--set", f"preemption.term_grace_s={GRACE_S}", "--set", "preemption.signal_deadline_s=60"]
    ep = f"127.0.0.1:{free_port()}"
    a = Node("a", tmp, ep, script=script, script_args=args, extra=common)
    nodes = [a]
    try:
        wait_listening(ep)  # a hosts the store; b is the node that is stopped
        b = Node("b", tmp, ep, script=script, script_args=args, extra=common)
        nodes.append(b)
        wait_until(lambda: [e["world_size"] for e in a.events("rendezvous_complete")][-1:] == [2]
                   and [e["world_size"] for e in b.events("rendezvous_complete")] == [2], 90, "world size 2")
        wait_until(lambda: any(e["world_size"] == 2 for e in a.events("train_step") + b.events("train_step")), 90,
                   "training at world size 2")
        (worker,) = b.worker_pids()

        took, killed = stop(b.pid, settings, lambda t: _wait(b, t))

        assert not killed, f"systemd would have SIGKILLed {killed}: the drain did not finish in TimeoutStopSec"
        assert b.proc.returncode == ExitCode.STOPPED, b.dump()
        assert took < float(settings["TimeoutStopSec"])
        # the agent, not systemd, stopped the worker: a notice, then SIGTERM with the configured grace
        [drain] = b.events("drain_started")
        assert drain["source"] == "signal"
        [term] = b.events("workers_terminating")
        assert term["reason"] == "notice" and term["grace_s"] == GRACE_S, term
        log = "\n".join(b.lines())
        assert term["pids"] == [worker], term  # SIGTERMed by the agent (torch's own line is dropped on a drain)
        assert "forcefully exiting" not in log  # it died of the SIGTERM, within the grace
        wait_until(lambda: not alive(worker), 10, "b's worker gone")
        with open(record) as fh:
            got = [json.loads(line) for line in fh]
        senders = {r["sender"] for r in got if r["pid"] == worker}
        assert senders == {b.pid}, f"b's worker got SIGTERM from {senders}, not from its agent {b.pid}"
        assert [e["new"] for e in b.events("state_change")][-2:] == ["draining", "stopped"]
        # the peer: a planned leave (the drain key), re-formed at 1 without spending a restart
        wait_until(lambda: [e["world_size"] for e in a.events("rendezvous_complete")][-1:] == [1], 60, "a at world 1")
        assert "peer_drain" in [e["reason"] for e in a.events("decision")], a.dump()
        assert not [e for e in a.events("state_change") if e["new"] == "restarting"]
        print(f"stop_s={took:.1f} kill_mode={settings['KillMode']}")
    except AssertionError:
        print(*(n.dump(60) for n in nodes), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()


def _wait(node: Node, timeout: float) -> bool:
    try:
        node.wait(timeout)
        return True
    except Exception:
        return False
