"""The keyed rendezvous handler (``rendezvous.protocol: keyed``) on a real ``TCPStore`` and a real etcd: nodes
are handlers on threads of this process. Form, planned leave, loss, join, spares beyond ``max_nodes``, the
decider's lease passing on from a dead holder, the publish fence (assignments and record), abort and close,
what the exit barrier reads, and a restarted ``trainguard store`` (a real store process restarted on its port)."""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from trainguard.agent.config import RendezvousConfig
from trainguard.agent.elastic_types import Plan, RendezvousAborted
from trainguard.agent.keyed_rendezvous import KeyedRendezvousHandler
from trainguard.agent.keyed_stores import etcd_handler, tcp_handler
from trainguard.agent.membership import EVICT, JOIN, Entry, Go, Record, assignment, encode_assignment, parse_lease, ranked, rec_key

pytestmark = pytest.mark.timeout(120)


class Job:
    """Handlers of one job on one store; every handler made is stopped at the end."""

    def __init__(self, kind: str, endpoint: str, **cfg: Any) -> None:
        base = {"min_nodes": 2, "max_nodes": 5, "keep_alive_interval_s": 1, "keep_alive_max_attempts": 2,
                "last_call_timeout_s": 30.0, "join_timeout_s": 60.0, **cfg}
        self.cfg = RendezvousConfig(backend="etcd" if kind == "etcd" else "c10d", endpoint=endpoint, **base)
        self.kind = kind
        self.made: list[KeyedRendezvousHandler] = []

    def node(self) -> KeyedRendezvousHandler:
        host, _, port = self.cfg.endpoint.rpartition(":")
        h = etcd_handler(self.cfg, "job") if self.kind == "etcd" else tcp_handler(self.cfg, "job", host=host, port=int(port))
        self.made.append(h)
        return h

    def round(self, who: list[KeyedRendezvousHandler], plan: Plan | None, timeout: float = 60.0) -> dict[str, tuple[int, int]]:
        """Every node of ``who`` joins; node id -> (group rank, world size)."""
        out: dict[str, Any] = {}

        def run(h: KeyedRendezvousHandler) -> None:
            try:
                info = h.next_round(lambda: False, plan)
                out[h.node] = (info.rank, info.world_size)
            except Exception as e:  # noqa: BLE001 - the test reads it
                out[h.node] = e

        threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in who]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in threads), "a node never got a round"
        return out

    def close(self) -> None:
        for h in self.made:
            h.stop_heartbeats()


@pytest.fixture(params=["tcp", "etcd"])
def job(request, tmp_path) -> Iterator[Job]:
    if request.param == "tcp":
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
        j = Job("tcp", f"127.0.0.1:{server.port}")
        yield j
        j.close()
        return
    if shutil.which("etcd") is None:
        pytest.skip("etcd not installed (Debian package etcd-server)")
    from tests.fixtures.etcd import start_etcd

    with start_etcd(tmp_path / "etcd") as server:
        j = Job("etcd", server.endpoint)
        yield j
        j.close()


def sizes(out: dict[str, Any]) -> list[tuple[int, int]]:
    assert all(isinstance(v, tuple) for v in out.values()), out
    return sorted(out.values())


def test_form_leave_loss_join(job):
    a, b, c, d = (job.node() for _ in range(4))
    names = frozenset(h.node for h in (a, b, c, d))
    assert sizes(job.round([a, b, c, d], Plan(members=names))) == [(i, 4) for i in range(4)]
    assert sorted(a.members()) == sorted(names) and a.members() == d.members()
    assert a.num_nodes_waiting() == 0

    d.leave()  # planned: the survivors' round completes without a timeout
    assert sizes(job.round([a, b, c], Plan(members=names, leaving=frozenset([d.node])))) == [(i, 3) for i in range(3)]
    assert d.node not in a.members()

    c.stop_heartbeats()  # lost: its heartbeat expires (1 s x 2), then the round completes
    t0 = time.monotonic()
    assert sizes(job.round([a, b], Plan(members=frozenset(a.members()), lost=True))) == [(0, 2), (1, 2)]
    assert time.monotonic() - t0 >= 1.0  # not before the lost node's heartbeat could have expired
    assert set(a.members()) == {a.node, b.node}

    e = job.node()
    joined: dict[str, Any] = {}
    t = threading.Thread(target=lambda: joined.update(job.round([e], None)), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:  # what the running world polls
        time.sleep(0.05)
    assert a.num_nodes_waiting() >= 1
    out = job.round([a, b], Plan(members=frozenset(a.members())))
    t.join(30)
    assert sizes({**out, **joined}) == [(0, 3), (1, 3), (2, 3)]
    ranks = {**{n: r for n, (r, _) in out.items()}, e.node: joined[e.node][0]}
    assert tuple(n for n, _ in sorted(ranks.items(), key=lambda kv: kv[1])) == ranked(ranks) == tuple(a.members())
    # a member read the whole record once (the first round has no change) and derived the members of the
    # leave, the loss and the join from go's change; the newcomer read the record of the round it joined
    assert e.members() == a.members() and a.record_reads == 1 and e.record_reads == 1


def test_spares_beyond_max_nodes_are_carried_and_take_a_leavers_place(job):
    job.cfg = dataclasses.replace(job.cfg, max_nodes=2)
    a, b, s = job.node(), job.node(), job.node()
    spare: dict[str, Any] = {}
    out = job.round([a, b], Plan(members=frozenset([a.node, b.node])))
    assert sizes(out) == [(0, 2), (1, 2)]
    t = threading.Thread(target=lambda: spare.update(job.round([s], None)), daemon=True)
    t.start()
    # the spare announced itself; the running world re-forms with it, it does not fit, and is carried
    deadline = time.monotonic() + 30
    while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sizes(job.round([a, b], Plan(members=frozenset(a.members())))) == [(0, 2), (1, 2)]
    time.sleep(0.5)
    assert a.num_nodes_waiting() == 0, "a carried spare must not look like a node waiting to join"
    assert not spare
    b.leave()
    assert sizes(job.round([a], Plan(members=frozenset(a.members()), leaving=frozenset([b.node])))) == [(0, 2)]
    t.join(30)
    assert spare == {s.node: (1, 2)}


def test_a_dead_deciders_lease_passes_on(job):
    dead, a, b = job.node(), job.node(), job.node()
    dead.start_heartbeats()
    dead._look_at_lease()  # it holds the lease, then dies without releasing it
    assert dead._lease_raw is not None
    held_term, _ = parse_lease(dead._lease_raw)
    dead.stop_heartbeats()
    dead._lease_raw = None
    assert sizes(job.round([a, b], Plan(members=frozenset([a.node, b.node])))) == [(0, 2), (1, 2)]
    raw = a._kv.get(rec_key(a.round, Go.decode(a._kv.get(f"r/{a.round}/go")).term))
    assert raw is not None and Record.decode(raw).term > held_term


def test_the_publish_fence_one_term_per_round(job):
    """A decider whose term lost the race for ``go`` never has its assignments read: here another term
    published round 0 first (assignments reversed), and every node takes that one. (TCPStore: assignments
    under the term, ``go`` created once; etcd: one transaction if ``go`` is absent and the lease is the
    decider's.)"""
    a, b = job.node(), job.node()
    kv = a._kv
    lease = b"99 " + b.node.encode()
    assert kv.create("lead", lease) == lease
    first, second = Go(99, 2, 0).encode(), Go(100, 2, 0).encode()
    rec = Record(0, (b.node, a.node), (), 0, 99).encode()
    assert kv.publish_round(0, 99, lease, [(b.node, encode_assignment(0, 2)), (a.node, encode_assignment(1, 2))], rec,
                            first) == first
    assert kv.publish_round(0, 100, lease, [(a.node, encode_assignment(0, 2)), (b.node, encode_assignment(1, 2))], rec,
                            second) == first  # a second publisher loses
    for n, rank in ((b, 0), (a, 1)):
        go, mine = n._kv.wait_round(0, n.node, 5.0)
        assert go == Go(99, 2, 0) and assignment(mine) == (rank, 2)


def test_a_losing_deciders_record_is_never_read(job):
    """The record too is the winning term's: a decider that lost the race for ``go`` with another world in
    mind (here: a third node, a later log position) must not change what the next decider builds on or what
    a node that arrives reads as the round's members. (At 92cd926 the TCPStore's record was one key set by
    every decider, so the loser's record replaced the winner's.)"""
    a, b, c = job.node(), job.node(), job.node()
    kv = a._kv
    lease = b"99 " + b.node.encode()
    assert kv.create("lead", lease) == lease
    won = Record(0, (b.node, a.node), (), 0, 99)
    first = Go(99, 2, 0).encode()
    assert kv.publish_round(0, 99, lease, [(b.node, encode_assignment(0, 2)), (a.node, encode_assignment(1, 2))],
                            won.encode(), first) == first
    lost = Record(0, (a.node, b.node, c.node), (), 5, 100)
    assert kv.publish_round(0, 100, lease, [(n, encode_assignment(i, 3)) for i, n in enumerate(lost.members)],
                            lost.encode(), Go(100, 3, 5).encode()) == first
    p = c.peek()  # a node that is in no round yet reads round 0's record through go's term
    assert p.round == 0 and p.participants == won.members and not p.this_node_participates
    dec = c._decider(1)  # what the next decider builds on
    assert dec is not None and dec.prev == won


def test_abort_leaves_and_the_others_form_without_it(job):
    a, b, c = job.node(), job.node(), job.node()
    names = frozenset([a.node, b.node, c.node])
    with pytest.raises(RendezvousAborted):
        c.next_round(lambda: True, Plan(members=names))
    c.stop_heartbeats()
    assert sizes(job.round([a, b], Plan(members=names, leaving=frozenset([c.node])))) == [(0, 2), (1, 2)]


def test_closed(job):
    a = job.node()
    a.set_closed()
    assert a.is_closed()
    with pytest.raises(RendezvousClosedError):
        a.next_round(lambda: False, None)


def test_peek_sees_a_dead_member_through_the_ring(job):
    """Each member reads only the next member's heartbeat; the one that finds it expired marks it, and
    every member's peek leaves it out (what the supervisor's member-lost check compares with its world)."""
    nodes = [job.node() for _ in range(3)]
    job.round(nodes, Plan(members=frozenset(h.node for h in nodes)))
    order = nodes[0].members()
    dead = next(h for h in nodes if h.node == order[1])
    before = next(h for h in nodes if h.node == order[0])  # its predecessor in the ring
    other = next(h for h in nodes if h.node == order[2])
    assert set(other.peek().participants) == set(order)
    dead.stop_heartbeats()
    time.sleep(2.5)  # 1 s x 2 attempts: expired
    assert set(other.peek().participants) == set(order)  # not other's neighbour: nothing marked yet
    assert dead.node not in before.peek().participants
    p = other.peek()
    assert dead.node not in p.participants and p.round == other.round and p.this_node_participates


def test_a_leave_is_no_node_waiting_a_join_is(job):
    """``num_nodes_waiting`` (what the supervisor's scale-up check reads) counts joins since the round, not a
    drained member's ``leave``: the survivors of a planned leave must see a peer drain, not a scale-up."""
    a, b = job.node(), job.node()
    assert sizes(job.round([a, b], Plan(members=frozenset([a.node, b.node])))) == [(0, 2), (1, 2)]
    assert a.num_nodes_waiting() == 0
    b.leave()
    assert a.num_nodes_waiting() == 0
    c = job.node()
    c._kv.announce(Entry(c.node, JOIN, 0))
    assert a.num_nodes_waiting() == 1


def test_round_view_holds_the_members_still_in_the_round(job):
    """What the exit barrier reads: a member that left (dead heartbeat) or went back to the rendezvous (a
    ``join`` since the round) is no participant any more; one waiting for a next round is still known."""
    a, b, c = job.node(), job.node(), job.node()
    names = frozenset([a.node, b.node, c.node])
    assert sizes(job.round([a, b, c], Plan(members=names))) == [(0, 3), (1, 3), (2, 3)]
    v = a.round_view()
    assert (v.round, v.closed, v.participants, v.known) == (0, False, names, names)
    c.leave()
    v = a.round_view()
    assert v.participants == {a.node, b.node} and c.node not in v.known
    b._kv.announce(Entry(b.node, JOIN, 0))  # b's workers restarted: it waits in the rendezvous for round 1
    v = b.round_view()
    assert v.participants == {a.node} and b.node in v.known and v.round == 0
    a.set_closed()
    assert a.round_view().closed


def test_heartbeat_outage_logs_one_line_and_one_on_resume(job, monkeypatch):
    """A store that fails every beat (restarted, cut off) gives one ``rendezvous_heartbeat_failed`` line for the
    outage, not one per beat, and one ``rendezvous_heartbeat_resumed`` with the beats missed."""
    from trainguard.agent import keyed_rendezvous

    lines: list[tuple[str, dict]] = []

    class Log:
        def warning(self, event: str, **kw: Any) -> None:
            lines.append((event, kw))

        def info(self, event: str, **kw: Any) -> None:
            lines.append((event, kw))

    monkeypatch.setattr(keyed_rendezvous, "log", Log())
    h = job.node()
    h._keep_alive_s = 0.05
    real = h._hb_kv
    down = threading.Event()
    down.set()

    class Flaky:
        def beat(self, node: str) -> None:
            if down.is_set():
                raise RuntimeError("Broken pipe")
            real.beat(node)

        def close(self) -> None:
            real.close()

    h._hb_kv = Flaky()  # type: ignore[assignment]
    h._hb_thread = threading.Thread(target=h._beat, daemon=True)
    h._hb_thread.start()
    time.sleep(0.6)  # ~12 failed beats
    down.clear()
    time.sleep(0.3)
    h.stop_heartbeats()
    events = [e for e, _ in lines]
    assert events == ["rendezvous_heartbeat_failed", "rendezvous_heartbeat_resumed"], events
    assert lines[1][1]["missed"] >= 5


def _restartable(tmp_path, **cfg: Any) -> tuple[Any, Job]:
    from tests.e2e.test_checkpoint_epochs import Store

    store = Store(str(tmp_path), "first")
    return store, Job("tcp", store.endpoint, **cfg)


def _restart(tmp_path, store: Any) -> Any:
    from tests.e2e.test_checkpoint_epochs import Store

    store.stop()
    return Store(str(tmp_path), "restarted", port=store.port)


def test_members_republish_their_round_into_a_restarted_store_and_go_on(tmp_path):
    store, job = _restartable(tmp_path)
    try:
        a, b = job.node(), job.node()
        both = frozenset([a.node, b.node])
        assert sizes(job.round([a, b], Plan(members=both))) == [(0, 2), (1, 2)]
        assert set(a.members()) == set(b.members()) == both  # (what the agent reads after each round)
        held_rec, held_go = a._held, a._go
        store = _restart(tmp_path, store)
        with pytest.raises(Exception):  # the old connection is dead for good
            a.peek()
        assert a.reconnect()
        # b has not reconnected (its beats fail on the dead connection): a vouched for it, so a's ring check does
        # not find it dead and mark it lost
        assert a._kv.alive([b.node]) == {b.node} and set(a.peek().participants) == both
        assert b.reconnect()  # it finds the same round
        kv = a._kv
        assert Go.decode(kv.get("r/0/go")) == held_go and Record.decode(kv.get(rec_key(0, held_go.term))) == held_rec
        assert kv.get("cur") == b"0" and parse_lease(kv.get("lead"))[0] >= held_go.term
        assert int(kv.store.add("jseq", 0)) >= held_rec.consumed
        for h in (a, b):
            p = h.peek()
            assert p.round == 0 and set(p.participants) == both and p.this_node_participates and p.waiting == 0
        assert a.round_view().participants == both  # heartbeats are in the new store

        # A node that arrives at the restarted store joins the next round: the decider builds on the
        # republished record (its announcement comes after the held log position), with a newer term.
        # The members go to that round once they see it waiting, as the agent does (num_nodes_waiting): started
        # together, the decider may find both members there first and publish at once without it ("everyone
        # expected is there"; 2 of 4 runs at 99818a4: c then waited alone for a round 2 until join_timeout_s).
        c = job.node()
        joined: dict[str, Any] = {}
        t = threading.Thread(target=lambda: joined.update(job.round([c], None)), daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:  # (seen only after the held position)
            time.sleep(0.05)
        assert a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1
        out = job.round([a, b], Plan(members=both))
        t.join(30)
        assert sizes({**out, **joined}) == [(0, 3), (1, 3), (2, 3)]
        assert a.round == b.round == c.round == 1
        assert set(a.members()) == both | {c.node} and a._go.term > held_go.term
    finally:
        job.close()
        store.stop()


def test_a_connection_the_guard_renewed_by_itself_republishes_the_round(tmp_path):
    """The handler's connection guard reconnects by itself after its backoff (no ``reconnect()`` call from the
    supervisor first): the next ``peek`` republishes the held round into the restarted store, so the member
    check still finds both members (at 6c3b812 it read an empty store and the world re-formed)."""
    from trainguard.agent.storecall import StoreCallTimeout

    store, job = _restartable(tmp_path)
    try:
        a, b = job.node(), job.node()
        both = frozenset([a.node, b.node])
        assert sizes(job.round([a, b], Plan(members=both))) == [(0, 2), (1, 2)]
        assert set(a.members()) == both
        held_go = a._go
        store = _restart(tmp_path, store)
        deadline = time.monotonic() + 30
        while True:  # what the supervisor's member check does: peek every interval until it answers
            try:
                p = a.peek()
                break
            except (StoreCallTimeout, dist.DistNetworkError, RuntimeError):
                assert time.monotonic() < deadline, "the guard never renewed the connection"
                time.sleep(0.2)
        assert p.round == 0 and set(p.participants) == both and p.this_node_participates
        assert Go.decode(a._kv.get("r/0/go")) == held_go
    finally:
        job.close()
        store.stop()


def test_a_different_world_under_the_same_round_is_never_overwritten(tmp_path):
    """A node that reached the restarted store before the members republished formed round 0 alone: the
    members' republication of their round 0 is refused (``conflict``), the store keeps the first world,
    and the members read the store's round from then on (their next rendezvous joins after it)."""
    store, job = _restartable(tmp_path, min_nodes=1, last_call_timeout_s=0.5)
    try:
        a, b = job.node(), job.node()
        both = frozenset([a.node, b.node])
        for h in (a, b):  # both alive before either decides (min_nodes=1: else the first may form alone)
            h.start_heartbeats()
        assert sizes(job.round([a, b], Plan(members=both))) == [(0, 2), (1, 2)]
        assert set(a.members()) == both
        store = _restart(tmp_path, store)
        z = job.node()
        assert sizes(job.round([z], None)) == [(0, 1)]
        z_go = z._kv.get("r/0/go")
        assert a.reconnect()
        assert a._kv.get("r/0/go") == z_go  # never overwritten
        assert a.members() == [z.node] and not a.peek().this_node_participates
    finally:
        job.close()
        store.stop()


def test_peek_drops_members_that_announced_since_the_round(job):
    """What the running members' member check reads: a member that went back to the rendezvous (its ``join``)
    and one it evicted are gone from ``participants`` at once, before any heartbeat expired, as torch's state
    drops them; only a newcomer's ``join`` counts as a node waiting."""
    nodes = [job.node() for _ in range(3)]
    job.round(nodes, Plan(members=frozenset(h.node for h in nodes)))
    a, b, c = (next(h for h in nodes if h.node == n) for n in nodes[0].members())
    assert set(b.peek().participants) == {a.node, b.node, c.node}
    c._kv.announce(Entry(c.node, JOIN, c.round))  # c re-forms without a (frozen): its join, then its evict of a
    c._kv.announce(Entry(a.node, EVICT, c.round))
    p = b.peek()
    # a member that went back to the rendezvous left this world: no newcomer to scale up for
    assert p.participants == (b.node,) and p.waiting == 0 and p.this_node_participates and p.round == b.round
    assert b.num_nodes_waiting() == 0
    d = job.node()
    d._kv.announce(Entry(d.node, JOIN, -1))  # a newcomer is one
    assert b.peek().waiting == 1 and b.num_nodes_waiting() == 1


def test_evidence_evicts_a_frozen_member_at_once_not_at_the_next_look(job):
    """A survivor's evidence that a member is gone (``Plan.evict``: its hang watch named the member frozen) is
    announced as soon as the rendezvous has it, and the survivor's round completes without the member while its
    heartbeat is still alive: with keep-alive 10 s x 3 a waiting node looks only every 20 s, and the evidence
    read only at a look came after a frozen member's heartbeat could expire (test_hang's frozen node, keep-alive
    5 s x 3, at 172b51e: ``member_evicted`` never logged)."""
    job.cfg = dataclasses.replace(job.cfg, min_nodes=1, keep_alive_interval_s=10, keep_alive_max_attempts=3)
    a, b = job.node(), job.node()
    both = frozenset([a.node, b.node])
    assert sizes(job.round([a, b], Plan(members=both))) == [(0, 2), (1, 2)]
    b.stop_heartbeats()  # frozen: no more beats, its last one alive for 30 s
    named: list[int] = []

    def evidence() -> frozenset[str]:  # the hang watch names it a little after the re-formation began
        named.append(1)
        return frozenset([b.node]) if len(named) > 3 else frozenset()

    evicted: list[str] = []
    out: dict[str, Any] = {}
    plan = Plan(members=both, lost=True, evict=evidence, round=a.round)
    t = threading.Thread(target=lambda: out.update(r=a.next_round(lambda: False, plan, evicted)), daemon=True)
    t.start()
    t.join(15)  # (before the first look, 20 s in)
    assert not t.is_alive(), "the evidence was not acted on before the next look"
    assert (out["r"].rank, out["r"].world_size) == (0, 1) and a.members() == [a.node]
    assert evicted == [b.node]
    assert a._kv.alive([b.node]) == {b.node}, "its heartbeat expired first: not a test of the eviction"


def test_handler_calls_give_up_under_a_partition_and_reconnect_after_the_heal():
    """A cut-off node's handler calls (what the supervisor's loop makes: peek, nodes waiting, the round store,
    the endpoint store) give up within the keep-alive window instead of waiting past the client's 60 s timeout,
    fail at once while the connection is known stuck, and work again on a new connection after the heal, with the round's
    state as it was. (Unbounded, the cut-off node's supervisor hung for the partition and ~24 s after the
    heal: test_partition on keyed at 19b2572.)"""
    from tests.agent.test_storecall import BlackHoleProxy
    from trainguard.agent.storecall import StoreCallTimeout

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    proxy = BlackHoleProxy(("127.0.0.1", server.port))
    job = Job("tcp", f"127.0.0.1:{proxy.port}", keep_alive_interval_s=1, keep_alive_max_attempts=2)
    try:
        a, b = job.node(), job.node()
        assert sizes(job.round([a, b], Plan(members=frozenset([a.node, b.node])))) == [(0, 2), (1, 2)]
        assert set(a.peek().participants) == {a.node, b.node}
        a.round_store(a.round).set("k", b"v")
        # (a TCPStore set awaits no answer: read it back, or the cut may hold its bytes in the proxy and the get
        # after the heal waits for a key that never arrived: 2 of 16 runs at 6c3b812)
        assert a.round_store(a.round).get("k") == b"v"
        bound = 1 * 2
        proxy.cut()
        calls = (a.peek, a.num_nodes_waiting, lambda: a.round_store(a.round).check(["k"]),
                 lambda: a.endpoint_store.check(["k"]))  # (census and straggler keys)
        for call in calls:
            t0 = time.monotonic()
            with pytest.raises(StoreCallTimeout):
                call()
            waited = time.monotonic() - t0
            assert waited < bound + 5.0, f"a handler call blocked {waited:.1f} s past its bound of {bound} s"
        proxy.heal()  # new connections forward again; the old ones stay black-holed
        deadline = time.monotonic() + 30
        while True:  # the guard renews the connection after its backoff (<= the bound)
            try:
                p = a.peek()
                break
            except StoreCallTimeout:
                assert time.monotonic() < deadline, "no new connection after the heal"
                time.sleep(0.1)
        assert p.round == 0 and a.node in p.participants
        assert a.round_store(a.round).get("k") == b"v"
        a.endpoint_store.set("census", b"1")  # the endpoint store follows the renewed connection
        assert server.get("census") == b"1"
    finally:
        job.close()
        proxy.close()


@pytest.mark.parametrize(("max_nodes", "interval_s", "advice"), [
    (32, 2, None),
    (800, 2, None),      # 400 renewals/s: at the line
    (801, 2, 3),
    (1024, 2, 3),        # 512/s -> 3 s (~341/s)
    (1024, 3, None),
    (4096, 5, 11),
    (4096, 11, None),
])
def test_etcd_keep_alive_advice(max_nodes, interval_s, advice):
    from trainguard.agent.config import etcd_keep_alive_advice

    assert etcd_keep_alive_advice(max_nodes, interval_s) == advice


@pytest.mark.parametrize(("backend", "protocol", "max_nodes", "interval_s"), [
    ("c10d", "auto", 1024, 2),      # a TCPStore's keep-alives cost it 0.6 % of a core at 1,024 nodes: 2 s
    ("c10d", "keyed", 4096, 2),
    ("etcd", "auto", 32, 2),        # auto -> dynamic below 33 nodes
    ("etcd", "dynamic", 1024, 2),   # no leases to renew: torch's rendezvous state
    ("etcd", "auto", 800, 2),       # 400 renewals/s: at the line
    ("etcd", "auto", 801, 3),
    ("etcd", "keyed", 1025, 3),     # the bench's 1,024 nodes (max_nodes N + 1)
    ("etcd", "auto", 4096, 11),
])
def test_auto_keep_alive_interval(backend, protocol, max_nodes, interval_s):
    from trainguard.agent.config import ETCD_RENEWALS_PER_S, auto_keep_alive_interval_s

    assert auto_keep_alive_interval_s(backend, protocol, max_nodes) == interval_s
    endpoint = "127.0.0.1:2379" if backend == "etcd" else "127.0.0.1:29400"
    cfg = RendezvousConfig(backend=backend, protocol=protocol, endpoint=endpoint, max_nodes=max_nodes)
    assert cfg.keep_alive_interval_s == interval_s  # what the agent runs with when the setting is left out
    if backend == "etcd" and interval_s > 2:
        assert max_nodes / interval_s <= ETCD_RENEWALS_PER_S < max_nodes / (interval_s - 1)
    # A value given is kept, even one that loads etcd (that one is warned: below).
    assert RendezvousConfig(backend=backend, protocol=protocol, endpoint=endpoint, max_nodes=max_nodes,
                            keep_alive_interval_s=2).keep_alive_interval_s == 2


def test_auto_keep_alive_interval_from_yaml_env_and_flags(tmp_path):
    """``auto`` (null) is the default, and can be asked for by name in YAML, the environment or a flag."""
    from trainguard.agent.configload import load_config

    path = tmp_path / "tg.yaml"
    base = "rendezvous:\n  backend: etcd\n  endpoint: 127.0.0.1:2379\n  max_nodes: 1024\n"
    path.write_text(base)
    assert load_config(str(path)).rendezvous.keep_alive_interval_s == 3
    for given in ("null", "auto"):
        path.write_text(base + f"  keep_alive_interval_s: {given}\n")
        assert load_config(str(path)).rendezvous.keep_alive_interval_s == 3, given
    env = "TRAINGUARD_RENDEZVOUS_KEEP_ALIVE_INTERVAL_S"
    assert load_config(str(path), env={env: "5"}).rendezvous.keep_alive_interval_s == 5
    assert load_config(str(path), env={env: "5"}, overrides={"rendezvous.keep_alive_interval_s": "auto"}
                       ).rendezvous.keep_alive_interval_s == 3
    path.write_text(base + "  keep_alive_interval_s: often\n")
    with pytest.raises(Exception, match="keep_alive_interval_s"):
        load_config(str(path))


def test_a_large_job_on_etcd_is_told_its_keep_alive_load(tmp_path):
    """etcd_handler warns, naming the setting and the value, when max_nodes' renewals would exceed
    ETCD_RENEWALS_PER_S at keep_alive_interval_s; a small job is not warned."""
    from structlog.testing import capture_logs

    if shutil.which("etcd") is None:
        pytest.skip("etcd not installed (Debian package etcd-server)")
    from tests.fixtures.etcd import start_etcd

    with start_etcd(tmp_path / "etcd") as server:
        made = []
        try:
            with capture_logs() as logs:
                made.append(etcd_handler(RendezvousConfig(backend="etcd", endpoint=server.endpoint, max_nodes=1024,
                                                          keep_alive_interval_s=2), "big"))
                made.append(etcd_handler(RendezvousConfig(backend="etcd", endpoint=server.endpoint, max_nodes=64,
                                                          keep_alive_interval_s=2), "small"))
                # the default (auto) is sized for the job: not warned
                made.append(etcd_handler(RendezvousConfig(backend="etcd", endpoint=server.endpoint, max_nodes=1024),
                                         "big-auto"))
        finally:
            for h in made:
                h.stop_heartbeats()
    [warned] = [e for e in logs if e["event"] == "rendezvous_keep_alive_load"]
    assert warned["max_nodes"] == 1024 and warned["renewals_per_s"] == 512
    assert "rendezvous.keep_alive_interval_s: 3" in warned["fix"]
