"""Tier 0 under a cost budget (``checkpoint.memory_max_overhead``): each rank proposes the smallest
snapshot interval that keeps its measured snapshot cost within the share of its step time, and the
world takes the largest proposal at each step agreement, so every rank snapshots the same steps."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.harness import free_port, run_ranks
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.interval import MEMORY_INTERVAL_MAX, memory_interval
from trainguard.contract.configbase import FieldError


@pytest.mark.parametrize("floor, share, snap, step, current, want", [
    (1, 0.0, 0.002, 0.010, 1, 1),        # no budget: every floor steps whatever it costs
    (3, 0.0, 0.002, 0.010, 1, 3),
    (1, 0.03, None, 0.010, 1, 1),        # nothing measured yet
    (1, 0.03, 0.002, None, 1, 1),
    (1, 0.03, 0.0002, 0.010, 1, 1),      # 2 % of a step: every step
    (1, 0.03, 0.0003, 0.010, 1, 1),      # exactly 3 %
    (1, 0.03, 0.0004, 0.010, 1, 2),      # 4 %: every other step (2 % each)
    (1, 0.03, 0.003, 0.010, 1, 16),      # 30 %: 10 would do; doublings: 16
    (3, 0.03, 0.003, 0.010, 1, 12),      # the configured interval is the floor, doubled from there
    (4, 0.03, 0.0004, 0.010, 1, 4),
    (1, 0.03, 0.003, 0.010, 32, 16),     # shorter when the cost fits 0.8 x the share at the shorter one
    (1, 0.03, 0.0004, 0.010, 8, 2),
    (1, 0.03, 0.0005, 0.010, 2, 2),      # 2.5 % at 2 steps: fits, and 1 step would not
    (1, 0.03, 0.00025, 0.010, 2, 2),     # 2.5 % at 1 step fits 3 % but not 0.8 x 3 %: keep 2
    (1, 0.03, 0.0002, 0.010, 2, 1),      # 2 % fits 2.4 % at 1 step: back to every step
    (1, 1e-9, 1.0, 0.001, 1, MEMORY_INTERVAL_MAX),  # capped
])
def test_the_interval_a_rank_proposes(floor, share, snap, step, current, want):
    assert memory_interval(floor, share, snap, step, current) == want


def test_a_share_out_of_range_is_refused_by_name():
    with pytest.raises(FieldError, match="memory_max_overhead"):
        CheckpointConfig(memory_max_overhead=1.5)
    with pytest.raises(FieldError, match="memory_max_overhead"):
        CheckpointConfig(memory_max_overhead=-0.1)


SLOW_RANK_SLEEP_S = 0.02
STEP_SLEEP_S = 0.005  # a step of about 5 ms: rank 1's snapshot is 4 steps' worth of the 0.5 share
STEPS = 40


def _rank(rank: int, port: int, folder: str, ckpt: str, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist
    from structlog.testing import capture_logs

    from trainguard.checkpoint.memory import MemoryTier
    from trainguard.runtime import Runtime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    snapped: list[int] = []
    real = MemoryTier.snapshot

    def snapshot(self, step, state, **kw):
        snapped.append(step)
        if rank == 1:  # rank 1's snapshots are slow (the hook runs inside the timed snapshot)
            self.fault_hook = lambda _step: time.sleep(SLOW_RANK_SLEEP_S)
        return real(self, step, state, **kw)

    MemoryTier.snapshot = snapshot
    rt = Runtime(rank=rank, world_size=2, local_rank=0, job_id="run", rdzv_id="r", rdzv_round=0, memory_dir=folder,
                 checkpoint=CheckpointConfig(url=ckpt, interval="off", memory_interval_steps=1,
                                             memory_max_overhead=0.5))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt, dataset_size=64, global_batch=4, micro_batch=2, seed=1)
    x = torch.randn(64, 4)
    with capture_logs() as logs:
        while rt.step < STEPS:
            for ids in rt.next_batches():
                rt.backward(model(x[ids]).pow(2).mean())
            rt.optimizer_step(opt)
            opt.zero_grad()
            time.sleep(STEP_SLEEP_S)
            rt.end_step()
    changes = [{"step": e["step"], "interval": e["interval_steps"]} for e in logs
               if e["event"] == "memory_interval_changed"]
    with open(out, "w") as fh:
        json.dump({"snapped": snapped, "changes": changes}, fh)
    rt.finish(barrier=False)
    os._exit(0)  # finish() tore the world down


@pytest.mark.timeout(120)
def test_every_rank_snapshots_the_same_steps_at_the_interval_the_slowest_asks_for(tmp_path):
    port = free_port()
    outs = [str(tmp_path / f"r{r}.json") for r in range(2)]
    args = []
    for r in range(2):
        os.makedirs(tmp_path / f"node{r}")
        args.append([str(r), str(port), str(tmp_path / f"node{r}"), f"file://{tmp_path}/ckpt", outs[r]])
    codes, logs = run_ranks("tests.checkpoint.test_memory_interval", args, timeout=100)
    assert codes == [0, 0], "".join(log[-3000:] for log in logs)
    got = [json.load(open(o)) for o in outs]
    assert got[0]["snapped"] == got[1]["snapped"], got  # the same steps on both ranks
    assert got[0]["changes"] == got[1]["changes"] and got[0]["changes"], got
    longest = max(c["interval"] for c in got[0]["changes"])
    assert longest >= 4, got  # rank 1's 20 ms snapshot against a 5 ms step, at most half of it: 8
    assert len(got[0]["changes"]) <= 6, got  # doublings: a drifting step time changes it rarely
    snapped = got[0]["snapped"]
    assert snapped[0] == 1 and 3 <= len(snapped) < STEPS // 2, snapped
    assert all(b - a <= longest for a, b in zip(snapped, snapped[1:])), snapped
    # each snapshot falls on a multiple of the interval agreed before it
    changes = got[0]["changes"]
    for s in snapped:
        every = 1
        for c in changes:
            if c["step"] <= s:
                every = c["interval"]
        assert s % every == 0, (s, every, changes)


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6])
