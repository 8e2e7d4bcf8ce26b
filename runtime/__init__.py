"""trainguard.runtime: what runs inside the training process.

* :class:`Runtime` (:mod:`trainguard.runtime.runtime`) — the worker API: ``from trainguard.runtime
  import Runtime``, a facade over its parts: :mod:`~trainguard.runtime.state` (the worker's state and
  its transitions), :mod:`~trainguard.runtime.agreement` (the step agreement) with
  :mod:`~trainguard.runtime.boundary` (its flags and the pure boundary decision),
  :mod:`~trainguard.runtime.reformation` (park, join, live-state hand-over) over
  :mod:`~trainguard.runtime.reform` (process groups), :mod:`~trainguard.runtime.session` (the agent
  session: link, SIGTERM, reports, the exit), :mod:`~trainguard.runtime.tiers` (the checkpoint tiers
  of one world), :mod:`~trainguard.runtime.groups` (the first world, the side groups),
  :mod:`~trainguard.runtime.stepend` (the end of a step: the boundary decision carried out),
  :mod:`~trainguard.runtime.stopping` (a stop: its checkpoint, report, park or exit),
  :mod:`~trainguard.runtime.liveness` (hang detection's heartbeats) and
  :mod:`~trainguard.runtime.finishing` (the end of training);
* :mod:`~trainguard.runtime.cursor` — the global sample cursor (exact data position at any world size);
* :mod:`~trainguard.runtime.link` — the worker's end of the agent's control socket;
* :mod:`~trainguard.runtime.shim` — orphan safety, the first code every worker process runs.

The contract both ends share (protocol, log, config base) lives in the leaf package
:mod:`trainguard.contract`, below every other package.

``Runtime`` is imported lazily (PEP 562), so the agent's worker launcher
(:mod:`~trainguard.runtime.shim`) starts without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.runtime.runtime import Runtime

__all__ = ["Runtime"]


def __getattr__(name: str) -> Any:
    if name == "Runtime":
        from trainguard.runtime.runtime import Runtime

        return Runtime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
