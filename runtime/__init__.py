"""trainguard.runtime: what runs inside the training process, and the leaf modules both ends share.

* :class:`Runtime` (:mod:`trainguard.runtime.runtime`) — the worker API: ``from trainguard.runtime
  import Runtime``;
* :mod:`~trainguard.runtime.cursor` — the global sample cursor (exact data position at any world size);
* :mod:`~trainguard.runtime.link` — the worker's end of the agent's control socket;
* :mod:`~trainguard.runtime.shim` — orphan safety, the first code every worker process runs.

Leaf modules, importing nothing of trainguard (so ``checkpoint``, ``strategies``, ``metrics`` and the
agent may all import them without a cycle): :mod:`~trainguard.runtime.protocol` (the worker <-> agent
<-> CLI contract), :mod:`~trainguard.runtime.log` (structlog set-up) and
:mod:`~trainguard.runtime.configbase` (typed config building blocks).

``Runtime`` is imported lazily (PEP 562), so importing a leaf module never loads torch.
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
