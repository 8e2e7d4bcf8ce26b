"""Resharding from memory beyond FSDP2 over one mesh dimension: the index arithmetic of
:mod:`trainguard.checkpoint.reshard` against torch's own, and a tensor-parallel + FSDP2 job on a (2, 2)
mesh (4 ranks, real ``parallelize_module`` and ``fully_shard`` placements, ``_StridedShard`` included)
restored from its in-memory snapshots at (1, 2) over a real gloo world of 2."""

import itertools
import json
import os
import sys

import pytest
import torch

from tests.harness import run_ranks
from trainguard.checkpoint import memory as mem
from trainguard.checkpoint import reshard

pytestmark = pytest.mark.timeout(240)


# ---- the index arithmetic, no process group -----------------------------------------------------------

def _placements(codes):
    return [reshard.placement(c) for c in codes]


LAYOUTS = [
    ((10, 6), (2, 2), [("SS", 0, 2), ("S", 0)]),   # FSDP2 over column-wise TP: 5 rows per TP rank, 3 + 2
    ((6, 10), (2, 2), [("S", 0), ("S", 1)]),       # FSDP2 over row-wise TP
    ((6,), (2, 2), [("S", 0), ("R",)]),            # a row-wise TP bias: replicated over TP
    ((7, 3), (3,), [("S", 0)]),                    # FSDP2 alone, uneven: 3 + 3 + 1
    ((2, 3), (4,), [("S", 0)]),                    # more ranks than rows: two hold none
    ((8, 4), (2, 2), [("S", 1), ("S", 1)]),        # one dimension sharded twice
    ((12,), (2, 3), [("SS", 0, 3), ("S", 0)]),
    ((5, 4), (2, 2), [("R",), ("R",)]),
]


@pytest.mark.parametrize("shape,mesh,codes", LAYOUTS)
def test_local_indices_agree_with_torch_and_cover_every_element_once_per_replica(shape, mesh, codes):
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = _placements(codes)
    replicas = 1
    for size, c in zip(mesh, codes, strict=True):
        replicas *= size if c[0] == "R" else 1
    seen = torch.zeros(shape, dtype=torch.long)
    for coord in itertools.product(*(range(n) for n in mesh)):
        idx = reshard.local_indices(shape, mesh, coord, placements)
        local, first = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
        assert tuple(len(i) for i in idx) == tuple(local)
        if all(len(i) for i in idx):
            assert tuple(int(i[0]) for i in idx) == tuple(first)
            assert all(bool((i[1:] > i[:-1]).all()) for i in idx)  # ascending, as overlap() requires
        mark = torch.zeros(shape, dtype=torch.long)
        reshard.assign(mark, [i for i in idx], torch.ones([len(i) for i in idx], dtype=torch.long)) if all(
            len(i) for i in idx) else None
        seen += mark
    assert bool((seen == replicas).all()), seen


def test_a_strided_layout_copies_through_index_positions():
    """_StridedShard without a Shard after it: each rank holds rows 0, 2, 4... or 1, 3, 5... of its half."""
    g = torch.arange(24.0).view(12, 2)
    codes = [("SS", 0, 2)]
    old = {c: reshard.local_indices((12, 2), (3,), (c,), _placements(codes)) for c in range(3)}
    new = {c: reshard.local_indices((12, 2), (2,), (c,), [reshard.placement(("S", 0))]) for c in range(2)}
    assert [i.tolist() for i in old[0]][0] != list(range(len(old[0][0])))  # not a run: the index path
    for c, mine in new.items():
        dst = torch.full((len(mine[0]), 2), -1.0)
        for o, theirs in old.items():
            got = reshard.overlap(mine, theirs)
            if got is not None:
                reshard.assign(dst, got[0], reshard.select(g[theirs[0]], got[1]))
        assert torch.equal(dst, g[mine[0]]), (c, dst)


def test_a_submesh_record_stands_for_every_rank_s_own_submesh():
    """Old rank 0 recorded a DTensor on its data-parallel submesh (0, 2) of the root mesh ((0, 1), (2, 3)):
    rank 1's shard of it lay on submesh (1, 3), at the place rank 0's lay on (0, 2)."""
    info = ((8, 2), (0, 2), (("S", 0),), ((0, 1), (2, 3)))
    rows = {r: reshard.indices(info, r)[0].tolist() for r in range(4)}
    assert rows == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [4, 5, 6, 7], 3: [4, 5, 6, 7]}
    assert reshard.indices(info, 4) is None  # not in the root mesh
    assert reshard.replication(info) == 2  # each row on both ranks of a tensor-parallel group
    assert reshard.replication(((6,), ((0, 1), (2, 3)), (("S", 0), ("R",)), None)) == 2
    assert reshard.replication(((6,), ((0, 1), (2, 3)), (("S", 0), ("S", 0)), None)) == 1
    # a 3-D root (2, 2, 2) sliced along its first and last dimensions: rank 2 = (0, 1, 0) lies in the slice
    # ((2, 3), (6, 7)) at (0, 0), as rank 0 lies in the recorded ((0, 1), (4, 5))
    root = (((0, 1), (2, 3)), ((4, 5), (6, 7)))
    info3 = ((4, 4), ((0, 1), (4, 5)), (("S", 0), ("S", 1)), root)
    assert [i.tolist() for i in reshard.indices(info3, 2)] == [[0, 1], [0, 1]]
    assert [i.tolist() for i in reshard.indices(info3, 7)] == [[2, 3], [2, 3]]


def test_a_pending_reduction_is_refused_by_name():
    with pytest.raises(reshard.ReshardError, match="pending reduction"):
        reshard.placement(("P", "Partial(sum)"))


# ---- a (2, 2) tensor-parallel + FSDP2 job restored at (1, 2) from memory ------------------------------

def _model(world: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 6))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def _full(m, opt) -> dict:
    """Every parameter and optimizer state tensor, whole (a collective)."""
    out = {f"p/{k}": v.full_tensor().tolist() for k, v in m.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"o/{i}/{k}"] = v.full_tensor().tolist() if hasattr(v, "full_tensor") else v.tolist()
    return out


def _rank(role: str, rank: int, world: int, init: str, folder: str, out: str) -> None:
    import torch.distributed as dist

    from trainguard.checkpoint.state import ModelOptimizerState

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    m, opt = _model(world, seed=0 if role == "old" else 1)
    state = {"app": ModelOptimizerState(m, opt)}
    tier = mem.MemoryTier(folder, rank=rank, world_size=world)
    if role == "old":
        for _ in range(2):
            m(torch.randn(3, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
        tier.snapshot(5, state, world="job/4")
        tier.settle()
        result = {"full": _full(m, opt)}
    else:
        cands = tier.reshard_candidates(state)
        skel = mem.blob_skeleton(tier.blob(0, 5, "job/4", world_size=4))
        needed = sorted(mem.shards_needed(state, 4, rank, skel))
        blobs = {r: tier.blob(r, 5, "job/4", world_size=4) for r in needed}
        refused = []
        try:  # a needed shard missing: refused by name, nothing loaded
            tier.load_resharded({r: b for r, b in blobs.items() if r != needed[-1]}, state, 4)
        except mem.MemoryTierError as e:
            refused.append(str(e))
        w = m.state_dict()["0.weight"]
        views = {r: mem._parse(mem.Header.unpack(b[:mem._HEADER.size]), b[mem.HEADER_BYTES:])[1] for r, b in blobs.items()}
        try:  # the same, one level down: an element of the new shard in none of the snapshots given
            mem.fill_resharded(w, skel["app"]["model"]["0.weight"], {needed[0]: views[needed[0]]}, 4, needed[0])
        except mem.MemoryTierError as e:
            refused.append(str(e))
        tier.load_resharded(blobs, state, 4)
        result = {"cands": cands, "needed": needed, "refused": refused, "full": _full(m, opt)}
    tier.close()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(result, fh)
    else:
        with open(out, "w") as fh:
            json.dump({"needed": result.get("needed")}, fh)
    dist.barrier()
    os._exit(0)  # no C++ teardown of the mesh's gloo groups at exit


def _run(tmp_path, role: str, world: int, folder: str) -> list[dict]:
    init = f"file://{tmp_path}/store-{role}"
    outs = [str(tmp_path / f"{role}{r}.json") for r in range(world)]
    codes, logs = run_ranks("tests.checkpoint.test_memreshard_mesh", [[role, str(r), str(world), init, folder, outs[r]]
                                                               for r in range(world)], timeout=200)
    assert codes == [0] * world, "".join(log[-3000:] for log in logs)
    return [json.load(open(o)) for o in outs]


def test_tensor_parallel_fsdp2_restores_at_a_smaller_data_parallel_size_from_memory(tmp_path):
    folder = str(tmp_path / "node")  # one node's folder: own slots and replicas of all four old ranks
    os.makedirs(folder)
    old = _run(tmp_path, "old", 4, folder)[0]["full"]
    # what the snapshot keeps of each DTensor: its global shape, mesh and placements
    probe = mem.MemoryTier(folder, rank=0, world_size=1)
    w = mem.blob_skeleton(probe.blob(0, 5, "job/4", world_size=4))["app"]["model"]["0.weight"]
    probe.close()
    assert w[3][:3] == ((10, 6), ((0, 1), (2, 3)), (("SS", 0, 2), ("S", 0)))
    # old (dp 1, tp 1): rows 5-9 of tensor parallelism's half, FSDP2's second chunk of them (3 + 2)
    assert [r.tolist() for r in reshard.indices(w[3], 3)] == [[8, 9], list(range(6))]
    new = _run(tmp_path, "new", 2, folder)
    assert {tuple(c) for c in new[0]["cands"]} == {(r, 5, "job/4", 4) for r in range(4)}
    # new (dp 0, tp 0) needs the old ranks of tp 0, (dp 0, tp 1) those of tp 1: the bias replicated over
    # tensor parallelism adds no transfer
    assert new[0]["needed"] == [0, 2] and new[1]["needed"] == [1, 3]
    assert len(new[0]["refused"]) == 2, new[0]["refused"]
    assert "old rank 2 is missing or failed its checksum" in new[0]["refused"][0]
    assert "elements of this rank's shard of a (10, 6) tensor are in none of the snapshots of old ranks [0]" in \
        new[0]["refused"][1]
    assert new[0]["full"].keys() == old.keys()
    for k, v in old.items():
        assert new[0]["full"][k] == v, k


if __name__ == "__main__":
    _rank(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
