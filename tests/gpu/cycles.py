"""In-place re-formations of a world of one in one process (issue 35): the single-GPU tier's test and
``bench/gpu_check.py``'s ``reform`` part both run :func:`reform_cycles` (NCCL on a GPU, gloo on the CPU)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from trainguard.runtime import device as dev
from trainguard.runtime import reform as rf
from trainguard.strategies.mesh import build_mesh


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resources(device: torch.device) -> dict[str, int]:
    """What a re-formation must not leak: file descriptors, threads, GPU memory (allocator and driver)."""
    out = {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task"))}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out.update(gpu_allocated=torch.cuda.memory_allocated(device), gpu_used=total - free)
    return out


def reform_cycles(device: torch.device, cycles: int = 3) -> dict[str, Any]:
    """Form a world of one, then re-form it ``cycles`` times (alternately after a lost peer: abort, and
    planned: synchronise + destroy), each world building a 2-D (dp, tp) mesh and running collectives on
    the default group and a mesh group. Returns each world's seconds and resources, and the growth of
    every resource from the first re-formed world to the last (the first world pays one-time set-up)."""
    saved = dict(os.environ)
    rows = []
    try:
        for i in range(cycles + 1):
            t0 = time.perf_counter()
            rf.init_world(rank=0, world_size=1, local_rank=device.index or 0, local_world_size=1,
                          master_addr="127.0.0.1", master_port=_port(), device=device, timeout_s=120)
            t_init = time.perf_counter() - t0
            mesh = build_mesh(device.type, (1, 1), ("dp", "tp"))
            x = torch.ones(1024, device=device)
            dist.all_reduce(x)
            dist.all_reduce(x, group=mesh.get_group("tp"))
            dev.synchronize(device)
            sample = resources(device)
            path = "abort" if i % 2 == 0 else "planned"
            t1 = time.perf_counter()
            rf.teardown_world(device, peer_lost=path == "abort")
            rows.append({"world": i, "teardown": path, "init_s": round(t_init, 4),
                         "teardown_s": round(time.perf_counter() - t1, 4), "ok": bool(x[0].item() == 1.0), **sample})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
    first, last = rows[1] if len(rows) > 1 else rows[0], rows[-1]
    growth = {k: last[k] - first[k] for k in first if k in ("fds", "threads", "gpu_allocated", "gpu_used")}
    reformed = rows[1:]
    return {"worlds": rows, "growth": growth,
            "abort_path_s": [r["init_s"] for r in reformed if rows[r["world"] - 1]["teardown"] == "abort"],
            "planned_path_s": [r["init_s"] for r in reformed if rows[r["world"] - 1]["teardown"] == "planned"],
            "teardown_abort_s": [r["teardown_s"] for r in rows if r["teardown"] == "abort"],
            "teardown_planned_s": [r["teardown_s"] for r in rows if r["teardown"] == "planned"]}
