"""How long does a checkpoint stall training? (benchmark, not a timed test)

Saves the same state (``--size-mb``, default 512 MiB of float32 tensors) with

* ``memcpy``      a plain copy into preallocated, already-touched buffers (the floor);
* ``torch.save``  of the full state dict to one file, fsync'd (what users do today);
* ``dcp.save``    synchronous ``torch.distributed.checkpoint.save`` to a directory;
* ``async``       :class:`trainguard.checkpoint.manager.CheckpointManager` ``save()`` (blocked time =
                  until ``save`` returns) and ``wait()`` (total = until committed), ``--saves`` times
                  in a row with the state mutated in between, to show the stall stays flat.

Prints a table and writes JSON (``--json PATH``) with ``state_bytes, memcpy_s, torch_save_s,
dcp_sync_s, async_blocked_s, async_total_s, peak_rss_bytes, staging_bytes`` (seconds, bytes), the
per-save blocked times (with a memcpy timed right before each save, as the machine may be shared)
and the ratios against the issue's targets. ``async_blocked_s`` is the
median over saves 2..N (save 1 also allocates the staging buffers; it is reported separately).
On CUDA (``--device cuda``) the staging buffers are pinned and the copy is device-to-host.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager


def make_state(size_mb: int, device: str, n_tensors: int = 64) -> dict[str, torch.Tensor]:
    numel = size_mb * 1024 * 1024 // 4 // n_tensors
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(numel, generator=g).to(device) for i in range(n_tensors)}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(fn: Any, repeat: int = 3) -> float:
    best = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--url", default=None, help="checkpoint URL (default: a temp dir, removed afterwards)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="tg-bench-")
    url = a.url or os.path.join(tmp, "ckpt")
    try:
        state = make_state(a.size_mb, a.device)
        state_bytes = sum(t.numel() * t.element_size() for t in state.values())
        sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

        # Floor: copy into preallocated (pinned on CUDA), already-touched host buffers.
        bufs = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=a.device == "cuda") for k, t in state.items()}

        def memcpy() -> None:
            for k, t in state.items():
                bufs[k].copy_(t, non_blocking=a.device == "cuda")
            sync()

        memcpy()
        memcpy_s = timed(memcpy)

        def tsave() -> None:
            p = os.path.join(tmp, "full.pt")
            with open(p, "wb") as f:
                torch.save({"model": state}, f)
                f.flush()
                os.fsync(f.fileno())
            os.unlink(p)

        torch_save_s = timed(tsave, repeat=2)

        def dsave() -> None:
            d = os.path.join(tmp, "dcp")
            dcp.save({"model": state}, checkpoint_id=d, no_dist=True)
            shutil.rmtree(d)

        dcp_sync_s = timed(dsave, repeat=2)

        rss_before = rss_bytes()
        cfg = CheckpointConfig(url=url, keep_last=2, verify=False)
        blocked: list[float] = []
        totals: list[float] = []
        floors: list[float] = []  # memcpy measured right before each save: the shared machine drifts
        with CheckpointManager(cfg, "bench", rank=0, world_size=1) as mgr:
            for i in range(1, a.saves + 1):
                with torch.no_grad():
                    for t in state.values():
                        t.add_(1.0)  # "training" changes the state between saves
                sync()
                t0 = time.perf_counter()
                memcpy()
                floors.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                mgr.save(i, {"model": state})
                blocked.append(time.perf_counter() - t0)
                mgr.wait()
                totals.append(time.perf_counter() - t0)
            staging_bytes = mgr.staging_bytes
        rss_after = rss_bytes()
        del bufs

        steady = blocked[1:] or blocked
        async_blocked_s = statistics.median(steady)
        res = {
            "device": a.device, "size_mb": a.size_mb, "saves": a.saves, "url": a.url or "tempdir",
            "state_bytes": state_bytes, "memcpy_s": memcpy_s, "torch_save_s": torch_save_s, "dcp_sync_s": dcp_sync_s,
            "async_blocked_s": async_blocked_s, "async_blocked_first_s": blocked[0],
            "async_blocked_max_steady_s": max(steady), "async_total_s": statistics.median(totals),
            "async_blocked_per_save_s": blocked, "memcpy_per_save_s": floors, "async_total_per_save_s": totals,
            "peak_rss_bytes": peak_rss_bytes(), "rss_growth_async_bytes": rss_after - rss_before,
            "staging_bytes": staging_bytes,
            "memcpy_gbps": state_bytes / memcpy_s / 1e9, "async_stage_gbps": state_bytes / async_blocked_s / 1e9,
            "ratios": {
                "async_blocked_over_memcpy": async_blocked_s / memcpy_s,
                "async_blocked_over_torch_save": async_blocked_s / torch_save_s,
                "staging_over_state": staging_bytes / state_bytes,
                "steady_blocked_max_over_min": max(steady) / min(steady),
                "async_blocked_over_memcpy_same_moment": statistics.median(
                    b / f for b, f in zip(blocked[1:], floors[1:])) if len(blocked) > 1 else blocked[0] / floors[0],
            },
            "targets": {"async_blocked_over_memcpy": 1.2, "async_blocked_over_torch_save": 0.05,
                        "staging_over_state": 1.1},
        }
        res["targets_met"] = {k: res["ratios"][k] <= v for k, v in res["targets"].items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    rows = [("state", f"{state_bytes / 2**20:.0f} MiB"), ("memcpy (floor)", f"{memcpy_s:.3f} s"),
            ("torch.save + fsync", f"{torch_save_s:.3f} s"), ("dcp.save (sync)", f"{dcp_sync_s:.3f} s"),
            ("async save: blocked (median 2..N)", f"{async_blocked_s:.3f} s"),
            ("async save: blocked, first save", f"{blocked[0]:.3f} s"),
            ("async save: until committed", f"{res['async_total_s']:.3f} s"),
            ("staging buffers", f"{staging_bytes / 2**20:.0f} MiB"),
            ("peak RSS", f"{res['peak_rss_bytes'] / 2**20:.0f} MiB")]
    rows += [(f"ratio {k} (target <= {res['targets'].get(k, '-')})", f"{v:.3f}") for k, v in res["ratios"].items()]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k.ljust(w)}  {v}")
    print("blocked per save (s): " + " ".join(f"{b:.3f}" for b in blocked))
    print("memcpy before each (s): " + " ".join(f"{b:.3f}" for b in floors))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
