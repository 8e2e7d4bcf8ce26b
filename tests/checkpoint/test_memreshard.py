"""Resharding from memory: the snapshots of a world of 3 ranks (sharded along dimension 0, as FSDP2's
DTensors are) restore a world of 2 over a real gloo world, each rank taking the rows of its new shards."""

import json
import os
import sys

import pytest
import torch

from tests.harness import run_ranks
from trainguard.checkpoint import memory as mem

pytestmark = pytest.mark.timeout(120)

W = torch.arange(15, dtype=torch.float32).view(5, 3)  # 5 rows: torch.chunk over 3 ranks 2+2+1, over 2 ranks 3+2
B = torch.tensor([[7.0, 8.0]])                         # 1 row: over 3 ranks 1+0+0, over 2 ranks 1+0

def _rank(rank: int, world: int, init: str, folder: str, out: str) -> None:
    """One rank of the new world (run by :func:`_run`): reshard the old world's snapshots into its state,
    write what it got to ``out``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = {"app": {"w": distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)]),
                     "b": distribute_tensor(torch.zeros(1, 2), mesh, [Shard(0)]), "step": torch.tensor(0.0), "lr": 0.0}}
    tier = mem.MemoryTier(folder, rank=rank, world_size=world)
    cands = tier.reshard_candidates(state)
    skel = mem.blob_skeleton(tier.blob(0, 9, "job/3", world_size=3))
    needed = sorted(mem.shards_needed(state, 3, rank, skel))
    blobs = {r: tier.blob(r, 9, "job/3", world_size=3) for r in needed}  # only the old shards its new ones overlap
    extra = tier.load_resharded(blobs, state, 3)
    app = state["app"]
    with open(out, "w") as fh:
        json.dump({"cands": cands, "needed": needed, "w": app["w"].to_local().tolist(),
                   "b": app["b"].to_local().tolist(), "step": app["step"].item(), "lr": app["lr"], "extra": extra}, fh)
    dist.barrier()
    os._exit(0)  # no C++ teardown of the mesh's gloo groups at exit (it can abort: a test of this code, not of that)


def _old_world(folder: str, ranks=(0, 1, 2)) -> None:
    """Snapshots of step 9 by a world of 3 ranks, each holding its torch.chunk shards (as FSDP2 does)."""
    for r in ranks:
        tier = mem.MemoryTier(folder, rank=r, world_size=3)
        tier.snapshot(9, {"app": {"w": torch.chunk(W, 3)[r].clone(), "b": B if r == 0 else B[:0],
                                  "step": torch.tensor(7.0), "lr": 0.1}}, world="job/3", extra={"base": None})
        tier.close()


def _run(tmp_path, folder: str, world: int = 2) -> list[dict]:
    init = f"file://{tmp_path}/store"
    outs = [str(tmp_path / f"r{r}.json") for r in range(world)]
    codes, logs = run_ranks("tests.checkpoint.test_memreshard", [[str(r), str(world), init, folder, outs[r]]
                                                          for r in range(world)], timeout=90)
    assert codes == [0] * world, "".join(log[-3000:] for log in logs)
    return [json.load(open(o)) for o in outs]


def test_a_world_of_2_takes_its_rows_from_the_snapshots_of_a_world_of_3(tmp_path):
    folder = str(tmp_path / "node")
    os.makedirs(folder)
    _old_world(folder)
    r0, r1 = _run(tmp_path, folder)
    assert [tuple(c) for c in r0["cands"]] == [(0, 9, "job/3", 3), (1, 9, "job/3", 3), (2, 9, "job/3", 3)]
    assert r0["w"] == W[0:3].tolist() and r1["w"] == W[3:5].tolist()
    assert r0["b"] == B.tolist() and r1["b"] == []
    assert r0["step"] == r1["step"] == 7.0 and r0["lr"] == r1["lr"] == 0.1
    assert r0["extra"] == {"base": None}
    # rows 0-2 of w live in old ranks 0 (0-1) and 1 (2); rows 3-4 in old ranks 1 (3) and 2 (4); b's one row in 0
    assert r0["needed"] == [0, 1] and r1["needed"] == [1, 2]


def test_shards_that_are_not_torch_chunks_or_a_missing_rank_are_refused(tmp_path):
    folder = str(tmp_path / "node")
    os.makedirs(folder)
    tier = mem.MemoryTier(folder, rank=0, world_size=1)
    cur = {"app": {"w": torch.zeros(5, 3)}}
    blobs = {}
    for r, rows in enumerate((W[0:1], W[1:5])):  # split 1 + 4: not what torch.chunk makes of 5 rows over 2
        t = mem.MemoryTier(folder, rank=r, world_size=2)
        t.snapshot(4, {"app": {"w": rows}}, world="job/2")
        blobs[r] = t.blob(r, 4, "job/2")
        t.close()
    with pytest.raises(mem.MemoryTierError, match="missing or failed its checksum"):
        tier.load_resharded({1: blobs[1]}, cur, 2)  # rank 0's values come from old rank 0: needed
    damaged = bytearray(blobs[0])
    damaged[-1] ^= 0xFF
    with pytest.raises(mem.MemoryTierError, match="missing or failed its checksum"):
        tier.load_resharded({0: bytes(damaged), 1: blobs[1]}, cur, 2)
    # a plain tensor (not a DTensor) must be the same on every rank: here it is not, and is refused
    with pytest.raises(mem.MemoryTierError, match=r"a tensor of shape \(5, 3\) is \(1, 3\)"):
        tier.load_resharded(blobs, cur, 2)
    tier.close()


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
