"""Run one segment of the bundled GPT job (``examples/train_gpt_elastic.py``, the worker runtime) as a
gloo world of ``world`` local processes, torchrun-style env, no agent; read the per-step losses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tests.fixtures.gloo_world import FAULTHANDLER_ENV, collect
from tests.harness import REPO, free_port
from trainguard.contract.protocol import RuntimeEnv

ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")
MODEL_PARALLEL = os.path.join(REPO, "examples", "train_gpt_mp.py")
# Small and fast on 2 shared cores; global batch 8 = 2 ranks x 2 micro-batches x 2 = 1 rank x 4 x 2.
JOB = ["--global-batch", "8", "--micro-batch", "2", "--seq-len", "32", "--d-model", "32", "--layers", "2",
       "--max-bytes", "1000000", "--log-every", "4", "--lr", "3e-3"]
# The same job with the end-to-end tests' global batch (24 = 2 ranks x 3 x 4 = 1 rank x 6 x 4).
E2E_BATCH = 24
E2E_SIZE = ["--global-batch", str(E2E_BATCH), "--micro-batch", "4"]


def run_segment(world: int, strategy: str, ckpt_url: str, *, steps: int, interval: int, fence: int, loss_log: str,
                extra: list[str] | None = None, timeout: float = 120.0, script: str = ELASTIC,
                expect_ok: bool = True, job_id: str = "run", memory_dir: str = "") -> list[tuple[int, str]]:
    """Train ranks ``0..world-1`` of ``script`` from the newest committed checkpoint (or ``--resume-step``
    in ``extra``) to ``steps``; periodic checkpoints every ``interval`` steps; fence = rendezvous round;
    ``job_id``: the checkpoint run id (the agents' ``agent.job_id`` when it continues their checkpoints);
    ``memory_dir``: a tier-0 folder (as an agent would hand it over; a snapshot every step), kept afterwards.
    Returns each rank's ``(exit code, output)``; asserts they all succeeded unless ``expect_ok`` is False."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    # The worker contract is written by its one owner (the fence is only the round the epoch record names).
    ckpt = {"url": ckpt_url, "interval_steps": interval, "when_busy": "wait",
            "memory_interval_steps": 1 if memory_dir else 0, "memory_max_overhead": 0}
    rt_env = RuntimeEnv(job_id=job_id, round=fence, checkpoint=ckpt, memory_dir=memory_dir).to_env()
    procs = []
    for r in range(world):
        env = {**base, **FAULTHANDLER_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RANK": str(r),
               "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **rt_env}
        cmd = [sys.executable, script, "--strategy", strategy, "--steps", str(steps), "--loss-log", loss_log,
               *JOB, *(extra or [])]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = collect(procs, timeout)
    bad = [f"--- rank {r} rc={rc}\n{out[-4000:]}" for r, (rc, out) in enumerate(outs) if rc != 0]
    assert not expect_ok or not bad, f"{strategy} at world size {world} failed:\n" + "\n".join(bad)
    return outs


def losses(path: str) -> dict[int, float]:
    """step -> global-batch loss (the last record wins: a resumed segment re-logs nothing before it)."""
    out: dict[int, float] = {}
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            out[int(rec["step"])] = float(rec["loss"])
    return out


def continuity(tmp: str, ckpt: str, strategy: str, step: int, world_before: int, logged: dict[int, float],
               extra: list[str] | None = None, script: str = ELASTIC, size: list[str] | None = None) -> float:
    """|loss of step+1 as logged by a resized run - loss of step+1 recomputed at ``world_before``|: the
    loss that step would have had without the resize.

    The reference restores the same committed ``step`` at the old world size from a copy of the run's
    checkpoints (so nothing it does can touch the run's) and trains one step of the e2e job
    (:data:`JOB` + ``size`` (default :data:`E2E_SIZE`) + ``extra``) with ``script``.
    """
    ref_dir = os.path.join(tmp, f"ref-{step}")
    shutil.copytree(ckpt, ref_dir)
    ref_log = os.path.join(tmp, f"ref-{step}.jsonl")
    run_segment(world_before, strategy, ref_dir, steps=step + 1, interval=0, fence=1000 + step, loss_log=ref_log,
                extra=[*(E2E_SIZE if size is None else size), *(extra or []), "--resume-step", str(step)],
                script=script, timeout=300)
    return abs(logged[step + 1] - losses(ref_log)[step + 1])
