"""Worker interpreters started before the agent's own imports, adopted by the node's first worker start.

A node's first workers used to start once the agent had imported torch and elastic, set up its services
and reached its first rendezvous (or, joining a running world, its standby start); then each imported
torch and the runtime again, one interpreter after the other: the bulk of a joining node's seconds
(``docs/benchmarks.md``, "A joining node's start-up"). With ``workers.prestart`` the agent's first act
after loading its config is to start one interpreter per local rank (:mod:`trainguard.runtime.warm`),
which imports ``workers.prestart_imports`` beside the agent's own start. When elastic then starts the
workers, :func:`take` hands each rank's interpreter to its subprocess handler instead of a new
process: the same pid, session and log files a fresh worker would have had, its final environment sent
over a socket pair.

The one safety rule (:func:`env_mismatch`): an interpreter is adopted only if the environment it was
started in equals the worker's final one in everything but the variables that name the worker's place
in its world (:func:`is_identity`: ranks, sizes, the master, ``TORCHELASTIC_*``, the runtime contract of
:class:`~trainguard.contract.protocol.RuntimeEnv`), which no import reads. Anything else different (a variable an import may have read) and it is ended,
``prestart_discarded`` names the variables, and the worker starts afresh. Spares not adopted by the first
start are ended then (:func:`close`); a restart later starts its workers the usual way.

Pure parts (:func:`spare_command`, :func:`spare_env`, :func:`env_mismatch`) beside the side effects
(:class:`Spare`, the module's pool). Imports no torch: :func:`start` runs before the agent imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

from trainguard.agent import workerenv
from trainguard.agent.config import TrainguardConfig
from trainguard.contract.log import get_logger
from trainguard.contract.protocol.env import RT_PREFIX
from trainguard.runtime.shim import SHIM_MODULE
from trainguard.runtime.warm import AGENT_PID_ENV, HEADER, IMPORTS_ENV

log = get_logger("trainguard.agent.prestart")

WARM_MODULE = "trainguard.runtime.warm"

IDENTITY_VARS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
"""elastic's per-start variables (``LocalElasticAgent._start_workers``): a worker's place in its world."""

IDENTITY_PREFIXES = ("TORCHELASTIC_", RT_PREFIX, "TRAINGUARD_PRESTART_")
"""elastic's run and restart variables, the agent's runtime contract, the prestart's own two."""


def is_identity(name: str) -> bool:
    """Whether ``name`` is set at the hand-over without having been read by an import."""
    return name in IDENTITY_VARS or name.startswith(IDENTITY_PREFIXES)


def env_mismatch(started: Mapping[str, str], final: Mapping[str, str]) -> list[str]:
    """The variables, not identity ones, that differ between the interpreter's start and the worker's
    final environment (set in one only, or to other values); empty: the interpreter may be adopted."""
    keys = set(started) | set(final)
    return sorted(k for k in keys if not is_identity(k) and started.get(k) != final.get(k))


def spare_program(worker_args: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """(python flags, program) of the shim command elastic would run (``-m trainguard.runtime.shim --
    [FLAGS] (SCRIPT | -m MODULE) ARGS``), or None when it is not a Python program of that form."""
    args = list(worker_args)
    if args[:3] != ["-m", SHIM_MODULE, "--"]:
        return None
    rest = args[3:]
    flags = []
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        if rest[0] not in ("-u", "-B", "-O", "-OO", "-s", "-E", "-I", "-b", "-bb", "-q"):
            return None  # a flag with a value, or one this launcher does not know: start it the usual way
        flags.append(rest.pop(0))
    if not rest or (rest[0] == "-m" and len(rest) < 2):
        return None
    return flags, rest


def spare_command(python: str, worker_args: Sequence[str], fd: int) -> list[str] | None:
    """The prestarted interpreter's command line for the worker command ``python worker_args``."""
    parsed = spare_program(worker_args)
    if parsed is None:
        return None
    flags, program = parsed
    return [python, *flags, "-m", WARM_MODULE, str(fd), "--", *program]


def spare_env(cfg: TrainguardConfig, inherited: Mapping[str, str], *, agent_pid: int) -> dict[str, str]:
    """The environment the interpreter starts in: what elastic's handler will give the worker (the
    agent's environment and the supervisor's worker variables) as far as it is known before the
    rendezvous, plus the prestart's own two variables."""
    w = cfg.workers
    env = dict(inherited)
    env.update(workerenv.AGENT_ENV)
    env.update(workerenv.worker_defaults(w, inherited))
    if cfg.metrics.enabled:
        from trainguard.metrics import channel

        env.update(channel.worker_env(os.path.join(cfg.agent.state_dir, cfg.agent.job_id)))
    env.update({k: str(v) for k, v in w.env.items()})
    env[IMPORTS_ENV] = " ".join(w.prestart_imports)
    env[AGENT_PID_ENV] = str(agent_pid)
    return env


class Spare:
    """One prestarted interpreter: its process, the agent's end of its socket, the worker command it stands
    for (elastic's ``(entrypoint, args)``) and the environment it started in."""

    def __init__(self, local_rank: int, worker: tuple[str, tuple[str, ...]], env: dict[str, str]) -> None:
        self.local_rank = local_rank
        self.worker = worker
        self.env = env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        try:
            command = spare_command(worker[0], worker[1], theirs.fileno())
            if command is None:
                raise ValueError(f"not a Python program of the shim's form: {worker}")
            self.proc = subprocess.Popen(command, env=env, pass_fds=(theirs.fileno(),), start_new_session=True,
                                         stdin=subprocess.DEVNULL)
        finally:
            theirs.close()

    def hand_over(self, final_env: Mapping[str, str], stdout: IO[Any] | None, stderr: IO[Any] | None) -> bool:
        """Send the worker's environment and its stdout/stderr; False if the interpreter is gone."""
        if self.proc.poll() is not None:
            return False
        body = json.dumps({"env": dict(final_env), "stdout": stdout is not None, "stderr": stderr is not None}).encode()
        fds = [f.fileno() for f in (stdout, stderr) if f is not None]
        try:
            socket.send_fds(self._sock, [HEADER.pack(len(body))], fds)
            self._sock.sendall(body)
        except OSError as e:
            log.warning("prestart_hand_over_failed", local_rank=self.local_rank, error=f"{type(e).__name__}: {e}")
            self.discard()
            return False
        finally:
            self._sock.close()
        return True

    def discard(self) -> None:
        """End the interpreter at once: none of the program has run in it (its session is SIGKILLed, so an
        import's helper process goes too; the socket closed, one between its imports and the hand-over
        exits 0 by itself). Never waits on a slow import: a refused interpreter must not delay the fresh
        worker that replaces it."""
        self._sock.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


_lock = threading.Lock()
_pool: dict[int, Spare] = {}


def start(cfg: TrainguardConfig, inherited: Mapping[str, str]) -> int:
    """Start one interpreter per local rank (``workers.prestart``); returns how many started."""
    w = cfg.workers
    if not w.prestart or w.no_python or not w.entrypoint:
        return 0
    worker = workerenv.worker_command(w)
    if spare_program(worker[1]) is None:
        log.info("prestart_skipped", reason="the worker command is not a plain script or module")
        return 0
    env = spare_env(cfg, inherited, agent_pid=os.getpid())
    with _lock:
        for rank in range(w.nproc_per_node):
            try:
                _pool[rank] = Spare(rank, worker, env)
            except OSError as e:
                log.warning("prestart_failed", local_rank=rank, error=f"{type(e).__name__}: {e}")
                break
        started = len(_pool)
    log.info("prestarted", workers=started, imports=list(w.prestart_imports))
    return started


def take(local_rank: int, entrypoint: str, args: Sequence[str], final_env: Mapping[str, str]) -> Spare | None:
    """The interpreter of ``local_rank`` if it may run this worker (the command it was started for, an
    environment that differs in identity variables only, still alive); a spare that may not is ended."""
    with _lock:
        spare = _pool.pop(local_rank, None)
    if spare is None:
        return None
    reason = ""
    if (entrypoint, tuple(args)) != spare.worker:
        reason = "the worker command changed"
    elif spare.proc.poll() is not None:
        reason = f"the interpreter exited ({spare.proc.returncode})"
    else:
        differ = env_mismatch(spare.env, final_env)
        if differ:
            reason = "environment differs: " + ", ".join(differ[:8]) + (" ..." if len(differ) > 8 else "")
    if reason:
        log.warning("prestart_discarded", local_rank=local_rank, reason=reason, effect="the worker starts afresh")
        spare.discard()
        return None
    return spare


def close(reason: str) -> None:
    """End every interpreter not adopted (the first start is over, or the agent stops)."""
    with _lock:
        left = list(_pool.values())
        _pool.clear()
    for spare in left:
        spare.discard()
    if left:
        log.info("prestart_closed", workers=len(left), reason=reason)


def pending() -> int:
    """Interpreters started and not yet adopted or ended."""
    with _lock:
        return len(_pool)
