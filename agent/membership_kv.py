"""The keyed rendezvous's store I/O (:mod:`trainguard.agent.membership` holds its decisions): one small
interface, :class:`Kv`, over a ``TCPStore`` (``trainguard store``) or etcd v3, each with what the store does
best.

==================  =========================================  ===============================================
operation           TCPStore (:class:`TcpKv`)                  etcd v3 (:class:`EtcdKv`)
==================  =========================================  ===============================================
heartbeat           ``set hb/<node>`` = wall-clock time        a key ``hb/<node>`` on the node's own lease
                    (one small write per interval)             (TTL interval x attempts), renewed on the
                                                               node's open gRPC ``LeaseKeepAlive`` stream
                                                               (:mod:`~.etcd_lease`; the gateway's
                                                               ``lease/keepalive`` without grpcio)
who is alive        ``multi_get`` of the nodes' ``hb`` keys    one range over ``hb/`` (keys only): the key of
                    (:func:`~.membership.heartbeat_alive`)     a dead node's expired lease is gone
announce            ``add jseq 1`` then ``set j/<seq>``        ``put j/<kind>/<node>``; its ``mod_revision``
                                                               orders the log
read the log        ``multi_get`` of the new ``j/<seq>``       one range over ``j/`` with ``min_mod_revision``
publish a round     each member's assignment and the record    one transaction, if ``go`` is absent and the
                    (created once) under the decider's term,   lease still this decider's: ``max_nodes/16``
                    then ``go`` (compare-and-set against       bucket keys (<= 120) of assignments, each
                    absent), ``cur``                           with ``go`` in it, the record, ``go``, ``cur``
wait for a round    one blocking ``get`` of the node's wake    a watch on the node's own bucket key: its one
                    key (the decider writes it with ``go``     event carries the round and the node's rank;
                    and the assignment; the node's alarm ends  a stream on the process's gRPC channel
                    it); the decider's short waits poll        (:mod:`~.etcd_watch`; the gateway's
                                                               ``watch``, a connection each, without grpcio)
read a few keys     one ``check`` + ``get`` per key             one transaction of range operations
create-once         ``compare_set(key, "", value)``            a transaction comparing ``create_revision`` 0
==================  =========================================  ===============================================

Every method is one round trip or a fixed few (``set_many`` on etcd: one transaction per 100 keys). etcd's
transactions are unary ``KV/Txn`` calls on the process's gRPC channel (:mod:`~.etcd_txn`) when grpcio is installed,
else gateway requests. On etcd
a waiting node makes ~3 requests per membership change (its look with its announcement in one transaction,
the decider's heartbeat, the watch), where it made ~11 at 3621de7: at 1,024 nodes every gateway request costs etcd
~0.3 ms of CPU, and the requests of a change were what a change waited for. Not
thread-safe: each thread that talks to the store has its own :class:`Kv` (a ``TCPStore`` client must not
be shared by threads, see :meth:`trainguard.agent.elastic.ElasticAdapter.side_store`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, TypeVar

from trainguard.agent.alarm import ALARMS
from trainguard.agent.etcd_wire import EtcdError, EtcdFailure, KeyValue, TxnResult, b64, cmp_absent, cmp_value, op_put, op_range, prefix_range_end, unb64
from trainguard.agent.storecall import read_many
from trainguard.agent.membership import (
    WAKE_MARK,
    Entry,
    Go,
    bucket_of,
    decode_bucket,
    decode_wake,
    encode_buckets,
    encode_wake,
    heartbeat_alive,
    rec_key,
    wake_key,
)

_T = TypeVar("_T")

HOLE_SKIP_S = 5.0
"""A log position handed out (``add``) whose entry is still missing after this long is skipped: its
writer died between the two calls."""

WAIT_POLL_S = 0.25
"""TCPStore: how often a node waiting for a round looks for it, when it polls (etcd: a watch)."""

LONG_WAIT_S = 2 * WAIT_POLL_S
"""TCPStore: a wait for a round at least this long blocks on the node's wake key instead of polling."""

FEW = 4
"""etcd: up to this many nodes' heartbeats are read key by key, more with one range over ``hb/``."""


class Kv(Protocol):
    """What the keyed rendezvous asks of a store. Keys are relative to the job's namespace."""

    def get(self, key: str) -> bytes | None: ...
    def set(self, key: str, value: bytes) -> None: ...
    def set_many(self, items: Sequence[tuple[str, bytes]]) -> None: ...
    def create(self, key: str, value: bytes) -> bytes:
        """Write ``value`` only if ``key`` is absent; the value there afterwards (ours when we won)."""
    def swap(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Compare-and-set an existing key; the value there afterwards."""
    def wait(self, key: str, timeout_s: float) -> bool:
        """Block until ``key`` exists (True) or ``timeout_s`` passed (False)."""
    def wait_value(self, key: str, timeout_s: float) -> bytes | None:
        """Block until ``key`` exists: its value, or None when ``timeout_s`` passed."""
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` (None where absent), in one round trip where the store allows."""
    def publish_round(self, t: int, term: int, lease: bytes, assignments: Sequence[tuple[str, bytes]], record: bytes,
                      go: bytes) -> bytes:
        """The decider publishes round ``t``: every named node's assignment, the record, ``go`` (created once:
        the fence) and ``cur``; the value of ``go`` afterwards (``go`` itself when this call published it)."""
    def wait_round(self, t: int, node: str, timeout_s: float) -> tuple[Go, bytes | None] | None:
        """Block until round ``t`` is published: its ``go`` and ``node``'s assignment (None: the round does not
        name it), or None when ``timeout_s`` passed."""
    def announce(self, entry: Entry) -> None: ...
    def enter(self, entry: Entry, keys: Sequence[str]) -> list[bytes | None]:
        """Announce ``entry`` and read ``keys`` (etcd: one transaction; the reads may see the store before it)."""
    def announcements(self, after: int) -> tuple[list[Entry], int]:
        """Log entries after position ``after``, in log order, and the position read up to."""
    def pending(self, after: int) -> int:
        """How many announcements came after position ``after`` (one small read)."""
    def beat(self, node: str) -> None: ...
    def unbeat(self, node: str) -> None:
        """The node leaves: it is dead for everyone at once."""
    def alive(self, nodes: Collection[str]) -> frozenset[str]: ...
    def vouch(self, nodes: Collection[str]) -> None:
        """A restarted store: a heartbeat as of now for each of ``nodes`` that has none there (created once,
        never over a node's own beat), so that members that have not reconnected yet are not found dead at
        once; one that died meanwhile beats no more and expires after the usual window."""
    def close(self) -> None: ...


class TcpKv:
    """:class:`Kv` on a ``TCPStore`` client (under a ``PrefixStore``: the job's namespace)."""

    def __init__(self, store: Any, interval_s: float, attempts: int, clock: Any = time.time,
                 poll_s: float = WAIT_POLL_S) -> None:
        self.store, self.poll_s = store, poll_s
        self.interval_s, self.attempts, self.clock = interval_s, attempts, clock
        self._holes: dict[int, float] = {}
        self.wake_via: Callable[[], Kv] | None = None
        """The :class:`Kv` on another connection to the same store (the heartbeat thread's) on which this
        node's alarm ends its wait for a round (:meth:`wait_round`); None: the wait polls ``go``."""
        self.max_block_s = interval_s * attempts / 2
        """A blocking wait is ended by the node's alarm after at most this long: half the bound of a call
        on a guarded client (``interval x attempts``), past which the guard would drop the connection."""

    def get(self, key: str) -> bytes | None:
        return bytes(self.store.get(key)) if self.store.check([key]) else None

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if items:
            self.store.multi_set([k for k, _ in items], [v for _, v in items])

    def create(self, key: str, value: bytes) -> bytes:
        return bytes(self.store.compare_set(key, b"", value))

    def swap(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(self.store.compare_set(key, expected, desired))

    def create_soon(self, key: str, value: bytes) -> None:
        """:meth:`create` without waiting for the answer where the store can (a guarded client: queued on its
        call thread), else now. For a node's alarm: 256 simulated nodes' alarms due at once must not wait
        for each other's round trips."""
        post = getattr(self.store, "post", None)
        if post is not None:
            post("compare_set", key, b"", value)
        else:
            self.create(key, value)

    def wait(self, key: str, timeout_s: float) -> bool:
        # Polled, not TCPStore.wait: a wait that times out costs the client a cancel round trip, and with a
        # few dozen clients doing so at once each stalled 5 s (torch 2.13, libuv or not; measured here).
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self.poll_s, left))
        return True

    def wait_value(self, key: str, timeout_s: float) -> bytes | None:
        return self.get(key) if self.wait(key, timeout_s) else None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return read_many(self.store, keys)

    def publish_round(self, t: int, term: int, lease: bytes, assignments: Sequence[tuple[str, bytes]], record: bytes,
                      go: bytes) -> bytes:
        # Assignments and the record under the decider's term: a decider that loses the race for go wrote keys
        # nobody reads (go names the winner's term). The record is created once: a term is never reused (the
        # lease's compare-and-set; after a store restart the members raise the lease's term first), so only a
        # member's republication of this very round can be there first, and then this decider publishes nothing.
        # (At 92cd926 the record was one key r/<t>/rec, set by every decider: a loser overwrote the winner's.)
        self.set_many([(f"r/{t}/{term}/a/{n}", v) for n, v in assignments])
        if self.create(rec_key(t, term), record) != record:
            return self.get(f"r/{t}/go") or b""
        got = self.create(f"r/{t}/go", go)
        if got == go:
            self.set("cur", str(t).encode())
            # After go (see wait_round): each named node's wait ends with its assignment and go.
            self.set_many([(wake_key(t, n), encode_wake(go, v)) for n, v in assignments])
        return got

    def wait_round(self, t: int, node: str, timeout_s: float) -> tuple[Go, bytes | None] | None:
        """A short wait (the decider's, between its polls) or one without :attr:`wake_via` polls ``go``.
        A long one is one blocking read of the node's wake key (:func:`~.membership.wake_key`): the decider
        writes each member's (and spare's) after it published the round, with ``go`` and the assignment in
        the value, so the wait is one request however long it takes (polled, 1,023 nodes waiting out a lost
        node's keep-alive made ~20,000 requests and their client CPU set the seconds of the bench). Its end
        without a round is the node's own alarm, which writes :data:`~.membership.WAKE_MARK` there over
        ``wake_via``'s connection: then the mark is deleted and ``go`` read once (the decider creates ``go``
        before the wake keys, so a round published meanwhile is seen: by the read, if the delete removed
        its wake value)."""
        if self.wake_via is None or timeout_s < LONG_WAIT_S:
            raw = self.wait_value(f"r/{t}/go", timeout_s)
            if raw is None:
                return None
            go = Go.decode(raw)
            return go, self.get(f"r/{t}/{go.term}/a/{node}")
        key, via = wake_key(t, node), self.wake_via
        ticket = ALARMS.arm(min(timeout_s, self.max_block_s), lambda: via().create_soon(key, WAKE_MARK))
        try:
            raw = bytes(self.store.get(key))  # (blocks until the key exists)
        finally:
            ALARMS.disarm(ticket)
        woken = decode_wake(raw)
        if woken is not None:
            return woken
        self.store.delete_key(key)
        return self.wait_round(t, node, 0.0)

    def enter(self, entry: Entry, keys: Sequence[str]) -> list[bytes | None]:
        out = self.get_many(keys)
        self.announce(entry)
        return out

    def announce(self, entry: Entry) -> None:
        seq = int(self.store.add("jseq", 1))
        self.store.set(f"j/{seq}", entry.encode())

    def announcements(self, after: int) -> tuple[list[Entry], int]:
        seq = int(self.store.add("jseq", 0))
        keys = [f"j/{i}" for i in range(after + 1, seq + 1)]
        if not keys:
            return [], after
        raws = read_many(self.store, keys)  # (a hole: a writer between its add and its set, or dead there)
        out, pos, now = [], after, time.monotonic()
        for i, raw in zip(range(after + 1, seq + 1), raws):
            if raw is None:
                if now - self._holes.setdefault(i, now) < HOLE_SKIP_S:
                    break
            else:
                entry = Entry.decode(raw)
                if entry is not None:
                    out.append(entry)
            pos = i
        return out, pos

    def pending(self, after: int) -> int:
        return max(0, int(self.store.add("jseq", 0)) - after)

    def beat(self, node: str) -> None:
        self.store.set(f"hb/{node}", f"{self.clock():.3f}".encode())

    def unbeat(self, node: str) -> None:
        self.store.set(f"hb/{node}", b"0")

    def alive(self, nodes: Collection[str]) -> frozenset[str]:
        nodes = list(nodes)
        if not nodes:
            return frozenset()
        keys = [f"hb/{n}" for n in nodes]
        raws = read_many(self.store, keys)
        now = self.clock()
        return frozenset(n for n, raw in zip(nodes, raws)
                         if raw is not None and heartbeat_alive(_float(raw), now, self.interval_s, self.attempts))

    def vouch(self, nodes: Collection[str]) -> None:
        now = f"{self.clock():.3f}".encode()
        for n in nodes:
            self.create(f"hb/{n}", now)

    def close(self) -> None:
        pass


def _float(raw: bytes) -> float | None:
    try:
        return float(raw)
    except ValueError:
        return None


class EtcdKv:
    """:class:`Kv` on etcd v3 (:class:`~trainguard.agent.etcd_client.EtcdClient`) under the job's prefix."""

    def __init__(self, client: Any, prefix: str, interval_s: float, attempts: int, buckets: int = 1) -> None:
        self.client = client
        self.buckets = buckets
        """How many bucket keys carry a round's assignments (:func:`~.membership.buckets_for` of ``max_nodes``)."""
        self._absent_at: dict[bytes, int] = {}
        """Key -> a store revision at which :meth:`get_many` found it absent (a watch starts after it)."""
        self.prefix = prefix.encode()
        self.ttl = max(2, int(round(interval_s * attempts)))
        self.interval_s = interval_s
        self.renew_timeout_s = interval_s * max(1, attempts - 1)
        self._lease: int | None = None
        self._stream_failures = 0
        self._stream: Any = None
        """The node's lease stream (:class:`~trainguard.agent.etcd_lease.LeaseStream`), opened on the first
        renewal; False when grpcio is missing (the gateway renews)."""
        self._grpc: bool | None = None
        """Whether watches (:mod:`~trainguard.agent.etcd_watch`) and transactions (:mod:`~trainguard.agent.etcd_txn`)
        go on gRPC: grpcio is installed (:meth:`_on_grpc`)."""

    def _k(self, key: str) -> bytes:
        return self.prefix + key.encode()

    def get(self, key: str) -> bytes | None:
        kv, _ = self.client.get(self._k(key))
        return None if kv is None else kv.value

    def set(self, key: str, value: bytes) -> None:
        self.client.put(self._k(key), value)

    def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        for i in range(0, len(items), 100):  # etcd's --max-txn-ops is 128 by default
            self._txn([], [op_put(self._k(k), v) for k, v in items[i:i + 100]])

    def create(self, key: str, value: bytes) -> bytes:
        k = self._k(key)
        result = self._txn([cmp_absent(k)], [op_put(k, value)], [op_range(k)])
        if result.succeeded:
            return value
        kvs = result.kvs(0)
        return kvs[0].value if kvs else b""

    def swap(self, key: str, expected: bytes, desired: bytes) -> bytes:
        k = self._k(key)
        result = self._txn([cmp_value(k, expected)], [op_put(k, desired)], [op_range(k)])
        if result.succeeded:
            return desired
        kvs = result.kvs(0)
        return kvs[0].value if kvs else b""

    def wait(self, key: str, timeout_s: float) -> bool:
        k = self._k(key)
        deadline = time.monotonic() + timeout_s
        while True:
            kv, revision = self.client.get(k)
            if kv is not None:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not self.client.wait_for_change(k, revision, left):
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def wait_value(self, key: str, timeout_s: float) -> bytes | None:
        k = self._k(key)
        deadline = time.monotonic() + timeout_s
        while True:
            kv, revision = self.client.get(k)
            if kv is not None:
                return kv.value
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            written = self._watch_key(k, revision, left)  # the event carries the value: no read after it
            if written is not None:
                return written.value
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)  # (deleted, compacted, or the watch failed: read again)

    def _watch_key(self, key: bytes, after: int, timeout_s: float) -> KeyValue | None:
        """``key`` as written after ``after`` (None: timed out, deleted, compacted or the watch failed: the caller
        reads again): on a gRPC ``Watch`` stream of the process's channel when grpcio is installed, else through the
        gateway, whose every watch is a new connection (with TLS a handshake: 1,023 at once in a leave at 1,024
        nodes, 4.8-6.3 s)."""
        from trainguard.agent import etcd_watch

        deadline = time.monotonic() + timeout_s
        return self._on_grpc(
            lambda: etcd_watch.watch_key(self.client.settings, self.client.auth_token, key, after,
                                         max(0.0, deadline - time.monotonic())),
            lambda: self.client.watch_key(key, after, timeout_s))

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: Sequence[dict[str, Any]] = ()) -> TxnResult:
        """One transaction: on the gRPC ``KV/Txn`` call of the process's channel when grpcio is installed, else
        through the gateway (JSON, base64 and a hop inside etcd: 1,023 enter transactions at once in a leave at
        1,024 nodes on etcd with TLS waited 1.6 s on average). Idempotent, as the gateway has always run these."""
        from trainguard.agent import etcd_txn

        return self._on_grpc(lambda: etcd_txn.txn(self.client.settings, self.client.auth_token, compare, success, failure),
                             lambda: self.client.txn(compare, success, failure))

    def _on_grpc(self, grpc: Callable[[], _T], gateway: Callable[[], _T]) -> _T:
        """``grpc()`` when grpcio is installed (:func:`~trainguard.agent.etcd_lease.available`, asked once), else
        ``gateway()``; on gRPC an expired token (or a member restarted) is renewed once more, as the gateway does."""
        from trainguard.agent import etcd_lease

        if self._grpc is None:
            self._grpc = etcd_lease.available()
        if not self._grpc:
            return gateway()
        try:
            return grpc()
        except EtcdError as e:
            if e.failure is not EtcdFailure.TOKEN_EXPIRED or not self.client.settings.username:
                raise
            self.client.authenticate()
            return grpc()

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._read(keys, [])

    def enter(self, entry: Entry, keys: Sequence[str]) -> list[bytes | None]:
        return self._read(keys, [op_put(self._k(f"j/{entry.kind}/{entry.node}"), entry.encode())])

    def _read(self, keys: Sequence[str], then: list[dict[str, Any]]) -> list[bytes | None]:
        """``keys`` read in one transaction, with the operations ``then`` after the reads."""
        ks = [self._k(k) for k in keys]
        result = self._txn([], [op_range(k) for k in ks] + then)
        out: list[bytes | None] = []
        self._absent_at.clear()
        for i, k in enumerate(ks):
            kvs = result.kvs(i)
            out.append(kvs[0].value if kvs else None)
            if not kvs:
                self._absent_at[k] = result.revision
        return out

    def publish_round(self, t: int, term: int, lease: bytes, assignments: Sequence[tuple[str, bytes]], record: bytes,
                      go: bytes) -> bytes:
        # One transaction: the buckets, the record, go and cur, if go is absent and this node still holds the
        # lease. Atomic, so the bucket keys need no term (a node can watch its own before the round exists).
        values = encode_buckets(go, assignments, self.buckets)
        go_key, lead = self._k(f"r/{t}/go"), self._k("lead")
        puts = [op_put(self._k(f"r/{t}/b/{i}"), v) for i, v in enumerate(values)]
        puts += [op_put(self._k(rec_key(t, term)), record), op_put(go_key, go), op_put(self._k("cur"), str(t).encode())]
        result = self._txn([cmp_absent(go_key), cmp_value(lead, lease)], puts, [op_range(go_key)])
        if result.succeeded:
            return go
        kvs = result.kvs(0)
        return kvs[0].value if kvs else b""  # (go absent: this node lost the lease; whoever holds it publishes)

    def wait_round(self, t: int, node: str, timeout_s: float) -> tuple[Go, bytes | None] | None:
        # A watch on this node's bucket key: its one event carries go and the node's assignment. When the last
        # look found go absent (written in the same transaction as the buckets), the watch starts from that
        # revision without reading the key first.
        key = f"r/{t}/b/{bucket_of(node, self.buckets)}"
        after = self._absent_at.get(self._k(f"r/{t}/go"))
        if after is None:
            raw = self.wait_value(key, timeout_s)
        else:
            written = self._watch_key(self._k(key), after, timeout_s)
            raw = None if written is None else written.value
            if raw is None:
                self._absent_at.pop(self._k(f"r/{t}/go"), None)  # (timed out, or compacted: read first next time)
        return None if raw is None else decode_bucket(raw, node)

    def announce(self, entry: Entry) -> None:
        self.client.put(self._k(f"j/{entry.kind}/{entry.node}"), entry.encode())

    def _log_range(self, after: int, count_only: bool) -> dict[str, Any]:
        start = self._k("j/")
        body: dict[str, Any] = {"key": b64(start), "range_end": b64(prefix_range_end(start)),
                                "min_mod_revision": str(after + 1)}
        if count_only:  # (etcd's count ignores min_mod_revision: the keys alone, without values)
            body["keys_only"] = True
        else:
            body.update(sort_order="ASCEND", sort_target="MOD")
        return self.client.call("kv/range", body)

    def announcements(self, after: int) -> tuple[list[Entry], int]:
        answer = self._log_range(after, False)
        out = [e for e in (Entry.decode(KeyValue.from_json(kv).value) for kv in answer.get("kvs", [])) if e is not None]
        return out, int(answer.get("header", {}).get("revision", after))

    def pending(self, after: int) -> int:
        return len(self._log_range(after, True).get("kvs", []))

    def _renew(self, lease: int) -> int:
        """The lease's TTL after renewing it (<= 0: gone): on the gRPC stream, else through the gateway."""
        if self._stream is None:
            from trainguard.agent import etcd_lease

            self._stream = (etcd_lease.LeaseStream(self.client.settings, self.client.auth_token)
                            if etcd_lease.available() else False)
        if self._stream:
            try:
                # Up to interval x (attempts - 1): a renewal answered then is still within the TTL. (With 2 s, in a
                # change at 1,024 simulated nodes under load 30, 520 renewals gave up, went through the gateway
                # on top, and 192 leases expired.)
                ttl = self._stream.renew(lease, max(1.0, self.renew_timeout_s))
                self._stream_failures = 0
                return ttl
            except EtcdError:
                # (the stream reopens on the next beat) A first failure is a missed beat, which the TTL covers:
                # sending it through the gateway at once doubled the requests of an etcd that was already slow
                # (an overload fed itself, 53bb38a with 8 processes). A second in a row goes through the gateway.
                self._stream_failures += 1
                if self._stream_failures < 2:
                    raise
        answer = self.client.call("lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", answer).get("TTL", 0) or 0)

    def beat(self, node: str) -> None:
        if self._lease is not None and self._renew(self._lease) > 0:
            return
        lease = int(self.client.call("lease/grant", {"TTL": str(self.ttl)})["ID"])
        self.client.call("kv/put", {"key": b64(self._k(f"hb/{node}")), "value": b64(b"1"), "lease": str(lease)})
        self._lease = lease

    def unbeat(self, node: str) -> None:
        if self._lease is not None:
            self.client.call("lease/revoke", {"ID": str(self._lease)})
            self._lease = None
        self.client.delete(self._k(f"hb/{node}"))

    def alive(self, nodes: Collection[str]) -> frozenset[str]:
        if len(nodes) <= FEW:  # a follower looking at the decider's heartbeat: that key alone
            return frozenset(n for n in nodes if self.client.get(self._k(f"hb/{n}"))[0] is not None)
        start = self._k("hb/")
        answer = self.client.call("kv/range", {"key": b64(start), "range_end": b64(prefix_range_end(start)),
                                               "keys_only": True})
        present = {unb64(kv.get("key"))[len(start):].decode() for kv in answer.get("kvs", [])}
        return frozenset(n for n in nodes if n in present)

    def vouch(self, nodes: Collection[str]) -> None:
        pass  # (etcd keeps its keys across its own restarts: nothing is lost to vouch for)

    def close(self) -> None:
        if self._stream:
            self._stream.close()


__all__ = ["EtcdKv", "FEW", "HOLE_SKIP_S", "Kv", "LONG_WAIT_S", "TcpKv", "WAIT_POLL_S"]
