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
    mgr = CheckpointManager(CheckpointConfig(url=url), "run", rank=0, world_size=1, fence=1)
    state = {"model": ModelOptimizerState(model)}
    mgr.save(1, state, block=True)

    def die(*_a: object, **_k: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    mgr._commit = die  # type: ignore[method-assign]
    mgr.save(2, state, block=True)
    sys.exit(3)  # not reached


if __name__ == "__main__":
    main()
