"""The keyed rendezvous handler on its store: on a ``TCPStore`` (``trainguard store``, or this agent's own) with
every call bounded and its connection renewed, or on etcd v3; and the handler for a ``rendezvous`` config
(:func:`create_handler`, what :func:`trainguard.agent.rendezvous.build_handler` calls for ``keyed``)."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainguard.agent import storecall
from trainguard.agent.config import etcd_keep_alive_advice
from trainguard.agent.keyed_rendezvous import KeyedRendezvousHandler
from trainguard.agent.membership import Settings, buckets_for
from trainguard.agent.membership_kv import Kv
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.rendezvous")


def tcp_handler(cfg: Any, run_id: str, *, host: str, port: int, timeout_s: float = 60.0,
                is_host: bool = False) -> KeyedRendezvousHandler:
    """The keyed handler on a ``TCPStore`` at ``host:port`` (``trainguard store``, or this agent's own
    when ``is_host``): two connections, one for the handler's calls and the round stores, one for the
    heartbeat thread. Every call on them gives up after ``keep_alive_interval_s x keep_alive_max_attempts``
    (:func:`~trainguard.agent.storecall.call_bound_s`, issue 37's bound for ``dynamic``) and the connection
    is renewed after a backoff (:class:`~trainguard.agent.storecall.ClientGuard`): a ``TCPStore`` call on a
    connection cut off by a partition waits past its own timeout, and after the heal its queued bytes wait
    for TCP's retransmission backoff. (Unbounded, the cut-off node's supervisor hung in a handler call for
    the whole partition and ~24 s after the heal, then named a healthy peer of the majority frozen from its
    stale view: test_partition on keyed at 19b2572.)"""
    from trainguard.agent.membership_kv import TcpKv

    def client() -> Any:
        return dist.TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=timeout_s))

    server = None
    if is_host:
        server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                               timeout=timedelta(seconds=timeout_s))
    base = server if server is not None else client()
    clients = iter([base])
    bound = storecall.call_bound_s(cfg.keep_alive_interval_s, cfg.keep_alive_max_attempts)
    made: list[KeyedRendezvousHandler] = []

    def kv_on(store: Any, main: bool = False) -> Kv:
        slot = [store]

        def renew() -> None:
            slot[0] = client()
            if main and made:  # the handler's own client: the round stores torch elastic gets follow it
                made[0]._store = slot[0]
                made[0]._renewed = True  # (the store may have restarted empty: see KeyedRendezvousHandler._after_renewal)
        guard = storecall.ClientGuard(lambda: slot[0], renew, bound_s=bound, interval_s=cfg.keep_alive_interval_s,
                                      name="keyed" if main else "keyed-heartbeat")
        kv = TcpKv(storecall.BoundedStore(guard, lambda c: dist.PrefixStore(f"trainguard.keyed.{run_id}", c)),
                   cfg.keep_alive_interval_s, cfg.keep_alive_max_attempts)
        kv.guard = guard  # type: ignore[attr-defined]  # (the handler's round stores share its guard)
        if main:  # its waits for a round block; the node's alarm ends one over the heartbeat's connection
            kv.wake_via = lambda: made[0]._hb_kv
        return kv

    first = [True]

    def make_kv() -> Kv:
        main, first[0] = first[0], False
        return kv_on(next(clients, None) or client(), main)

    h = KeyedRendezvousHandler(run_id=run_id, addr=cfg.local_addr or socket.getfqdn(), settings=_settings(cfg),
                               keep_alive_s=cfg.keep_alive_interval_s, join_timeout_s=cfg.join_timeout_s,
                               make_kv=make_kv, store=base, backend="keyed-c10d", look_s=_look_s(cfg),
                               attempts=cfg.keep_alive_max_attempts,
                               reconnect=(client, lambda s: kv_on(s, True), kv_on))
    made.append(h)
    return h


def etcd_handler(cfg: Any, run_id: str) -> KeyedRendezvousHandler:
    """The keyed handler on etcd v3 under ``<prefix>/<job>/k/``; the round stores under ``.../store/``."""
    from trainguard.agent.etcd_rendezvous import EtcdStore, connect
    from trainguard.agent.membership_kv import EtcdKv

    client, prefix = connect(cfg, run_id)
    advice = etcd_keep_alive_advice(cfg.max_nodes, cfg.keep_alive_interval_s)
    if advice is not None:
        log.warning("rendezvous_keep_alive_load", max_nodes=cfg.max_nodes, interval_s=cfg.keep_alive_interval_s,
                    renewals_per_s=round(cfg.max_nodes / cfg.keep_alive_interval_s),
                    effect="at full size the leases' renewals take over 10 % of one etcd core (0.22-0.24 ms each "
                           "measured; docs/rendezvous.md, sizing)",
                    fix=f"set rendezvous.keep_alive_interval_s: {advice} (the detection bound of a silent node becomes "
                        f"{advice} x keep_alive_max_attempts s), or give etcd its own cores")

    buckets = buckets_for(cfg.max_nodes)

    def make_kv() -> Kv:
        return EtcdKv(client, prefix + "k/", cfg.keep_alive_interval_s, cfg.keep_alive_max_attempts, buckets)

    return KeyedRendezvousHandler(run_id=run_id, addr=cfg.local_addr or socket.getfqdn(), settings=_settings(cfg),
                                  keep_alive_s=cfg.keep_alive_interval_s, join_timeout_s=cfg.join_timeout_s,
                                  make_kv=make_kv, store=EtcdStore(client, prefix), backend="keyed-etcd-v3",
                                  look_s=_look_s(cfg), attempts=cfg.keep_alive_max_attempts)


def create_handler(cfg: Any, run_id: str) -> KeyedRendezvousHandler:
    """The keyed handler for a ``rendezvous`` config: on etcd v3 (``backend: etcd``) or on the ``TCPStore`` at
    ``endpoint`` (``backend: c10d``; ``is_host`` as torch's rule: unset = host when the endpoint is an address
    of this machine and the port is free, else connect)."""
    if cfg.backend == "etcd":
        return etcd_handler(cfg, run_id)
    from trainguard.agent.preflight import is_local_address

    host, _, port = cfg.endpoint.rpartition(":")
    host = host.strip("[]")
    if cfg.is_host is None and is_local_address(host):
        try:
            return tcp_handler(cfg, run_id, host=host, port=int(port), is_host=True)
        except (RuntimeError, OSError):  # another agent on this machine hosts it
            pass
    return tcp_handler(cfg, run_id, host=host, port=int(port), is_host=bool(cfg.is_host))


def _look_s(cfg: Any) -> float:
    """A waiting node looks at the decider's lease every ``interval x (attempts - 1)``: a dead decider is
    not seen before its heartbeat expires anyway, and at 1,024 nodes on etcd every look is a request."""
    return float(cfg.keep_alive_interval_s * max(1, cfg.keep_alive_max_attempts - 1))


def _settings(cfg: Any) -> Settings:
    return Settings(cfg.min_nodes, cfg.max_nodes, cfg.last_call_timeout_s)


__all__ = ["create_handler", "etcd_handler", "tcp_handler"]
