"""Exit codes of the agent process and the lost-work line (issue 43, item 1): pure tables, and the
supervisor's outcome when an API worker reports that its emergency checkpoint failed."""

import time

import pytest
import structlog

from tests.agent.test_supervisor_scripted import HEALTHY, exited, make  # imports the supervisor: its env var
from trainguard.agent.exitcodes import ExitCode, exit_code, not_saved_fields
from trainguard.contract.protocol import EXIT_RESIZE, AgentState, CheckpointKind, Committed, Hello

S = AgentState


@pytest.mark.parametrize("outcome, kind, failed, code", [
    (S.SUCCEEDED, None, False, ExitCode.FINISHED),
    (S.FAILED, None, False, ExitCode.FAILED),
    (S.FAILED, "drain", True, ExitCode.FAILED),  # a failed job stays "failed", whatever else went wrong
    (S.STOPPED, "drain", False, ExitCode.DRAINED),  # trainguard drain
    (S.STOPPED, "termination", False, ExitCode.DRAINED),  # a cloud notice
    (S.STOPPED, "preempt", False, ExitCode.DRAINED),  # SIGUSR1 (Slurm)
    (S.STOPPED, "stop", False, ExitCode.STOPPED),  # SIGTERM / SIGINT
    (S.STOPPED, "drain", True, ExitCode.WORK_LOST),
    (S.STOPPED, "stop", True, ExitCode.WORK_LOST),
])
def test_exit_code_table(outcome, kind, failed, code):
    assert exit_code(outcome, drain_kind=kind, emergency_failed=failed) is code


def test_exit_codes_are_distinct_and_documented():
    from trainguard.agent import exitcodes

    assert len({int(c) for c in ExitCode}) == len(ExitCode)
    for c in ExitCode:  # the module's table is what docs/operations.md copies
        assert f"\n{int(c):<5}{c.label}" in exitcodes.__doc__, c
    with open("docs/operations.md") as fh:
        ops = fh.read()
    for c in ExitCode:
        assert f"| {int(c)} | {c.label} |" in ops, c


def _msg(**kw):
    return Committed(step=637, kind=CheckpointKind.EMERGENCY, rank=0, saved=False, **kw)


@pytest.mark.parametrize("msg, url, fix_has, fix_lacks", [
    (_msg(last_committed=600, error="OSError: [Errno 30] Read-only file system: '/ckpt/j/step-637'"), "file:///ckpt",
     ["Read-only file system", "file:///ckpt", "writable"], ["set checkpoint.url"]),
    (_msg(), "", ["set checkpoint.url (TRAINGUARD_CHECKPOINT_URL)"], []),
    (_msg(last_committed=600), "file:///ckpt", ["worker log", "checkpoint_failed"], ["set checkpoint.url"]),
])
def test_not_saved_names_the_cause(msg, url, fix_has, fix_lacks):
    f = not_saved_fields(msg, checkpoint_url=url)
    assert f["lost_steps"] == (637 if msg.last_committed is None else 37)
    for s in fix_has:
        assert s in f["fix"], f
    for s in fix_lacks:
        assert s not in f["fix"], f
    assert bool(f["error"]) == bool(msg.error)


def test_committed_error_crosses_the_wire():
    from trainguard.contract.protocol import decode, encode

    m = _msg(error="StorageError: PermissionError: denied")
    assert decode(encode(m)) == m


def test_a_failed_emergency_checkpoint_makes_the_agent_exit_work_lost(tmp_path):
    sup, fake, tr = make(tmp_path, [HEALTHY] * 3 + [exited(EXIT_RESIZE)] * 3)
    sup.control.api_workers = lambda: [Hello(rank=0, local_rank=0, pid=1)]

    def on_poll(n):
        if n == 1 and sup.drain is None:
            sup.request_drain("manual", "drain", time.time() + 100)
        if sup._asked == "drain" and not sup._emergency_committed:
            for rank in (0, 1):  # every rank reports; the agent says it once
                sup._on_control(Committed(step=637, kind=CheckpointKind.EMERGENCY, rank=rank, saved=False,
                                          last_committed=600, error="OSError: [Errno 30] Read-only file system"))

    fake.on_poll = on_poll
    with structlog.testing.capture_logs() as logs:
        sup._loop()
        code = sup._finish()
    assert code == ExitCode.WORK_LOST == 5
    [line] = [e for e in logs if e["event"] == "checkpoint_not_saved"]
    assert "Read-only file system" in line["fix"] and "set checkpoint.url" not in line["fix"]
    [bye] = [e for e in logs if e["event"] == "agent_exit"]
    assert bye["exit_code"] == 5 and bye["log_level"] == "error" and "Read-only" in bye["error"]
