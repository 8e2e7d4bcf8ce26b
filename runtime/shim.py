"""Orphan safety: the first code every worker process runs.

``python -m trainguard.runtime.shim [--no-python] -- ARGV...``

torch.distributed.elastic starts workers in their own session (``start_new_session=True``), so when
an agent is SIGKILLed nothing reaches them and they train on at the old world size. The shim asks
the kernel for ``PR_SET_PDEATHSIG = SIGKILL`` (delivered when the thread that started us dies; the
agent starts workers from its long-lived supervisor thread), checks that the agent has not already
died in between (``getppid()`` against :attr:`RuntimeEnv.agent_pid <trainguard.contract.protocol.RuntimeEnv.agent_pid>`), then ``exec``s the real worker.
The setting survives ``execve`` of non-setuid programs. systemd's final SIGKILL of the unit's cgroup
(``KillMode=mixed``, at the end of ``TimeoutStopSec``) is the second line of defence.

The shim also sets SIGUSR1 to ignored (inherited across ``exec``): Slurm delivers ``--signal=USR1@s``
and ``scancel --signal=USR1`` to every process of a job step, workers included, and SIGUSR1's default
action ends the process. The notice is the agent's to act on (``preemption.sigusr1``); a worker ending
on it would count as a crash. A script that installs its own SIGUSR1 handler still gets the signal.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from trainguard.contract.protocol import RuntimeEnv

PR_SET_PDEATHSIG = 1

SHIM_MODULE = "trainguard.runtime.shim"
"""The module elastic starts every worker through (``python -m trainguard.runtime.shim -- ...``)."""


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent (thread) dies. False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    no_python = False
    if argv and argv[0] == "--no-python":
        no_python, argv = True, argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.exit("worker_shim: nothing to run (usage: python -m trainguard.runtime.shim [--no-python] -- ARGV...)")
    set_parent_death_signal(signal.SIGKILL)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    expected = RuntimeEnv.from_env().agent_pid
    if expected is not None and os.getppid() != expected:
        sys.exit(f"worker_shim: the agent (pid {expected}) died before this worker started")
    if no_python:
        os.execvp(argv[0], argv)
    os.execv(sys.executable, [sys.executable, *argv])


if __name__ == "__main__":
    main()
