"""The control plane at scale (issue 40): the agents' real rendezvous path with many simulated nodes,
against a real ``trainguard store`` or etcd (plain or TLS) - how forming and re-forming a world, and the keep-alives, grow
with the number of nodes.

    OMP_NUM_THREADS=1 python bench/control_plane.py [--nodes 8,32,128] [--stores tcp,etcd,etcd-tls]
                                                    [--procs 4] [--steady-s 10] [--json out.json]

Each simulated node is one rendezvous handler built by the agent's own code (``build_handler`` from a
``RendezvousConfig``, joined with ``next_round`` and a :class:`~trainguard.agent.elastic.Plan`, left with
the exit operation as ``ElasticAdapter.leave`` does), running on a thread; the nodes are spread over
``--procs`` processes. No workers, no training: only the control plane. Per N, side by side:

==================  ================================================================================
form_s              all N join a fresh rendezvous (the plan names them all): go -> the last node's
                    round complete
leave_s             one node leaves (planned); the other N-1 re-form with the plan naming it as leaving
loss_s              one node vanishes (its keep-alive stops, it never leaves); the others re-form with
                    a lost-member plan: includes the keep-alive expiry (the detection bound,
                    ``keep_alive_interval_s x keep_alive_max_attempts``)
join_s              a new node joins the N-1: all re-form with it
store ops / bytes   get_state / set_state calls of the c10d rendezvous backend and the bytes moved,
                    per membership change and per second at steady state (keep-alives only); CAS
                    retries (a set_state that lost the race)
state_bytes         the pickled rendezvous state's size after forming
store_cpu           the store process's CPU seconds per wall second at steady state
client_cpu          the simulating processes' CPU seconds per wall second, per node (the simulator
                    itself: a figure that grows with it is the machine, not the store)
==================  ================================================================================

The table ends with the fitted growth exponent of each figure (slope of log figure over log N).
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

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {"gets": self.gets, "sets": self.sets, "cas_lost": self.cas_lost, "bytes": self.bytes}


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

    def __init__(self, endpoint: str, run_id: str, cfg_kw: dict[str, Any]) -> None:
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--participants",
                                   json.dumps({"endpoint": endpoint, "run_id": run_id, "cfg": cfg_kw})],
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


def _proc_main(conn: Any, endpoint: str, run_id: str, cfg_kw: dict[str, Any]) -> None:
    """Host participants; obey the driver's commands on ``conn``."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from trainguard.agent.config import RendezvousConfig
    from trainguard.agent.elastic import Plan, fresh_reads, next_round
    from trainguard.agent.rendezvous import build_handler
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    counters = _Counters()
    _instrument(counters)
    handlers: dict[int, Any] = {}

    def make(i: int) -> None:
        cfg = RendezvousConfig(endpoint=endpoint, local_addr=f"n{i}", **cfg_kw)
        handlers[i] = build_handler(cfg, run_id)
        fresh_reads(handlers[i])  # as ElasticAdapter does

    def join(i: int, plan: Any, out: dict[int, Any]) -> None:
        try:
            info = next_round(handlers[i], lambda: False, plan)
            out[i] = {"done": time.time(), "rank": info.rank, "world": info.world_size}
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out[i] = {"error": f"{type(e).__name__}: {e}"[:300], "done": time.time()}

    while True:
        cmd, arg = conn.recv()
        if cmd == "make":
            for i in arg:
                make(i)
            conn.send({i: str(handlers[i]._this_node) for i in arg})
        elif cmd == "join":
            plan_kw, who = arg
            plan = Plan(members=frozenset(plan_kw["members"]), leaving=frozenset(plan_kw.get("leaving", ())),
                        lost=bool(plan_kw.get("lost", False)))
            out: dict[int, Any] = {}
            threads = [threading.Thread(target=join, args=(i, plan, out), daemon=True) for i in who if i in handlers]
            # (keys go back as JSON strings; the driver turns them into ints)
            for t in threads:
                t.start()
            deadline = time.monotonic() + ROUND_TIMEOUT_S
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            conn.send({**{i: {"error": f"no round within {ROUND_TIMEOUT_S:g} s", "done": time.time()}
                          for i in who if i in handlers}, **out})
        elif cmd == "leave":
            h = handlers.pop(arg)
            h._stop_heartbeats()
            h._op_executor.run(_RendezvousExitOp(), time.monotonic() + 60)
            conn.send(True)
        elif cmd == "vanish":  # a frozen node: its heartbeats stop, it never leaves
            handlers.pop(arg)._stop_heartbeats()
            conn.send(True)
        elif cmd == "stats":
            t = os.times()
            conn.send({**counters.snapshot(), "cpu_s": t.user + t.system})
        elif cmd == "stop":
            for h in handlers.values():
                try:
                    h._stop_heartbeats()
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

    def __init__(self, n: int, procs: int, cfg_kw: dict[str, Any], store: Any) -> None:
        self.server = store
        cfg_kw = {**cfg_kw, **store.cfg}
        self.run_id = f"cp-{n}-{os.getpid()}"
        self.next_id = n
        self.owner: dict[int, int] = {}
        procs = max(1, min(procs, n))
        self.conns = [_Proc(store.endpoint, self.run_id, cfg_kw) for _ in range(procs)]
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

    def round(self, who: list[int], plan: dict[str, Any]) -> dict[str, Any]:
        """All of ``who`` join with ``plan``; seconds from go to the last completion."""
        t0 = time.time()
        by: dict[int, list[int]] = {}
        for i in who:
            by.setdefault(self.owner[i], []).append(i)
        for p, these in by.items():
            self.conns[p].send(("join", (plan, these)))
        out: dict[int, Any] = {}
        for p in by:
            out.update(self.conns[p].recv())
        errors = [v["error"] for v in out.values() if "error" in v]
        worlds = {v.get("world") for v in out.values() if "error" not in v}
        return {"seconds": max(v["done"] for v in out.values()) - t0, "errors": errors[:3], "n_errors": len(errors),
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


def measure(n: int, procs: int, steady_s: float, cfg_kw: dict[str, Any], store: str = "tcp") -> dict[str, Any]:
    """One N on a fresh ``store`` (:class:`StoreServer`): form, steady keep-alives, a planned leave, an
    unannounced loss, a join."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tg-cp-") as folder:
        server = StoreServer(store, folder)
        try:
            return _measure(n, procs, steady_s, cfg_kw, server)
        finally:
            server.close()


def _measure(n: int, procs: int, steady_s: float, cfg_kw: dict[str, Any], server: StoreServer) -> dict[str, Any]:
    c = Cluster(n, procs, cfg_kw, server)
    row: dict[str, Any] = {"nodes": n, "store": server.kind, "procs": len(c.conns)}
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
        r = c.round([*rest2, new], {"members": [c.names[i] for i in rest2]})
        row["join"] = {**r, **_ops(_delta(s0, c.stats()))}
    finally:
        c.close()
    return row


def _note(row: dict[str, Any], phase: str) -> None:
    print(f"{row['store']} N={row['nodes']}: {phase}", file=sys.stderr, flush=True)


def _ops(d: dict[str, float]) -> dict[str, float]:
    return {"ops": d["gets"] + d["sets"], "bytes": d["bytes"], "cas_lost": d["cas_lost"]}


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
    """One block per store: a line per N, then the fitted growth exponent of each column."""
    head = ["store", "N", *[c[0] for c in COLUMNS]]
    lines = [" | ".join(f"{h:>14}" for h in head)]
    for store in dict.fromkeys(r.get("store", "tcp") for r in rows):
        these = [r for r in rows if r.get("store", "tcp") == store]
        for r in these:
            vals = [store, str(r["nodes"])] + [_fmt(r.get(a, {}).get(b)) for _, (a, b) in COLUMNS]
            lines.append(" | ".join(f"{v:>14}" for v in vals))
        exps = [store, "exponent"] + [_fmt(fit_exponent([r["nodes"] for r in these], [r.get(a, {}).get(b) for r in these]))
                                      for _, (a, b) in COLUMNS]
        lines.append(" | ".join(f"{v:>14}" for v in exps))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="8,32,128")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--steady-s", type=float, default=10.0)
    ap.add_argument("--keep-alive-s", type=int, default=2, help="rendezvous.keep_alive_interval_s")
    ap.add_argument("--keep-alive-attempts", type=int, default=3, help="rendezvous.keep_alive_max_attempts")
    ap.add_argument("--stores", default="tcp", help="comma-separated: tcp, etcd, etcd-tls")
    ap.add_argument("--json", default=None)
    ap.add_argument("--participants", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.participants:
        if REPO not in sys.path:
            sys.path.insert(0, REPO)
        spec = json.loads(a.participants)
        _proc_main(_Lines(), spec["endpoint"], spec["run_id"], spec["cfg"])
        return 0
    ns = [int(x) for x in a.nodes.split(",") if x]
    if REPO not in sys.path:  # tests.fixtures.etcd starts etcd for the etcd stores
        sys.path.insert(0, REPO)
    rows = []
    for store in [x for x in a.stores.split(",") if x]:
        for n in ns:
            cfg_kw = {"min_nodes": max(1, n - 2), "max_nodes": n + 1, "keep_alive_interval_s": a.keep_alive_s,
                      "keep_alive_max_attempts": a.keep_alive_attempts, "join_timeout_s": 600.0,
                      "last_call_timeout_s": 30.0}
            t0 = time.monotonic()
            row = measure(n, a.procs, a.steady_s, cfg_kw, store)
            row["bench_s"] = time.monotonic() - t0
            rows.append(row)
            print(f"{store} N={n}: done in {row['bench_s']:.1f} s", file=sys.stderr, flush=True)
    print(table(rows))
    for r in rows:
        for ph in ("form", "leave", "loss", "join"):
            if r.get(ph, {}).get("n_errors"):
                print(f"{r['store']} N={r['nodes']} {ph}: {r[ph]['n_errors']} nodes failed, e.g. {r[ph]['errors'][:1]}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": rows, "load_avg": os.getloadavg(), "args": vars(a)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
