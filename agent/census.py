"""The jobs that share one rendezvous store, and what a node's world should be by them.

Why: a node with a mistyped ``agent.job_id`` (``walk-job-l`` for ``walk-job-1``) joins *another*
rendezvous on the same store, forms a world of 1 (its own ``min_nodes`` allows it) and trains alone. It
cannot see the other job's rendezvous (keys are prefixed by the job id, and a ``TCPStore`` cannot list
keys), so every agent publishes what its job expects under keys outside any job's prefix:

* ``trainguard/census/jobs``: job ids, appended (``store.append``: atomic, one line per agent life);
* ``trainguard/census/job/<job_id>``: :class:`JobRecord` JSON, rewritten by every node of the job at each
  completed rendezvous (the last writer wins: they hold the same job's view).

After its rendezvous, an agent reads the others' records and :func:`census_warnings` (pure, table-tested)
says what is wrong: its world has fewer nodes than another job on the same store expects as its
``min_nodes`` (the likely mistyped id: ``world_smaller_than_expected``, an error line naming
``agent.job_id`` / ``TRAINGUARD_AGENT_JOB_ID``), or its own job's nodes disagree on
``rendezvous.min_nodes`` / ``max_nodes`` (``rendezvous_config_mismatch``) or on ``checkpoint.interval``
(``checkpoint_interval_mismatch``: only the node of global rank 0 decides when the job saves) or on
``workers.nproc_per_node`` (``nproc_per_node_mismatch``). And
:func:`share_interval`: that node publishes the interval it exports, the others export it too. A node of a job that stands
alone on its store (``etcd``, or a store per job) cannot know what it should expect: nothing is said.
Never raises (a census is a hint).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from trainguard.agent.storecall import read_many
from trainguard.contract.log import get_logger

log = get_logger("trainguard.agent.census")

JOBS_KEY = "trainguard/census/jobs"
RECORD_PREFIX = "trainguard/census/job/"
MAX_JOBS = 64
"""The most other jobs read per check (a store shared by hundreds of jobs is not the case to optimise)."""


class _JsonRecord:
    """``to_json`` / ``from_json`` of a record dataclass (unknown keys from a newer agent are dropped;
    anything malformed reads as None)."""

    __slots__ = ()

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, data: bytes) -> Any:
        try:
            d = json.loads(data)
            known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
            return cls(**cls._coerce({k: v for k, v in d.items() if k in known}))
        except (ValueError, KeyError, TypeError):
            return None

    @staticmethod
    def _coerce(d: dict[str, Any]) -> dict[str, Any]:
        return d


@dataclass(frozen=True, slots=True)
class JobRecord(_JsonRecord):
    """What one job expects, as its newest node saw it at its last completed rendezvous."""

    job_id: str
    min_nodes: int
    max_nodes: int
    nodes: int
    """Nodes in the job's newest world."""
    node: str
    """The node that wrote the record."""
    unix_s: float = 0.0
    checkpoint_interval: str = ""
    """The node's ``checkpoint.interval`` as configured (``auto``, ``50``, ``90s``, ``off``)."""
    nproc_per_node: int = 0
    """The node's ``workers.nproc_per_node`` (0: unknown)."""

    @staticmethod
    def _coerce(d: dict[str, Any]) -> dict[str, Any]:
        ints = ("min_nodes", "max_nodes", "nodes", "nproc_per_node")
        return {**d, **{k: int(d[k]) for k in ints if k in d}}


@dataclass(frozen=True, slots=True)
class SmallerWorld:
    """This node's world has fewer nodes than another job on the same store expects as its ``min_nodes``."""

    me: JobRecord
    other: JobRecord
    other_jobs: tuple[str, ...]
    event = "world_smaller_than_expected"

    def log(self) -> None:
        me, o = self.me, self.other
        log.error("world_smaller_than_expected", job_id=me.job_id, nodes=me.nodes, min_nodes=me.min_nodes,
                  other_job=o.job_id, other_min_nodes=o.min_nodes, other_nodes=o.nodes, other_jobs=list(self.other_jobs),
                  effect=f"this node trains in a world of {me.nodes} node(s) of job {me.job_id!r}, while job "
                         f"{o.job_id!r} on the same rendezvous store expects at least {o.min_nodes}",
                  fix=f"if this node belongs to {o.job_id!r}, stop it and fix agent.job_id (TRAINGUARD_AGENT_JOB_ID, "
                      f"--rdzv-id); if it is a job of its own, ignore this line")


@dataclass(frozen=True, slots=True)
class ConfigMismatch:
    """The nodes of one job disagree on ``rendezvous.min_nodes`` / ``max_nodes``."""

    me: JobRecord
    other: JobRecord
    event = "rendezvous_config_mismatch"

    def log(self) -> None:
        me, o = self.me, self.other
        log.error("rendezvous_config_mismatch", job_id=me.job_id, min_nodes=me.min_nodes, max_nodes=me.max_nodes,
                  other_node=o.node, other_min_nodes=o.min_nodes, other_max_nodes=o.max_nodes,
                  effect="the nodes of one job disagree on the world they may form: a node with a smaller min_nodes "
                         "can start a world the others would not",
                  fix="set the same rendezvous.min_nodes / max_nodes (TRAINGUARD_RENDEZVOUS_MIN_NODES / _MAX_NODES) "
                      "on every node of the job")


@dataclass(frozen=True, slots=True)
class IntervalMismatch:
    """The nodes of one job are configured with different ``checkpoint.interval``s: only the node of
    global rank 0 decides when the job saves, so the others' setting is not in effect."""

    me: JobRecord
    other: JobRecord
    event = "checkpoint_interval_mismatch"

    def log(self) -> None:
        me, o = self.me, self.other
        log.error("checkpoint_interval_mismatch", job_id=me.job_id, checkpoint_interval=me.checkpoint_interval,
                  other_node=o.node, other_checkpoint_interval=o.checkpoint_interval,
                  effect="the job saves at the interval of the node that hosts global rank 0, whatever the others "
                         "say; every node exports that effective value as trainguard_checkpoint_interval_seconds",
                  fix="set the same checkpoint.interval (TRAINGUARD_CHECKPOINT_INTERVAL) on every node and restart "
                      "the node of global rank 0 to change it")


@dataclass(frozen=True, slots=True)
class NprocMismatch:
    """The nodes of one job start different numbers of workers: torch forms an uneven world (ranks per
    node differ, a global batch split by world size changes with who is in)."""

    me: JobRecord
    other: JobRecord
    event = "nproc_per_node_mismatch"

    def log(self) -> None:
        me, o = self.me, self.other
        log.error("nproc_per_node_mismatch", job_id=me.job_id, nproc_per_node=me.nproc_per_node, other_node=o.node,
                  other_nproc_per_node=o.nproc_per_node,
                  effect="the world has an uneven number of ranks per node (torchrun does the same without a word)",
                  fix="set the same workers.nproc_per_node (TRAINGUARD_WORKERS_NPROC_PER_NODE, --nproc-per-node) on "
                      "every node of the job")


Finding = SmallerWorld | ConfigMismatch | IntervalMismatch | NprocMismatch


def census_warnings(me: JobRecord, same_job: JobRecord | None, others: list[JobRecord]) -> list[Finding]:
    """What is wrong with ``me`` (this node's job and world) given the record its job held before this
    node wrote (``same_job``, from another node) and the records of the other jobs on the store (pure)."""
    out: list[Finding] = []
    bigger = sorted((o for o in others if o.job_id != me.job_id and me.nodes < o.min_nodes),
                    key=lambda o: (-o.min_nodes, o.job_id))
    if bigger:
        out.append(SmallerWorld(me, bigger[0], tuple(x.job_id for x in bigger[:10])))
    if same_job is not None and same_job.node != me.node and (same_job.min_nodes, same_job.max_nodes) != (
            me.min_nodes, me.max_nodes):
        out.append(ConfigMismatch(me, same_job))
    if (same_job is not None and same_job.node != me.node and same_job.checkpoint_interval and me.checkpoint_interval
            and same_job.checkpoint_interval != me.checkpoint_interval):
        out.append(IntervalMismatch(me, same_job))
    if (same_job is not None and same_job.node != me.node and same_job.nproc_per_node and me.nproc_per_node
            and same_job.nproc_per_node != me.nproc_per_node):
        out.append(NprocMismatch(me, same_job))
    return out


class _Outage:
    """One ``census_unavailable`` line per outage, not one per keep-alive interval: the census is read and
    written every interval, and a store that is down fails each of them. ``census_available`` says when
    it answers again. Per process (one agent)."""

    def __init__(self) -> None:
        self.since: float | None = None

    def failed(self, e: BaseException) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.info("census_unavailable", error=f"{type(e).__name__}: {e}"[:300],
                     effect="no census hints until the store answers (logged once per outage)")

    def answered(self) -> None:
        if self.since is not None:
            log.info("census_available", unavailable_s=round(time.monotonic() - self.since, 1))
            self.since = None


OUTAGE = _Outage()


def _get(store: Any, key: str) -> bytes | None:
    return bytes(store.get(key)) if store.check([key]) else None


def check_census(store: Any, me: JobRecord) -> list[Finding]:
    """Read the other jobs' records and this job's previous one, publish ``me``, log and return the
    findings. ``store``: the raw rendezvous store (not prefixed by a job); None: no census (etcd)."""
    if store is None:
        return []
    try:
        raw = _get(store, JOBS_KEY) or b""
        jobs = sorted({j for j in raw.decode(errors="replace").split("\n") if j and j != me.job_id})[:MAX_JOBS]
        others = [r for j in jobs if (b := _get(store, RECORD_PREFIX + j)) is not None
                  and (r := JobRecord.from_json(b)) is not None]
        prev = _get(store, RECORD_PREFIX + me.job_id)
        same = JobRecord.from_json(prev) if prev is not None else None
        store.set(RECORD_PREFIX + me.job_id, me.to_json())
        if me.job_id not in raw.decode(errors="replace").split("\n"):
            store.append(JOBS_KEY, (me.job_id + "\n").encode())
        OUTAGE.answered()
    except Exception as e:  # noqa: BLE001 - a hint must never stop a rendezvous
        OUTAGE.failed(e)
        return []
    found = census_warnings(me, same, others)
    for f in found:
        f.log()
    return found


def record(job_id: str, min_nodes: int, max_nodes: int, nodes: int, node: str, checkpoint_interval: str = "",
           nproc_per_node: int = 0) -> JobRecord:
    return JobRecord(job_id=job_id, min_nodes=min_nodes, max_nodes=max_nodes, nodes=nodes, node=node,
                     unix_s=time.time(), checkpoint_interval=checkpoint_interval, nproc_per_node=nproc_per_node)


INTERVAL_PREFIX = "trainguard/census/interval/"


def share_interval(store: Any, job_id: str, node: str, *, decides: bool, metrics: Any) -> float | None:
    """The job's effective periodic checkpoint interval on every node: the node that hosts global rank 0
    (``decides``) publishes what it exports; the others export that instead of their own (``auto`` on a
    node without rank 0 would otherwise read 0, "off"). Returns the value in effect on this node (None:
    unknown yet). Never raises."""
    if store is None or metrics is None:
        return None
    key = INTERVAL_PREFIX + job_id
    try:
        if decides:
            metrics.set_job_checkpoint_interval(None)
            seconds = float(metrics.checkpoint_interval_here())
            store.set(key, json.dumps({"seconds": seconds, "node": node}).encode())
            OUTAGE.answered()
            return seconds
        if not store.check([key]):
            OUTAGE.answered()
            return None
        seconds = float(json.loads(bytes(store.get(key)))["seconds"])
        OUTAGE.answered()
        metrics.set_job_checkpoint_interval(seconds)
        return seconds
    except Exception as e:  # noqa: BLE001 - observing only
        OUTAGE.failed(e)
        return None


NODES_PREFIX = "trainguard/census/nodes/"
NODE_PREFIX = "trainguard/census/node/"
VIEW_PREFIX = "trainguard/census/view/"
"""+ job id: the job's view (:func:`job_view` JSON) as the last reader published it."""
STATUS_READERS = 2
"""How many nodes (the first by group rank) read every node's status record and publish the job's view."""
MAX_NODES = 4096
"""The most node records a reader reads per interval."""
LEFT_AFTER_S = 30.0
"""A node whose record is older than this is shown as gone (its cost still counts in the job's total)."""


@dataclass(frozen=True, slots=True)
class NodeStatus(_JsonRecord):
    """One node's part of the job-wide picture, published by its agent every keep-alive interval."""

    node: str
    group_rank: int
    ranks: tuple[int, ...]
    state: str
    step: float | None
    samples_per_second: float | None
    last_checkpoint_step: float | None
    last_checkpoint_unix_s: float | None
    cost: float | None
    currency: str
    agent_start_unix_s: float
    unix_s: float

    @staticmethod
    def _coerce(d: dict[str, Any]) -> dict[str, Any]:
        return {**d, "ranks": tuple(int(r) for r in d["ranks"])}


def node_status(node: str, group_rank: int, ranks: tuple[int, ...], view: dict[str, Any], agent_start_unix_s: float,
                now: float | None = None) -> NodeStatus:
    """This node's record from its own ``trainguard status`` view (:func:`trainguard.metrics.status.build_view`)."""
    now = time.time() if now is None else now
    age = view.get("last_checkpoint_age_s")
    return NodeStatus(node=node, group_rank=group_rank, ranks=tuple(ranks), state=str(view.get("state") or "-"),
                      step=view.get("step"), samples_per_second=view.get("samples_per_second"),
                      last_checkpoint_step=view.get("last_checkpoint_step"),
                      last_checkpoint_unix_s=None if age is None else now - age, cost=view.get("cost"),
                      currency=str(view.get("currency") or ""), agent_start_unix_s=agent_start_unix_s, unix_s=now)


def share_status(store: Any, job_id: str, me: NodeStatus, *, reads_all: bool = True) -> list[NodeStatus]:
    """Publish ``me``; a node that ``reads_all`` (one of the world's first :data:`STATUS_READERS` by group
    rank) also reads every node's record of the job (each agent life of each node: the newest per node; one
    ``multi_get``) and publishes the job's view under :data:`VIEW_PREFIX` for the others
    (:func:`read_view`). The records read ([``me``] alone for the others). O(N) store traffic per interval
    for the whole job, not O(N^2): at 1,024 nodes 2 x 1,024 records read per keep-alive interval instead of
    1,024 x 1,024. Never raises: [] when the store cannot be used."""
    if store is None:
        return []
    try:
        key = f"{NODE_PREFIX}{job_id}/{me.node}"
        listed = NODES_PREFIX + job_id
        if not reads_all:
            if not store.check([key]):  # this node's first record: list it once
                store.append(listed, (me.node + "\n").encode())
            store.set(key, me.to_json())
            OUTAGE.answered()
            return [me]
        names = bytes(store.get(listed)).decode(errors="replace").split("\n") if store.check([listed]) else []
        if me.node not in names:
            store.append(listed, (me.node + "\n").encode())
        store.set(key, me.to_json())
        out = [me]
        others = sorted({x for x in names if x and x != me.node})[:MAX_NODES]
        for raw in read_many(store, [f"{NODE_PREFIX}{job_id}/{n}" for n in others]):
            if raw is not None and (r := NodeStatus.from_json(raw)) is not None:
                out.append(r)
        store.set(VIEW_PREFIX + job_id, json.dumps(job_view(out)).encode())
        OUTAGE.answered()
        return out
    except Exception as e:  # noqa: BLE001 - observing only
        OUTAGE.failed(e)
        return []


def read_view(store: Any, job_id: str) -> dict[str, Any] | None:
    """The job's view as a reader last published it (one ``get``; for ``trainguard status`` on a node that
    does not read every record), None when there is none or the store cannot be used. Never raises."""
    if store is None:
        return None
    try:
        key = VIEW_PREFIX + job_id
        if not store.check([key]):
            return None
        v = json.loads(bytes(store.get(key)))
        return v if isinstance(v, dict) and "members" in v else None
    except Exception:  # noqa: BLE001 - observing only
        return None


def job_view(records: list[NodeStatus], now: float | None = None) -> dict[str, Any]:
    """The job-wide picture from the nodes' records (pure): members (by group rank) and the nodes gone,
    the step, the summed rate, the newest commit, and the cost so far of every node seen (nodes that
    left included; each node's cost since its agent started)."""
    now = time.time() if now is None else now
    live = sorted((r for r in records if now - r.unix_s <= LEFT_AFTER_S), key=lambda r: r.group_rank)
    gone = sorted((r for r in records if now - r.unix_s > LEFT_AFTER_S), key=lambda r: r.node)
    steps = [r.step for r in live if r.step is not None]
    commits = [(r.last_checkpoint_step, r.last_checkpoint_unix_s) for r in records if r.last_checkpoint_step is not None]
    rates = [r.samples_per_second for r in live if r.samples_per_second is not None]
    last = max(commits, key=lambda c: (c[0], c[1] or 0.0)) if commits else None
    return {
        "members": [{"node": r.node, "group_rank": r.group_rank, "ranks": list(r.ranks), "state": r.state,
                     "step": r.step, "samples_per_second": r.samples_per_second} for r in live],
        "gone": [{"node": r.node, "last_seen_s": round(now - r.unix_s, 1), "cost": r.cost} for r in gone],
        "step": max(steps) if steps else None,
        "samples_per_second": sum(rates) if rates else None,
        "last_checkpoint_step": None if last is None else last[0],
        "last_checkpoint_age_s": None if last is None or last[1] is None else max(0.0, now - last[1]),
        "cost": sum(r.cost for r in records if r.cost is not None),
        "currency": next((r.currency for r in records if r.currency), ""),
    }


def format_job(v: dict[str, Any]) -> str:
    """The job-wide table ``trainguard status`` prints after the node's own view."""
    def f(x: Any, spec: str) -> str:
        return "-" if x is None else f"{x:{spec}}"

    ckpt = "none yet" if v["last_checkpoint_step"] is None else (
        f"step {v['last_checkpoint_step']:.0f}" + ("" if v["last_checkpoint_age_s"] is None
                                                  else f", {v['last_checkpoint_age_s']:.0f} s ago"))
    lines = ["", f"job               {len(v['members'])} node(s); step {f(v['step'], '.0f')}; "
                 f"{f(v['samples_per_second'], '.1f')} samples/s",
             f"last checkpoint   {ckpt}",
             f"cost so far       {v['cost']:.4f} {v['currency']} (every node seen, those gone included)",
             "NODE              GROUP RANK  RANKS        STATE       STEP"]
    for m in v["members"]:
        r = m["ranks"]
        ranks = "-" if not r else (f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]))
        lines.append(f"{m['node']:<18}{m['group_rank']:<12}{ranks:<13}{m['state']:<12}{f(m['step'], '.0f')}")
    for g in v["gone"]:
        lines.append(f"{g['node']:<18}{'gone':<12}{'-':<13}{'last seen ' + str(g['last_seen_s']) + ' s ago'}")
    return "\n".join(lines) + "\n"


__all__ = ["NodeStatus", "format_job", "job_view", "node_status", "read_view", "share_status", "STATUS_READERS", "VIEW_PREFIX", "INTERVAL_PREFIX", "JOBS_KEY", "ConfigMismatch", "Finding", "IntervalMismatch", "JobRecord", "NprocMismatch", "RECORD_PREFIX",
           "SmallerWorld", "census_warnings", "check_census", "record", "share_interval"]
