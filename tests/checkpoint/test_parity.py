"""Tier 1 as XOR parity (``checkpoint.memory_replica_parity``): the coding, the rebuild plan, and a lost
node rebuilt over real processes and a real gloo group.

The multi-process cases run a world of 3 ranks on 3 "nodes" (3 snapshot folders) that snapshot with
parity at steps 1..3; then node 2 is lost (its folder emptied, as a replacement node's is) and a new
world of 3 restores: rank 2's snapshot is rebuilt from the survivors' parity blocks and snapshots.

* ``clean``: the loss comes after step 3: step 3 is restored, bit for bit the state trained.
* ``mid_exchange``: rank 2 is SIGKILLed during step 3's parity exchange: no rank overwrote its own
  snapshot (the exchange failed before the agreement), so step 2 is restored, never a mix.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import sys

import pytest
import torch
import torch._dynamo  # noqa: F401 - its lazy import (by get_state_dict) sets TORCHINDUCTOR_CACHE_DIR; do it first

from tests.harness import free_port, run_ranks
from trainguard.checkpoint import parity

pytestmark = pytest.mark.timeout(240)


# ---- pure: groups, coding, plan ---------------------------------------------------------------------


def test_parity_groups_split_the_nodes_evenly_and_never_leave_one_alone():
    assert parity.parity_groups(1) == []
    assert parity.parity_groups(2) == [[0, 1]]
    assert parity.parity_groups(3) == [[0, 1, 2]]
    assert parity.parity_groups(8) == [list(range(8))]
    assert parity.parity_groups(9) == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert parity.parity_groups(17, max_size=8) == [list(range(0, 6)), list(range(6, 12)), list(range(12, 17))]
    assert parity.group_of(5, 6, 2) == ([1, 3, 5], 2)  # local rank 1 on each of 3 nodes
    assert parity.group_of(0, 2, 2) is None  # one node


def _blocks(datas: list[bytes]) -> tuple[int, list[torch.Tensor]]:
    g = len(datas)
    seg = parity.seg_bytes(max(len(d) for d in datas), g)
    flats = [parity.Flat.of_bytes(d) for d in datas]
    blocks = []
    for j in range(g):
        b = torch.zeros(seg, dtype=torch.uint8)
        for i in range(g):
            if i != j:
                piece = torch.empty(seg, dtype=torch.uint8)
                flats[i].read(parity.segment_to(i, j, g) * seg, piece)
                parity.xor_(b, piece)
        blocks.append(b)
    return seg, blocks


@pytest.mark.parametrize("g", [2, 3, 4, 5])
def test_any_one_member_is_rebuilt_from_the_others(g):
    gen = torch.Generator().manual_seed(g)
    datas = [bytes(torch.randint(0, 256, (int(n),), generator=gen, dtype=torch.uint8).tolist())
             for n in torch.randint(1, 5000, (g,), generator=gen)]
    seg, blocks = _blocks(datas)
    assert seg * (g - 1) >= max(map(len, datas)) and seg % 8 == 0
    for x in range(g):
        out = []
        for k, j, others in parity.rebuild_order(x, g):
            acc = blocks[j].clone()
            for i, kk in others:
                piece = torch.empty(seg, dtype=torch.uint8)
                parity.Flat.of_bytes(datas[i]).read(kk * seg, piece)
                parity.xor_(acc, piece)
            out.append(acc.numpy().tobytes())
        assert b"".join(out)[:len(datas[x])] == datas[x], (g, x)


def test_flat_reads_tensors_at_their_slot_offsets_with_zero_gaps():
    a = torch.arange(3, dtype=torch.int8)  # 3 bytes, padded to 16
    b = torch.tensor([7], dtype=torch.int8)
    f = parity.Flat.of([a, b], b"xy", align=16)
    assert f.length == 16 + 16 + 2
    out = torch.empty(40, dtype=torch.uint8)
    f.read(0, out)
    assert out[:3].tolist() == [0, 1, 2] and out[3:16].tolist() == [0] * 13 and out[16] == 7
    assert bytes(out[32:34].tolist()) == b"xy" and out[34:].tolist() == [0] * 6


def _inventory(node, data=(), blocks=()):
    return {"node": node, "data": list(data), "blocks": list(blocks)}


def _rec(members, holder, seg=64):
    return {"world": "w", "members": members, "index": members.index(holder), "seg": seg,
            "contrib": [{"rank": m, "tensor_bytes": 80, "meta_bytes": 20, "seg_crc": 100 + m} for m in members if m != holder]}


def test_the_plan_rebuilds_one_lost_member_per_group_from_the_newest_set():
    members = [0, 1, 2]
    inv = [_inventory("n0", [(0, 5, "w", 3)], [(0, 5, "w", 3, _rec(members, 0)), (0, 4, "w", 3, _rec(members, 0))]),
           _inventory("n1", [(1, 5, "w", 3)], [(1, 5, "w", 3, _rec(members, 1))]),
           _inventory("n2")]  # the replacement node: nothing
    plan = parity.plan_rebuilds(inv)
    assert len(plan) == 1
    rb = plan[0]
    assert (rb.rank, rb.step, rb.world_size, rb.seg, rb.tensor_bytes, rb.meta_bytes) == (2, 5, 3, 64, 80, 20)
    assert rb.rebuilder != 2  # a replica file of rank 2 on rank 2's node would read as its own
    # segment 0 of member 2 went to holder (2+1+0)%3 = 0, segment 1 to holder 1
    (p0, crc0), (p1, crc1) = rb.segments
    assert p0 == (parity.Piece(0, "block", 0), parity.Piece(1, "data", 1, parity.segment_to(1, 0, 3)))
    assert p1 == (parity.Piece(1, "block", 1), parity.Piece(0, "data", 0, parity.segment_to(0, 1, 3)))
    assert (crc0, crc1) == (102, 102)
    # Nothing to do when the set is complete; nothing possible when two members are gone.
    inv[2] = _inventory("n2", [(2, 5, "w", 3)], [(2, 5, "w", 3, _rec(members, 2))])
    assert parity.plan_rebuilds(inv) == []
    assert parity.plan_rebuilds([inv[0], _inventory("n1"), _inventory("n2")]) == []


def test_the_plan_reads_each_file_once_per_node():
    members = [0, 1]
    same_node = [_inventory("n0", [(0, 3, "w", 2)], [(0, 3, "w", 2, _rec(members, 0))])] * 2  # two ranks, one folder
    plan = parity.plan_rebuilds([*same_node, _inventory("n1")])
    assert [(rb.rank, [p.provider for p in rb.segments[0][0]]) for rb in plan] == [(1, [0])]


# ---- over processes -----------------------------------------------------------------------------------


WIDTH = 48


def _state(seed: int):  # noqa: ANN202 - model, optimizer, trainer, checkpoint state
    from trainguard.checkpoint.state import ModelOptimizerState, TrainerState

    torch.manual_seed(seed)
    m = torch.nn.Linear(WIDTH, WIDTH)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    trainer = TrainerState(seed=3, cursor={"epoch": 0, "consumed": 0})
    return m, opt, trainer, {"app": ModelOptimizerState(m, opt), "trainer": trainer}


def _digest(m: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().numpy().tobytes())
        for v in opt.state[p].values():
            h.update(v.detach().numpy().tobytes() if isinstance(v, torch.Tensor) else str(v).encode())
    return h.hexdigest()


def _train(rank: int, port: int, folder: str, mode: str, out: str) -> None:
    import torch.distributed as dist

    from trainguard.checkpoint import memory as mem

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    group = dist.new_group(backend="gloo")
    m, opt, trainer, state = _state(seed=rank)
    tier = mem.MemoryTier(folder, rank=rank, world_size=3)
    tier.set_parity(group, [0, 1, 2], rank)
    tier.guard(opt)
    digests = {}
    for step in (1, 2, 3):
        opt.zero_grad()
        m(torch.randn(4, WIDTH)).pow(2).mean().backward()
        opt.step()  # waits for the previous snapshot's exchange and write (the guard)
        trainer.step = step
        digests[step] = _digest(m, opt)
        if step == 3 and mode == "mid_exchange" and rank == 2:
            real, calls = parity._pairwise, []

            def die_in_the_chunks(*a, **k):
                calls.append(1)
                if len(calls) == 2:  # the heads went out; the data is next
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*a, **k)
            parity._pairwise = die_in_the_chunks  # type: ignore[assignment]
        tier.snapshot(step, state, world="run/0")
    tier.settle()
    with open(out, "w") as fh:
        json.dump({"digests": digests, "parity_step": tier.parity_step, "failed": tier.parity_failed,
                   "bytes": [tier.nbytes, tier.replica_bytes]}, fh)
    os._exit(0)  # no teardown collective with a peer that may be dead


def _restore(rank: int, port: int, folder: str, url: str, out: str) -> None:
    import torch.distributed as dist

    from trainguard.checkpoint import memory as mem
    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    m, opt, trainer, state = _state(seed=100 + rank)  # restarted workers: fresh state
    tier = mem.MemoryTier(folder, rank=rank, world_size=3)
    tier.parity_restore = True
    with CheckpointManager(CheckpointConfig(url=url), "run", rank=rank, world_size=3) as mgr:
        step = mgr.restore(state, memory=tier)
        tier_used = mgr.last_restored_tier.value
    with open(out, "w") as fh:
        json.dump({"step": step, "tier": tier_used, "digest": _digest(m, opt), "trainer_step": trainer.step}, fh)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["clean", "mid_exchange"])
def test_a_lost_node_is_rebuilt_from_parity(tmp_path, mode):
    folders = [str(tmp_path / f"node{r}") for r in range(3)]
    for f in folders:
        os.makedirs(f)
    outs = [str(tmp_path / f"train{r}.json") for r in range(3)]
    codes, logs = _run("train", folders, outs, mode)
    if mode == "mid_exchange":
        assert codes[2] == -signal.SIGKILL, logs[2][-3000:]
    assert all(c == 0 for c in codes[:2 if mode == "mid_exchange" else 3]), [x[-3000:] for x in logs]
    trained = [json.load(open(o)) for o in outs[:2 if mode == "mid_exchange" else 3]]
    want = 3 if mode == "clean" else 2
    for t in trained:
        assert t["parity_step"] == want, t
        assert (t["failed"] is None) == (mode == "clean"), t
        own, blocks = t["bytes"]  # one own slot, and two parity blocks of half a snapshot each: no more than a copy
        from trainguard.checkpoint import memory as mem
        assert own and blocks - 2 * (mem.HEADER_BYTES + mem._PARITY_META) <= own - mem.HEADER_BYTES, t["bytes"]
    # Node 2 is lost: a replacement comes with an empty folder.
    for name in os.listdir(folders[2]):
        os.remove(os.path.join(folders[2], name))
    outs2 = [str(tmp_path / f"restore{r}.json") for r in range(3)]
    codes, logs = _run("restore", folders, outs2, str(tmp_path / "ckpt"))
    assert codes == [0, 0, 0], [x[-3000:] for x in logs]
    got = [json.load(open(o)) for o in outs2]
    assert [g["step"] for g in got] == [want] * 3 and {g["tier"] for g in got} == {"peer"}, got
    assert [g["trainer_step"] for g in got] == [want] * 3
    if mode == "clean":
        assert [g["digest"] for g in got] == [t["digests"][str(want)] for t in trained]
    else:  # rank 2's own digests died with it: ranks 0 and 1 match theirs, and the rebuilt rank 2 loaded
        assert [g["digest"] for g in got[:2]] == [t["digests"][str(want)] for t in trained]
    assert "memory_parity_rebuilt" in "".join(logs)


def _run(phase: str, folders: list[str], outs: list[str], arg: str) -> tuple[list[int], list[str]]:
    port = free_port()
    return run_ranks("tests.checkpoint.test_parity", [[phase, str(r), str(port), folders[r], arg, outs[r]] for r in range(3)],
                     timeout=150)


if __name__ == "__main__":
    phase, rank, port, folder, arg, out = sys.argv[1:7]
    (_train if phase == "train" else _restore)(int(rank), int(port), folder, arg, out)


def test_an_exchange_left_behind_never_writes_the_own_slot(tmp_path, monkeypatch):
    """A worker that parks while its parity exchange is stuck with a vanished peer leaves it behind
    (``abandon``): when the exchange comes back later it writes nothing, so the own slot keeps the
    previous snapshot, whole. (In process: the exchange and the agreement are stand-ins.)"""
    import threading

    import torch.distributed as dist

    from trainguard.checkpoint import memory as mem

    gate = threading.Event()
    calls: list[int] = []

    def exchange(flat, block, *, step, **kw):
        block(parity.seg_bytes(flat.length, 3))
        calls.append(step)
        if step == 2:
            gate.wait(30)  # stuck until the test lets it go
        return []

    monkeypatch.setattr(parity, "exchange", exchange)
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: None)  # the agreement: every rank says ok
    m, opt, trainer, state = _state(seed=0)
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=3)
    tier.set_parity(object(), [0, 1, 2], 0)
    trainer.step = 1
    tier.snapshot(1, state, world="w")
    tier.settle()
    assert tier.available(state) == [(1, "w")] and tier.parity_step == 1
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # step 2's state differs
    trainer.step = 2
    tier.snapshot(2, state, world="w")
    assert not tier.abandon(0.2)  # still in the exchange: left behind
    assert tier.parity_failed and "left behind" in tier.parity_failed
    gate.set()
    for _ in range(100):
        if len(calls) == 2 and not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("tg-snapshot")):
            break
        time.sleep(0.05)
    assert tier.available(state) == [(1, "w")] and tier.parity_step == 1  # step 1 whole, step 2 never written
    with pytest.raises(mem.MemoryTierError, match="parity exchange"):
        tier.snapshot(3, state, world="w")  # no more snapshots in this world
    tier.close()
