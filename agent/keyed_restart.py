"""A restarted ``trainguard store`` under the keyed rendezvous: new connections, this node's heartbeat at once, and
its round republished (create-once, fenced) so that the members go on in the round they were in. A part of
:class:`~trainguard.agent.keyed_rendezvous.KeyedRendezvousHandler` (its state and its other methods); the
decisions are pure in :mod:`trainguard.agent.membership` (:func:`~trainguard.agent.membership.republish_action`,
:func:`~trainguard.agent.membership.lease_floor`, :func:`~trainguard.agent.membership.floor_value`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainguard.agent import storecall
from trainguard.agent.membership import Republish, encode_assignment, floor_value, lease_floor, rec_key, republish_action
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.rendezvous")


class StoreRestart:
    """Mixin of :class:`~trainguard.agent.keyed_rendezvous.KeyedRendezvousHandler`."""

    _reconnect: Any
    _store: Any
    _kv: Any
    _hb_kv: Any
    _renewed: bool
    _held: Any
    _go: Any
    _hb_thread: Any
    node: str
    round: int
    restores = 0
    """Times :meth:`_restore` put this node's heartbeat and round back (keys the supervisor wrote there may be gone:
    :attr:`~trainguard.agent.elastic.ElasticAdapter.store_generation` counts these)."""
    keep_alive_window_s: float
    _cur: Callable[[], int]

    def reconnect(self) -> bool:
        """After the store restarted (every call fails): new connections, this node's heartbeat at once, and
        its round republished (see the module docstring). False (nothing changed) on etcd or while the store
        does not answer yet. Called from the supervisor thread (the heartbeat thread picks up its new client)."""
        if self._reconnect is None:
            return False
        connect, kv_main, kv_beat = self._reconnect
        bound = self.keep_alive_window_s
        try:
            base = storecall.call_with_deadline(connect, bound, "connect")
            beat_client = storecall.call_with_deadline(connect, bound, "connect")
        except Exception:  # noqa: BLE001 - not back yet: the caller tries again later
            return False
        self._store, self._kv, self._hb_kv = base, kv_main(base), kv_beat(beat_client)
        self._renewed = False
        self._restore("new")
        return True

    def _after_renewal(self) -> None:
        """The handler's connection guard renewed its connection by itself (a call failed, a later one
        reconnected): restore this node's heartbeat and round as :meth:`reconnect` does. Without this the guard
        reconnected to a restarted, empty store before the supervisor's reconnect ran, the member check read
        no round there and the world re-formed (test_keyed_store_restart on keyed at 6c3b812: 'store_reconnected'
        from the guard, no 'rendezvous_store_reconnected', member_lost). After a partition's heal the store
        still holds the round: ``same``, nothing written but heartbeats that are absent."""
        if not self._renewed:
            return
        self._renewed = False
        self._restore("renewed")

    def _renewed_read(self, read: Callable[[], Any]) -> Any:
        """``read()`` after :meth:`_after_renewal`, and again after it when that read was the call that renewed
        the connection."""
        self._after_renewal()
        out = read()
        if self._renewed:
            self._after_renewal()
            out = read()
        return out

    def _restore(self, connection: str) -> None:
        """This node's heartbeat at once and its round republished on the current connection, one log line."""
        self.restores += 1
        if self._hb_thread is not None and self._hb_thread.is_alive():
            self._kv.beat(self.node)
        outcome = self._republish()
        if outcome is Republish.CONFLICT:  # what this node held is not the store's round: read the store's from now on
            self._held, self._go = None, None
        fields = {"node": self.node, "round": self.round, "republished": outcome.value if outcome else "none",
                  "connection": connection}
        if outcome is Republish.CONFLICT:
            log.error("rendezvous_store_reconnected", **fields,
                      cause="the restarted store holds another world under this round number",
                      effect="left as it is: this node's next rendezvous joins the store's rounds; "
                             "the checkpoint epochs fence the two worlds")
        else:
            log.warning("rendezvous_store_reconnected", **fields,
                        effect="new connections; this node's heartbeat and round are in the store again")

    def _republish(self) -> Republish | None:
        """Republish the held round into a store that lost it (:func:`~trainguard.agent.membership.republish_action`):
        ``publish`` when this node's copy won, ``same`` when a peer's did."""
        held, go = self._held, self._go
        if held is None or go is None or held.round != self.round:
            return None
        k, kv = held.round, self._kv
        self._raise("lead", lambda raw: lease_floor(raw, go.term))
        self._raise("jseq", lambda raw: floor_value(raw, held.consumed))
        if republish_action(held, go, kv.get(rec_key(k, go.term)), kv.get(f"r/{k}/go"), self._cur()) in (
                Republish.PUBLISH, Republish.SAME):
            # The peers' heartbeats are gone with the store: vouch for them as of now (created once), as the
            # dynamic protocol's reconnect refreshes every heartbeat, or this node's first ring check finds a
            # peer that has not reconnected yet dead and the world re-forms without it (seen in
            # test_keyed_store_restart at 0a43d75: member_lost 14 ms after the reconnect).
            kv.vouch([*held.members, *held.spares])
        act, won = Republish.PUBLISH, False
        for _ in range(3):  # publish, then read back what the store holds
            act = republish_action(held, go, kv.get(rec_key(k, go.term)), kv.get(f"r/{k}/go"), self._cur())
            if act is not Republish.PUBLISH:
                break
            kv.set_many([(f"r/{k}/{go.term}/a/{n}", encode_assignment(i, len(held.members)))
                         for i, n in enumerate(held.members)]
                        + [(f"r/{k}/{go.term}/a/{n}", encode_assignment(-1, len(held.members))) for n in held.spares])
            if kv.create(rec_key(k, go.term), held.encode()) == held.encode():
                won = kv.create(f"r/{k}/go", go.encode()) == go.encode() or won
        if act is Republish.SAME:
            self._raise("cur", lambda raw: floor_value(raw, k))
            return Republish.PUBLISH if won else Republish.SAME  # (the log says who republished)
        return act

    def _raise(self, key: str, want: Callable[[bytes | None], bytes | None]) -> None:
        """Compare-and-set ``key`` to ``want(value there)`` until ``want`` says it is high enough."""
        raw = self._kv.get(key)
        for _ in range(5):
            new = want(raw)
            if new is None:
                return
            got = self._kv.create(key, new) if raw is None else self._kv.swap(key, raw, new)
            if got == new:
                return
            raw = got or None


__all__ = ["StoreRestart"]
