"""Rendezvous handler construction from the ``rendezvous`` config section (public torch API only).

What a handler does once built — the interruptible join, the planned leave — lives in the elastic
adapter (:mod:`trainguard.agent.elastic`), the one module that touches torch elastic's internals.
"""

from __future__ import annotations

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


__all__ = ["build_handler"]
