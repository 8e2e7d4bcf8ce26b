"""A plain ``torch.distributed`` job (no worker API) for the exit-barrier test: ``--steps`` all-reduces on
gloo, a barrier, then the end that the node's arguments ask for. ``--done-file``: write it once this
worker finished (then exit 0). ``--fail-after FILES``: once every file (comma-separated) exists, exit 1,
once per job (``--fail-flag`` records it): a member whose workers fail after the others finished, so its
agent restarts them and leaves the round; with ``--hold``, sleep there instead (the test kills the node)."""

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--done-file", default="")
p.add_argument("--fail-after", default="")
p.add_argument("--fail-flag", default="")
p.add_argument("--hold", action="store_true")
a = p.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
t = torch.ones(1)
for _ in range(a.steps):
    dist.all_reduce(t)
    time.sleep(0.02)
dist.barrier()
rank, world = dist.get_rank(), dist.get_world_size()
dist.destroy_process_group()
print(json.dumps({"event": "job_end", "rank": rank, "world_size": world, "sum": float(t.item())}), flush=True)
if a.fail_after and not os.path.exists(a.fail_flag):
    files = a.fail_after.split(",")
    deadline = time.monotonic() + 120
    while not all(os.path.exists(f) for f in files) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # the others' workers have exited by now (their agents then enter the exit barrier)
    if a.hold:
        print(json.dumps({"event": "holding_after_the_others_finished", "rank": rank}), flush=True)
        time.sleep(600)
    with open(a.fail_flag, "w") as fh:
        fh.write(f"{os.getpid()}\n")
    print(json.dumps({"event": "failing_after_the_others_finished", "rank": rank}), flush=True)
    sys.exit(1)
if a.done_file:
    with open(a.done_file, "w") as fh:
        fh.write(f"{os.getpid()}\n")
