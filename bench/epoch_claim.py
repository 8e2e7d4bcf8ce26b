"""What does fencing by store-issued epochs cost? (benchmark, not a timed test)

For each backend — ``file://`` (a temp dir), ``s3://`` (moto_server), ``gs://`` (gcp-storage-emulator),
``memory://`` — all on this machine (the emulators are the ones the tests use, started here on
127.0.0.1 and stopped at the end), it measures in milliseconds:

* ``probe``    the first use of a store: finding out whether it honours conditional creates
               (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``; three requests, once per process);
* ``claim``    claiming the next epoch, as rank 0 does when a world forms: list the epochs and the
               step directories, then one create-exclusive write (``--claims`` times in a row);
* ``claim2``   the same with two claimers racing (two threads, one client each): every claim, and how
               many numbers were lost to the other claimer;
* ``check``    the owner check a save runs twice (before its shards and before its manifest): two
               listings and one read of the epoch record.

It reports, per backend, whether the conditional create is native or the write-then-read-back
fallback, and the median and p90 of each figure. Prints a table; ``--json PATH`` writes every figure.

    OMP_NUM_THREADS=1 .venv/bin/python bench/epoch_claim.py --json epoch_claim.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fixtures.storage import (  # noqa: E402 - the emulators the tests use
    gcs_options,
    make_bucket,
    s3_options,
    start_gcs_server,
    start_moto_server,
)
from trainguard.checkpoint.epochs import check_owner, claim_epoch, new_record  # noqa: E402
from trainguard.checkpoint.storage import Storage  # noqa: E402


def _ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(x * 1e3 for x in xs)
    return {"median_ms": round(statistics.median(xs), 3), "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 3),
            "n": len(xs)}


def _claim(storage: Storage, run: str) -> tuple[Any, int]:
    return claim_epoch(storage, run, lambda n, mode: new_record(n, mode, base_step=-1, base_epoch=-1, world_size=8,
                                                                rdzv_id="bench", rdzv_round=0))


def bench_backend(name: str, url: str, options: dict[str, Any], claims: int) -> dict[str, Any]:
    storage = Storage(url, options, retry_attempts=3, retry_deadline_s=30)
    run = f"run-{uuid.uuid4().hex[:6]}"
    t0 = time.perf_counter()
    mode = storage.conditional_create_mode(f"{run}/epochs")
    probe = time.perf_counter() - t0
    times, recs = [], []
    for _ in range(claims):
        t0 = time.perf_counter()
        rec, _ = _claim(storage, run)
        times.append(time.perf_counter() - t0)
        recs.append(rec)
    checks = []
    for _ in range(claims):
        t0 = time.perf_counter()
        check_owner(storage, run, recs[-1])
        checks.append(time.perf_counter() - t0)
    # Two claimers racing, each with its own client (as two hosts would).
    run2 = f"race-{uuid.uuid4().hex[:6]}"
    stores = [Storage(url, options, retry_attempts=3, retry_deadline_s=30) for _ in range(2)]
    for s in stores:
        s.conditional_create_mode(f"{run2}/epochs")
    raced: list[float] = []
    lost = [0, 0]
    got: list[list[int]] = [[], []]
    gate = threading.Barrier(2)

    def racer(i: int) -> None:
        for _ in range(claims):
            gate.wait(30)
            t0 = time.perf_counter()
            rec, conflicts = _claim(stores[i], run2)
            raced.append(time.perf_counter() - t0)
            lost[i] += conflicts
            got[i].append(rec.epoch)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    shared = sorted(set(got[0]) & set(got[1]))
    return {"backend": name, "conditional_create": mode, "probe_ms": round(probe * 1e3, 3), "claim": _ms(times),
            "claim2": {**_ms(raced), "lost_claims": sum(lost), "epochs_held_twice": len(shared)},
            "check": _ms(checks)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--claims", type=int, default=30, help="claims per backend (and per racer)")
    ap.add_argument("--only", default="file,s3,gs,memory", help="comma-separated backends")
    ap.add_argument("--json", default=None, metavar="PATH")
    a = ap.parse_args(argv)
    from trainguard.contract.log import configure

    configure("console", "warning", sys.stderr)  # the table on stdout; storage warnings on stderr
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    wanted = a.only.split(",")
    results: list[dict[str, Any]] = []
    servers = []
    try:
        with tempfile.TemporaryDirectory(prefix="tg-epoch-bench-") as tmp:
            if "file" in wanted:
                results.append(bench_backend("file", f"file://{tmp}/ckpt", {}, a.claims))
            if "memory" in wanted:
                results.append(bench_backend("memory", f"memory://bench-{uuid.uuid4().hex[:6]}", {}, a.claims))
            if "s3" in wanted:
                moto = start_moto_server()
                servers.append(moto)
                opts = s3_options(moto.endpoint)
                results.append(bench_backend("s3 (moto)", f"s3://{make_bucket('s3', opts)}/ckpt", opts, a.claims))
            if "gs" in wanted:
                gcs = start_gcs_server()
                if gcs is None:
                    print("gcp-storage-emulator is not installed: skipping gs://", file=sys.stderr)
                else:
                    servers.append(gcs)
                    os.environ["STORAGE_EMULATOR_HOST"] = gcs.endpoint
                    opts = gcs_options(gcs.endpoint)
                    results.append(bench_backend("gs (emulator)", f"gs://{make_bucket('gs', opts)}/ckpt", opts,
                                                 a.claims))
    finally:
        for s in servers:
            s.stop()
    header = ["backend", "conditional create", "probe ms", "claim ms (median / p90)",
              "racing claim ms (median / p90)", "lost", "held twice", "owner check ms (median / p90)"]
    rows = [[r["backend"], r["conditional_create"], f"{r['probe_ms']:.1f}",
             f"{r['claim']['median_ms']:.1f} / {r['claim']['p90_ms']:.1f}",
             f"{r['claim2']['median_ms']:.1f} / {r['claim2']['p90_ms']:.1f}", str(r["claim2"]["lost_claims"]),
             str(r["claim2"]["epochs_held_twice"]), f"{r['check']['median_ms']:.1f} / {r['check']['p90_ms']:.1f}"]
            for r in results]
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    doc = {"claims": a.claims, "host_cpus": os.cpu_count(), "results": results}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
