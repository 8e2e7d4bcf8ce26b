"""The keyed rendezvous's pure decisions (:mod:`trainguard.agent.membership`), as tables."""

from __future__ import annotations

import pytest

from trainguard.agent.membership import (
    CHANGE_MAX,
    EVICT,
    JOIN,
    LEAVE,
    NO_RECORD,
    Action,
    Change,
    Entry,
    Go,
    Lease,
    Record,
    Republish,
    Settings,
    Wants,
    WAKE_MARK,
    apply_change,
    assignment,
    decode_wake,
    encode_wake,
    change_of,
    decide,
    encode_assignment,
    floor_value,
    fold,
    heartbeat_alive,
    lease_action,
    lease_floor,
    master_of,
    members_digest,
    moved_since,
    bucket_of,
    buckets_for,
    decode_bucket,
    encode_buckets,
    new_entries,
    parse_lease,
    republish_action,
)

S = Settings(min_nodes=2, max_nodes=4, last_call_s=2.0)
ABCD = frozenset("abcd")


def rec(*members: str, spares: tuple[str, ...] = (), round_: int = 3) -> Record:
    return Record(round_, tuple(members), spares, consumed=10)


@pytest.mark.parametrize(("entries", "prev_round", "want"), [
    ([], 0, Wants()),
    ([Entry("a", JOIN, 0), Entry("b", JOIN, 0)], 0, Wants(("a", "b"))),
    ([Entry("a", JOIN, 0), Entry("a", JOIN, 1)], 0, Wants(("a",))),                        # announced twice: once
    ([Entry("a", JOIN, 0), Entry("a", LEAVE, 0)], 0, Wants((), frozenset("a"))),             # joined, then drained
    ([Entry("a", LEAVE, 0), Entry("a", JOIN, 0)], 0, Wants(("a",))),                         # left, came back
    ([Entry("b", JOIN, 0), Entry("a", JOIN, 0), Entry("b", LEAVE, 0)], 0, Wants(("a",), frozenset("b"))),
    ([Entry("c", EVICT, 4)], 4, Wants(evicted=frozenset("c"))),                              # evidence about this world
    ([Entry("c", EVICT, 3)], 4, Wants()),                                                    # about an older world: ignored
])
def test_fold(entries, prev_round, want):
    assert fold(entries, prev_round) == want


@pytest.mark.parametrize(("beat", "now", "alive"), [
    (100.0, 100.0, True),
    (100.0, 105.9, True),      # interval 2 x 3 attempts: dead at 6 s
    (100.0, 106.0, False),
    (None, 100.0, False),      # never beat
    (0.0, 100.0, False),       # left (its heartbeat was zeroed)
])
def test_heartbeat_alive(beat, now, alive):
    assert heartbeat_alive(beat, now, 2.0, 3) is alive


@pytest.mark.parametrize(("raw", "want"), [
    (None, (0, "")), (b"", (0, "")), (b"3 node-a", (3, "node-a")), (b"4 -", (4, "")), (b"junk", (0, "")),
])
def test_parse_lease(raw, want):
    assert parse_lease(raw) == want


@pytest.mark.parametrize(("holder", "holder_alive", "want"), [
    ("me", True, Lease.HOLD),
    ("", False, Lease.TAKE),          # vacant
    ("other", False, Lease.TAKE),     # its holder's heartbeat expired
    ("other", True, Lease.FOLLOW),
])
def test_lease_action(holder, holder_alive, want):
    assert lease_action("me", holder, holder_alive) is want


# (prev record, wants, alive, now, min_since, expect) -> (action, members, spares, reason)
DECIDE = [
    # the first world, no plan: torch's last call after min_nodes
    ("first: below min", NO_RECORD, Wants(("a",)), ABCD, 0.0, None, frozenset(),
     Action.WAIT, (), (), "below min_nodes"),
    ("first: min there, last call runs", NO_RECORD, Wants(("a", "b")), ABCD, 5.0, None, frozenset(),
     Action.WAIT, (), (), "last call"),
    ("first: last call over", NO_RECORD, Wants(("a", "b", "c")), ABCD, 7.0, 5.0, frozenset(),
     Action.PUBLISH, ("a", "b", "c"), (), "last call"),
    ("first: max_nodes at once", NO_RECORD, Wants(tuple("abcde")), frozenset("abcde"), 0.0, None, frozenset(),
     Action.PUBLISH, tuple("abcd"), ("e",), "max_nodes"),
    ("first: the plan names everyone", NO_RECORD, Wants(("b", "a", "c")), ABCD, 0.0, None, frozenset("abc"),
     Action.PUBLISH, ("a", "b", "c"), (), "everyone expected is there"),
    ("ranks as torch's: by address, pid, local id", NO_RECORD,
     Wants(("10.0.0.2_7_0", "10.0.0.10_99_0", "10.0.0.2_10_1", "10.0.0.2_10_0")),
     frozenset({"10.0.0.2_7_0", "10.0.0.10_99_0", "10.0.0.2_10_1", "10.0.0.2_10_0"}), 0.0, None,
     frozenset({"10.0.0.2_7_0", "10.0.0.10_99_0", "10.0.0.2_10_1", "10.0.0.2_10_0"}),
     Action.PUBLISH, ("10.0.0.10_99_0", "10.0.0.2_7_0", "10.0.0.2_10_0", "10.0.0.2_10_1"), (), "max_nodes"),
    ("max_nodes: members before newcomers get in", rec("c", "d", "e"), Wants(("a", "c", "d", "e", "b")),
     frozenset("abcde"), 0.0, None, frozenset(), Action.PUBLISH, ("a", "c", "d", "e"), ("b",), "max_nodes"),
    ("first: a planned node missing", NO_RECORD, Wants(("a", "b")), ABCD, 0.0, None, frozenset("abc"),
     Action.WAIT, (), (), "last call"),
    # a planned leave: the survivors, no timeout; ranks keep their order
    ("leave", rec("a", "b", "c", "d"), Wants(("c", "a", "b"), frozenset("d")), frozenset("abc"), 0.0, None, frozenset(),
     Action.PUBLISH, ("a", "b", "c"), (), "everyone expected is there"),
    ("leave, a survivor not back yet", rec("a", "b", "c", "d"), Wants(("a", "b"), frozenset("d")), frozenset("abc"),
     0.0, None, frozenset(), Action.WAIT, (), (), "last call"),
    # a loss: waits while the lost node's heartbeat holds, publishes once it expired
    ("loss, heartbeat still fresh", rec("a", "b", "c"), Wants(("a", "b")), frozenset("abc"), 1.0, None, frozenset(),
     Action.WAIT, (), (), "last call"),
    ("loss, heartbeat expired", rec("a", "b", "c"), Wants(("a", "b")), frozenset("ab"), 1.5, 1.0, frozenset(),
     Action.PUBLISH, ("a", "b"), (), "everyone expected is there"),
    ("loss, evicted on evidence", rec("a", "b", "c"), Wants(("a", "b"), evicted=frozenset("c")), frozenset("abc"),
     0.0, None, frozenset(), Action.PUBLISH, ("a", "b"), (), "everyone expected is there"),
    ("a live member never comes back: last call", rec("a", "b", "c"), Wants(("a", "b")), frozenset("abc"), 3.0, 1.0,
     frozenset(), Action.PUBLISH, ("a", "b"), (), "last call"),
    # a join: the members come back, the newcomer goes last
    ("join", rec("b", "c"), Wants(("a", "c", "b")), frozenset("abc"), 0.0, None, frozenset(),
     Action.PUBLISH, ("a", "b", "c"), (), "everyone expected is there"),
    ("a dead joiner is no candidate", rec("a", "b"), Wants(("e", "b", "a")), frozenset("ab"), 0.0, None, frozenset(),
     Action.PUBLISH, ("a", "b"), (), "everyone expected is there"),
    # spares carried by the record take a leaver's place
    ("a spare replaces a leaver", rec("a", "b", "c", "d", spares=("e",)), Wants(("a", "b", "c"), frozenset("d")),
     frozenset("abce"), 0.0, None, frozenset(), Action.PUBLISH, ("a", "b", "c", "e"), (), "max_nodes"),
    ("below min after a loss", rec("a", "b"), Wants(("a",)), frozenset("a"), 0.0, None, frozenset(),
     Action.WAIT, (), (), "below min_nodes"),
]


@pytest.mark.parametrize(("name", "prev", "wants", "alive", "now", "min_since", "expect", "action", "members", "spares",
                          "reason"), DECIDE, ids=[c[0] for c in DECIDE])
def test_decide(name, prev, wants, alive, now, min_since, expect, action, members, spares, reason):
    d = decide(prev, wants, alive, S, now, min_since, expect)
    assert (d.action, d.members, d.spares, d.reason) == (action, members, spares, reason)


def test_decide_keeps_the_last_call_clock_and_resets_it_below_min():
    d = decide(NO_RECORD, Wants(("a", "b")), ABCD, S, 5.0, None)
    assert d.min_since == 5.0
    assert decide(NO_RECORD, Wants(("a", "b")), ABCD, S, 6.0, d.min_since).min_since == 5.0
    assert decide(NO_RECORD, Wants(("a",)), ABCD, S, 6.5, d.min_since).min_since is None


def test_decide_names_who_is_missing():
    d = decide(rec("a", "b", "c"), Wants(("a",)), frozenset("abc"), S, 0.0, None)
    assert d.missing == ("b", "c")


@pytest.mark.parametrize("value", [
    Entry("10.0.0.5_123_0", JOIN, 4), Entry("n_1_2", LEAVE, -1), Entry("x", EVICT, 7),
    Entry("10.0.0.5_123_0", JOIN, 4, 29500),
])
def test_entry_round_trip(value):
    assert Entry.decode(value.encode()) == value


def test_an_entry_without_a_port_is_an_older_agents_join():
    assert Entry.decode(b"join 3 n_1_0") == Entry("n_1_0", JOIN, 3, 0)


@pytest.mark.parametrize("raw", [b"", b"join", b"join x y", b"hello 1 a", b"join 1 a p", b"join 1 a 2 3"])
def test_entry_refuses_what_is_no_entry(raw):
    assert Entry.decode(raw) is None


def test_record_go_and_assignment_round_trip():
    r = Record(5, ("a", "b"), ("c",), 42, 3)
    assert Record.decode(r.encode()) == r
    assert Go.decode(Go(3, 2, 42).encode()) == Go(3, 2, 42)
    assert Go.decode(Go(3, 2, 42, "10.0.0.5:29500").encode()) == Go(3, 2, 42, "10.0.0.5:29500")
    assert Go.decode(b"3 2 42") == Go(3, 2, 42, "")  # from an older decider
    assert assignment(encode_assignment(1, 2)) == (1, 2)
    assert list(new_entries(3, 6)) == [4, 5, 6] and list(new_entries(6, 6)) == []


@pytest.mark.parametrize("go", [Go(3, 2, 42), Go(3, 2, 42, "10.0.0.5:29500"), Go(7, 1024, 9, "[::1]:1", None)])
@pytest.mark.parametrize("mine", [encode_assignment(0, 2), encode_assignment(-1, 2), encode_assignment(1023, 1024)])
def test_a_wake_value_carries_go_and_the_assignment(go, mine):
    assert decode_wake(encode_wake(go.encode(), mine)) == (go, mine)


def test_the_nodes_own_mark_carries_no_round():
    assert decode_wake(WAKE_MARK) is None


def test_fold_keeps_each_joiners_last_port():
    w = fold([Entry("a", JOIN, 0, 100), Entry("b", JOIN, 0), Entry("a", JOIN, 0, 101), Entry("c", JOIN, 0, 7),
              Entry("c", LEAVE, 0)], 0)
    assert w.port_of("a") == 101 and w.port_of("b") == 0 and w.joined == ("a", "b")


@pytest.mark.parametrize(("members", "ports", "master", "addr_port"), [
    (("10.0.0.5_12_0", "10.0.0.6_9_0"), {"10.0.0.5_12_0": 29500}, "10.0.0.5:29500", ("10.0.0.5", 29500)),
    (("node_a_12_0",), {"node_a_12_0": 7}, "node_a:7", ("node_a", 7)),         # an address with "_" in it
    (("fd00::1_12_0",), {"fd00::1_12_0": 7}, "[fd00::1]:7", ("fd00::1", 7)),     # IPv6
    (("10.0.0.5_12_0", "x_1_0"), {"x_1_0": 5}, "", None),                        # rank 0 announced no port
    (("plain",), {"plain": 5}, "", None),                                         # not an addr_pid_n id
    ((), {}, "", None),
])
def test_master_of(members, ports, master, addr_port):
    wants = Wants(joined=tuple(members), ports=tuple(sorted(ports.items())))
    assert master_of(members, wants) == master
    assert Go(1, len(members), 0, master).master_addr_port == addr_port


@pytest.mark.parametrize(("max_nodes", "buckets"), [(1, 1), (16, 1), (17, 2), (1025, 65), (1920, 120), (100_000, 120)])
def test_buckets_for(max_nodes, buckets):
    assert buckets_for(max_nodes) == buckets


def test_buckets_carry_go_and_each_nodes_assignment_once():
    go = Go(3, 3, 17, "10.0.0.5:29500").encode()
    nodes = [f"10.0.0.{i}_12_0" for i in range(40)]
    assign = [(n, encode_assignment(i if i < 3 else -1, 3)) for i, n in enumerate(nodes)]
    values = encode_buckets(go, assign, 4)
    assert len(values) == 4 and all(v.split(b"\n")[0] == go for v in values)
    for i, n in enumerate(nodes):
        got_go, mine = decode_bucket(values[bucket_of(n, 4)], n)
        assert got_go == Go(3, 3, 17, "10.0.0.5:29500") and assignment(mine) == ((i if i < 3 else -1), 3)
    assert decode_bucket(values[0], "not_in_it_0") == (Go(3, 3, 17, "10.0.0.5:29500"), None)
    assert decode_bucket(values[bucket_of("10.0.0.1_12_0", 4)], "10.0.0.1_12") [1] is None  # a prefix is no match
    assert bucket_of("10.0.0.1_12_0", 4) == bucket_of("10.0.0.1_12_0", 4) and {bucket_of(n, 4) for n in nodes} == {0, 1, 2, 3}


N = [f"10.0.0.{i}_7_0" for i in range(1, 9)]  # ranked: by address


@pytest.mark.parametrize(("name", "prev", "members", "spares", "added", "removed"), [
    ("a planned leave", Record(4, tuple(N[:4])), N[:3], (), (), (N[3],)),
    ("a loss in the middle", Record(4, tuple(N[:4])), [N[0], N[2], N[3]], (), (), (N[1],)),
    ("a join that ranks first", Record(4, tuple(N[1:4])), N[:4], (), (N[0],), ()),
    ("a join and a leave at once", Record(4, tuple(N[:3])), [N[0], N[1], N[5]], (), (N[5],), (N[2],)),
    ("a spare carried", Record(4, tuple(N[:2])), N[:2], (N[6],), (), ()),
    ("nothing changed", Record(4, tuple(N[:2])), N[:2], (), (), ()),
])
def test_a_change_derives_the_next_rounds_members(name, prev, members, spares, added, removed):
    ch = change_of(prev, members, spares)
    assert ch == Change(prev.round, added, removed, tuple(spares), members_digest(members)), name
    assert apply_change(prev, ch) == tuple(members), name
    go = Go(7, len(members), 30, "10.0.0.1:29500", ch)
    assert Go.decode(go.encode()) == go and decode_bucket(encode_buckets(go.encode(), [], 1)[0], "x")[0] == go


def test_no_change_for_the_first_round_or_a_big_one_and_a_wrong_base_or_digest_derives_nothing():
    many = [f"10.1.{i // 250}.{i % 250}_7_0" for i in range(CHANGE_MAX + 1)]
    assert change_of(NO_RECORD, N[:2], ()) is None  # the first round: every member reads the record
    assert change_of(Record(0, ()), sorted(many), ()) is None  # a mass arrival: the record too
    assert change_of(Record(0, ()), sorted(many)[:CHANGE_MAX], ()) is not None
    ch = change_of(Record(4, tuple(N[:4])), N[:3], ())
    assert apply_change(Record(3, tuple(N[:4])), ch) is None  # not the round the change is of
    assert apply_change(Record(4, tuple(N[:5])), ch) is None  # another member list under that round: digest
    assert Change.decode("not json") is None and Change.decode("[1, 2]") is None
    assert Go.decode(b"3 2 42 10.0.0.5:29500|garbage") == Go(3, 2, 42, "10.0.0.5:29500", None)


# -- a restarted store: what a member republishes ------------------------------------------------------------
HELD = Record(3, ("a", "b"), ("s",), consumed=7, term=2)
HELD_GO = Go(2, 2, 7)


@pytest.mark.parametrize(("name", "rec", "go", "cur", "want"), [
    ("store empty after its restart", None, None, -1, Republish.PUBLISH),
    ("a peer republished the same round", HELD.encode(), HELD_GO.encode(), 3, Republish.SAME),
    ("same round, cur not raised yet", HELD.encode(), HELD_GO.encode(), -1, Republish.SAME),
    ("a peer between its record and its go", HELD.encode(), None, -1, Republish.PUBLISH),
    ("go there, record not yet (identical go)", None, HELD_GO.encode(), 3, Republish.PUBLISH),
    ("another world under the round: other members", Record(3, ("a", "c"), (), 7, 2).encode(), Go(2, 2, 7).encode(), 3,
     Republish.CONFLICT),
    ("another world under the round: another term's go", None, Go(5, 1, 0).encode(), 3, Republish.CONFLICT),
    ("same members, another log position", Record(3, ("a", "b"), ("s",), 9, 2).encode(), None, 3, Republish.CONFLICT),
    ("record without its spares", Record(3, ("a", "b"), (), 7, 2).encode(), HELD_GO.encode(), 3, Republish.CONFLICT),
    ("a torn go", None, b"garbage", 3, Republish.CONFLICT),
    ("a torn record", b"{not json", None, 3, Republish.CONFLICT),
    ("the store is past the round", None, None, 4, Republish.MOVED_ON),
    ("the store is past the round, whatever is under it", b"{not json", b"x", 9, Republish.MOVED_ON),
])
def test_republish_action(name, rec, go, cur, want):
    assert republish_action(HELD, HELD_GO, rec, go, cur) is want, name


@pytest.mark.parametrize(("there", "floor", "want"), [
    (None, 7, b"7"),          # absent (restarted store): set it
    (b"0", 7, b"7"),          # a counter that restarted below the held position
    (b"3", 7, b"7"),
    (b"7", 7, None),          # there already
    (b"12", 7, None),         # past it (announcements after the restart): left alone
    (b"junk", 7, b"7"),       # unreadable: replaced
    (b"", 0, b"0"),
])
def test_floor_value(there, floor, want):
    assert floor_value(there, floor) == want


@pytest.mark.parametrize(("there", "term", "want"), [
    (None, 2, b"2 -"),             # no lease after the restart: vacant at the round's term
    (b"1 x_1_0", 2, b"2 -"),        # a decider after the restart took a lower term: the next takes 3
    (b"2 -", 2, None),
    (b"2 x_1_0", 2, None),
    (b"5 x_1_0", 2, None),          # newer terms stand
    (b"junk", 2, b"2 -"),
])
def test_lease_floor(there, term, want):
    assert lease_floor(there, term) == want


@pytest.mark.parametrize(("entries", "round_", "want"), [
    ([], 3, set()),
    ([Entry("b", JOIN, 3)], 3, {"b"}),                            # went back to the rendezvous (re-forms, restarted)
    ([Entry("b", LEAVE, 3)], 3, {"b"}),                           # planned leave
    ([Entry("a", EVICT, 3)], 3, {"a"}),                           # evicted on evidence about this round
    ([Entry("a", EVICT, 2)], 3, set()),                           # evidence about an older round: not this one
    ([Entry("c", JOIN, 3), Entry("a", EVICT, 3)], 3, {"a", "c"}),  # the partition case: decider's join + its evict
])
def test_moved_since(entries, round_, want):
    assert moved_since(entries, round_) == want
