"""``trainguard store``: a long-lived rendezvous store for the ``c10d`` backend.

Why: with ``rdzv_backend=c10d`` torch.distributed.elastic lets the agent whose host matches the
endpoint *host* the ``TCPStore`` inside its own process. When that node is preempted the store
dies with it and every survivor fails with ``RendezvousConnectionError`` (pytorch#67742) — on a
spot cluster that turns the loss of one node into the loss of the job. This command runs the
store in its own process on a small on-demand coordinator node; every agent then uses
``rdzv_endpoint=<store-host>:29400`` with ``is_host=false`` and any worker node can disappear.
See ``docs/rendezvous.md`` for the trade-off against ``etcd``.

Binding: ``TCPStore`` on its own listens on every interface (IPv4 and IPv6) whatever host it is
given. We bind the listening socket ourselves to ``--host`` and hand it over through
``master_listen_fd``, so ``--host 10.0.0.5`` really listens on that address only, and
``--host 0.0.0.0`` on all IPv4 addresses. The default is ``127.0.0.1``: a store is reachable from
other nodes only when the operator names the interface.

Security: the store has **no authentication and no TLS**. Anyone who reaches the port can join any
job's rendezvous, or rewrite its keys (the participant list, the workers' ``MASTER_ADDR``, the drain
record). Keep the port reachable only from the cluster's nodes (security group / firewall) and say
so with ``--firewalled``; without it, a store listening beyond loopback logs ``store_exposed`` (a
warning) at start. Where the network cannot be trusted, use ``rendezvous.backend: etcd`` with TLS,
client certificates and a per-job etcd user instead (``docs/rendezvous.md``).

State: the store is memory-only. A restart loses every run's rendezvous state and breaks the
agents' client connections, so the unit restarts it only on failure and the coordinator node
must be on-demand, not spot. One store serves any number of jobs (keys are prefixed by run id).

Environment: this module never reads :data:`os.environ`; the CLI entry point passes it to
:func:`main` (for ``NOTIFY_SOCKET`` / ``WATCHDOG_USEC``).

Log events: ``store_ready`` (host, port, pid, exposed, firewalled), ``store_exposed`` (warning),
``store_stopping`` (signal), ``store_stopped``, ``store_failed``, ``store_parent_gone`` (warning: started with
``--exit-with-parent``, it was reparented; it stops), ``store_close_stuck`` (error: the server's shutdown did not
return within :data:`CLOSE_DEADLINE_S`; the process exits without it).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

from trainguard.agent.sdnotify import Notifier, WatchdogThread, watchdog_interval
from trainguard.contract.log import configure, get_logger

log = get_logger("trainguard.agent.store")

DEFAULT_PORT = 29400
"""The c10d rendezvous backend's default port (``torch.distributed.elastic`` uses the same)."""

HEARTBEAT_KEY = "trainguard/store/heartbeat"
"""Key the watchdog health check increments, proving the server answers requests."""

DEFAULT_HOST = "127.0.0.1"
"""Loopback unless the operator names an interface: an unauthenticated store is never exposed by default."""

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "StoreServer", "is_exposed", "main", "register"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``store`` subcommand to an ``argparse`` subparsers object; returns its parser.

    The parser's ``func`` default is :func:`main`, so a dispatcher can call ``args.func(args, env)``.
    """
    p: argparse.ArgumentParser = subparsers.add_parser(
        "store",
        help="run a standalone c10d rendezvous store (TCPStore) for a spot cluster",
        description=(
            "Run a long-lived torch.distributed TCPStore for the c10d rendezvous backend on a small "
            "on-demand coordinator node. Agents point rendezvous.endpoint at HOST:PORT with "
            "is_host=false, so losing any training node (including the first one) is survivable. "
            "The store is unauthenticated, unencrypted and in-memory: listen on the cluster interface "
            "only, firewall the port to the cluster's nodes, and do not run it on a spot node; where "
            "the network is not trusted use rendezvous.backend etcd (TLS + auth). Stops cleanly on "
            "SIGTERM/SIGINT."
        ),
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on: one interface address (e.g. the cluster-network IP), {DEFAULT_HOST} "
             "(default: this node only), 0.0.0.0 (all IPv4) or :: (all IPv4+IPv6)",
    )
    p.add_argument(
        "--firewalled",
        action="store_true",
        help="state that the port is reachable only from the cluster's nodes (security group / firewall); "
             "silences the store_exposed warning logged when listening beyond loopback",
    )
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this store exits, however it exits (a batch script killed by "
             "Slurm before its EXIT trap ran left its store behind, listening after the job ended)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"TCP port to listen on (default {DEFAULT_PORT}, the c10d default; 0 picks a free port and logs it)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds the store's own operations may block (default 300)",
    )
    p.add_argument(
        "--log-format",
        choices=["auto", "json", "console"],
        default="auto",
        help="log format: auto (JSON unless stderr is a TTY, default), json or console",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.set_defaults(func=main)
    return p


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host:port`` (raises ``OSError`` with the address on failure)."""
    infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    last: OSError | None = None
    for family, type_, proto, _, addr in infos:
        sk = socket.socket(family, type_, proto)
        try:
            sk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and addr[0] == "::":
                sk.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sk.bind(addr)
            sk.listen(socket.SOMAXCONN)
            sk.set_inheritable(False)
            return sk
        except OSError as exc:
            sk.close()
            last = exc
    raise OSError(f"cannot listen on {host}:{port}: {last}") from last


def is_exposed(host: str) -> bool:
    """Whether listening on ``host`` accepts connections from other machines (anything but loopback)."""
    if host in ("localhost", "ip6-localhost"):
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: whatever it resolves to may be reachable
        return True


def _connect_host(host: str) -> str:
    """The address the server's own in-process client uses to reach a wildcard bind."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


class StoreServer:
    """A ``TCPStore`` master with no fixed world size, bound to one address.

    ``wait_for_workers=False`` and ``world_size=None``: agents come and go; the store never waits
    for a count. ``multi_tenant`` stays ``False``: this process owns exactly one server, and the
    flag only matters to processes that create several stores on one port.
    :meth:`close` is idempotent.
    """

    def __init__(self, host: str, port: int, timeout: float = 300.0) -> None:
        """Bind and start serving; raises ``OSError`` if the address is taken or invalid."""
        import torch.distributed as dist  # heavy import, only for this subcommand

        self.host = host
        sock = _bind(host, port)
        self.port: int = sock.getsockname()[1]
        try:
            self._store: Any = dist.TCPStore(
                _connect_host(host),
                self.port,
                world_size=None,
                is_master=True,
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
                multi_tenant=False,
                master_listen_fd=sock.fileno(),
                use_libuv=True,
            )
        except BaseException:
            sock.close()
            raise
        # The TCPServer now owns the descriptor and closes it on shutdown; Python must not.
        sock.detach()
        self._lock = threading.Lock()

    def healthy(self) -> bool:
        """Round-trip one request through the server (used as the watchdog health check)."""
        with self._lock:
            if self._store is None:
                return False
            self._store.add(HEARTBEAT_KEY, 1)
            return True

    def num_keys(self) -> int:
        """Number of keys held (includes the heartbeat key); ``-1`` once closed."""
        with self._lock:
            return -1 if self._store is None else int(self._store.num_keys())

    def close(self) -> None:
        """Stop serving and release the port; idempotent."""
        with self._lock:
            store, self._store = self._store, None
        del store  # the TCPServer shuts down (and closes its socket) when its last reference goes


CLOSE_DEADLINE_S = 10.0
"""How long the stopping store waits for the server's own shutdown before it exits without it."""


def _close_within(server: "StoreServer", seconds: float) -> bool:
    """``server.close()`` on a thread of its own; False when it has not returned within ``seconds``."""
    closer = threading.Thread(target=server.close, name="store-close", daemon=True)
    closer.start()
    closer.join(seconds)
    return not closer.is_alive()


def main(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    """Run the store until SIGTERM or SIGINT; returns the process exit code (0 on a clean stop).

    ``env`` is the process environment, passed by the CLI entry point (``os.environ``), or else
    taken from ``args.environ`` when a dispatcher that calls ``args.func(args)`` attached it there.
    It is only read for ``NOTIFY_SOCKET`` and ``WATCHDOG_USEC``/``WATCHDOG_PID``; without it
    sd_notify is off, and a ``Type=notify`` unit would time out waiting for READY.
    Must run on the main thread (it installs signal handlers, restored on return).
    """
    if env is None:
        env = getattr(args, "environ", None) or {}
    configure(getattr(args, "log_format", "auto"), getattr(args, "log_level", "info"))
    parent = os.getppid() if getattr(args, "exit_with_parent", False) else None
    notifier = Notifier.from_env(env)
    stop = threading.Event()
    received: list[int] = []

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    server: StoreServer | None = None
    watchdog: WatchdogThread | None = None
    try:
        try:
            server = StoreServer(args.host, args.port, timeout=args.timeout)
        except (OSError, RuntimeError, ValueError) as exc:
            log.error(
                "store_failed",
                host=args.host,
                port=args.port,
                error=str(exc),
                fix="free the port, or pick another with --port, and check --host is an address of this node",
            )
            return 1
        started = time.monotonic()
        exposed, firewalled = is_exposed(args.host), bool(getattr(args, "firewalled", False))
        if exposed and not firewalled:
            log.warning(
                "store_exposed",
                host=args.host,
                port=server.port,
                risk="the store has no authentication: anyone who reaches this port can join any job's rendezvous "
                     "or rewrite its keys (participants, MASTER_ADDR, the drain record)",
                fix="allow the port from the cluster's nodes only (security group / firewall) and pass --firewalled, "
                    "or use rendezvous.backend: etcd with TLS and authentication (docs/rendezvous.md)",
            )
        log.info("store_ready", host=args.host, port=server.port, pid=os.getpid(), backend="c10d",
                 exposed=exposed, firewalled=firewalled)
        notifier.ready(status=f"serving c10d rendezvous store on {args.host}:{server.port}")
        interval = watchdog_interval(env)
        if interval is not None:
            watchdog = WatchdogThread(notifier, interval, server.healthy).start()
        while not stop.wait(timeout=1.0):
            if parent is not None and os.getppid() != parent:  # reparented: whoever started it is gone
                log.warning("store_parent_gone", parent=parent, effect="stopping (--exit-with-parent)")
                break
        signame = signal.Signals(received[0]).name if received else "parent_exited" if parent is not None else "unknown"
        log.info("store_stopping", signal=signame, keys=server.num_keys())
        if watchdog is not None:  # first: a ping in flight (its health check is a round trip) came after STOPPING
            watchdog.stop()
        notifier.stopping(status=f"stopping on {signame}")
        if not _close_within(server, CLOSE_DEADLINE_S):
            # The server's shutdown never returned: a store of a cancelled Slurm job hung so, in the C++ join of its
            # libuv thread, for an hour after its SIGTERM (main thread in a futex, the loop in epoll_wait; not
            # reproduced alone). Nothing is left to do but end: the kernel releases the port.
            log.error("store_close_stuck", port=server.port, waited_s=CLOSE_DEADLINE_S,
                      effect="the process exits without the server's shutdown")
            notifier.close()
            os._exit(0)
        log.info("store_stopped", port=server.port, uptime_s=round(time.monotonic() - started, 3))
        return 0
    finally:
        if watchdog is not None:
            watchdog.stop()
        if server is not None:
            server.close()
        notifier.close()
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":  # ``python -m trainguard.agent.store``: an entry point, so it may read os.environ
    import sys

    _parser = argparse.ArgumentParser(prog="trainguard")
    _sub = _parser.add_subparsers(dest="command", required=True)
    register(_sub)
    _args = _parser.parse_args(["store", *sys.argv[1:]])
    sys.exit(main(_args, os.environ))
