"""The agent's process exit codes: how ``trainguard run`` / ``trainguard agent`` ended, for wrappers,
schedulers and systemd (``SuccessExitStatus=``). One pure function maps the outcome to a code.

===  ===========  ====================================================================================
0    finished     the job finished (the workers exited 0)
1    failed       the workers failed with no restarts left, or the agent itself failed
2    usage        bad config or command line (one ``trainguard: ...`` line on stderr names the fix)
3    drained      this node left the job on a drain (``trainguard drain``, a preemption notice); its
                  work is committed (or it had no worker-API workers to save); the job goes on
4    stopped      this node left the job on SIGTERM / SIGINT (``systemctl stop``, Ctrl-C), work
                  committed as for ``drained``; the job goes on
5    work lost    this node left (drain or stop), but its emergency checkpoint failed or missed the
                  deadline: the steps since the last commit are lost (the log line
                  ``checkpoint_not_saved`` names the storage error)
130  interrupted  a second Ctrl-C before the agent was up
===  ===========  ====================================================================================

Worker exit codes (75: "checkpoint committed, re-form me") are another contract,
:mod:`trainguard.contract.protocol`.
"""

from __future__ import annotations

import enum
import json
import os
from typing import Any

from trainguard.contract.protocol import AgentState, Committed


class ExitCode(enum.IntEnum):
    FINISHED = 0
    FAILED = 1
    USAGE = 2
    DRAINED = 3
    STOPPED = 4
    WORK_LOST = 5
    INTERRUPTED = 130

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")


STOP_KIND = "stop"
"""The notice kind of SIGTERM / SIGINT (:mod:`trainguard.agent.watchers.signals`)."""


def exit_code(outcome: AgentState, *, drain_kind: str | None, emergency_failed: bool) -> ExitCode:
    """The process exit code of an agent whose supervisor ended in ``outcome`` (a terminal state).

    ``drain_kind``: the kind of the notice that made the node leave (None: it left for no notice,
    e.g. the rendezvous closed); ``emergency_failed``: a worker reported that its emergency
    checkpoint was not saved because the save failed (not: because ``checkpoint.url`` is unset)."""
    if outcome is AgentState.SUCCEEDED:
        return ExitCode.FINISHED
    if outcome is AgentState.STOPPED:
        if emergency_failed:
            return ExitCode.WORK_LOST
        return ExitCode.STOPPED if drain_kind == STOP_KIND else ExitCode.DRAINED
    return ExitCode.FAILED


def not_saved_fields(msg: Committed, *, checkpoint_url: str) -> dict[str, Any]:
    """The fields of the agent's ``checkpoint_not_saved`` line for a worker's report that its
    checkpoint was not saved: what is lost, why, and the fix that matches the cause (the storage
    error is never reported as "checkpoint.url is unset" when it is set)."""
    lost = msg.step if msg.last_committed is None else msg.step - msg.last_committed
    if msg.error:
        fix = (f"the save to checkpoint.url ({checkpoint_url or 'unset'}) failed: {msg.error}; make the storage "
               "writable (mount, permissions, credentials in checkpoint.storage_options / "
               "TRAINGUARD_CHECKPOINT_STORAGE_OPTIONS) or give the drain more time (trainguard drain "
               "--deadline, preemption.default_deadline_s)")
    elif not checkpoint_url:
        fix = "set checkpoint.url (TRAINGUARD_CHECKPOINT_URL) so that drains save the work"
    else:
        fix = "the workers gave no reason: see the worker log (event checkpoint_failed) under agent.log_dir"
    return {
        "kind": msg.kind.value, "step": msg.step, "last_committed": msg.last_committed, "lost_steps": lost,
        "error": msg.error or None,
        "effect": "the workers stopped without a checkpoint of this step: the next start resumes from the "
                  "last committed step, or from step 0 when there is none",
        "fix": fix,
    }


def record_path(control_path: str) -> str:
    """Where an exiting agent leaves its outcome: beside its control socket, ``<job>.sock.exit.json``
    (read by ``trainguard drain --wait`` once the socket is gone; the next agent of the job replaces it)."""
    return control_path + ".exit.json"


def write_record(control_path: str, record: dict[str, Any]) -> None:
    """Write the outcome record atomically (temp file + rename); best effort, never raises."""
    path = record_path(control_path)
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def read_record(control_path: str, pid: int | None = None) -> dict[str, Any] | None:
    """The outcome record an agent left (of process ``pid`` when given), or None."""
    try:
        with open(record_path(control_path)) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or (pid is not None and rec.get("pid") != pid):
        return None
    return rec


__all__ = ["ExitCode", "exit_code", "not_saved_fields", "read_record", "record_path", "write_record"]
