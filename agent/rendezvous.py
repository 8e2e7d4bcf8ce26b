"""Rendezvous handler construction from the ``rendezvous`` config section (public torch API only).

What a handler does once built — the interruptible join, the planned leave — lives in the elastic
adapter (:mod:`trainguard.agent.elastic`), the one module that touches torch elastic's internals.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from trainguard.agent.config import RendezvousConfig
from trainguard.contract.configbase import ConfigError
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.rendezvous")


def build_handler(cfg: RendezvousConfig, run_id: str) -> RendezvousHandler:
    """Create the rendezvous handler for ``cfg``: torch's dynamic one, or with ``protocol: keyed`` (or ``auto``
    above 32 nodes: :func:`~trainguard.agent.config.resolve_protocol`) ours (:mod:`trainguard.agent.keyed_rendezvous`)."""
    if cfg.effective_protocol == "keyed":
        from trainguard.agent.keyed_stores import create_handler as create_keyed_handler

        return create_keyed_handler(cfg, run_id)
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


def store_to_reach(cfg: RendezvousConfig) -> tuple[str, int] | None:
    """(host, port) of a c10d store this agent connects to as a client (None: it hosts the store, or
    the backend is not c10d). Pure; the same rule as torch's (``is_host`` unset: host when the
    endpoint is an address of this machine)."""
    from trainguard.agent.preflight import is_local_address

    if cfg.backend != "c10d" or cfg.is_host is True:
        return None
    host, _, port = cfg.endpoint.rpartition(":")
    host = host.strip("[]")
    if cfg.is_host is None and is_local_address(host):
        return None
    return host, int(port)


def wait_for_store(cfg: RendezvousConfig, *, progress_every_s: float = 10.0,
                   connect: Callable[[tuple[str, int], float], Any] = socket.create_connection) -> None:
    """Before torch's handler connects: wait until the rendezvous store at ``rendezvous.endpoint``
    accepts a TCP connection, logging ``rendezvous_endpoint_unreachable`` every ``progress_every_s``,
    for at most ``rendezvous.join_timeout_s``; then raise one :class:`ConfigError` naming the endpoint
    and the fix (instead of torch's ``RendezvousConnectionError`` and its C++ frames, minutes later)."""
    target = store_to_reach(cfg)
    if target is None:
        return
    t0 = time.monotonic()
    deadline = t0 + cfg.join_timeout_s
    next_note = t0 + min(progress_every_s, cfg.join_timeout_s / 3)
    error = ""
    while True:
        try:
            connect(target, min(5.0, max(0.1, deadline - time.monotonic()))).close()
            if error:
                log.info("rendezvous_endpoint_reachable", endpoint=cfg.endpoint,
                         waited_s=round(time.monotonic() - t0, 1))
            return
        except OSError as e:
            error = e.strerror or str(e) or type(e).__name__
        now = time.monotonic()
        if now >= deadline:
            raise ConfigError(
                "rendezvous.endpoint", f"cannot reach the rendezvous store at {cfg.endpoint} ({error}) within "
                f"{cfg.join_timeout_s:g} s (rendezvous.join_timeout_s)",
                "check the host and port, and that `trainguard store` (or the agent that hosts the store) runs "
                "there and the port is open to this node", value=cfg.endpoint)
        if now >= next_note:
            log.warning("rendezvous_endpoint_unreachable", endpoint=cfg.endpoint, error=error,
                        waited_s=round(now - t0, 1), gives_up_in_s=round(deadline - now, 1),
                        fix="check rendezvous.endpoint (TRAINGUARD_RENDEZVOUS_ENDPOINT) and that the store runs")
            next_note = now + progress_every_s
        time.sleep(min(1.0, max(0.0, deadline - now)))


__all__ = ["build_handler", "store_to_reach", "wait_for_store"]
