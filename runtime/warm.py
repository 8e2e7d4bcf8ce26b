"""A prestarted worker interpreter: imports first, its program once the agent hands it over.

``python [FLAGS] -m trainguard.runtime.warm FD -- (SCRIPT | -m MODULE) ARGS...``

The agent starts one of these per local rank before its own imports (:mod:`trainguard.agent.prestart`).
It does what :mod:`~trainguard.runtime.shim` does for a worker (``PR_SET_PDEATHSIG = SIGKILL``, SIGUSR1
ignored, the agent checked alive), imports the modules named in ``TRAINGUARD_PRESTART_IMPORTS`` (torch, the
runtime: the bulk of a worker's start-up), then waits on the socket ``FD`` for its hand-over: the
worker's final environment and the stdout/stderr it would have been started with (file descriptors passed
over the socket). It replaces its environment with that one, points fds 1 and 2 at those files, and runs
the program in this process as ``python SCRIPT ARGS`` / ``python -m MODULE ARGS`` would (``__main__``,
``sys.argv``, ``sys.path[0]``). End of file on the socket instead (the agent did not need it): it exits 0.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import socket
import struct
import sys

from trainguard.runtime.shim import set_parent_death_signal

IMPORTS_ENV = "TRAINGUARD_PRESTART_IMPORTS"
"""Space-separated module names the interpreter imports before its hand-over."""

AGENT_PID_ENV = "TRAINGUARD_PRESTART_AGENT_PID"
"""The agent that started the interpreter (checked against ``getppid()``, as the shim does)."""

HEADER = struct.Struct("!I")
"""The hand-over: the length of its JSON body, sent with the stdout/stderr descriptors."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"hand-over cut after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def receive(sock: socket.socket) -> tuple[dict[str, object], list[int]] | None:
    """The hand-over message and the descriptors that came with it; None at end of file."""
    data, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, 2)
    if not data:
        return None
    if len(data) < HEADER.size:
        data += _recv_exact(sock, HEADER.size - len(data))
    (n,) = HEADER.unpack(data)
    return json.loads(_recv_exact(sock, n)), list(fds)


def preload(names: list[str]) -> list[str]:
    """Import ``names``; return those that failed (the program imports what it needs itself)."""
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an optimisation only: report and go on
            failed.append(name)
            print(f"trainguard prestart: importing {name} failed ({type(e).__name__}: {e}); the worker imports "
                  "what it needs itself", file=sys.stderr, flush=True)
    return failed


def _agent_alive(expected: str | None) -> bool:
    return not expected or os.getppid() == int(expected)


def run_program(program: list[str]) -> None:
    """Run ``program`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``) in this process as python's command line would."""
    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]  # runpy puts the module's file in argv[0]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        return
    script = program[0]
    sys.argv = list(program)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.exit("trainguard prestart: usage: python -m trainguard.runtime.warm FD -- (SCRIPT | -m MODULE) ARGS...")
    fd, program = int(argv[0]), argv[2:]
    set_parent_death_signal(signal.SIGKILL)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    expected = os.environ.get(AGENT_PID_ENV)
    if not _agent_alive(expected):
        os._exit(0)
    sock = socket.socket(fileno=fd)
    preload(os.environ.get(IMPORTS_ENV, "").split())
    try:
        got = receive(sock)
    except (OSError, EOFError, ValueError):
        got = None
    if got is None or not _agent_alive(expected):
        os._exit(0)  # not needed (or the agent is gone): nothing of the program ran
    msg, fds = got
    sock.close()
    env = msg["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for target, name in ((1, "stdout"), (2, "stderr")):
        if msg.get(name):
            fd_in = fds.pop(0)
            os.dup2(fd_in, target)
            os.close(fd_in)
    run_program(program)


if __name__ == "__main__":
    main()
