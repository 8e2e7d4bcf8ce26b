"""FSDP gradient accumulation memory: per-micro-batch reduce-scatter vs unsharded accumulation
(benchmark, not a timed test).

Both paths run side by side in one invocation, each as a fresh gloo world of ``--world`` CPU
processes training the same model (``--layers`` x ``Linear(d, d)``, fp32) with gradient accumulation
``--accum``:

* ``per_micro_batch`` (the default, ``accumulate_unsharded=False``): every micro-batch reduce-scatters
  its gradients, which accumulate sharded (1/world of the gradient per rank);
* ``unsharded`` (``accumulate_unsharded=True``, the former behaviour): ``set_requires_gradient_sync(False)``
  keeps full-size gradients on every rank until the last micro-batch.

Each rank measures its peak resident memory over the steps above what it held after setup (``VmHWM``
of ``/proc/self/status``, reset via ``/proc/self/clear_refs`` once the sharded model exists). The
workers run with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every tensor buffer on its own and
returns it to the OS when freed, so the resident set follows the live tensors (otherwise freed heap
memory stays resident and hides the difference). The table shows the peak
per rank of each path, their difference and the unsharded-gradient size the strategy computes
(``FSDPStrategy.unsharded_gradient_bytes``), whose part ``(1 - 1/world)`` the default path should save.
Writes JSON with ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.strategies.fsdp import FSDPStrategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(a.d, a.d) for _ in range(a.layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # no optimizer state: the gradients dominate
    s = FSDPStrategy(accumulate_unsharded=a.mode == "unsharded", wrap=lambda m: isinstance(m, torch.nn.Linear))
    s.device = torch.device("cpu")
    model, opt = s.setup(model, opt)
    x = torch.randn(a.micro, a.d)

    def step() -> None:
        for i in range(a.accum):
            with s.no_sync(model, last=i == a.accum - 1):
                (model(x).pow(2).mean() / a.accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    dist.barrier()
    before = _rss()
    _reset_peak()
    for _ in range(a.steps):
        step()
    peak = _rss_peak()
    out = {"rank": dist.get_rank(), "peak_rss_bytes": peak, "rss_after_setup_bytes": before,
           "peak_over_setup_bytes": peak - before, "unsharded_grad_bytes": s.unsharded_gradient_bytes(model)}
    with open(a.out, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def run_mode(a: argparse.Namespace, mode: str, tmp: str) -> list[dict]:
    from tests.harness import free_port  # noqa: PLC0415 - a loopback port, as the test suite picks them

    port = str(free_port())
    procs, outs = [], []
    for r in range(a.world):
        out = os.path.join(tmp, f"{mode}-{r}.json")
        outs.append(out)
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(a.world), "LOCAL_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
               "MALLOC_MMAP_THRESHOLD_": "65536"}
        cmd = [sys.executable, "-m", "bench.fsdp_accumulation", "--worker", "--mode", mode, "--out", out,
               "--d", str(a.d), "--layers", str(a.layers), "--accum", str(a.accum), "--micro", str(a.micro),
               "--steps", str(a.steps)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO))
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"{mode} worker failed with exit code {p.returncode}")
    res = []
    for o in outs:
        with open(o) as f:
            res.append(json.load(f))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    with tempfile.TemporaryDirectory() as tmp:
        per = run_mode(a, "per_micro_batch", tmp)
        uns = run_mode(a, "unsharded", tmp)
    peak_per = max(r["peak_over_setup_bytes"] for r in per)
    peak_uns = max(r["peak_over_setup_bytes"] for r in uns)
    grad = per[0]["unsharded_grad_bytes"]
    expected_saving = grad * (1 - 1 / a.world)
    res = {"world": a.world, "accum": a.accum, "params": grad // 4, "unsharded_grad_bytes": grad,
           "per_micro_batch": per, "unsharded": uns,
           "peak_over_setup_per_micro_batch_bytes": peak_per, "peak_over_setup_unsharded_bytes": peak_uns,
           "saving_bytes": peak_uns - peak_per, "expected_saving_bytes": expected_saving,
           "saving_over_expected": (peak_uns - peak_per) / expected_saving if expected_saving else None}
    mib = 2 ** 20
    rows = [("path", "peak over setup, max over ranks"),
            ("per_micro_batch (default)", f"{peak_per / mib:.0f} MiB"),
            ("unsharded (accumulate_unsharded)", f"{peak_uns / mib:.0f} MiB"),
            ("saving", f"{(peak_uns - peak_per) / mib:.0f} MiB"),
            (f"unsharded gradient x (1 - 1/{a.world})", f"{expected_saving / mib:.0f} MiB"),
            ("saving / expected", f"{res['saving_over_expected']:.2f}")]
    w = max(len(r[0]) for r in rows)
    print(f"FSDP accumulation memory: world {a.world}, accumulation {a.accum}, {grad // 4 / 1e6:.1f}M fp32 parameters")
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
