"""Tier 1 only where it adds a copy: with replicated state (DDP) every rank's snapshot restores any rank,
so a lost node's state already lives in the survivors' own snapshots and buddy replicas would only
double the host memory; with sharded state (FSDP2) each rank's shard exists nowhere else, so the
replicas are kept. Real gloo worlds of 2 processes, one rank per "node" (each its own snapshot folder)."""

import json
import os
import sys

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _rank(rank: int, init: str, strategy: str, tmp: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from structlog.testing import capture_logs

    from tests.runtime.test_finishing import train_loop
    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.runtime import Runtime

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    folder = os.path.join(tmp, f"node-{rank}")
    os.makedirs(folder, exist_ok=True)
    cfg = CheckpointConfig(url=os.path.join(tmp, "ckpt"), interval="off", memory_interval_steps=1,
                           memory_max_overhead=0, memory_replica=True, async_save=False)
    rt = Runtime(rank=rank, world_size=2, local_rank=0, local_world_size=1, job_id="run", rdzv_id="r",
                 rdzv_round=0, memory_dir=folder, checkpoint=cfg, device="cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with capture_logs() as logs:
        model, opt = rt.setup(model, opt, dataset_size=32, global_batch=4, micro_batch=2, seed=1, strategy=strategy)
        train_loop(rt, model, opt, 3)
    if rt._tiers.replicator is not None:
        rt._tiers.replicator.wait(60)
    dist.barrier()
    out = {"replicator": rt._tiers.replicator is not None, "copies": rt._tiers.memory.copies,
           "survivable": rt._tiers.survivable(), "own": sorted(f for f in os.listdir(folder) if f.startswith("rank-")),
           "replicas": sorted(f for f in os.listdir(folder) if f.startswith("replica-")),
           "replica_bytes": rt._tiers.memory.replica_bytes,
           "redundant_logged": [e["event"] for e in logs if e["event"] == "memory_replica_redundant"]}
    with open(out_path, "w") as fh:
        json.dump(out, fh)
    dist.barrier()
    os._exit(0)  # the runtime's side groups and threads are not torn down here (no rt.finish())


def run(tmp_path, strategy):
    init = f"file://{tmp_path}/store-{strategy}"
    outs = [str(tmp_path / f"{strategy}-r{r}.json") for r in range(2)]
    codes, logs = run_ranks("tests.runtime.test_tiers",
                            [[str(r), init, strategy, str(tmp_path), outs[r]] for r in range(2)], timeout=90)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    return [json.load(open(o)) for o in outs]


def test_ddp_keeps_no_buddy_replicas(tmp_path):
    r0, r1 = run(tmp_path, "ddp")
    for r in (r0, r1):
        assert not r["replicator"] and r["copies"] == 1  # memory sized (and capped) for tier 0 alone
        assert r["replicas"] == [] and r["replica_bytes"] == 0 and r["own"]
        assert r["survivable"]  # the survivors' own snapshots outlive a lost node
    assert r0["redundant_logged"] == ["memory_replica_redundant"] and r1["redundant_logged"] == []


def test_fsdp_keeps_its_buddy_replicas(tmp_path):
    r0, r1 = run(tmp_path, "fsdp")
    for r in (r0, r1):
        assert r["replicator"] and r["copies"] == 2
        assert r["replicas"] and r["replica_bytes"] > 0  # the other rank's shard, received into this "node"
        assert r["survivable"] and not r["redundant_logged"]


if __name__ == "__main__":
    _rank(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
