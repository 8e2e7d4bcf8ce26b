"""Save step 1, then die by SIGKILL after step 2's shards are written but before its manifest."""

from __future__ import annotations

import os
import signal
import sys

import torch

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.state import ModelOptimizerState


def main() -> None:
    url = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    def die(point: str, step: int) -> None:
        if point == "before_commit" and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    mgr = CheckpointManager(CheckpointConfig(url=url), "run", rank=0, world_size=1, fault_hook=die)
    state = {"model": ModelOptimizerState(model)}
    mgr.save(1, state, block=True)
    mgr.save(2, state, block=True)
    sys.exit(3)  # not reached


if __name__ == "__main__":
    main()
