"""Cost of the step-boundary agreement: ``workers.step_agreement: blocking`` vs ``overlapped`` at every
step vs ``overlapped`` every stride (``workers.step_agreement_period_s``).

A trainguard worker agrees with every rank on a stop, a re-formation or a checkpoint: a 7-integer
all-reduce over a gloo side group (``Runtime.end_step``). ``blocking`` waits for it at every step;
``overlapped`` (period 0) issues it at step N and reads it at step N+1; ``strided`` (period
``--period``, the default 0.5 s) agrees every as many steps as fit in the period and between two
agreements only counts the step (its step-time histogram kept in the process until the next). This bench starts ``--ranks``
processes on 127.0.0.1 (gloo, ``OMP_NUM_THREADS=1``), each training a small DDP model whose step ends
with ``--step-sleep`` seconds of idle host time (what a GPU step looks like from the host: kernels
queued, the CPU waiting), and alternates blocks of ``--block`` steps in each mode (ABCABC..., the same
processes and machine noise for all). The workers report metrics through a multiprocess folder, as
under the agent. Per mode it reports the mean time spent in ``end_step`` and the mean step period
(one ``end_step`` return to the next); ``period_ratio`` = blocking / overlapped,
``strided_period_ratio`` = overlapped / strided.

Usage: ``OMP_NUM_THREADS=1 python bench/step_agreement.py [--ranks 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("blocking", "overlapped", "strided")


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.runtime import Runtime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.ranks)
    settings = {"blocking": ("blocking", 0.0), "overlapped": ("overlapped", 0.0), "strided": ("overlapped", a.period)}
    rt = Runtime(rank=a.rank, world_size=a.ranks, local_rank=0, job_id="bench", rdzv_round=0,
                 checkpoint=CheckpointConfig(url=a.ckpt, interval="off"), step_agreement=MODES[0])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = rt.setup(model, opt, dataset_size=100_000, global_batch=8 * a.ranks, micro_batch=8, seed=1)
    x = torch.randn(100_000, 64)
    rows: dict[str, dict[str, list[float]]] = {m: {"end_step_s": [], "period_s": []} for m in MODES}
    last = time.perf_counter()
    for i in range(a.warmup + a.steps):
        mode = MODES[(max(0, i - a.warmup) // a.block) % len(MODES)]
        if settings[mode] != (rt.step_agreement, rt.step_agreement_period_s):
            ag = rt._agreement  # switch modes at a block boundary
            pending, ag.pending = ag.pending, None
            if pending is not None:
                pending[0].wait()
            # The next boundary exchanges and waits, as a world's first: the stride is agreed afresh.
            ag.mode, ag.period_s = settings[mode]
            ag.next_boundary, ag.stride = 0, 1
        for ids in rt.next_batches():
            with rt.accumulating(last=True):
                rt.backward(model(x[ids]).pow(2).mean())
        rt.optimizer_step(opt)
        opt.zero_grad()
        time.sleep(a.step_sleep)
        t0 = time.perf_counter()
        rt.end_step()
        t1 = time.perf_counter()
        if i >= a.warmup and (i - a.warmup) % a.block:  # the first step of a block carries the switch
            rows[mode]["end_step_s"].append(t1 - t0)
            rows[mode]["period_s"].append(t1 - last)
            rows[mode].setdefault("stride", []).append(rt._agreement.stride)
        last = t1
    rt.finish()
    if a.rank == 0:
        with open(a.out, "w") as fh:
            json.dump(rows, fh)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--block", type=int, default=50)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--period", type=float, default=0.5, help="workers.step_agreement_period_s of the strided mode")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(prefix="tg-bench-agree-")
    out = os.path.join(work, "rows.json")
    metrics_dir = os.path.join(work, "metrics")
    os.makedirs(metrics_dir)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}, "OMP_NUM_THREADS": "1",
           "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--ranks", str(a.ranks), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--block", str(a.block), "--step-sleep", str(a.step_sleep), "--port", str(port),
           "--period", str(a.period),
           "--ckpt", os.path.join(work, "ckpt"), "--out", out]
    t0 = time.time()
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for r in range(a.ranks)]
    errs = [pr.communicate(timeout=1800)[1] for pr in procs]
    if any(pr.returncode for pr in procs):
        sys.stderr.write("".join(e[-3000:] for e in errs))
        return 1
    with open(out) as fh:
        rows = json.load(fh)
    res: dict[str, object] = {"ranks": a.ranks, "steps": a.steps, "block": a.block, "step_sleep_s": a.step_sleep,
                              "period_s": a.period,
                              "cpus": os.cpu_count(), "wall_s": round(time.time() - t0, 1)}
    print(f"{a.ranks} ranks on 127.0.0.1 (gloo), {a.steps} steps in blocks of {a.block}, step sleep {a.step_sleep} s, "
          f"strided period {a.period} s")
    print(f"{'mode':<12} {'end_step mean ms':>17} {'p95 ms':>8} {'period mean ms':>15} {'steps':>6} {'stride':>7}")
    for m in MODES:
        e, per = rows[m]["end_step_s"], rows[m]["period_s"]
        res[m] = {"end_step_s_mean": round(statistics.fmean(e), 6), "end_step_s_p95": round(sorted(e)[int(0.95 * len(e))], 6),
                  "period_s_mean": round(statistics.fmean(per), 6), "steps": len(e),
                  "stride_median": statistics.median(rows[m]["stride"])}
        r = res[m]
        print(f"{m:<12} {r['end_step_s_mean'] * 1e3:>17.3f} {r['end_step_s_p95'] * 1e3:>8.3f} "  # type: ignore[index]
              f"{r['period_s_mean'] * 1e3:>15.3f} {len(e):>6} {r['stride_median']:>7}")  # type: ignore[index]
    b, o, st = res["blocking"], res["overlapped"], res["strided"]
    res["period_ratio"] = round(b["period_s_mean"] / o["period_s_mean"], 4)  # type: ignore[index]
    res["end_step_saved_s"] = round(b["end_step_s_mean"] - o["end_step_s_mean"], 6)  # type: ignore[index]
    res["strided_period_ratio"] = round(o["period_s_mean"] / st["period_s_mean"], 4)  # type: ignore[index]
    res["strided_end_step_saved_s"] = round(o["end_step_s_mean"] - st["end_step_s_mean"], 6)  # type: ignore[index]
    print(f"period_ratio (blocking / overlapped): {res['period_ratio']}; end_step saved per step: "
          f"{res['end_step_saved_s'] * 1e3:.3f} ms")  # type: ignore[operator]
    print(f"strided_period_ratio (overlapped / strided): {res['strided_period_ratio']}; end_step saved per step: "
          f"{res['strided_end_step_saved_s'] * 1e3:.3f} ms")  # type: ignore[operator]
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
