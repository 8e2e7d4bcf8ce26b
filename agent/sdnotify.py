"""Built-in sd_notify: readiness, status and watchdog messages to systemd, without libsystemd.

The protocol (``man 3 sd_notify``) is one datagram of newline-separated ``KEY=VALUE`` lines sent
to the ``AF_UNIX`` socket named by ``$NOTIFY_SOCKET``. A name starting with ``@`` is a Linux
abstract socket (the ``@`` becomes a NUL byte). When the variable is unset the process does not run
under ``Type=notify`` and every call here is a no-op, so the agent needs no special case for
running in a terminal, a container or a test.

Environment: this module never reads :data:`os.environ`. The CLI entry point passes the mapping
(``Notifier.from_env(os.environ)``), which keeps tests hermetic and honours the house rule that only
the config loader and the entry point touch the process environment.

Watchdog: with ``WatchdogSec=`` systemd sets ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``); the service
must send ``WATCHDOG=1`` more often than that or it is killed with ``SIGABRT`` and restarted. The
recommended period is half the interval, which :func:`watchdog_interval` returns.
:class:`WatchdogThread` pings on that period *only while* a health callable says the agent's main
loop is alive, so a hung supervisor stops feeding the watchdog and systemd restarts it.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Mapping

from trainguard.contract.log import get_logger

log = get_logger(__name__)

__all__ = ["Notifier", "WatchdogThread", "watchdog_interval"]

SEND_TIMEOUT_S = 1.0
"""Upper bound on one send. The receiver's queue is small (``net.unix.max_dgram_qlen``, 10 in some
containers); if nobody drains it a blocking send would hang the caller, e.g. the agent while it
announces STOPPING. A send that times out is dropped and logged."""


def _socket_address(name: str) -> str | bytes:
    """``@abstract`` -> ``b"\\0abstract"``; a filesystem path stays as it is."""
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


def watchdog_interval(env: Mapping[str, str], pid: int | None = None) -> float | None:
    """Seconds between watchdog pings (half of ``WATCHDOG_USEC``), or ``None`` if not enabled.

    ``WATCHDOG_PID``, when set, names the process systemd expects the pings from; if it is not
    ``pid`` (default: this process) the watchdog is meant for someone else (e.g. a parent that
    exec'd us with the variables inherited) and ``None`` is returned, as ``sd_watchdog_enabled``
    does. Malformed or non-positive values also give ``None``.
    """
    raw = env.get("WATCHDOG_USEC", "")
    try:
        usec = int(raw)
    except ValueError:
        return None
    if usec <= 0:
        return None
    wpid = env.get("WATCHDOG_PID")
    if wpid:
        try:
            if int(wpid) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return usec / 1_000_000 / 2


class Notifier:
    """Sends sd_notify messages; every method is a no-op when ``NOTIFY_SOCKET`` is unset.

    Thread-safe: one datagram per call, each ``sendto`` is atomic. Send failures (systemd gone,
    socket removed, receiver queue full for :data:`SEND_TIMEOUT_S`) are logged once as
    ``sd_notify_failed`` and never raised: notification must not be able to take the agent down.
    """

    def __init__(self, socket_path: str | None, send_timeout: float = SEND_TIMEOUT_S) -> None:
        """``socket_path`` is the raw ``$NOTIFY_SOCKET`` value (``None`` or ``""`` disables);
        ``send_timeout`` bounds one send, in seconds."""
        self._send_timeout = send_timeout
        self._address: str | bytes | None = _socket_address(socket_path) if socket_path else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Notifier:
        """Build from an environment mapping (the entry point passes ``os.environ``)."""
        return cls(env.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        """Whether a notify socket is configured."""
        return self._address is not None

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` (``KEY=VALUE``) as one datagram; ``True`` if it was sent."""
        if self._address is None:
            return False
        payload = "\n".join(lines).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    self._sock.settimeout(self._send_timeout)
                self._sock.sendto(payload, self._address)
                return True
            except OSError as exc:
                if not self._warned:
                    log.warning("sd_notify_failed", error=str(exc), message=lines[0] if lines else "")
                    self._warned = True
                return False

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: start-up finished (the agent sends it once its first rendezvous attempt starts)."""
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """``STATUS=text``: one line shown by ``systemctl status`` (state, world size, step)."""
        return self.notify("STATUS=" + text.replace("\n", " "))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the main loop is alive."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: a drain/shutdown has begun (systemd then waits up to ``TimeoutStopSec``)."""
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        """``RELOADING=1``: configuration reload in progress; send :meth:`ready` when done."""
        return self.notify("RELOADING=1")

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: ask systemd for more time in the current start/stop phase."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def close(self) -> None:
        """Close the socket; idempotent. Later sends reopen it."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class WatchdogThread:
    """A daemon thread that sends ``WATCHDOG=1`` every ``interval`` s while ``healthy()`` is true.

    ``healthy`` is called from this thread; it must be cheap and thread-safe (typically "has the
    supervisor loop ticked within the last N seconds"). An exception in it counts as unhealthy and is
    logged as ``watchdog_health_error``; the thread keeps running. When unhealthy no ping is sent, so
    systemd's watchdog fires after ``WatchdogSec``. :meth:`stop` is idempotent and safe to call on a
    thread that was never started.
    """

    def __init__(self, notifier: Notifier, interval: float, healthy: Callable[[], bool] = lambda: True) -> None:
        """``interval`` in seconds, usually ``watchdog_interval(env)``; must be positive."""
        if interval <= 0:
            raise ValueError(f"watchdog interval must be positive, got {interval!r}")
        self._notifier = notifier
        self._interval = interval
        self._healthy = healthy
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unhealthy_logged = False

    @property
    def interval(self) -> float:
        """Seconds between pings."""
        return self._interval

    def start(self) -> WatchdogThread:
        """Start pinging (an immediate first ping, then every ``interval``); returns ``self``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainguard-sd-watchdog", daemon=True)
            self._thread.start()
        return self

    def _tick(self) -> None:
        try:
            ok = bool(self._healthy())
        except Exception as exc:  # a failing health check must not kill the thread
            log.warning("watchdog_health_error", error=repr(exc))
            ok = False
        if ok:
            self._notifier.watchdog()
            self._unhealthy_logged = False
        elif not self._unhealthy_logged:
            log.warning("watchdog_withheld", reason="health check failed; systemd will restart the agent")
            self._unhealthy_logged = True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._tick()
            self._stop.wait(self._interval)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread and wait up to ``timeout`` s for it; idempotent."""
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout)

    def __enter__(self) -> WatchdogThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
