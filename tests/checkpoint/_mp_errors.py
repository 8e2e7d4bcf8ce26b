"""One rank of a 2-rank gloo world that restores several prepared runs and reports what happened.

For each ``--runs`` id: build a manager, ``restore``, and print one JSON line
``{"run", "rank", "step", "error", "message"}`` (``error`` is the exception type, or null). Any
exception is caught and reported; an uncaught one (a traceback) or a hang is what the test fails on.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import CheckpointError
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.state import ModelOptimizerState


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--opts", default="{}")
    ap.add_argument("--runs", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    cfg = CheckpointConfig(url=a.url, storage_options=json.loads(a.opts), retry_attempts=2, retry_deadline_s=3,
                           restore_deadline_s=4)
    try:
        for run in a.runs.split(","):
            model = torch.nn.Linear(16, 16)
            rec: dict[str, object] = {"run": run, "rank": a.rank, "step": None, "error": None, "message": ""}
            with CheckpointManager(cfg, run, rank=a.rank, world_size=a.world) as mgr:
                try:
                    rec["step"] = mgr.restore({"model": ModelOptimizerState(model)})
                except CheckpointError as e:
                    rec["error"], rec["message"] = type(e).__name__, str(e)
            print("RESULT " + json.dumps(rec), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
