"""The tiny job as a plain torchrun script: DDP over gloo, a ``torch.save`` checkpoint every K steps
(written by rank 0, renamed into place), restored on every (re)start. No notice handling."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common


def main(doc: str = __doc__, on_step: Callable[[], None] | None = None) -> None:
    """The loop; ``on_step`` runs after every finished step (``nvrx_job.py``: the heartbeat)."""
    args = common.parser(doc).parse_args()
    common.setup_torch()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    data = common.dataset()
    model = common.model()
    opt = common.optimizer(model)
    path = os.path.join(args.ckpt_dir, "ckpt.pt")
    step = 0
    if args.ckpt_dir and os.path.exists(path):
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    model = DDP(model)
    while step < args.steps:
        step += 1
        ids = common.global_batch(step)[rank::world]
        opt.zero_grad(set_to_none=True)
        common.loss_of(model, data, ids).backward()
        opt.step()
        time.sleep(args.step_sleep)
        common.log_step(args.step_log, step, rank, world, gen, ids)
        if on_step is not None:
            on_step()
        if args.ckpt_dir and rank == 0 and step % args.ckpt_every == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
