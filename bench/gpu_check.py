"""The prepared GPU check (issue 35): everything this project must learn on the first GPU it gets, in
one command that fits a short single-GPU lease (<= 8 minutes), written to one JSON.

    python bench/gpu_check.py [--out gpu-check.json] [--budget-s 480] [--only part,part] [--dry-run]

On the lent machines (Python 3.12, their own torch, no registry, no structlog) the pure-Python wheels
travel with the checkout: ``bash bench/gpu_wheels.sh`` here makes ``.whl/`` (structlog and this
package), and the device command is ``bash bench/gpu_check.sh`` (installs them with ``pip --no-index
--target`` and runs this script; see docs/gpu.md).

Each part runs in its own subprocess with its own timeout, so one hang or segfault costs that part
only (its ``rc``, ``seconds`` and output tail are recorded); parts left when the budget runs out are
recorded as ``not_run``. The parts and their figures:

==============  ==================================================================================
env             torch / CUDA / NCCL versions, the GPU, whether the carried packages import
d2h             checkpoint staging (:class:`~trainguard.checkpoint.staging.Stager`) GB/s against a
                pinned ``cudaMemcpy`` into the SAME arena buffer (``staging_over_peak``, target >= 0.8)
save_stall      an async checkpoint save from GPU tensors: host-blocked seconds and the GPU-side
                stall of the compute stream, per GB of state
host_register   ``cudaHostRegister`` seconds per 16 GiB (what the first save's arena costs)
tier0           the bundled GPT at a size filling >= 20 GB of the GPU: a snapshot's call, commit
                (copies + checksum) and cost as the interval controller books it; the step time
                with a snapshot every step (``overhead_every_step``) and at the interval the
                product picks for ``memory_max_overhead`` 0.03 (``overhead``, target <= 1.03); the
                GPU memory delta (target 0); whether the slots were page-locked (``pin_error``)
reform          three in-place NCCL re-formations in one process (world 1 -> 1), abort path and
                planned path, a 2-D mesh built in each new world: seconds each; growth of GPU
                memory, threads and file descriptors (target 0)
pytest_1gpu     the single-GPU test tier (``pytest -m gpu tests/gpu``): pass / fail / skip of each
==============  ==================================================================================

``--dry-run`` runs every part on the CPU with tiny sizes (gloo instead of NCCL, no pinning): it proves
this script's own logic and the JSON's shape in CI (tests/test_gpu_check.py); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # the tests package (the reform part shares the single-GPU tier's helper)
    sys.path.insert(0, REPO)

PARTS: dict[str, float] = {  # part -> timeout (s); run in this order
    "env": 60, "d2h": 90, "save_stall": 90, "host_register": 60, "reform": 90, "tier0": 180, "pytest_1gpu": 270,
}
BUDGET_S = 480.0
TARGETS = {"d2h_staging_over_peak_min": 0.8, "tier0_overhead_max": 1.03, "tier0_fill_bytes_min": 20e9}
GB = 1e9


# ---- the parts (each runs in its own process: ``--part NAME --result FILE``) -------------------------

def _device(dry: bool) -> Any:
    import torch

    if dry or not torch.cuda.is_available():
        return torch.device("cpu")
    d = torch.device("cuda", 0)
    torch.cuda.set_device(d)
    return d


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def part_env(dry: bool) -> dict[str, Any]:
    import platform

    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if out["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_total_bytes=p.total_memory, sms=p.multi_processor_count,
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    for mod in ("structlog", "yaml", "fsspec", "prometheus_client", "trainguard.runtime", "pynvml"):
        try:
            __import__(mod)
            out[f"import_{mod}"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            out[f"import_{mod}"] = f"{type(e).__name__}: {e}"[:200]
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()[:200]
    except (OSError, subprocess.TimeoutExpired) as e:
        out["nvidia_smi"] = f"unavailable: {e}"[:200]
    try:
        shm = os.statvfs("/dev/shm")
        out["dev_shm_free_bytes"] = shm.f_bavail * shm.f_frsize
    except OSError:
        out["dev_shm_free_bytes"] = None
    return out


def _best(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _state(device: Any, size_mb: int, n: int) -> tuple[dict[str, Any], int, int]:
    """``n`` float32 tensors of ``size_mb`` MiB in all on ``device``: (state, numel each, bytes)."""
    import torch

    numel = size_mb * 2**20 // 4 // n
    return {"model": {f"w{i}": torch.randn(numel, device=device) for i in range(n)}}, numel, numel * 4 * n


def part_d2h(dry: bool) -> dict[str, Any]:
    import torch

    from trainguard.checkpoint.staging import Stager

    device = _device(dry)
    state, numel, nbytes = _state(device, *((16, 8) if dry else (4096, 64)))
    n = len(state["model"])
    stager = Stager()
    stager.prepare(state)
    arena = stager._arena
    assert arena is not None
    flat = torch.randn(numel * n, device=device)
    dst = arena.buffer[:nbytes].view(torch.float32)

    def peak() -> None:  # one contiguous copy into the same (pinned) arena the stager copies into
        dst.copy_(flat, non_blocking=True)
        _sync(device)

    def staging() -> None:
        stager.stage(state)
        if stager.ready is not None:
            stager.ready.synchronize()

    t_peak, t_stage = _best(peak, 5), _best(staging, 5)
    staged = stager.stage(state)
    if stager.ready is not None:
        stager.ready.synchronize()
    exact = all(torch.equal(staged["model"][k], v.cpu()) for k, v in state["model"].items())
    return {"state_bytes": nbytes, "staging_bytes": stager.staging_bytes, "pinned": arena.pinned,
            "peak_gbps": nbytes / t_peak / GB, "staging_gbps": nbytes / t_stage / GB,
            "staging_over_peak": t_peak / t_stage, "staged_equal": exact}


class _Clock:
    """Seconds between marks on the compute stream (CUDA events), or the host clock on the CPU."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self._torch = torch

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a: Any, b: Any) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3


def part_save_stall(dry: bool) -> dict[str, Any]:
    import torch

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager

    device = _device(dry)
    state, _, nbytes = _state(device, *((8, 8) if dry else (2048, 32)))
    probe = torch.ones(1024, device=device)
    clock = _Clock(device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tg-gpucheck-") as d:
        cfg = CheckpointConfig(url=os.path.join(d, "ckpt"), async_save=True, keep_last=2)
        with CheckpointManager(cfg, "gpu-check", rank=0, world_size=1) as mgr:
            mgr.prepare_staging(state)
            for step in range(1, 5):
                _sync(device)
                a = clock.mark()
                probe.add_(1.0)  # what the next step's first kernel would do
                b = clock.mark()
                base = clock.seconds(a, b)
                _sync(device)
                a = clock.mark()
                t0 = time.perf_counter()
                mgr.save(step, state)
                blocked = time.perf_counter() - t0
                probe.add_(1.0)
                b = clock.mark()
                stall = max(0.0, clock.seconds(a, b) - base)
                assert mgr.wait(120) == step
                rows.append({"step": step, "blocked_s": blocked, "gpu_stall_s": stall})
    steady = rows[1:]  # the first save also builds the arena's layout
    blocked = sorted(r["blocked_s"] for r in steady)[len(steady) // 2]
    stall = sorted(r["gpu_stall_s"] for r in steady)[len(steady) // 2]
    return {"state_bytes": nbytes, "saves": rows, "blocked_s": blocked, "gpu_stall_s": stall,
            "blocked_s_per_gb": blocked / (nbytes / GB), "gpu_stall_s_per_gb": stall / (nbytes / GB)}


def part_host_register(dry: bool) -> dict[str, Any]:
    import torch

    from trainguard.checkpoint import pinned

    device = _device(dry)
    nbytes = (64 * 2**20) if dry else 16 * 2**30
    buf = torch.empty(nbytes, dtype=torch.uint8)
    out: dict[str, Any] = {"bytes": nbytes}
    if device.type != "cuda":
        out.update(register_s=None, unregister_s=None, seconds_per_16gib=None, why="no CUDA: nothing to register")
        return out
    t0 = time.perf_counter()
    pinned._register(buf.data_ptr(), nbytes)
    out["register_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pinned._unregister(buf.data_ptr())
    out["unregister_s"] = time.perf_counter() - t0
    out["seconds_per_16gib"] = out["register_s"] * (16 * 2**30) / nbytes
    return out


def part_reform(dry: bool) -> dict[str, Any]:
    from tests.gpu.cycles import reform_cycles

    return reform_cycles(_device(dry), cycles=3)


def _snapshot_dir(need: int) -> tuple[str, str]:
    """A folder for the tier-0 slots: /dev/shm when it holds two of them (as on a node), else /tmp."""
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > 2.5 * need:
            return tempfile.mkdtemp(prefix="tg-gpucheck-", dir="/dev/shm"), "/dev/shm"
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="tg-gpucheck-"), "/tmp"


def part_tier0(dry: bool) -> dict[str, Any]:
    import math
    import shutil

    import torch
    import torch.nn.functional as F

    from trainguard.checkpoint import slots
    from trainguard.checkpoint.interval import memory_interval
    from trainguard.checkpoint.memory import MemoryTier
    from trainguard.checkpoint.state import ModelOptimizerState
    from trainguard.examples.train_gpt import TinyGPT

    device = _device(dry)
    seq, d, layers, heads, batch, steps = (16, 32, 2, 4, 2, 6) if dry else (512, 2048, 24, 16, 16, 8)
    torch.manual_seed(0)
    model = TinyGPT(seq, d, layers, heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clock = _Clock(device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step() -> None:
        x = torch.randint(0, 256, (batch, seq), device=device)
        with amp:
            loss = F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def phase(n: int, snap: Callable[[int], float] | None, every: int = 1) -> tuple[list[float], list[float]]:
        """``n`` steps, a snapshot after every ``every``-th: each step's seconds (compute stream) and
        each snapshot call's (host)."""
        times, calls = [], []
        last = clock.mark()
        for i in range(n):
            step()
            if snap is not None and (i + 1) % every == 0:
                calls.append(snap(i))
            now = clock.mark()
            times.append(clock.seconds(last, now))
            last = now
        return times, calls

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    for _ in range(2):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base_times, _ = phase(steps, None)
    _sync(device)
    t_base = median(base_times[1:])
    peak_without = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    state = {"model": ModelOptimizerState(model, opt)}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # params + 2 moments
    folder, where = _snapshot_dir(nbytes)
    out: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters()), "snapshot_bytes": nbytes,
                           "folder": where, "step_s": t_base}
    try:
        tier = MemoryTier(folder, rank=0, world_size=1, replicated=True)
        tier.guard(opt)
        counter = iter(range(100, 10**6))

        def snap(_: int) -> float:
            t0 = time.perf_counter()
            tier.snapshot(next(counter), state, world="gpu-check")
            return time.perf_counter() - t0

        # 1. The first snapshot into each slot maps and page-locks it (cudaHostRegister): once per slot.
        for _ in range(slots.SLOTS):
            step()
            t0 = time.perf_counter()
            snap(0)
            tier.settle()
            out.setdefault("first_snapshots_s", []).append(time.perf_counter() - t0)
        out["pin_error"] = tier.pin_error
        # 2. One snapshot in steady state: the call, then the commit in the background (the wait for the
        # copies, the checksum), timed apart; the checksum's own throughput on the slot.
        step()
        _sync(device)
        t0 = time.perf_counter()
        out["snapshot_call_s"] = snap(0)
        tier.settle()
        out["commit_s"] = time.perf_counter() - t0
        slot = tier._slots[tier._newest]
        t0 = time.perf_counter()
        with memoryview(slot.mm) as mv, mv[slots.HEADER_BYTES:slots.HEADER_BYTES + tier._tensor_bytes] as data:
            slots.checksum(data, tier._threads)
        out["checksum_gbps"] = tier._tensor_bytes / GB / max(1e-9, time.perf_counter() - t0)
        out["checksum_threads"] = tier._threads
        # 3. A snapshot every step (the worst case): each waits for the one before.
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        every_times, calls = phase(steps, snap)
        tier.settle()
        _sync(device)
        out["step_with_snapshot_every_step_s"] = median(every_times[1:])
        out["overhead_every_step"] = out["step_with_snapshot_every_step_s"] / t_base
        out["snapshot_call_every_step_s"] = median(calls[1:]) if len(calls) > 1 else None
        # 4. The cost of one snapshot when the commit of the one before is done (spaced by the commit):
        # what the product's interval controller books (the call plus the optimizer step's wait).
        space = max(2, math.ceil(out["commit_s"] / max(t_base, 1e-6)) + 1)
        waited0 = tier.waited_s
        spaced, calls = phase(3 * space, snap, space)
        tier.settle()
        n_snaps = max(1, len(calls))
        cost = max(0.0, sum(calls) + (tier.waited_s - waited0)) / n_snaps
        extra = max(0.0, sum(spaced) - len(spaced) * t_base) / n_snaps
        out.update(snapshot_cost_s=cost, snapshot_extra_step_s=extra)
        # 5. At the interval the product would choose (memory_interval, checkpoint.memory_max_overhead
        # 0.03, from the booked cost): the overhead measured over two intervals (at most 240 steps).
        every = memory_interval(1, 0.03, cost, t_base, 1)
        out["interval_for_3pct"] = every
        if 2 * every <= 240:
            at, _ = phase(2 * every, snap, every)
            tier.settle()
            out["overhead"] = (sum(at) / len(at)) / t_base
            out["overhead_measured"] = True
        else:
            out["overhead"] = 1.0 + extra / (every * t_base)
            out["overhead_measured"] = False
        _sync(device)
        peak_with = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        out["snapshot_committed"] = bool(tier.available(state))
        tier.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out.update(gpu_peak_bytes=peak_without, gpu_peak_delta_bytes=peak_with - peak_without)
    return out


def part_pytest_1gpu(dry: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tg-gpucheck-") as d:
        xml = os.path.join(d, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-m", "gpu",
               os.path.join(REPO, "tests", "gpu"), f"--junitxml={xml}"]
        if dry:  # CI: collect and skip (no GPU); the tier's logic is what the dry run proves
            cmd += ["-k", "single"]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=PARTS["pytest_1gpu"] - 15)
        tests = _junit(xml) if os.path.exists(xml) else {}
    counts = {k: sum(1 for v in tests.values() if v["outcome"] == k) for k in ("passed", "failed", "skipped")}
    return {"rc": r.returncode, "tests": tests, **counts, "tail": (r.stdout + r.stderr)[-2000:]}


def _junit(path: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, msg, detail = "passed", "", []
        for child in case:
            if child.tag in ("failure", "error"):  # a call that failed and a teardown that failed: both kept
                outcome = "failed"
                msg = msg or (child.get("message") or "")[:300]
                detail.append(f"[{child.tag}] {child.get('message') or ''}\n{(child.text or '')[-4000:]}")
            elif child.tag == "skipped":
                outcome, msg = "skipped", (child.get("message") or "")[:300]
        out[name] = {"outcome": outcome, "message": msg, **({"detail": detail} if detail else {})}
    return out


PART_FUNCS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "env": part_env, "d2h": part_d2h, "save_stall": part_save_stall, "host_register": part_host_register,
    "reform": part_reform, "tier0": part_tier0, "pytest_1gpu": part_pytest_1gpu,
}


# ---- the driver --------------------------------------------------------------------------------------

def run_part(name: str, timeout: float, dry: bool) -> dict[str, Any]:
    """Run one part in a subprocess; never raises."""
    with tempfile.TemporaryDirectory(prefix="tg-gpucheck-") as d:
        result = os.path.join(d, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--part", name, "--result", result, *(["--dry-run"] if dry else [])]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            out += (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        rec: dict[str, Any] = {"rc": rc, "seconds": round(time.monotonic() - t0, 2), "timeout_s": timeout}
        if os.path.exists(result):
            with open(result) as f:
                rec["result"] = json.load(f)
        if rc != 0:
            rec["tail"] = out[-3000:]
    return rec


def verdicts(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Pure: each target of issue 35 -> True / False / None (not measured)."""
    def res(name: str) -> dict[str, Any] | None:
        return parts.get(name, {}).get("result")

    out: dict[str, Any] = {}
    d2h = res("d2h")
    out["d2h_staging_over_peak"] = None if d2h is None else d2h["staging_over_peak"] >= TARGETS["d2h_staging_over_peak_min"]
    t0 = res("tier0")
    out["tier0_overhead"] = None if t0 is None else (t0["overhead"] <= TARGETS["tier0_overhead_max"]
                                                     and t0["gpu_peak_bytes"] >= TARGETS["tier0_fill_bytes_min"])
    out["tier0_no_gpu_memory_growth"] = None if t0 is None else t0["gpu_peak_delta_bytes"] <= 0
    rf = res("reform")
    out["reform_no_growth"] = None if rf is None else all(v == 0 for v in rf["growth"].values())
    py = res("pytest_1gpu")
    out["single_gpu_tests_green"] = None if py is None else (py["failed"] == 0 and py["passed"] > 0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check.json")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    ap.add_argument("--only", default="", help="comma-separated parts (default: all, in order)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: proves the script, measures nothing")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.part:
        res = PART_FUNCS[a.part](a.dry_run)
        with open(a.result, "w") as f:
            json.dump(res, f, indent=1, default=str)
        return 0
    names = [n for n in a.only.split(",") if n] or list(PARTS)
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {unknown}; the parts are {list(PARTS)}")
    t_start = time.monotonic()
    parts: dict[str, dict[str, Any]] = {}
    for name in names:
        left = a.budget_s - (time.monotonic() - t_start)
        if left < 10:
            parts[name] = {"rc": "not_run", "why": f"the budget of {a.budget_s:.0f}s ran out"}
            continue
        parts[name] = run_part(name, min(PARTS[name], left), a.dry_run)
        print(f"gpu_check: {name:<14} rc={parts[name]['rc']!s:<8} {parts[name].get('seconds', 0):7.1f}s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    report = {"dry_run": a.dry_run, "commit": commit or os.environ.get("TG_COMMIT", ""),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "total_s": round(time.monotonic() - t_start, 1),
              "budget_s": a.budget_s, "targets": TARGETS, "parts": parts, "verdicts": verdicts(parts)}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(json.dumps(report["verdicts"]), flush=True)
    print(f"gpu_check: wrote {a.out} in {report['total_s']}s", flush=True)
    return 0 if all(isinstance(p.get("rc"), int) and p["rc"] == 0 for p in parts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
