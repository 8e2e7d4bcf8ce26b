"""The control plane at scale (issue 40): the agents' real rendezvous path with many simulated nodes,
against a real ``trainguard store`` or etcd (plain or TLS) - how forming and re-forming a world, and the keep-alives, grow
with the number of nodes.

    OMP_NUM_THREADS=1 python bench/control_plane.py [--nodes 8,32,128,512,1024] [--stores tcp,etcd,etcd-tls]
        [--protocols dynamic,keyed] [--baseline-max tcp=128,etcd=128] [--procs 16] [--steady-s 10]
        [--json out.json] [--plot out.png]

Each simulated node is one rendezvous handler built by the agent's own code, for ``--protocols``:
``dynamic`` (the baseline, and the default up to 32 nodes under ``auto``: ``build_handler`` from a
``RendezvousConfig`` that names it, since ``auto`` would choose ``keyed`` above 32 nodes, joined with
``next_round`` and a :class:`~trainguard.agent.elastic.Plan`, left with the exit operation as
``ElasticAdapter.leave`` does; run up to ``--baseline-max`` nodes per store, where it fails or takes
minutes) and ``keyed`` (``rendezvous.protocol: keyed``, :mod:`trainguard.agent.keyed_rendezvous`: joined
with its ``next_round`` and the same plan, left with its ``leave``), running on a thread; after each round
every node reads the round's members (``members()``, as the agent's ``world()`` does); the nodes are
spread over ``--procs`` processes (16 by default: 64 nodes per process at 1,024; with 4, each process ran
~1,000 threads - a node's, its two store clients' call threads, its heartbeat's - whose contention for the
interpreter lock doubled the simulator's CPU: a planned leave at 1,024 nodes on ``trainguard store`` took
10.8 CPU-s of clients at 37fb2a0 with 4 processes, 4.6 with 16; the phases report the clients' CPU and the
node threads' own, so that a figure set by the simulator shows as such). No workers, no training: only the
control plane. Per N, side by side:

==================  ================================================================================
form_s              all N join a fresh rendezvous (the plan names them all): go -> the last node's
                    round complete
leave_s             one node leaves (planned); the other N-1 re-form with the plan naming it as leaving
loss_s              one node vanishes (its keep-alive stops, it never leaves); the others re-form with
                    a lost-member plan: includes the keep-alive expiry (the detection bound,
                    ``keep_alive_interval_s x keep_alive_max_attempts``)
join_s              a new node joins the N-1: it enters the rendezvous 1 s before them (as in the agents,
                    which re-form because a node waits); seconds from the members' start
store ops / bytes   dynamic: get_state / set_state calls of the rendezvous backend and the state bytes
                    moved; keyed: every store request on the wire (TCPStore calls with keys, prefix and
                    values; etcd gateway calls with their JSON, base64 and all: pessimistic next to the
                    baseline); per membership change and per second at steady state (keep-alives only);
                    CAS lost (a compare-and-set that did not write)
state_bytes         the pickled rendezvous state's size after forming
store_cpu           the store process's CPU seconds per wall second at steady state
client_cpu          the simulating processes' CPU seconds per wall second, per node (the simulator
                    itself: a figure that grows with it is the machine, not the store)
phase CPU           (JSON, per phase) ``store_cpu_s``: the store server's CPU seconds in the phase;
                    ``client_cpu_s``: the simulating processes'; ``node_threads_cpu_s``: the nodes' own
                    threads' (their calls, decisions and members read); ``median_s``: the median node's
                    seconds. A phase whose clients use about its wall time x the cores measured the
                    simulator
==================  ================================================================================

The table ends with the fitted growth exponent of each figure (slope of log figure over log N); the
JSON holds every row, the exponents, the load average and the commit; ``--plot`` draws bytes per leave
and per join, keep-alive bytes per second and the re-form seconds over N (log-log).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUND_TIMEOUT_S = 120.0
"""A round not complete by then is reported as an error (the nodes left waiting are abandoned, and the
remaining phases of that N are skipped): the bench never hangs."""


# ---- the participants' process ----------------------------------------------------------------------

class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gets = self.sets = self.cas_lost = self.bytes = 0
        self.kinds: dict[str, float] = {}
        """``n:<call>`` -> requests, ``s:<call>`` -> seconds the callers spent in them (the profile of a phase:
        ``<call>`` is the method and the kind of key, e.g. ``kv/range r/go``)."""

    def kind(self, call: str, seconds: float) -> None:
        with self.lock:
            self.kinds["n:" + call] = self.kinds.get("n:" + call, 0) + 1
            self.kinds["s:" + call] = self.kinds.get("s:" + call, 0.0) + seconds

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return {"gets": self.gets, "sets": self.sets, "cas_lost": self.cas_lost, "bytes": self.bytes, **self.kinds}


def _instrument(counters: _Counters) -> None:
    """Count the rendezvous backends' state reads and compare-and-sets (and their bytes): c10d and etcd."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from trainguard.agent.etcd_rendezvous import EtcdRendezvousBackend

    for cls in (C10dRendezvousBackend, EtcdRendezvousBackend):
        _count(cls, counters)


def _count(cls: Any, counters: _Counters) -> None:
    get0, set0 = cls.get_state, cls.set_state

    def get_state(self: Any) -> Any:
        out = get0(self)
        with counters.lock:
            counters.gets += 1
            counters.bytes += len(out[0]) if out else 0
        return out

    def set_state(self: Any, state: bytes, token: Any = None) -> Any:
        out = set0(self, state, token)
        with counters.lock:
            counters.sets += 1
            counters.bytes += len(state) + (len(out[0]) if out else 0)
            if out is not None and not out[2]:
                counters.cas_lost += 1
        return out

    cls.get_state = get_state
    cls.set_state = set_state


def _size(v: Any) -> int:
    """Bytes of keys and values in a store call's arguments or result (ints count 8)."""
    if v is None or isinstance(v, bool):
        return 0
    if isinstance(v, (bytes, bytearray, str)):
        return len(v)
    if isinstance(v, (int, float)):
        return 8
    if isinstance(v, (list, tuple)):
        return sum(_size(x) for x in v)
    return 0


class _CountingStore:
    """A ``TCPStore`` client (under its ``PrefixStore``) whose requests are counted: one per call, the bytes
    of keys (with the job's prefix) and values both ways; a ``compare_set`` that did not write is a lost CAS."""

    def __init__(self, store: Any, prefix_len: int, counters: _Counters) -> None:
        self._store, self._plen, self._c = store, prefix_len, counters

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)

        def call(*args: Any) -> Any:
            t0 = time.monotonic()
            out = fn(*args)
            keys = args[0] if args and isinstance(args[0], list) else args[:1]
            first = keys[0] if keys else ""
            kind = _tcp_kind(first.decode(errors="replace") if isinstance(first, bytes) else str(first))
            self._c.kind(f"{name} {kind}{' x%d' % len(keys) if len(keys) > 1 else ''}", time.monotonic() - t0)
            with self._c.lock:
                self._c.gets += 1
                self._c.bytes += _size(args) + _size(out) + self._plen * len(keys)
                if name == "compare_set" and bytes(out) != bytes(args[2]):
                    self._c.cas_lost += 1
            return out

        return call


def _tcp_kind(key: str) -> str:
    """The kind of a keyed key on ``trainguard store`` for the profile: ``r/w`` for ``r/3/w/<node>``, ``hb`` for
    ``hb/<node>``, ``j`` for ``j/17`` (no node names: one row per kind, not per node)."""
    parts = [p for p in key.split("/") if p and not p.lstrip("-").isdigit()]
    return "/".join(parts[:2]) if parts and parts[0] == "r" else (parts[0] if parts else "")


def _instrument_keyed(counters: _Counters) -> None:
    """Count the keyed rendezvous's store requests on the wire: TCPStore calls (:class:`_CountingStore`,
    installed per handler by :func:`_count_keyed_handler`) and etcd gateway calls (request and answer JSON,
    base64 and all: pessimistic next to the dynamic baseline's state bytes; a watch counts its request), the gRPC
    lease renewals, the gRPC watches (``grpc watch``: the protobuf messages and their framing) and the gRPC
    transactions (``grpc txn``: the same)."""
    import trainguard.agent.etcd_lease as etcd_lease
    import trainguard.agent.etcd_txn as etcd_txn
    import trainguard.agent.etcd_watch as etcd_watch
    from trainguard.agent.etcd_client import EtcdClient

    call0, watch0, renew0 = EtcdClient.call, EtcdClient._watch, etcd_lease.LeaseStream.renew
    grpc_watch0, grpc_txn0 = etcd_watch.watch_key, etcd_txn.txn

    def call(self: Any, method: str, body: dict[str, Any], **kw: Any) -> Any:
        t0 = time.monotonic()
        out = call0(self, method, body, **kw)
        counters.kind(f"{method} {_key_kind(body)}", time.monotonic() - t0)
        with counters.lock:
            counters.gets += 1
            counters.bytes += len(json.dumps(body)) + len(json.dumps(out))
            if method == "kv/txn" and body.get("compare") and not out.get("succeeded", False):
                counters.cas_lost += 1
        return out

    def watch(self: Any, create: dict[str, Any], timeout_s: float) -> Any:
        # The watch request, and what it answers (the event with the key and its value; 64 bytes without one).
        t0 = time.monotonic()
        out = None
        try:
            out = watch0(self, create, timeout_s)
            return out
        finally:
            counters.kind(f"watch {_key_kind(create)}", time.monotonic() - t0)
            with counters.lock:
                counters.gets += 1
                counters.bytes += len(json.dumps(create)) + (len(json.dumps(out)) if out else 64)

    def renew(self: Any, lease_id: int, timeout_s: float) -> int:
        # A message each way on the open stream: the protobuf, its 5-byte gRPC prefix and a 9-byte HTTP/2 frame
        # header (the response's ~30-byte header counted as 40).
        t0 = time.monotonic()
        try:
            return renew0(self, lease_id, timeout_s)
        finally:
            counters.kind("grpc LeaseKeepAlive", time.monotonic() - t0)
            with counters.lock:
                counters.gets += 1
                counters.bytes += len(etcd_lease.encode_keepalive(lease_id)) + 40 + 2 * (5 + 9)

    def grpc_watch(settings: Any, token_fn: Any, key: bytes, after_revision: int, timeout_s: float) -> Any:
        # A stream on the open channel: HEADERS to open it and RST_STREAM to end it (~64 bytes with HPACK's indexed
        # path and token), the create request, etcd's `created` answer (~40) and the event with the key and its
        # value (~40 of header and revisions), each message with its 5-byte gRPC prefix and 9-byte HTTP/2 frame header.
        t0 = time.monotonic()
        out = None
        try:
            out = grpc_watch0(settings, token_fn, key, after_revision, timeout_s)
            return out
        finally:
            counters.kind(f"grpc watch {_kind_of(key)}", time.monotonic() - t0)
            with counters.lock:
                counters.gets += 1
                counters.bytes += (64 + len(etcd_watch.encode_watch_create(key, after_revision + 1)) + 40 + 2 * (5 + 9)
                                   + (len(out.key) + len(out.value) + 40 + 5 + 9 if out is not None else 0))

    def grpc_txn(settings: Any, token_fn: Any, compare: Any, success: Any, failure: Any = (), **kw: Any) -> Any:
        # A stream on the open channel: HEADERS (~64 bytes with HPACK's indexed path and token) and the request, then
        # etcd's HEADERS (~20), the answer and its trailers (~30); each message with its 5-byte gRPC prefix and
        # 9-byte HTTP/2 frame header. The answer: its header (~30: cluster and member ids, revision, term), ~12 per
        # response and each key with its value and ~20 of revisions and tags.
        t0 = time.monotonic()
        out = None
        try:
            out = grpc_txn0(settings, token_fn, compare, success, failure, **kw)
            return out
        finally:
            body = {"compare": list(compare), "success": list(success)}
            counters.kind(f"grpc txn {_key_kind(body)}", time.monotonic() - t0)
            with counters.lock:
                counters.gets += 1
                counters.bytes += 64 + len(etcd_txn.encode_txn(compare, success, failure)) + 20 + 30 + 2 * (5 + 9)
                if out is not None:
                    counters.bytes += 30 + sum(12 + sum(len(kv.key) + len(kv.value) + 20 for kv in out.kvs(i))
                                               for i in range(len(out.responses)))
                    if compare and not out.succeeded:
                        counters.cas_lost += 1

    EtcdClient.call, EtcdClient._watch = call, watch  # type: ignore[method-assign]
    etcd_lease.LeaseStream.renew = renew  # type: ignore[method-assign]
    etcd_watch.watch_key = grpc_watch  # (membership_kv looks it up on the module at each call)
    etcd_txn.txn = grpc_txn  # (the same)


def _kind_of(key: bytes) -> str:
    """The kind of a keyed-rendezvous key for the profile: ``r/go`` for ``.../k/r/3/go``, ``hb`` for ``.../k/hb/n1``,
    ``store/MASTER_ADDR`` for a round store's key."""
    text = key.decode(errors="replace")
    for mark in ("/k/", "/store/"):
        if mark in text:
            rest = text.split(mark, 1)[1]
            parts = [p for p in rest.split("/") if p and not p.lstrip("-").isdigit()]
            if mark == "/store/":
                return "store/" + (parts[-1] if parts else "")
            return "/".join(parts[:2]) if parts and parts[0] == "r" else (parts[0] if parts else "")
    return "other"


def _key_kind(body: dict[str, Any]) -> str:
    from trainguard.agent.etcd_wire import unb64

    key = body.get("key")
    if key is None:
        ops = body.get("success") or body.get("compare") or []
        if ops:
            first = ops[0]
            inner = first.get("request_put") or first.get("request_range") or first
            key = inner.get("key")
            if key is not None:
                return f"{_kind_of(unb64(key))} x{len(body.get('success', []))}"
        return "lease" if "ID" in body or "TTL" in body else "other"
    return _kind_of(unb64(key))


def _count_keyed_handler(h: Any, counters: _Counters) -> None:
    from trainguard.agent.membership_kv import TcpKv

    def wrap(kv: Any) -> Any:
        if isinstance(kv, TcpKv):
            kv.store = _CountingStore(kv.store, len(f"trainguard.keyed.{h.get_run_id()}/"), counters)
        return kv

    wrap(h._kv)
    wrap(h._hb_kv)


class _Lines:
    """The participants' side of the command channel: JSON lines on stdin / the original stdout (whatever
    else prints - log lines - goes to stderr)."""

    def __init__(self) -> None:
        self.out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def recv(self) -> Any:
        line = sys.stdin.readline()
        if not line:
            return "stop", None
        return tuple(json.loads(line))

    def send(self, obj: Any) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()


class _Proc:
    """The driver's side: one participants' process (``--participants``), commands as JSON lines."""

    def __init__(self, endpoint: str, run_id: str, cfg_kw: dict[str, Any], protocol: str = "dynamic") -> None:
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--participants",
                                   json.dumps({"endpoint": endpoint, "run_id": run_id, "cfg": cfg_kw,
                                               "protocol": protocol})],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)

    def send(self, obj: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self) -> Any:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"a participants' process ended (rc {self.p.poll()})")
        out = json.loads(line)
        return {int(k): v for k, v in out.items()} if isinstance(out, dict) and all(
            k.isdigit() for k in out) else out


def _proc_main(conn: Any, endpoint: str, run_id: str, cfg_kw: dict[str, Any], protocol: str = "dynamic") -> None:
    """Host participants; obey the driver's commands on ``conn``."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from trainguard.agent.config import RendezvousConfig
    from trainguard.agent.elastic import Plan, fresh_reads, next_round
    from trainguard.agent.keyed_stores import create_handler as create_keyed
    from trainguard.agent.rendezvous import build_handler
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    keyed = protocol == "keyed"
    counters = _Counters()
    (_instrument_keyed if keyed else _instrument)(counters)
    handlers: dict[int, Any] = {}
    started: dict[int, threading.Thread] = {}
    out: dict[int, Any] = {}

    def make(i: int) -> None:
        # (the protocol named, not the default: auto would pick keyed for the baseline above 32 nodes)
        cfg = RendezvousConfig(endpoint=endpoint, local_addr=f"n{i}", protocol="keyed" if keyed else "dynamic", **cfg_kw)
        if keyed:
            handlers[i] = create_keyed(cfg, run_id)
            _count_keyed_handler(handlers[i], counters)
            return
        handlers[i] = build_handler(cfg, run_id)
        fresh_reads(handlers[i])  # as ElasticAdapter does

    def name(i: int) -> str:
        return handlers[i].node if keyed else str(handlers[i]._this_node)

    def join(i: int, plan: Any, out: dict[int, Any]) -> None:
        c0 = time.thread_time()
        try:
            h = handlers[i]
            info = h.next_round(lambda: False, plan) if keyed else next_round(h, lambda: False, plan)
            if keyed:  # as ElasticAdapter.world() does on every node after every round (dynamic: from its state)
                h.members()
            out[i] = {"done": time.time(), "rank": info.rank, "world": info.world_size, "cpu": time.thread_time() - c0}
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out[i] = {"error": f"{type(e).__name__}: {e}"[:300], "done": time.time()}

    while True:
        cmd, arg = conn.recv()
        if cmd == "make":
            for i in arg:
                make(i)
            conn.send({i: name(i) for i in arg})
        elif cmd == "join":  # start joining; "collect" waits for the outcome
            plan_kw, who = arg
            plan = Plan(members=frozenset(plan_kw["members"]), leaving=frozenset(plan_kw.get("leaving", ())),
                        lost=bool(plan_kw.get("lost", False)))
            for i in who:
                if i in handlers:
                    started[i] = threading.Thread(target=join, args=(i, plan, out), daemon=True)
                    started[i].start()
            conn.send(True)
        elif cmd == "collect":
            deadline = time.monotonic() + ROUND_TIMEOUT_S
            for i in arg:
                if i in started:
                    started[i].join(max(0.0, deadline - time.monotonic()))
            # (keys go back as JSON strings; the driver turns them into ints)
            conn.send({i: out.pop(i, {"error": f"no round within {ROUND_TIMEOUT_S:g} s", "done": time.time()})
                       for i in arg if started.pop(i, None) is not None})
        elif cmd == "leave":
            h = handlers.pop(arg)
            if keyed:
                h.leave()
            else:
                h._stop_heartbeats()
                h._op_executor.run(_RendezvousExitOp(), time.monotonic() + 60)
            conn.send(True)
        elif cmd == "vanish":  # a frozen node: its heartbeats stop, it never leaves
            h = handlers.pop(arg)
            h.stop_heartbeats() if keyed else h._stop_heartbeats()
            conn.send(True)
        elif cmd == "stats":
            t = os.times()
            conn.send({**counters.snapshot(), "cpu_s": t.user + t.system})
        elif cmd == "stop":
            for h in handlers.values():
                try:
                    h.stop_heartbeats() if keyed else h._stop_heartbeats()
                except Exception:  # noqa: BLE001
                    pass
            conn.send(True)
            return


# ---- the driver -------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        parts = fh.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


class Cluster:
    """N simulated nodes over ``procs`` processes, one store."""

    def __init__(self, n: int, procs: int, cfg_kw: dict[str, Any], store: Any, protocol: str = "dynamic") -> None:
        self.server = store
        cfg_kw = {**cfg_kw, **store.cfg}
        self.run_id = f"cp-{n}-{os.getpid()}"
        self.next_id = n
        self.owner: dict[int, int] = {}
        procs = max(1, min(procs, n))
        self.conns = [_Proc(store.endpoint, self.run_id, cfg_kw, protocol) for _ in range(procs)]
        for i in range(n):
            self.owner[i] = i % procs
        self.names: dict[int, str] = {}
        self._make(list(range(n)))

    def _make(self, ids: list[int]) -> None:
        by: dict[int, list[int]] = {}
        for i in ids:
            by.setdefault(self.owner[i], []).append(i)
        for p, these in by.items():
            self.conns[p].send(("make", these))
        for p in by:
            self.names.update(self.conns[p].recv())

    def add(self) -> int:
        i = self.next_id
        self.next_id += 1
        self.owner[i] = i % len(self.conns)
        self._make([i])
        return i

    def _start(self, who: list[int], plan: dict[str, Any]) -> dict[int, list[int]]:
        by: dict[int, list[int]] = {}
        for i in who:
            by.setdefault(self.owner[i], []).append(i)
        for p, these in by.items():
            self.conns[p].send(("join", (plan, these)))
        for p in by:
            self.conns[p].recv()
        return by

    def round(self, who: list[int], plan: dict[str, Any], first: list[int] = (), lead_s: float = 1.0) -> dict[str, Any]:
        """All of ``who`` join with ``plan``; seconds from go to the last completion. ``first`` (a joiner)
        start ``lead_s`` before the others, who go then: as in the agents, where the members re-form
        because a node is waiting (``num_nodes_waiting``), not at the same instant as it."""
        early = self._start(list(first), plan) if first else {}
        if first:
            time.sleep(lead_s)
        t0 = time.time()
        by = self._start([i for i in who if i not in first], plan)
        for p, these in early.items():
            by.setdefault(p, []).extend(these)
        for p, these in by.items():
            self.conns[p].send(("collect", these))
        out: dict[int, Any] = {}
        for p in by:
            out.update(self.conns[p].recv())
        errors = [v["error"] for v in out.values() if "error" in v]
        worlds = {v.get("world") for v in out.values() if "error" not in v}
        done = sorted(v["done"] - t0 for v in out.values())
        return {"seconds": done[-1], "median_s": done[len(done) // 2], "errors": errors[:3], "n_errors": len(errors),
                "node_threads_cpu_s": round(sum(v.get("cpu", 0.0) for v in out.values()), 3),
                "world_sizes": sorted(w for w in worlds if w is not None)}

    def stats(self) -> dict[str, float]:
        for c in self.conns:
            c.send(("stats", None))
        tot: dict[str, float] = {}
        for c in self.conns:
            for k, v in c.recv().items():
                tot[k] = tot.get(k, 0) + v
        tot["store_cpu_s"] = _cpu_of(self.server.pid)
        return tot

    def call(self, cmd: str, i: int) -> None:
        self.conns[self.owner[i]].send((cmd, i))
        self.conns[self.owner[i]].recv()

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop", None))
                c.recv()
            except Exception:  # noqa: BLE001
                pass
        for c in self.conns:
            try:
                c.p.wait(10)
            except subprocess.TimeoutExpired:
                c.p.kill()
                c.p.wait()


class StoreServer:
    """The rendezvous store the simulated nodes share: ``tcp`` (``trainguard store``), ``etcd`` (plain) or
    ``etcd-tls`` (TLS with client certificates); started per N, so every N starts from an empty store."""

    def __init__(self, kind: str, folder: str) -> None:
        import contextlib

        self.kind = kind
        self._stack = contextlib.ExitStack()
        if kind == "tcp":
            port = _free_port()
            proc = subprocess.Popen([sys.executable, "-m", "trainguard.agent.cli", "store", "--host", "127.0.0.1",
                                     "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._stack.callback(_end, proc)
            _wait_port(port, 30)
            self.pid, self.endpoint = proc.pid, f"127.0.0.1:{port}"
            self.cfg: dict[str, Any] = {"backend": "c10d", "is_host": False}
            return
        from pathlib import Path

        from tests.fixtures.etcd import make_pki, start_etcd

        pki = make_pki(Path(folder) / "pki") if kind == "etcd-tls" else None
        server = self._stack.enter_context(start_etcd(Path(folder) / "etcd", pki=pki))
        self.pid, self.endpoint = server.process.pid, server.endpoint
        self.cfg = {"backend": "etcd"}
        if pki is not None:
            self.cfg.update(ca_file=pki.ca_file, cert_file=pki.client_cert, key_file=pki.client_key)

    def close(self) -> None:
        self._stack.close()


def _end(proc: subprocess.Popen[Any]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the store did not listen on {port} within {timeout} s")


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a.get(k, 0) for k in b}


def measure(n: int, procs: int, steady_s: float, cfg_kw: dict[str, Any], store: str = "tcp",
            protocol: str = "dynamic") -> dict[str, Any]:
    """One N on a fresh ``store`` (:class:`StoreServer`): form, steady keep-alives, a planned leave, an
    unannounced loss, a join; ``protocol``: ``dynamic`` (torch's handler, the baseline) or ``keyed``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tg-cp-") as folder:
        server = StoreServer(store, folder)
        try:
            return _measure(n, procs, steady_s, cfg_kw, server, protocol)
        finally:
            server.close()


def _interval(cfg_kw: dict[str, Any], server: Any, protocol: str) -> int:
    """The keep-alive interval the simulated agents run with (``auto`` resolved as the agent does)."""
    from trainguard.agent.config import auto_keep_alive_interval_s

    given = cfg_kw.get("keep_alive_interval_s")
    backend = "etcd" if server.kind.startswith("etcd") else "c10d"
    return given if given is not None else auto_keep_alive_interval_s(backend, protocol, cfg_kw["max_nodes"])


def _measure(n: int, procs: int, steady_s: float, cfg_kw: dict[str, Any], server: StoreServer,
             protocol: str = "dynamic") -> dict[str, Any]:
    c = Cluster(n, procs, cfg_kw, server, protocol)
    row: dict[str, Any] = {"nodes": n, "store": server.kind, "protocol": protocol, "procs": len(c.conns),
                           "keep_alive_interval_s": _interval(cfg_kw, server, protocol)}
    try:
        everyone = list(range(n))
        _note(row, "form")
        s0 = c.stats()
        r = c.round(everyone, {"members": [c.names[i] for i in everyone]})
        s1 = c.stats()
        row["form"] = {**r, **_ops(_delta(s0, s1))}
        if r["n_errors"]:
            return row
        time.sleep(1.0)
        a = c.stats()
        time.sleep(steady_s)
        b = c.stats()
        d = _delta(a, b)
        row["steady"] = {"ops_per_s": (d["gets"] + d["sets"]) / steady_s, "bytes_per_s": d["bytes"] / steady_s,
                         "cas_lost_per_s": d["cas_lost"] / steady_s, "store_cpu": d["store_cpu_s"] / steady_s,
                         "client_cpu_per_node": d["cpu_s"] / steady_s / n}
        members = [c.names[i] for i in everyone]
        _note(row, "leave")  # planned leave of the last node
        gone = everyone[-1]
        s0 = c.stats()
        c.call("leave", gone)
        rest = everyone[:-1]
        r = c.round(rest, {"members": members, "leaving": [c.names[gone]]})
        row["leave"] = {**r, **_ops(_delta(s0, c.stats()))}
        if r["n_errors"]:
            return row
        _note(row, "loss")  # unannounced loss of another node
        lost = rest[-1]
        s0 = c.stats()
        c.call("vanish", lost)
        rest2 = rest[:-1]
        r = c.round(rest2, {"members": [c.names[i] for i in rest], "lost": True})
        row["loss"] = {**r, **_ops(_delta(s0, c.stats()))}
        if r["n_errors"]:
            return row
        _note(row, "join")
        new = c.add()
        s0 = c.stats()
        r = c.round([*rest2, new], {"members": [c.names[i] for i in rest2]}, first=[new])
        row["join"] = {**r, **_ops(_delta(s0, c.stats()))}
    finally:
        c.close()
    return row


def _note(row: dict[str, Any], phase: str) -> None:
    print(f"{row['store']}/{row.get('protocol', 'dynamic')} N={row['nodes']}: {phase}", file=sys.stderr, flush=True)


def _ops(d: dict[str, float]) -> dict[str, float]:
    profile = {k[2:]: {"requests": int(v), "client_s": round(d.get("s:" + k[2:], 0.0), 3)}
               for k, v in sorted(d.items()) if k.startswith("n:") and v}
    # The phase's CPU: the store server's and all simulating processes' together (on a 2-core machine a
    # phase whose clients use more than its wall x cores measures the simulator, not the control plane).
    return {"ops": d["gets"] + d["sets"], "bytes": d["bytes"], "cas_lost": d["cas_lost"], "profile": profile,
            "store_cpu_s": round(d.get("store_cpu_s", 0.0), 3), "client_cpu_s": round(d.get("cpu_s", 0.0), 3)}


# ---- the hang watch's store load (issue 40, part 2) --------------------------------------------------

class _HangStore:
    """An in-memory store that counts the hang watch's requests and their bytes (keys and values both ways):
    what one exchange of every node costs the store, without a store to saturate."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}
        self.ops = self.bytes = 0

    def set(self, k: str, v: bytes) -> None:
        self.ops += 1
        self.bytes += len(k) + len(v)
        self.d[k] = v

    def check(self, ks: list[str]) -> bool:
        self.ops += 1
        self.bytes += sum(len(k) for k in ks)
        return all(k in self.d for k in ks)

    def get(self, k: str) -> bytes:
        self.ops += 1
        self.bytes += len(k) + len(self.d[k])
        return self.d[k]

    def multi_get(self, ks: list[str]) -> list[bytes]:
        self.ops += 1
        self.bytes += sum(len(k) + len(self.d[k]) for k in ks)
        return [self.d[k] for k in ks]


def _exchange_3621de7(store: Any, me: str, members: list[str], seq: int, raw: bytes) -> None:
    """The hang watch's exchange as it was at 3621de7 (its store calls only): its record, then every other
    member's, a ``check`` and a ``get`` each."""
    from trainguard.agent.hangwatch import PROGRESS_KEY

    store.set(PROGRESS_KEY + me, raw)
    for m in members:
        if m != me and store.check([PROGRESS_KEY + m]):
            store.get(PROGRESS_KEY + m)


def hang_load(n: int, mode: str, intervals: int = 6) -> dict[str, Any]:
    """Store requests and bytes per second of the hang watch of ``n`` nodes (one rank each, node ids of the
    agents' shape), ``mode`` ``3621de7`` (every node reads every record) or ``now`` (this code: readers and
    verdicts); the last of ``intervals`` exchanges of every node is counted, ops/s = that / the interval."""
    from trainguard.agent.hang import HangConfig
    from trainguard.agent.hangwatch import HangWatch, encode_record
    from trainguard.contract import protocol as proto

    cfg = HangConfig()
    store = _HangStore()
    names = [f"10.0.{i // 250}.{i % 250}_4242_0" for i in range(n)]
    clock = [1000.0]
    watches = [HangWatch(cfg, node_name=f"node-{i}", clock=lambda: clock[0]) for i in range(n)]
    for w, m in zip(watches, names):
        w.start_world(store, m, tuple(names), thread=False)
    cpu0 = time.process_time()
    for k in range(1, intervals + 1):
        clock[0] += cfg.heartbeat_interval_s
        if k == intervals:
            ops0, bytes0 = store.ops, store.bytes
        for r, (w, m) in enumerate(zip(watches, names)):
            beat = proto.Progress(rank=r, local_rank=0, step=k, phase=proto.Phase.STEP, beat=k, progress=k,
                                  where="train.py:80 main")
            if mode == "3621de7":
                _exchange_3621de7(store, m, names, k, encode_record(m, k, [beat], f"node-{r}"))
            else:
                w.on_progress(beat)
                w.exchange()
    ops, nbytes = store.ops - ops0, store.bytes - bytes0
    return {"nodes": n, "mode": mode, "ops_per_interval": ops, "bytes_per_interval": nbytes,
            "ops_per_s": ops / cfg.heartbeat_interval_s, "bytes_per_s": nbytes / cfg.heartbeat_interval_s,
            "interval_s": cfg.heartbeat_interval_s, "sim_cpu_s": round(time.process_time() - cpu0, 2)}


def hang_table(rows: list[dict[str, Any]]) -> str:
    head = ["N", "mode", "ops/interval", "ops/s", "bytes/s", "sim cpu s"]
    lines = [" | ".join(f"{h:>14}" for h in head)]
    for r in rows:
        vals = [r["nodes"], r["mode"], r["ops_per_interval"], _fmt(float(r["ops_per_s"])), _fmt(float(r["bytes_per_s"])),
                r["sim_cpu_s"]]
        lines.append(" | ".join(f"{v!s:>14}" for v in vals))
    return "\n".join(lines)


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y over log x (None with fewer than two positive points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return None if den == 0 else sum((p[0] - mx) * (p[1] - my) for p in pts) / den


COLUMNS = [("form s", ("form", "seconds")), ("leave s", ("leave", "seconds")), ("loss s", ("loss", "seconds")),
           ("join s", ("join", "seconds")), ("leave bytes", ("leave", "bytes")), ("join bytes", ("join", "bytes")),
           ("leave CAS lost", ("leave", "cas_lost")), ("steady ops/s", ("steady", "ops_per_s")),
           ("steady B/s", ("steady", "bytes_per_s")), ("store cpu", ("steady", "store_cpu")),
           ("client cpu/node", ("steady", "client_cpu_per_node"))]


def table(rows: list[dict[str, Any]]) -> str:
    """One block per store and protocol: a line per N, then the fitted growth exponent of each column."""
    head = ["store", "protocol", "N", *[c[0] for c in COLUMNS]]
    lines = [" | ".join(f"{h:>14}" for h in head)]
    for key in dict.fromkeys((r.get("store", "tcp"), r.get("protocol", "dynamic")) for r in rows):
        these = [r for r in rows if (r.get("store", "tcp"), r.get("protocol", "dynamic")) == key]
        for r in these:
            vals = [*key, str(r["nodes"])] + [_fmt(r.get(a, {}).get(b)) for _, (a, b) in COLUMNS]
            lines.append(" | ".join(f"{v:>14}" for v in vals))
        exps = [*key, "exponent"] + [_fmt(exponent(these, a, b)) for _, (a, b) in COLUMNS]
        lines.append(" | ".join(f"{v:>14}" for v in exps))
    return "\n".join(lines)


def exponent(rows: list[dict[str, Any]], phase: str, figure: str) -> float | None:
    """The fitted growth exponent of ``rows[*][phase][figure]`` over N."""
    return fit_exponent([r["nodes"] for r in rows], [r.get(phase, {}).get(figure) for r in rows])


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Log-log: bytes per planned leave and per join, steady keep-alive bytes per second, re-form seconds;
    one line per store and protocol (matplotlib: ``pip install '.[bench]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("leave", "bytes", "store bytes per planned leave"), ("join", "bytes", "store bytes per join"),
              ("steady", "bytes_per_s", "keep-alive bytes per second"), ("leave", "seconds", "re-form after a leave (s)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, (phase, figure, title) in zip(axes, panels):
        for key in dict.fromkeys((r["store"], r.get("protocol", "dynamic")) for r in rows):
            these = [r for r in rows if (r["store"], r.get("protocol", "dynamic")) == key and r.get(phase, {}).get(figure)]
            if not these:
                continue
            e = exponent(these, phase, figure)
            ax.plot([r["nodes"] for r in these], [r[phase][figure] for r in these], marker="o",
                    linestyle="--" if key[1] == "dynamic" else "-",
                    label=f"{key[0]} {key[1]}" + (f" (N^{e:.2f})" if e is not None else ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("nodes")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="8,32,128")
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--steady-s", type=float, default=10.0)
    ap.add_argument("--keep-alive-s", type=lambda v: None if v == "auto" else int(v), default=None,
                    help="rendezvous.keep_alive_interval_s (default auto: the agent's default for the store and N; "
                         "each row records the one it ran with)")
    ap.add_argument("--keep-alive-attempts", type=int, default=3, help="rendezvous.keep_alive_max_attempts")
    ap.add_argument("--stores", default="tcp", help="comma-separated: tcp, etcd, etcd-tls")
    ap.add_argument("--protocols", default="dynamic,keyed",
                    help="comma-separated: dynamic (torch's handler, the baseline), keyed (rendezvous.protocol: keyed)")
    ap.add_argument("--baseline-max", default="tcp=128,etcd=128,etcd-tls=128",
                    help="largest N the dynamic baseline runs at, per store (it fails or takes minutes beyond)")
    ap.add_argument("--hang-nodes", default="",
                    help="comma-separated N: also count the hang watch's store load (3621de7's exchange and this one's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    ap.add_argument("--participants", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.participants:
        if REPO not in sys.path:
            sys.path.insert(0, REPO)
        spec = json.loads(a.participants)
        _proc_main(_Lines(), spec["endpoint"], spec["run_id"], spec["cfg"], spec.get("protocol", "dynamic"))
        return 0
    ns = [int(x) for x in a.nodes.split(",") if x]
    if REPO not in sys.path:  # tests.fixtures.etcd starts etcd for the etcd stores
        sys.path.insert(0, REPO)
    caps = {k: int(v) for k, v in (x.split("=") for x in a.baseline_max.split(",") if x)}
    rows = []
    load_before = os.getloadavg()
    for store in [x for x in a.stores.split(",") if x]:
        for protocol in [x for x in a.protocols.split(",") if x]:
            for n in ns:
                if protocol == "dynamic" and n > caps.get(store, n):
                    continue
                cfg_kw = {"min_nodes": max(1, n - 2), "max_nodes": n + 1, "keep_alive_interval_s": a.keep_alive_s,
                          "keep_alive_max_attempts": a.keep_alive_attempts, "join_timeout_s": 600.0,
                          "last_call_timeout_s": 30.0}
                t0 = time.monotonic()
                row = measure(n, a.procs, a.steady_s, cfg_kw, store, protocol)
                row["bench_s"] = time.monotonic() - t0
                row["load_avg"] = os.getloadavg()
                rows.append(row)
                print(f"{store}/{protocol} N={n}: done in {row['bench_s']:.1f} s, load {row['load_avg'][0]:.1f}",
                      file=sys.stderr, flush=True)
    hang_rows = [hang_load(n, mode) for n in (int(x) for x in a.hang_nodes.split(",") if x) for mode in ("3621de7", "now")]
    print(table(rows))
    if hang_rows:
        print()
        print(hang_table(hang_rows))
    for r in rows:
        for ph in ("form", "leave", "loss", "join"):
            if r.get(ph, {}).get("n_errors"):
                print(f"{r['store']}/{r['protocol']} N={r['nodes']} {ph}: {r[ph]['n_errors']} nodes failed, "
                      f"e.g. {r[ph]['errors'][:1]}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": rows, "hang_watch": hang_rows, "load_avg_before": load_before, "load_avg": os.getloadavg(), "args": vars(a),
                       "commit": _commit(), "exponents": {f"{s}/{p}/{ph}.{fig}": exponent(
                           [r for r in rows if (r["store"], r["protocol"]) == (s, p)], ph, fig)
                           for s, p in dict.fromkeys((r["store"], r["protocol"]) for r in rows)
                           for _, (ph, fig) in COLUMNS}}, fh, indent=1)
    if a.plot:
        plot(rows, a.plot)
    return 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    sys.exit(main())
