"""Issue 43 item 2 (second half): a node whose world is smaller than another job on the same
rendezvous store expects (a mistyped job id), and nodes of one job that disagree on min/max nodes."""

from __future__ import annotations

import datetime
import json
import time

import pytest
import structlog
import torch.distributed as dist

from trainguard.agent.census import JOBS_KEY, OUTAGE, JobRecord, census_warnings, check_census


def rec(job: str, mn: int, mx: int, nodes: int, node: str = "n") -> JobRecord:
    return JobRecord(job_id=job, min_nodes=mn, max_nodes=mx, nodes=nodes, node=node)


@pytest.mark.parametrize("me, same, others, events", [
    # the mistyped id: alone (1 node, its own min 1) beside walk-job-1, which expects 2
    (rec("walk-job-l", 1, 2, 1), None, [rec("walk-job-1", 2, 2, 2)], ["world_smaller_than_expected"]),
    # a job of its own next to a smaller one: nothing to say
    (rec("big", 2, 4, 2), None, [rec("small", 1, 1, 1)], []),
    # as many nodes as the other job's min: nothing
    (rec("a", 1, 4, 2), None, [rec("b", 2, 4, 3)], []),
    # alone on its store: nothing can be known
    (rec("a", 1, 2, 1), None, [], []),
    # a record of its own job by another node with other bounds
    (rec("a", 1, 2, 1, "n1"), rec("a", 2, 2, 2, "n2"), [], ["rendezvous_config_mismatch"]),
    # ... its own previous record (same node) is no disagreement
    (rec("a", 1, 2, 1, "n1"), rec("a", 2, 2, 2, "n1"), [], []),
    # its own job in the others' list is never "another job"
    (rec("a", 1, 2, 1), None, [rec("a", 2, 2, 2)], []),
    # item 6: one node restarted with another checkpoint.interval
    (JobRecord("a", 2, 2, 2, "n1", checkpoint_interval="90s"), JobRecord("a", 2, 2, 2, "n2", checkpoint_interval="auto"),
     [], ["checkpoint_interval_mismatch"]),
    (JobRecord("a", 2, 2, 2, "n1", checkpoint_interval="auto"), JobRecord("a", 2, 2, 2, "n2", checkpoint_interval="auto"),
     [], []),
    # a mismatched --nproc-per-node across nodes (torchrun forms the odd world silently)
    (JobRecord("a", 2, 2, 2, "n1", nproc_per_node=8), JobRecord("a", 2, 2, 2, "n2", nproc_per_node=4), [],
     ["nproc_per_node_mismatch"]),
    (JobRecord("a", 2, 2, 2, "n1", nproc_per_node=8), JobRecord("a", 2, 2, 2, "n2"), [], []),  # an older agent: unknown
    (rec("x", 1, 3, 1, "n1"), rec("x", 1, 4, 1, "n2"), [rec("y", 3, 3, 3), rec("z", 2, 2, 2)],
     ["world_smaller_than_expected", "rendezvous_config_mismatch"]),
])
def test_census_table(me, same, others, events):
    assert [w.event for w in census_warnings(me, same, others)] == events


def test_the_warning_names_the_other_job_the_key_and_the_fix():
    [w] = census_warnings(rec("walk-job-l", 1, 2, 1), None, [rec("walk-job-1", 2, 2, 2), rec("tiny", 1, 1, 1)])
    with structlog.testing.capture_logs() as logs:
        w.log()
    [line] = logs
    assert (line["other_job"], line["other_min_nodes"], line["nodes"]) == ("walk-job-1", 2, 1)
    assert "agent.job_id (TRAINGUARD_AGENT_JOB_ID" in line["fix"] and line["log_level"] == "error"


@pytest.mark.timeout(30)
def test_two_jobs_on_one_real_tcp_store():
    """Through a real TCPStore (as `trainguard store` serves it): walk-job-1's two nodes publish first;
    the mistyped node's agent then finds walk-job-1 and logs one error line; walk-job-1's nodes stay
    quiet; the store holds both records."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    with structlog.testing.capture_logs() as logs:
        assert check_census(client, rec("walk-job-1", 2, 2, 2, "node-0")) == []
        assert check_census(host, rec("walk-job-1", 2, 2, 2, "node-1")) == []
        found = check_census(client, rec("walk-job-l", 1, 2, 1, "node-2"))
        assert check_census(host, rec("walk-job-1", 2, 2, 2, "node-0")) == []  # a re-formation later: quiet
    assert [w.event for w in found] == ["world_smaller_than_expected"]
    errors = [e for e in logs if e["log_level"] == "error"]
    assert [(e["event"], e["job_id"], e["other_job"]) for e in errors] == [
        ("world_smaller_than_expected", "walk-job-l", "walk-job-1")]
    assert sorted(bytes(host.get(JOBS_KEY)).decode().split()) == ["walk-job-1", "walk-job-l"]


@pytest.fixture(autouse=True)
def _store_up():
    OUTAGE.since = None  # the latch is per process: each test starts with the store answering
    yield
    OUTAGE.since = None


def test_an_outage_is_one_line_and_its_end_another():
    """Every keep-alive interval reads and writes the census: a store that is down fails each of them, and
    used to log ``census_unavailable`` each time. Once per outage now, and ``census_available`` at its end."""
    class Flaky:
        down = True

        def check(self, keys):
            if self.down:
                raise ConnectionResetError("store gone")
            return False

        def append(self, key, value):
            pass

        def set(self, key, value):
            pass

    store = Flaky()
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            assert check_census(store, rec("a", 1, 1, 1)) == []
        store.down = False
        assert check_census(store, rec("a", 1, 1, 1)) == []
        assert check_census(store, rec("a", 1, 1, 1)) == []
        store.down = True
        assert check_census(store, rec("a", 1, 1, 1)) == []
    assert [e["event"] for e in logs] == ["census_unavailable", "census_available", "census_unavailable"]


def test_a_store_that_fails_is_only_a_hint():
    class Broken:
        def check(self, keys):
            raise ConnectionResetError("store gone")

    with structlog.testing.capture_logs() as logs:
        assert check_census(Broken(), rec("a", 1, 1, 1)) == []
        assert check_census(None, rec("a", 1, 1, 1)) == []
    assert [e["event"] for e in logs] == ["census_unavailable"]


@pytest.mark.timeout(30)
def test_every_node_exports_the_jobs_effective_interval():
    """Item 6: with `interval: auto` only the node of global rank 0 runs the controller; the other node
    exported 0 ("off") or its own, unused, setting. Through a real TCPStore the deciding node publishes
    what it exports and the other node exports that."""
    from trainguard.agent.census import share_interval
    from trainguard.metrics.agent import AgentMetrics
    from trainguard.metrics.config import CostConfig, MetricsConfig

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))
    a = AgentMetrics(MetricsConfig(port=0), CostConfig(), "node-a", job_id="j", start_sampler=False)
    b = AgentMetrics(MetricsConfig(port=0), CostConfig(), "node-b", job_id="j", start_sampler=False)

    def exported(m):
        return {s.name: s.value for f in m.registry.collect() for s in f.samples}["trainguard_checkpoint_interval_seconds"]

    try:
        a.set_checkpoint_interval(120.0)  # what rank 0's controller chose (auto)
        b.set_checkpoint_policy(30.0, 0)  # node b restarted with TRAINGUARD_CHECKPOINT_INTERVAL=30s
        assert share_interval(host, "j", "node-b", decides=False, metrics=b) is None  # nothing published yet
        assert exported(b) == 30.0
        assert share_interval(host, "j", "node-a", decides=True, metrics=a) == 120.0
        assert share_interval(host, "j", "node-b", decides=False, metrics=b) == 120.0
        assert exported(a) == exported(b) == 120.0
        b.set_checkpoint_policy(45.0, 0)  # its own setting changes again: still not in effect
        assert exported(b) == 120.0 and b.checkpoint_interval_here() == 45.0
        a.set_checkpoint_interval(60.0)  # the controller moves: every node follows at the next share
        share_interval(host, "j", "node-a", decides=True, metrics=a)
        share_interval(host, "j", "node-b", decides=False, metrics=b)
        assert exported(b) == 60.0
        share_interval(host, "j", "node-b", decides=True, metrics=b)  # b now hosts rank 0: its own value
        assert exported(b) == 45.0
    finally:
        a.close()
        b.close()


def _ns(node, gr, ranks, step, rate, ck, ck_t, cost, t):
    from trainguard.agent.census import NodeStatus

    return NodeStatus(node=node, group_rank=gr, ranks=ranks, state="running", step=step, samples_per_second=rate,
                      last_checkpoint_step=ck, last_checkpoint_unix_s=ck_t, cost=cost, currency="USD",
                      agent_start_unix_s=0.0, unix_s=t)


def test_job_view_from_node_records():
    """Item 7: members by group rank with their ranks, the job's step and rate, the newest commit, and the
    cost of every node seen, a spot node gone 100 s ago included."""
    from trainguard.agent.census import format_job, job_view

    now = 1000.0
    v = job_view([_ns("b", 1, (2, 3), 266, 40.0, 250, 990.0, 1.5, now - 1),
                  _ns("a", 0, (0, 1), 267, 41.0, 260, 995.0, 2.0, now - 2),
                  _ns("spot", 2, (4, 5), 120, 40.0, 100, 500.0, 0.25, now - 100)], now=now)
    assert [(m["node"], m["ranks"]) for m in v["members"]] == [("a", [0, 1]), ("b", [2, 3])]
    assert (v["step"], v["samples_per_second"], v["last_checkpoint_step"], v["last_checkpoint_age_s"]) == (267, 81.0, 260, 5.0)
    assert v["cost"] == 3.75 and [g["node"] for g in v["gone"]] == ["spot"]
    text = format_job(v)
    assert "2 node(s); step 267; 81.0 samples/s" in text and "step 260, 5 s ago" in text and "3.7500 USD" in text
    assert "a                 0           0-1" in text and "spot              gone" in text


@pytest.mark.timeout(30)
def test_any_node_sees_the_job_through_the_store():
    """Item 7 through a real TCPStore: each node's agent publishes its own view (from its metrics
    registry); either node reads both (the first node's view before the second published: itself only)."""
    from trainguard.agent.census import job_view, node_status, share_status
    from trainguard.metrics.agent import AgentMetrics
    from trainguard.metrics.config import CostConfig, MetricsConfig

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))
    ms = [AgentMetrics(MetricsConfig(port=0), CostConfig(spot_price_per_hour=3.6), f"node-{i}", job_id="j",
                       start_sampler=False) for i in range(2)]
    try:
        for i, m in enumerate(ms):
            m.set_state("running")
            m.set_world(4, 2, 1)
            m.set_stored_commit(120 + i, 1.0)
        first = share_status(host, "j", node_status("node-0", 0, (0, 1), ms[0].view(), ms[0].started_unix_s))
        assert [r.node for r in first] == ["node-0"]
        both = share_status(host, "j", node_status("node-1", 1, (2, 3), ms[1].view(), ms[1].started_unix_s))
        again = share_status(host, "j", node_status("node-0", 0, (0, 1), ms[0].view(), ms[0].started_unix_s))
        for records in (both, again):
            v = job_view(records)
            assert [(m["node"], m["ranks"], m["state"]) for m in v["members"]] == [
                ("node-0", [0, 1], "running"), ("node-1", [2, 3], "running")]
            assert v["last_checkpoint_step"] == 121 and v["cost"] >= 0 and v["currency"] == "USD"
    finally:
        for m in ms:
            m.close()


class CountingStore:
    """An in-memory store with TCPStore's calls (append, check, get, set, multi_get) that counts the records read."""

    def __init__(self):
        self.d, self.reads = {}, 0

    def set(self, k, v):
        self.d[k] = bytes(v)

    def append(self, k, v):
        self.d[k] = self.d.get(k, b"") + bytes(v)

    def check(self, ks):
        return all(k in self.d for k in ks)

    def get(self, k):
        self.reads += 1
        return self.d[k]

    def multi_get(self, ks):
        self.reads += len(ks)
        return [self.d[k] for k in ks]


def test_only_the_first_two_nodes_read_every_record_the_others_read_the_view_on_demand():
    """Issue 40: the job's status is O(N) per interval, not O(N^2). With 64 nodes, only group ranks 0 and 1
    read every record (and publish the job's view); the other 62 publish their own and read nothing; any
    node's `trainguard status` reads the view once."""
    from trainguard.agent.census import NodeStatus, STATUS_READERS, read_view, share_status

    store, n, now = CountingStore(), 64, time.time()

    def rec(i):
        return NodeStatus(node=f"node-{i}", group_rank=i, ranks=(i,), state="running", step=100 + i, samples_per_second=2.0,
                          last_checkpoint_step=90, last_checkpoint_unix_s=now - 5, cost=0.5, currency="USD",
                          agent_start_unix_s=now - 60, unix_s=now)

    for i in range(n):  # the first interval: everyone publishes (the readers see those before them)
        share_status(store, "j", rec(i), reads_all=i < STATUS_READERS)
    store.reads = 0
    got = {i: share_status(store, "j", rec(i), reads_all=i < STATUS_READERS) for i in range(n)}  # one interval
    assert store.reads <= STATUS_READERS * (n + 1)  # O(N): the two readers' reads, nobody else's
    assert all(len(got[i]) == n for i in range(STATUS_READERS))
    assert all([r.node for r in got[i]] == [f"node-{i}"] for i in range(STATUS_READERS, n))
    store.reads = 0
    view = read_view(store, "j")
    assert store.reads == 1
    assert [m["node"] for m in view["members"]] == [f"node-{i}" for i in range(n)]
    assert view["step"] == 100 + n - 1 and view["last_checkpoint_step"] == 90
    assert read_view(CountingStore(), "j") is None  # no reader published yet
    assert read_view(None, "j") is None
