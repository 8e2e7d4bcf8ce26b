"""The tiny job on torchft's API: each node is one replica group (one worker under its own ``torchrun``),
``torchft.Manager`` with a gloo process group and the lighthouse at ``$TORCHFT_LIGHTHOUSE``; torchft's
``DistributedDataParallel`` and ``OptimizerWrapper`` run the per-step quorum and commit. A replica that
(re)joins heals from a live peer (no durable checkpoint: torchft leaves those to the user, and no fault
here takes every replica down). Step ``s``'s global batch is split over the quorum's participants."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import common
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


def main() -> None:
    args = common.parser(__doc__).parse_args()
    common.setup_torch()
    data = common.dataset()
    model = common.model()
    inner = common.optimizer(model)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["opt"])

    group = os.environ.get("REPLICA_GROUP_ID", "0")
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=float(os.environ.get("TORCHFT_TIMEOUT_SEC", "60")))),
                      min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=lambda: {"model": model.state_dict(), "opt": inner.state_dict()},
                      replica_id=f"peers_{group}")
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)  # torchft.optim.OptimizerWrapper
    while manager.current_step() < args.steps:
        opt.zero_grad(set_to_none=True)  # starts the quorum
        step = manager.current_step() + 1
        prank, n = manager.participating_rank(), manager.num_participants()
        batch = common.global_batch(step)
        ids = batch[prank::n] if prank is not None and n else batch[:1]  # a healing replica's grads are zeroed
        common.loss_of(ddp, data, ids).backward()
        opt.step()  # commits only if every participant got through the step
        time.sleep(args.step_sleep)
        if manager.current_step() == step and prank is not None:
            common.log_step(args.step_log, step, prank, n, getattr(manager, "_quorum_id", None), ids, group=group)
    manager.shutdown()


if __name__ == "__main__":
    main()
