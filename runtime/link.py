"""The worker's end of the agent's control socket (:mod:`trainguard.contract.protocol`).

Says :class:`~trainguard.contract.protocol.Hello` once, then a daemon thread listens for
:class:`~trainguard.contract.protocol.Stop` orders; the training thread reads :attr:`AgentLink.request`
at each step boundary and reports commits with :meth:`AgentLink.committed`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger

log = get_logger("trainguard.runtime.link")


class AgentLink:
    """One connection to the local agent. :attr:`request` only ever grows (drain beats resize)."""

    def __init__(self, path: str, rank: int, local_rank: int, pid: int, *, connect_timeout_s: float = 5.0) -> None:
        self.request = proto.StopReason.NONE
        self.checkpoint_reason: str | None = None
        """Set by a :class:`~trainguard.contract.protocol.CheckpointNow` order until :meth:`take_checkpoint`."""
        self.deadline: float | None = None
        """Epoch seconds by which a draining node must be gone (from the agent's stop order)."""
        self.on_abort: Callable[[str], None] | None = None
        """Called on the listener thread when the agent orders an :class:`~trainguard.contract.protocol.Abort`
        (the training thread may be blocked in a collective that only this can end)."""
        self._reform: proto.Reform | None = None
        self._reformed = threading.Event()
        self._send_lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout_s)
        self._sock.connect(path)
        self._send(proto.Hello(rank=rank, local_rank=local_rank, pid=pid))
        self._sock.settimeout(1.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="trainguard-agent-link", daemon=True)
        self._thread.start()

    def _send(self, msg: proto.Message) -> None:
        with self._send_lock:
            self._sock.sendall(proto.encode(msg))

    def _listen(self) -> None:
        buf = b""
        while not self._stop.is_set():
            try:
                chunk = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    msg = proto.decode(line)
                except proto.ProtocolError as e:
                    log.warning("control_bad_message", error=str(e))
                    continue
                if isinstance(msg, proto.Stop):
                    self._on_stop(msg)
                elif isinstance(msg, proto.Abort):
                    if self.on_abort is not None:
                        try:
                            self.on_abort(msg.why)
                        except Exception as e:  # noqa: BLE001 - the listener must survive it
                            log.warning("abort_failed", error=f"{type(e).__name__}: {e}"[:300])
                elif isinstance(msg, proto.CheckpointNow):
                    self.checkpoint_reason = msg.why or "agent"
                elif isinstance(msg, proto.Reform):
                    # The stop order that led to the park is served by this new world; one that comes
                    # after it (a drain while the world forms) stays pending. Cleared here, in the
                    # messages' order, not when the training thread takes the world (chaos
                    # `sigterm_agent @ rendezvous`: a drain 18 ms after the Reform was lost that way).
                    self.request = proto.StopReason.NONE
                    self.deadline = None
                    self._reform = msg
                    self._reformed.set()

    def _on_stop(self, msg: proto.Stop) -> None:
        if msg.reason is proto.StopReason.DRAIN:
            self.deadline = msg.deadline
        self.request = max(self.request, msg.reason)

    def wait_reform(self, timeout_s: float, abort: Callable[[], bool] | None = None) -> proto.Reform | None:
        """Block until the agent sends the new world (None after ``timeout_s``, if the agent went away,
        or once ``abort()`` is true: checked every 0.5 s at most). The stop order that led here is
        consumed (when the Reform arrived): the new world starts with only the orders that came after
        it pending."""
        deadline = time.monotonic() + timeout_s
        while not self._reformed.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or not self._thread.is_alive() or (abort is not None and abort()):
                return None
        self._reformed.clear()
        msg, self._reform = self._reform, None
        return msg

    def take_checkpoint(self) -> str | None:
        """The pending out-of-cycle checkpoint request (its reason), cleared; None if there is none."""
        reason, self.checkpoint_reason = self.checkpoint_reason, None
        return reason

    def report(self, msg: proto.Committed | proto.Restored | proto.Parked | proto.Joined | proto.Progress
               | proto.Pace) -> None:
        """Tell the agent a checkpoint committed (or could not be saved) or was restored, that this
        worker parked or joined its world. Best effort: the agent may be gone."""
        try:
            self._send(msg)
        except OSError as e:
            log.warning("agent_link_send_failed", op=msg.OP, error=str(e))

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
