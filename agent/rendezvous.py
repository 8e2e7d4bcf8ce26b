"""Rendezvous handler construction and the planned leave.

``DynamicRendezvousHandler.shutdown()`` *closes* the rendezvous for every node. A node that leaves
because it is preempted must only leave the participant set: :func:`leave_rendezvous` runs the
handler's exit operation (the first half of ``next_rendezvous``) and stops its heartbeats. When the
last participant of a completed round has left, the round advances and the survivors, already
waiting in their own ``next_rendezvous``, form the next one at once: no keep-alive expiry and no
``last_call`` wait for the departed node.
"""

from __future__ import annotations

import time
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from trainguard.agent.config import RendezvousConfig
from trainguard.runtime.log import get_logger

log = get_logger("trainguard.agent.rendezvous")


def build_handler(cfg: RendezvousConfig, run_id: str) -> RendezvousHandler:
    """Create the torch elastic rendezvous handler for ``cfg``."""
    extra: dict[str, Any] = {
        "join_timeout": cfg.join_timeout_s,
        "last_call_timeout": cfg.last_call_timeout_s,
        "close_timeout": cfg.close_timeout_s,
        "keep_alive_interval": cfg.keep_alive_interval_s,
        "keep_alive_max_attempt": cfg.keep_alive_max_attempts,
    }
    if cfg.backend == "c10d" and cfg.is_host is not None:
        # Left unset, torch hosts the store if the endpoint is this machine and falls back to being a
        # client when another local agent already hosts it; an explicit value disables that fallback.
        extra["is_host"] = cfg.is_host
    if cfg.backend == "static":
        extra = {"rank": 0}
    params = RendezvousParameters(
        backend=cfg.backend,
        endpoint=cfg.endpoint,
        run_id=run_id,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        local_addr=cfg.local_addr or None,
        **extra,
    )
    if cfg.backend == "etcd":  # etcd v3 with TLS and auth: our backend, torch's dynamic rendezvous
        from trainguard.agent.etcd_rendezvous import create_handler as create_etcd_handler

        return create_etcd_handler(cfg, params)
    return rdzv_registry.get_rendezvous_handler(params)


def current_round(handler: RendezvousHandler) -> int:
    """The rendezvous round this node last joined (the checkpoint fence); -1 if unknown."""
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    return int(getattr(state, "round", -1))


def leave_rendezvous(handler: RendezvousHandler, timeout_s: float = 10.0) -> bool:
    """Leave the participant set without closing the rendezvous. Returns whether it was done.

    Uses the handler's private exit operation (verified against torch 2.13's
    ``dynamic_rendezvous.py``); a handler without one (static) has nothing to leave.
    """
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp
    except ImportError:  # pragma: no cover - torch layout changed
        log.warning("rendezvous_leave_unsupported", reason="no _RendezvousExitOp in this torch")
        return False
    executor = getattr(handler, "_op_executor", None)
    if executor is None:
        return False
    stop = getattr(handler, "_stop_heartbeats", None)
    if stop is not None:
        stop()
    started = time.monotonic()
    executor.run(_RendezvousExitOp(), time.monotonic() + timeout_s)
    log.info("rendezvous_left", seconds=round(time.monotonic() - started, 3))
    return True


__all__ = ["build_handler", "current_round", "leave_rendezvous"]
