"""One-shot etcd watches, the keyed rendezvous's wait for its round (issue 40): the JSON gateway (a new HTTP
connection per watch, with TLS a new handshake: ``EtcdClient.watch_key``) against a stream on the process's gRPC
channel (:mod:`trainguard.agent.etcd_watch`), on a real etcd, plain and with TLS.

    OMP_NUM_THREADS=1 python bench/etcd_watch.py [--waiters 128] [--rounds 5] [--stores etcd,etcd-tls]
        [--json out.json]

Each round: ``--waiters`` threads (one per simulated node; the gateway: one ``EtcdClient`` each, as each node has
its own) start a watch on their own key after the current revision, as nodes waiting for a round do; after
0.5 s one transaction writes every key (the publication); the round ends when every watch has returned its value.
Per transport, summed over the rounds: ``client CPU-s`` (this process), ``etcd CPU-s`` (the etcd process, from
/proc), and per round the seconds from the write to the last watch's return. Figures are per watch where named.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # (tests.fixtures.etcd starts etcd)


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        parts = fh.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def run(settings: Any, etcd_pid: int, transport: str, waiters: int, rounds: int) -> dict[str, Any]:
    import trainguard.agent.etcd_watch as etcd_watch
    from trainguard.agent.etcd_client import EtcdClient
    from trainguard.agent.etcd_wire import op_put

    writer = EtcdClient(settings)
    clients = [EtcdClient(settings) for _ in range(waiters)] if transport == "gateway" else []
    client_cpu = etcd_cpu = 0.0
    latencies: list[float] = []
    missing = 0
    for r in range(rounds):
        keys = [f"bench/{transport}/{r}/{i}".encode() for i in range(waiters)]
        _, rev = writer.get(keys[0])
        done: dict[int, float] = {}
        got: dict[int, bytes | None] = {}

        def wait(i: int) -> None:
            if transport == "gateway":
                kv = clients[i].watch_key(keys[i], rev, 30.0)
            else:
                kv = etcd_watch.watch_key(settings, writer.auth_token, keys[i], rev, 30.0)
            got[i], done[i] = (kv.value if kv else None), time.monotonic()

        c0, e0 = _self_cpu(), _cpu_of(etcd_pid)
        threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(waiters)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        t_write = time.monotonic()
        for i in range(0, waiters, 100):  # etcd's --max-txn-ops is 128
            writer.txn([], [op_put(k, b"v" + k) for k in keys[i:i + 100]])
        for t in threads:
            t.join(60)
        client_cpu += _self_cpu() - c0
        etcd_cpu += _cpu_of(etcd_pid) - e0
        latencies.append(max(done.values(), default=t_write) - t_write)
        missing += sum(1 for i in range(waiters) if got.get(i) != b"v" + keys[i])
    for c in [writer, *clients]:
        c.close()
    n = waiters * rounds
    return {"transport": transport, "waiters": waiters, "rounds": rounds, "client_cpu_s": round(client_cpu, 3),
            "etcd_cpu_s": round(etcd_cpu, 3), "client_cpu_ms_per_watch": round(1000 * client_cpu / n, 3),
            "etcd_cpu_ms_per_watch": round(1000 * etcd_cpu / n, 3), "write_to_last_s": [round(x, 3) for x in latencies],
            "missing": missing}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waiters", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stores", default="etcd,etcd-tls")
    p.add_argument("--json", default="")
    a = p.parse_args()
    from tests.fixtures.etcd import make_pki, start_etcd
    from trainguard.agent.etcd_client import EtcdSettings

    rows = []
    load_before = os.getloadavg()
    for store in a.stores.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            pki = make_pki(Path(tmp) / "pki") if store == "etcd-tls" else None
            with start_etcd(Path(tmp) / "etcd", pki=pki) as server:
                kw = {} if pki is None else {"ca_file": pki.ca_file, "cert_file": pki.client_cert, "key_file": pki.client_key}
                settings = EtcdSettings(endpoints=(server.endpoint,), **kw)
                for transport in ("gateway", "grpc"):
                    rows.append({"store": store, **run(settings, server.process.pid, transport, a.waiters, a.rounds)})
    cols = ["store", "transport", "waiters", "rounds", "client_cpu_s", "etcd_cpu_s", "client_cpu_ms_per_watch",
            "etcd_cpu_ms_per_watch", "write_to_last_s", "missing"]
    print(" | ".join(f"{c:>24}" for c in cols))
    for row in rows:
        print(" | ".join(f"{str(row[c]):>24}" for c in cols))
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    print(f"commit {commit}{' (dirty)' if dirty else ''}, load {os.getloadavg()[0]:.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": rows, "args": vars(a), "commit": commit + ("-dirty" if dirty else ""),
                       "load_avg_before": load_before, "load_avg": os.getloadavg()}, fh, indent=1)


if __name__ == "__main__":
    main()
