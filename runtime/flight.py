"""The flight recorder's trace, dumped by the worker itself (issue 35, item 10).

torch records every collective of every process group of the process in one ring buffer (its size:
``TORCH_FR_BUFFER_SIZE``, or ``TORCH_NCCL_TRACE_BUFFER_SIZE``; the agent gives workers 2000 unless
set, :func:`trainguard.agent.workerenv.gpu_defaults`). torch's own dump (on a watchdog timeout, or
through ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``) is run by the heartbeat monitor of the process's *first*
NCCL group only: after an in-place re-formation the default group is a new one and nothing dumps. So
the worker dumps when it parks for a lost peer (before the abort clears the groups), to torch's own
file name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (default ``/tmp/nccl_trace_rank_``) + ``<rank>``, with the
world's ordinal appended: ``.../nccl_trace_rank_3.world-2``. The records of all worlds of the
process are in it (each names its group); the newest are this world's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch

DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"


def _dumper() -> Callable[[], bytes] | None:
    c10d = torch._C._distributed_c10d
    return getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)


def trace_path(env: Mapping[str, str], rank: int, world: int) -> str:
    """Pure: where this rank's dump of ``world`` (0: the process's first world) goes."""
    return f"{env.get('TORCH_NCCL_DEBUG_INFO_TEMP_FILE') or DEFAULT_PREFIX}{rank}.world-{world}"


def dump(rank: int, world: int, env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """Write the flight recorder's trace (torch's pickle format, readable by ``torch.distributed.flight_recorder``
    tools) to :func:`trace_path`; returns ``(path, bytes)``, or None when torch records nothing (buffer
    size 0, or a build without it). Never raises: a dump is evidence, not a step of the recovery."""
    fn = _dumper()
    if fn is None:
        return None
    try:
        raw = fn()
        import pickle

        if not pickle.loads(raw).get("entries"):
            return None
        path = trace_path(os.environ if env is None else env, rank, world)
        with open(path, "wb") as f:
            f.write(raw)
        return path, len(raw)
    except Exception:  # noqa: BLE001 - see the docstring
        return None


__all__ = ["DEFAULT_PREFIX", "dump", "trace_path"]
