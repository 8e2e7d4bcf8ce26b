"""A stand-in training worker for the metrics tests: reports through the real WorkerMetrics API.

Run as a script in a process whose environment already holds ``PROMETHEUS_MULTIPROC_DIR`` (from
``AgentMetrics.worker_env()``), exactly as the agent starts workers. It "trains" by sleeping
``--step-time`` per step, checkpoints every ``--ckpt-every`` steps (one failure at
``--fail-ckpt-at``), reports an allocator peak, and stops after ``--steps`` steps or when
``--stop-file`` appears. It prints ``step N`` lines so the parent can follow it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--local-rank", type=int, default=0)
    ap.add_argument("--start-step", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--fail-ckpt-at", type=int, default=-1)
    ap.add_argument("--gpu-peak", type=int, default=0)
    ap.add_argument("--stop-file", default="")
    ap.add_argument("--memory-interval", type=int, default=0, help="report a tier-0 snapshot every step, this many apart")
    ap.add_argument("--restored", type=int, default=-1, help="report a restore of this step before the first step")
    ap.add_argument("--skipped", type=int, default=0, help="... that skipped this newer committed step")
    ap.add_argument("--corrupt", type=int, default=0, help="... having found this many steps proven corrupt")
    a = ap.parse_args()

    from trainguard.metrics.worker import WorkerMetrics

    w = WorkerMetrics(a.rank, a.local_rank, strict=True)
    if a.gpu_peak:
        w.observe_gpu_peak(a.gpu_peak)
    step = a.start_step
    if a.restored >= 0:
        w.observe_restore(a.restored, "periodic", skipped=a.skipped or None, corrupt=a.corrupt)
        step = a.restored
    for _ in range(a.steps):
        t0 = time.perf_counter()
        time.sleep(a.step_time)
        step += 1
        w.observe_step(step, a.samples, a.samples * a.seq_len, time.perf_counter() - t0)
        if a.ckpt_every and step % a.ckpt_every == 0:
            ok = step != a.fail_ckpt_at
            w.observe_checkpoint("periodic", stage_s=0.01, persist_s=0.05 if ok else None, blocked_s=0.01,
                                 nbytes=4096, step=step, ok=ok)
            if a.rank == 0:  # the interval controller's inputs, as the runtime's rank 0 exports them
                w.observe_interval({"interval_s": None, "optimum_s": 12.5, "save_cost_s": 0.01, "persist_s": 0.05,
                                    "restore_s": None, "mtbf_s": 7200.0, "rollback_probability": 0.25,
                                    "unannounced_failures": 0, "survived_losses": 3})
        if a.memory_interval:
            w.observe_memory(0.001, 4096, None, a.memory_interval)
        print(f"step {step}", flush=True)
        if a.stop_file and os.path.exists(a.stop_file):
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
