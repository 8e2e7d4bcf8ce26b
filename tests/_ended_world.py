"""One rank of ``tests/runtime/test_world_connections.py``: two gloo ranks, a DDP model on each (its reducer
keeps the default group alive), rank 1 blocked in an all-reduce rank 0 never joins; rank 0 parks."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainguard.runtime import reform as rf


def main() -> None:
    mode, rank, port, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    mark = lambda name, text="": open(os.path.join(folder, name), "w").write(text)  # noqa: E731
    seen = lambda name: os.path.exists(os.path.join(folder, name))  # noqa: E731
    rf.init_world(rank=rank, world_size=2, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                  master_port=port, device=torch.device("cpu"), timeout_s=120)
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()  # the reducer now holds the default group
    if rank == 1:
        mark("blocked")
        try:
            dist.all_reduce(torch.ones(4))  # rank 0 never joins this one
            mark("rank1_done", "returned")
        except Exception as e:  # noqa: BLE001 - what failed, and whether rank 0 had exited by then
            mark("rank1_done", f"{'after_rank0_exit' if seen('rank0_exit') else 'rank0_alive'} {e}")
        os._exit(0)
    while not seen("blocked"):
        time.sleep(0.05)
    time.sleep(0.5)  # rank 1 is inside the all-reduce
    if mode == "end":
        mark("ended", str(rf.end_world_connections()))
    rf.teardown_world(torch.device("cpu"), peer_lost=True)  # destroys the groups; DDP's reference keeps the default one
    deadline = time.monotonic() + (60 if mode == "end" else 3)
    while not seen("rank1_done") and time.monotonic() < deadline:
        time.sleep(0.05)
    mark("rank0_exit")
    os._exit(0)


if __name__ == "__main__":
    main()
