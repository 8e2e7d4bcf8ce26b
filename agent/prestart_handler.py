"""elastic's subprocess handler, handed a prestarted interpreter where there is one (:mod:`trainguard.agent.prestart`).

torch's ``SubprocessContext`` builds one ``SubprocessHandler`` per local rank through
``torch.distributed.elastic.multiprocessing.api.get_subprocess_handler``; :func:`install` replaces that
name with :func:`handler`, which asks the pool for the rank's interpreter. The handler opens the log
files as torch's does; its ``_popen`` hands them and the worker's environment to the interpreter and
returns the interpreter's ``Popen``, so elastic waits on, signals (``killpg``: the interpreter leads a
session of its own, as a fresh worker does) and reads the exit code of the same process as ever.
"""

from __future__ import annotations

import os
from subprocess import Popen
from typing import Any

import torch.distributed.elastic.multiprocessing.api as _mp_api
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from trainguard.agent import prestart
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.prestart")

TORCH_GET_HANDLER = _mp_api.get_subprocess_handler
"""torch's own factory, as this module found it."""


class PrestartedHandler(SubprocessHandler):
    """A ``SubprocessHandler`` whose process is a prestarted interpreter (a fresh one if it is refused)."""

    def __init__(self, spare: prestart.Spare, **kwargs: Any) -> None:
        self._spare = spare
        super().__init__(**kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> Popen:  # See base class.
        spare, self._spare = self._spare, None
        if spare is not None and spare.hand_over(env, self._stdout, self._stderr):
            log.info("prestart_adopted", local_rank=self.local_rank_id, pid=spare.proc.pid)
            return spare.proc
        if spare is not None:
            spare.discard()
        return super()._popen(args, env)


def handler(entrypoint: str, args: tuple, env: dict[str, str], stdout: str, stderr: str, local_rank_id: int,
            numa_options: Any = None) -> SubprocessHandler:
    """``get_subprocess_handler`` with the pool asked first (not under NUMA binding, which wraps the command)."""
    kwargs = dict(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                  local_rank_id=local_rank_id, numa_options=numa_options)
    if numa_options is None and prestart.pending():
        final = {**os.environ, **env}  # what SubprocessHandler gives the process
        spare = prestart.take(local_rank_id, entrypoint, tuple(str(a) for a in args), final)
        if spare is not None:
            return PrestartedHandler(spare, **kwargs)
    return TORCH_GET_HANDLER(**kwargs)


def install() -> None:
    """Route elastic's worker starts through :func:`handler` (idempotent)."""
    _mp_api.get_subprocess_handler = handler
