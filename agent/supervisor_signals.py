"""What the agents tell each other through the round's store: a draining node's record (so a planned
re-formation does not wait for it, and its peers know why its workers went away), the worker-API flag, and
the store's own health (one warning per outage, reconnecting). A part of
:class:`~trainguard.agent.supervisor.Supervisor`."""

from __future__ import annotations

import time

from trainguard.agent.supervisor_join import WORKER_API_KEY
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.supervisor")
DRAIN_KEY = "trainguard/draining"
"""Rendezvous-store key (under the round's prefix) a draining node increments, so its peers know why
its workers went away."""
LEAVING_KEY = "trainguard/leaving/"
"""+ node id: a draining node's record (round store), so a planned re-formation does not wait for it."""


class RoundSignals:
    """Mixin of :class:`~trainguard.agent.supervisor.Supervisor` (its state and its other methods)."""

    def _publish_drain(self) -> None:
        store = self.adapter.store
        if self._drain_published == self.adapter.round:
            return
        try:
            if store is not None:
                store.set(LEAVING_KEY + self.adapter.node_id, "1")
                store.add(DRAIN_KEY, 1)
                self._drain_published = self.adapter.round
        except Exception as e:  # the store may be gone with its host; the drain goes on regardless
            log.warning("drain_publish_failed", error=str(e))

    def _leaving_members(self, members: tuple[str, ...]) -> frozenset[str]:
        store = self.adapter.store
        out = set()
        for m in members:
            try:
                if store is not None and store.check([LEAVING_KEY + m]):
                    out.add(m)
                self._store_ok()
            except Exception as e:
                self._store_failed("leaving_members", e)
        return frozenset(out)

    def _mark_worker_api(self) -> None:
        """Tell nodes that will join this world that its workers use the worker API (they warm up). Once per
        round, and again after a reconnection to the store (a restarted store lost the mark)."""
        world = self._current
        mark = None if world is None else (world.round, getattr(self.adapter, "store_generation", 0))
        if world is None or self._marked_api == mark or not self.control.api_workers():
            return
        try:
            self.adapter.store.set(WORKER_API_KEY, "1")
            self._marked_api = mark
            self._store_ok()
        except Exception as e:
            self._store_failed("mark_worker_api", e)

    def _store_failed(self, op: str, e: BaseException) -> None:
        """A rendezvous-store call failed: one warning per outage, not one per poll (the loop polls
        every ``workers.monitor_interval_s``); :meth:`_store_ok` logs the end of it."""
        self._store_failures += 1
        if self._store_down_since is None:
            self._store_down_since = time.monotonic()
            log.warning("rendezvous_store_unreachable", op=op, error=f"{type(e).__name__}: {e}"[:300],
                        effect="the workers train on; scale-up and member checks wait for the store (the agent "
                               "reconnects once it answers again); the next membership change fails over to a "
                               "restart if the store is still unreachable")
        now = time.monotonic()
        if now >= self._reconnect_at:  # a restarted store: a TCPStore client never reconnects by itself
            self._reconnect_at = now + self.cfg.rendezvous.keep_alive_interval_s
            try:
                if self.adapter.reconnect_store():
                    self._store_ok()
            except Exception as err:  # noqa: BLE001 - retried at the next failed call
                log.warning("rendezvous_store_reconnect_failed", error=f"{type(err).__name__}: {err}"[:300])

    def _store_ok(self) -> None:
        if self._store_down_since is not None:
            log.info("rendezvous_store_reachable", down_s=round(time.monotonic() - self._store_down_since, 3),
                     failed_calls=self._store_failures)
            self._store_down_since, self._store_failures = None, 0

    def _peer_draining(self) -> bool:
        store = self.adapter.store
        try:
            return store is not None and store.check([DRAIN_KEY])
        except Exception:
            return False
