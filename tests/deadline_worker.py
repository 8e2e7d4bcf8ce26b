"""One rank of the abandoned-emergency-save scenario (``tests/runtime/test_stopping.py``).

Both ranks train one step and commit it. Rank 1 then freezes (SIGSTOP: its sockets stay open, no
reset, no data — a peer that vanished without a TCP reset); rank 0 is asked to drain with a deadline
a few seconds away and starts the emergency save, whose collectives wait for rank 1."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from trainguard.contract import protocol as proto
from trainguard.runtime import Runtime


def main() -> None:
    ready, deadline_in_s = sys.argv[1], float(sys.argv[2])
    rt = Runtime.from_env()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt, dataset_size=16, global_batch=4, micro_batch=2, seed=1)
    x = torch.randn(16, 4)
    micro = rt.next_batches()
    for i, ids in enumerate(micro):
        with rt.accumulating(last=i == len(micro) - 1):
            rt.backward(model(x[ids]).pow(2).mean())
    rt.optimizer_step(opt)
    rt.end_step()  # interval_steps=1: step 1 is saved in the background ...
    assert rt._tiers.manager is not None and rt._tiers.manager.wait() == 1  # ... and committed on both ranks
    if rt.rank == 1:
        open(ready, "w").close()
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    while not os.path.exists(ready):
        time.sleep(0.05)
    time.sleep(0.5)  # rank 1 is stopped by now
    # Step 2 trained on both ranks (its collectives done) before rank 1 froze: the emergency save is of
    # step 2, whose collectives now wait for the frozen peer. (Step 1, committed, would be skipped.)
    rt.step += 1
    print(f"EMERGENCY_START {time.time():.3f}", flush=True)
    rt._stop(proto.StopReason.DRAIN, time.time() + deadline_in_s)  # exits the process


if __name__ == "__main__":
    main()
