"""Tier 0 (in-memory snapshots) without processes: the choice of the step to restore, torn and corrupt
slots, the memory cap, a round trip into a model, the manager choosing between memory and storage, and
the agent's node folder."""

from __future__ import annotations

import os
import struct
import time
import zlib

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported lazily by get_state_dict, it sets TORCHINDUCTOR_CACHE_DIR)

from tests.runtime.test_finishing import train_loop
from trainguard.agent.memtier import NodeSnapshots, node_dir
from trainguard.checkpoint import memory as mem
from trainguard.checkpoint import slots
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.discovery import StepRef
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.state import ModelOptimizerState, TrainerState
from trainguard.contract.configbase import FieldError
from trainguard.contract.protocol import CheckpointTier

pytestmark = pytest.mark.timeout(60)


W, V = "run/0", "run/3"  # two worlds (rendezvous id / round)


@pytest.mark.parametrize("held, durable, want", [
    ([[(7, W), (6, W)], [(7, W), (6, W)]], None, (7, W)),   # every rank finished 7
    ([[(7, W), (6, W)], [(6, W)]], None, (6, W)),           # rank 1 died writing 7: 6 is complete everywhere
    ([[(8, W), (7, W)], [(7, W), (6, W)]], None, (7, W)),   # one snapshot apart: the newest common step
    ([[(8, W), (7, W)], [(6, W), (5, W)]], None, None),     # nothing in common: never mix steps
    ([[(7, W), (6, W)], []], None, None),                   # a rank holds nothing (a new node, a lost folder)
    ([[(7, W), (6, V)], [(7, V), (6, V)]], None, (6, V)),   # step 7 of two different worlds: never mixed
    ([[(7, W)], [(7, V)]], None, None),
    ([[(7, W), (6, W)], [(7, W), (6, W)]], 5, (7, W)),      # newer than storage's newest committed step
    ([[(7, W), (6, W)], [(7, W), (6, W)]], 7, None),        # storage holds the same step: the committed one
    ([[(7, W), (6, W)], [(7, W), (6, W)]], 9, None),        # storage is newer
    ([[(3, W)]], None, (3, W)),                             # one rank
    ([], None, None),
])
def test_choose_step_from_own_snapshots(held, durable, want):
    provided = [[(r, step, world) for step, world in items] for r, items in enumerate(held)]
    got, sources, why = mem.choose_sources(provided, world_size=len(held), newest_durable=durable)
    assert got == want, why
    assert (why == "ok") == (want is not None)
    assert sources == ({r: (r, r) for r in range(len(held))} if want else {})  # every rank loads its own


@pytest.mark.parametrize("provided, durable, want, sources", [
    # every rank holds its own: local loads
    ([[(0, 7, W)], [(1, 7, W)], [(2, 7, W)]], None, (7, W), {0: (0, 0), 1: (1, 1), 2: (2, 2)}),
    # rank 2's node was lost; rank 0 holds its replica (a replacement node is rank 2 now, holding nothing)
    ([[(0, 7, W), (2, 7, W), (2, 6, W)], [(1, 7, W)], []], None, (7, W), {0: (0, 0), 1: (1, 1), 2: (0, 2)}),
    # the replica lags one snapshot: the newest step every rank has somewhere
    ([[(0, 8, W), (0, 7, W), (2, 7, W)], [(1, 8, W), (1, 7, W)], []], None, (7, W),
     {0: (0, 0), 1: (1, 1), 2: (0, 2)}),
    # replicated state (DDP): the world shrank 3 -> 2, the survivors hold snapshots of the old world's
    # ranks 0 and 2; each loads its own node's copy, whichever old rank wrote it
    ([[(-1, 7, W), (-1, 6, W)], [(-1, 7, W)]], None, (7, W), {0: (0, -1), 1: (1, -1)}),
    # a replicated snapshot only one survivor holds is handed to the other
    ([[(-1, 7, W)], [(-1, 6, W)]], None, (7, W), {0: (0, -1), 1: (0, -1)}),
    # a replica of another world never completes this one
    ([[(0, 7, W), (2, 7, V)], [(1, 7, W)], []], None, None, {}),
    ([[(0, 7, W), (2, 7, W)], [(1, 7, W)], []], 7, None, {}),        # storage holds the same step
    ([[(0, 7, W), (5, 7, W)], [(1, 7, W)]], None, (7, W), {0: (0, 0), 1: (1, 1)}),  # a rank outside: ignored
    ([[], []], None, None, {}),
])
def test_choose_sources(provided, durable, want, sources):
    pick, got, why = mem.choose_sources(provided, world_size=len(provided), newest_durable=durable)
    assert pick == want, why
    assert got == sources


def test_replicas_are_double_buffered_and_a_torn_transfer_keeps_the_good_one(tmp_path):
    src_dir, buddy_dir = tmp_path / "a", tmp_path / "b"
    src_dir.mkdir()
    buddy_dir.mkdir()
    m, opt, trainer, state = _job()
    src = mem.MemoryTier(str(src_dir), rank=2, world_size=3)
    buddy = mem.MemoryTier(str(buddy_dir), rank=0, world_size=3)
    blobs = {}
    for s in (1, 2, 3):
        _train(m, opt, trainer, s)
        src.snapshot(s, state, world=W)
        blobs[s] = src.newest_blob()
        assert buddy.write_replica(blobs[s]).step == s
    files = sorted(os.listdir(buddy_dir))
    assert files == ["replica-00002-0.snap", "replica-00002-1.snap"]  # one replica per source, two buffers
    assert [(r, st) for r, st, _ in buddy.provides(_job()[3]) if r == 2] == [(2, 3), (2, 2)]
    with pytest.raises(mem.MemoryTierError):
        buddy.write_replica(blobs[3][:-10])  # cut short: refused, nothing replaced
    torn = bytearray(blobs[3])
    torn[mem.HEADER_BYTES + 1] ^= 0xFF
    with pytest.raises(mem.MemoryTierError):
        buddy.write_replica(bytes(torn))
    assert [(r, st) for r, st, _ in buddy.provides(_job()[3]) if r == 2] == [(2, 3), (2, 2)]
    # the lost rank's replacement loads the replica it is handed
    m2, opt2, trainer2, state2 = _job(seed=9)
    assert buddy.blob(2, 3, W) == blobs[3]
    src.load_blob(buddy.blob(2, 3, W), state2)
    assert trainer2.step == 3 and all(torch.equal(a, b) for a, b in zip(m2.state_dict().values(), m.state_dict().values()))
    with pytest.raises(mem.MemoryTierError, match="does not fit"):
        src.load_blob(blobs[3], _job(width=17)[3])


def test_buddies():
    from trainguard.checkpoint.replica import buddies

    assert buddies(0, 3, 1) == (1, 2) and buddies(2, 3, 1) == (0, 1)
    assert buddies(1, 4, 2) == (3, 3)  # two nodes of two: the same local rank on the other node
    assert buddies(0, 2, 2) is None    # one node: no other failure domain


def test_cap_arithmetic_and_errors():
    per_slot = mem.slot_bytes(1000, 100)
    assert per_slot == mem.HEADER_BYTES + 1100 + 4096  # room for the skeleton to grow: at least 4 KiB
    assert mem.slot_bytes(1000, 10_000) == mem.HEADER_BYTES + 11_000 + 10_000  # as much again
    assert mem.slot_bytes(1000, 10**6) == mem.HEADER_BYTES + 1000 + 10**6 + 64 * 1024  # at most 64 KiB
    assert mem.node_bytes(per_slot, 4) == per_slot * mem.SLOTS * 4
    mem.check_fits(per_slot, local_world_size=4, max_bytes=mem.node_bytes(per_slot, 4), free_bytes=10**12, directory="/x")
    with pytest.raises(mem.MemoryTierError) as e:
        mem.check_fits(per_slot, local_world_size=4, max_bytes=mem.node_bytes(per_slot, 4) - 1, free_bytes=10**12,
                       directory="/x")
    msg = str(e.value)
    assert "checkpoint.memory_max_bytes" in msg and "TRAINGUARD_CHECKPOINT_MEMORY_MAX_BYTES" in msg
    assert str(mem.node_bytes(per_slot, 4)) in msg and "memory_interval_steps=0" in msg
    # with tier 1 every rank also holds one replica (two buffers) of a buddy's state
    assert mem.node_bytes(per_slot, 4, copies=2) == 2 * mem.node_bytes(per_slot, 4)
    with pytest.raises(mem.MemoryTierError, match="own \\+ a buddy's replica"):
        mem.check_fits(per_slot, local_world_size=4, max_bytes=mem.node_bytes(per_slot, 4), free_bytes=10**12,
                       directory="/x", copies=2)
    with pytest.raises(mem.MemoryTierError, match=r"/x has 10 bytes free.*TRAINGUARD_CHECKPOINT_MEMORY_DIR"):
        mem.check_fits(per_slot, local_world_size=1, max_bytes=0, free_bytes=10, directory="/x")
    # with parity over 3 nodes: one own slot and two blocks of half a slot
    assert mem.parity_buffers(3) == 2.0 and mem.parity_buffers(2) == 3.0 and mem.parity_buffers(5) == 1.5
    assert mem.node_bytes(per_slot, 4, buffers=2.0) == per_slot * 2 * 4
    with pytest.raises(mem.MemoryTierError, match=r"2.00 buffers \(own \+ parity\)"):
        mem.check_fits(per_slot, local_world_size=4, max_bytes=per_slot * 8 - 1, free_bytes=10**12, directory="/x",
                       buffers=2.0)


def test_tier0_where_it_adds_a_copy():
    """Tier 0 is on by default, except for replicated state (DDP) re-forming in place: every live peer
    holds any rank's state there. The operator can take the snapshots anyway, or turn tier 0 off."""
    from trainguard.runtime.tiers import tier0_wanted

    on = CheckpointConfig(url="/c")
    assert on.memory_interval_steps == 1 and on.memory_max_overhead == 0.03 and not on.memory_replicated_in_place
    assert tier0_wanted(on, replicated=False, in_place=True)      # FSDP2 / TP / ZeRO in place: shards live nowhere else
    assert tier0_wanted(on, replicated=True, in_place=False)      # DDP restarting: the restart loses the live state
    assert not tier0_wanted(on, replicated=True, in_place=True)   # DDP in place: a live peer restores any rank
    assert tier0_wanted(CheckpointConfig(url="/c", memory_replicated_in_place=True), replicated=True, in_place=True)
    off = CheckpointConfig(url="/c", memory_interval_steps=0, memory_replicated_in_place=True)
    assert not any(tier0_wanted(off, replicated=r, in_place=i) for r in (False, True) for i in (False, True))


def test_default_cap_is_half_the_available_host_memory(tmp_path):
    """Tier 0 is on by default: without ``memory_max_bytes`` a node's snapshots take at most half of the
    memory the host has available (plus what they already hold); an explicit cap replaces that rule."""
    per_slot = mem.slot_bytes(1000, 100)
    need = mem.node_bytes(per_slot, 4)
    mem.check_fits(per_slot, local_world_size=4, max_bytes=0, free_bytes=10**12, directory="/x", available_bytes=2 * need)
    with pytest.raises(mem.MemoryTierError) as e:
        mem.check_fits(per_slot, local_world_size=4, max_bytes=0, free_bytes=10**12, directory="/x",
                       available_bytes=2 * need - 2)
    msg = str(e.value)
    assert f"need {need} bytes" in msg and "MemAvailable" in msg and "TRAINGUARD_CHECKPOINT_MEMORY_MAX_BYTES" in msg
    mem.check_fits(per_slot, local_world_size=4, max_bytes=need, free_bytes=10**12, directory="/x",
                   available_bytes=10)  # an explicit cap: the host's figure is the operator's call
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    8000000 kB\n")
    assert mem.host_available_bytes(str(info)) == 8000000 * 1024
    info.write_text("MemTotal: 5 kB\n")
    assert mem.host_available_bytes(str(info)) is None and mem.host_available_bytes(str(tmp_path / "none")) is None
    (tmp_path / "rank-00000-0.snap").write_bytes(b"x" * 100)
    (tmp_path / "replica-00001-1.snap").write_bytes(b"x" * 20)
    assert mem.folder_bytes(str(tmp_path)) == 120 and mem.folder_bytes(str(tmp_path / "none")) == 0


def test_snapshot_refused_beyond_half_the_available_memory(tmp_path, monkeypatch):
    """The worker side: a snapshot that would take more than half of what the host has available is
    refused (nothing written); the same state fits once the operator sets a cap that allows it."""
    monkeypatch.setattr(mem, "host_available_bytes", lambda meminfo="/proc/meminfo": 100_000)
    state = {"t": torch.arange(100_000, dtype=torch.float32)}  # 400 KB, two slots
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    with pytest.raises(mem.MemoryTierError, match="MemAvailable"):
        tier.snapshot(1, state)
    assert not any(f.endswith(".snap") and os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path))
    tier.close()
    capped = mem.MemoryTier(str(tmp_path), rank=0, world_size=1, max_bytes=10**7)
    assert capped.snapshot(1, state).step == 1
    capped.close()


def _job(seed: int = 0, width: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainerState, dict]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    trainer = TrainerState(seed=3, cursor={"epoch": 0, "consumed": 0})
    return m, opt, trainer, {"app": ModelOptimizerState(m, opt), "trainer": trainer}


def _train(m, opt, trainer, step):
    opt.zero_grad()
    m(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    trainer.step, trainer.cursor = step, {"epoch": 0, "consumed": 4 * step}


def _copy(m, opt):
    import copy

    return copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict()["state"])


def test_round_trip_two_slots_torn_and_corrupt(tmp_path):
    m, opt, trainer, state = _job()
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    _train(m, opt, trainer, 1)
    tier.snapshot(1, state, world=W, extra={"base": StepRef(0, 2)})
    want_m, want_o = _copy(m, opt)
    want_draw = torch.rand(3)  # the RNG state of step 1 (kept as bytes in the snapshot) draws this
    _train(m, opt, trainer, 2)
    r = tier.snapshot(2, state, world=W)
    assert r.nbytes > 0 and tier.nbytes == sum(os.path.getsize(p) for p in tmp_path.iterdir())
    assert sorted(os.listdir(tmp_path)) == ["rank-00000-0.snap", "rank-00000-1.snap"]
    assert tier.available(state) == [(2, W), (1, W)]
    _train(m, opt, trainer, 3)  # not snapshotted

    # restore step 1 into the live objects: weights, Adam state, trainer step and cursor
    with pytest.raises(mem.MemoryTierError):
        tier.load(1, state, world=V)  # another world's step 1: not this one
    assert tier.load(1, state, world=W) == {"base": StepRef(0, 2)}
    assert all(torch.equal(v, want_m[k]) for k, v in m.state_dict().items())
    got_o = opt.state_dict()["state"]
    assert all(torch.equal(got_o[i][k], want_o[i][k]) for i in want_o for k in want_o[i])
    assert trainer.step == 1 and trainer.cursor == {"epoch": 0, "consumed": 4}
    assert torch.equal(torch.rand(3), want_draw)

    # a writer killed after zeroing the commit word of the slot it was writing (step 3 into 2's slot)
    slot2 = next(p for p in tmp_path.iterdir() if mem.Header.unpack(p.read_bytes()[:4096]).step == 2)
    raw = bytearray(slot2.read_bytes())
    raw[8:16] = b"\0" * 8
    slot2.write_bytes(bytes(raw))
    assert tier.available(state) == [(1, W)]
    # a commit word that names another step than the header's (fields written, commit of an old write)
    raw[8:16] = struct.pack("<Q", 5)
    slot2.write_bytes(bytes(raw))
    assert tier.available(state) == [(1, W)]
    # a flipped byte in the data of the other slot: its checksum fails
    slot1 = next(p for p in tmp_path.iterdir() if p != slot2)
    raw1 = bytearray(slot1.read_bytes())
    raw1[mem.HEADER_BYTES + 3] ^= 0xFF
    slot1.write_bytes(bytes(raw1))
    assert tier.available(state) == []
    with pytest.raises(mem.MemoryTierError, match="no valid in-memory snapshot of step 1"):
        tier.load(1, state, world=W)
    tier.close()


def test_a_snapshot_with_namedtuple_leaves_still_loads(tmp_path, monkeypatch):
    # Leaves are plain (index, shape, dtype) tuples; snapshots written before held NamedTuples (a node
    # folder that outlives an upgrade of the workers): they still load, into the same values.
    import pickle

    def as_before(x):  # noqa: ANN001, ANN202
        if isinstance(x, tuple):
            return mem._Leaf(*x)
        if isinstance(x, dict):
            return {k: as_before(v) for k, v in x.items()}
        if isinstance(x, list):
            return [as_before(v) for v in x]
        if isinstance(x, mem._Tuple):
            return mem._Tuple([as_before(v) for v in x.items])
        return x

    m, opt, trainer, state = _job()
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    _train(m, opt, trainer, 1)
    real = mem.skeleton
    monkeypatch.setattr(mem, "skeleton", lambda sd, out, sig=None: as_before(real(sd, out, sig)))
    tier.snapshot(1, state, world=W)
    monkeypatch.undo()
    tier.settle()
    raw = next(tmp_path.iterdir()).read_bytes()
    h = mem.Header.unpack(raw[:mem.HEADER_BYTES])
    start = mem.HEADER_BYTES + h.tensor_bytes
    leaves = mem._leaves(pickle.loads(raw[start:start + h.meta_bytes])["skeleton"])
    assert leaves and all(type(leaf) is mem._Leaf for leaf in leaves)  # written the old way
    want_m, want_o = _copy(m, opt)
    _train(m, opt, trainer, 2)
    assert tier.available(state) == [(1, W)]  # the layout compares equal to plain-tuple leaves
    tier.load(1, state, world=W)
    assert all(torch.equal(v, want_m[k]) for k, v in m.state_dict().items())
    got_o = opt.state_dict()["state"]
    assert all(torch.equal(got_o[i][k], want_o[i][k]) for i in want_o for k in want_o[i])
    assert trainer.step == 1
    tier.close()


def _held_pool():  # noqa: ANN202 - (pool, release, entered)
    """A tier's background pool whose jobs wait until ``release`` is set (``entered``: one is waiting)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    release, entered = threading.Event(), threading.Event()

    class HeldPool(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            def held():
                entered.set()
                assert release.wait(30)
                return fn(*args, **kwargs)
            return super().submit(held)

    return HeldPool(1), release, entered


def test_a_snapshot_is_valid_only_once_its_background_commit_ran(tmp_path):
    """The training thread copies and returns; the checksum and commit word come from a background
    thread. A worker killed before that commit (another process reads the folder meanwhile, as a
    restarted worker does) leaves the previous snapshot as the newest valid one."""
    m, opt, trainer, state = _job()
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    _train(m, opt, trainer, 1)
    tier.snapshot(1, state, world=W)
    tier._pool, release, entered = _held_pool()
    _train(m, opt, trainer, 2)
    r = tier.snapshot(2, state, world=W)  # returns with the commit still to come
    assert r.step == 2 and entered.wait(30)
    other = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)  # a restarted worker's view
    assert other.available(state) == [(1, W)]
    release.set()
    tier.settle()
    assert other.available(state) == [(2, W), (1, W)]
    assert tier.available(state) == [(2, W), (1, W)]
    tier.close()
    other.close()


def test_guarded_parameters_are_copied_beside_the_next_forward_and_before_the_next_step(tmp_path):
    """With the optimizer guarded, its parameters and state are copied in the background: the next
    forward and backward run meanwhile, the next ``optimizer.step()`` waits for the copy, and the
    snapshot holds the state of its own step. Buffers (BatchNorm's running statistics, which the next
    forward changes) are copied before ``snapshot`` returns."""
    import copy
    import threading

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    trainer = TrainerState(seed=3, cursor={"epoch": 0, "consumed": 0})
    state = {"app": ModelOptimizerState(m, opt), "trainer": trainer}
    _train(m, opt, trainer, 1)
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    tier.guard(opt)
    tier._pool, release, entered = _held_pool()
    want_m, want_o = copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict()["state"])
    tier.snapshot(1, state, world=W)
    assert entered.wait(30)
    now, later = tier._deferred(tier._sig, tier._last[2])
    assert len(later) == 6 + 18 and len(now) == 3  # 6 params + 3 Adam tensors each; BN buffers
    stepped = threading.Event()

    def step2():
        _train(m, opt, trainer, 2)  # forward + backward run; opt.step() waits for the copy
        stepped.set()

    t = threading.Thread(target=step2)
    t.start()
    time.sleep(0.3)
    assert not stepped.is_set() and all(torch.equal(v, want_m[k]) for k, v in m.state_dict().items()
                                        if "running" not in k and "num_batches" not in k)
    assert tier.waited_s == 0.0
    release.set()
    t.join(30)
    assert stepped.is_set() and not torch.equal(m[0].weight, want_m["0.weight"])
    assert tier.waited_s >= 0.2  # the step's wait is booked: it is part of the snapshot's cost (tiers.py)
    m2 = copy.deepcopy(m)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.01)
    trainer2 = TrainerState(seed=3)
    tier.load(1, {"app": ModelOptimizerState(m2, opt2), "trainer": trainer2}, world=W)
    assert all(torch.equal(v, want_m[k]) for k, v in m2.state_dict().items())  # running stats of step 1 too
    got_o = opt2.state_dict()["state"]
    assert all(torch.equal(got_o[i][k], want_o[i][k]) for i in want_o for k in want_o[i])
    tier.close()


def test_other_world_size_rank_or_layout_is_not_a_candidate(tmp_path):
    m, opt, trainer, state = _job()
    _train(m, opt, trainer, 1)
    t0 = mem.MemoryTier(str(tmp_path), rank=0, world_size=2)
    t0.snapshot(1, state, world=W)
    assert t0.available(state) == [(1, W)]
    assert mem.MemoryTier(str(tmp_path), rank=0, world_size=3).available(state) == []
    # a restarted worker (a new process, same rank and world size) finds them
    assert mem.MemoryTier(str(tmp_path), rank=0, world_size=2).available(state) == [(1, W)]
    other = _job(width=17)[3]  # another model: the layout differs
    assert t0.available(other) == []
    t0.snapshot(2, state, world=W)
    t1 = mem.MemoryTier(str(tmp_path), rank=1, world_size=2)
    t1.snapshot(2, state, world=W)
    t0.rebind(1, 2)  # re-formed in place as rank 1: the old rank's and the new rank's files are emptied
    assert t0.available(state) == []
    assert mem.MemoryTier(str(tmp_path), rank=0, world_size=2).available(state) == []


def test_layout_change_invalidates_the_older_slot(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters())
    state = {"app": ModelOptimizerState(m, opt), "trainer": TrainerState()}
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    sd = {"w": torch.zeros(3)}
    tier.snapshot(1, {"x": sd})
    tier.snapshot(2, {"x": {"w": torch.zeros(5)}})  # the layout changed (e.g. optimizer state appeared)
    assert tier.available({"x": {"w": torch.zeros(5)}}) == [(2, "")]
    assert tier.available({"x": sd}) == []
    assert tier.available(state) == []


def test_cap_refuses_the_snapshot(tmp_path):
    m, opt, trainer, state = _job()
    _train(m, opt, trainer, 1)
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1, local_world_size=8, max_bytes=100_000)
    with pytest.raises(mem.MemoryTierError, match="checkpoint.memory_max_bytes"):
        tier.snapshot(1, state)
    assert tier.available(state) == []


def test_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(mem.MemoryTierError, match="through the trainguard agent.*MEMORY_INTERVAL_STEPS"):
        mem.MemoryTier(str(tmp_path / "nope"), rank=0, world_size=1)


def test_manager_prefers_a_newer_snapshot_and_falls_back_to_storage(tmp_path):
    cfg = CheckpointConfig(url=f"memory://tier0-{os.getpid()}-{id(tmp_path)}", memory_interval_steps=1)
    m, opt, trainer, state = _job()
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    with CheckpointManager(cfg, "run", rank=0, world_size=1) as mgr:
        _train(m, opt, trainer, 1)
        mgr.save(1, state, block=True)
        for s in (2, 3):
            _train(m, opt, trainer, s)
            tier.snapshot(s, state, world=W, extra={"base": mgr.base})
        want_m, _ = _copy(m, opt)
        _train(m, opt, trainer, 4)  # then the worker dies
    m2, opt2, trainer2, state2 = _job(seed=5)
    with CheckpointManager(cfg, "run", rank=0, world_size=1) as mgr:
        assert mgr.restore(state2, memory=tier) == 3
        assert mgr.last_restored_tier is CheckpointTier.MEMORY and mgr.last_restored is None
        assert all(torch.equal(v, want_m[k]) for k, v in m2.state_dict().items()) and trainer2.step == 3
        assert mgr.base == StepRef(1, 1) and mgr.epoch_record.base_step == 1  # the lineage goes on from step 1
        mgr.save(3, state2, block=True)  # committed: storage now holds the snapshot's step
    with CheckpointManager(cfg, "run", rank=0, world_size=1) as mgr:
        assert mgr.restore(_job(seed=6)[3], memory=tier) == 3
        assert mgr.last_restored_tier is CheckpointTier.STORAGE  # same step: the committed checkpoint
    tier.invalidate()
    with CheckpointManager(cfg, "run", rank=0, world_size=1) as mgr:
        assert mgr.restore(_job(seed=7)[3], memory=tier) == 3
        assert mgr.last_restored_tier is CheckpointTier.STORAGE


def test_config_checks_name_the_key():
    with pytest.raises(FieldError, match="memory_interval_steps"):
        CheckpointConfig(memory_interval_steps=-1)
    with pytest.raises(FieldError, match="memory_max_bytes"):
        CheckpointConfig(memory_max_bytes=-5)
    with pytest.raises(FieldError, match="memory_dir.*absolute"):
        CheckpointConfig(memory_dir="shm")
    with pytest.raises(FieldError, match="memory_replica_parity.*needs memory_replica"):
        CheckpointConfig(memory_replica_parity=True)
    assert CheckpointConfig(memory_replica=True, memory_replica_parity=True).memory_replica_parity


def test_agent_owns_the_node_folder(tmp_path):
    root = str(tmp_path / "shm")
    assert node_dir(root, "job/1", "node a") == os.path.join(root, "trainguard-job_1-node_a")
    off = NodeSnapshots(CheckpointConfig(url="/c", memory_dir=root, memory_interval_steps=0), "j", "n")
    assert off.open() == "" and not os.path.exists(root)
    assert not NodeSnapshots(CheckpointConfig(memory_dir=root), "j", "n").enabled  # no checkpoint url
    on = NodeSnapshots(CheckpointConfig(url="/c", memory_dir=root), "j", "n")  # on by default
    path = on.open()
    assert os.path.isdir(path) and oct(os.stat(path).st_mode & 0o777) == "0o700"
    with open(os.path.join(path, "rank-00000-0.snap"), "wb") as fh:
        fh.write(b"x" * 10)
    assert on.open() == path and os.listdir(path) == ["rank-00000-0.snap"]  # a restarted agent keeps them
    on.remove("succeeded")
    assert not os.path.exists(path)
    on.remove("again")  # idempotent
    bad = NodeSnapshots(CheckpointConfig(url="/c", memory_dir="/proc/nope", memory_interval_steps=1), "j", "n")
    from trainguard.contract.configbase import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.memory_dir / TRAINGUARD_CHECKPOINT_MEMORY_DIR"):
        bad.open()


# ---- the worker runtime: snapshots every N steps, the restore order, the refusal ------------------------

@pytest.fixture
def keep_sigterm_handler():
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _train_rt(url: str, folder: str, steps: int, *, every: int, max_bytes: int = 0, restore: bool = False):
    from trainguard.runtime import Runtime

    rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_id="r", rdzv_round=0, memory_dir=folder,
                 checkpoint=CheckpointConfig(url=url, interval="off", memory_interval_steps=every,
                                             memory_max_overhead=0, memory_max_bytes=max_bytes, async_save=False))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt, dataset_size=32, global_batch=4, micro_batch=2, seed=1)
    if restore:
        rt.restore()
    train_loop(rt, model, opt, steps)
    return rt, model


def test_runtime_restores_the_newest_snapshot_then_saves_it_durably(tmp_path, keep_sigterm_handler):
    from structlog.testing import capture_logs

    url, folder = str(tmp_path / "ckpt"), str(tmp_path / "node")
    os.makedirs(folder)
    _, ref = _train_rt(str(tmp_path / "ref"), str(tmp_path / "unused"), 6, every=0)  # the same run to step 6
    killed, _ = _train_rt(url, folder, 7, every=2)  # snapshots of 2, 4, 6; "killed" after step 7 (no finish)
    killed._tiers.memory.close()  # its commit thread dies with the process (else it lingers until garbage collected)
    with capture_logs() as logs:
        rt, model = _train_rt(url, folder, 6, every=2, restore=True)
    restored = [e for e in logs if e["event"] == "worker_restored"]
    assert restored and restored[0]["step"] == 6 and restored[0]["source"] == "memory", restored
    assert rt.step == 6 and torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)
    assert rt.cursor.consumed == 6 * 4
    rt.finish(barrier=False)  # a snapshot is not durable: the last step is saved to storage
    with CheckpointManager(CheckpointConfig(url=url), "run", rank=0, world_size=1) as mgr:
        assert [(c.step, c.kind) for c in mgr.list()] == [(6, "final")]


def test_runtime_refuses_a_state_over_the_cap_and_trains_on(tmp_path, keep_sigterm_handler):
    from structlog.testing import capture_logs

    folder = str(tmp_path / "node")
    os.makedirs(folder)
    with capture_logs() as logs:
        rt, _ = _train_rt(str(tmp_path / "ckpt"), folder, 3, every=1, max_bytes=1000)
    refused = [e for e in logs if e["event"] == "memory_tier_refused"]
    assert len(refused) == 1 and "TRAINGUARD_CHECKPOINT_MEMORY_MAX_BYTES" in refused[0]["error"]
    assert rt.step == 3 and not [f for f in os.listdir(folder) if os.path.getsize(os.path.join(folder, f))]


def test_replicator_gives_up_on_a_stalled_transfer(tmp_path, monkeypatch):
    import threading

    from trainguard.checkpoint import replica

    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=2)
    rep = replica.Replicator(tier, None, rank=0, world_size=2, local_world_size=1)
    assert rep.enabled and rep.pair == (1, 1)
    done = threading.Event()
    rep._thread = threading.Thread(target=done.wait, daemon=True)  # a transfer whose peer never answers
    rep._thread.start()
    monkeypatch.setattr(replica, "WAIT_S", 0.05)
    rep.settle()
    assert not rep.enabled and "did not finish" in rep.failed
    rep.replicate()  # a no-op from now on
    assert rep._thread is None
    done.set()
    assert replica.Replicator(tier, None, rank=0, world_size=1, local_world_size=1).enabled is False


def test_a_buddy_killed_mid_transfer_keeps_its_good_replica(tmp_path, monkeypatch):
    src_dir, buddy_dir = tmp_path / "a", tmp_path / "b"
    src_dir.mkdir()
    buddy_dir.mkdir()
    m, opt, trainer, state = _job()
    src = mem.MemoryTier(str(src_dir), rank=1, world_size=2)
    buddy = mem.MemoryTier(str(buddy_dir), rank=0, world_size=2)
    for s in (1, 2, 3):
        _train(m, opt, trainer, s)
        src.snapshot(s, state, world=W)
        if s < 3:
            buddy.write_replica(src.newest_blob())

    def die(*a, **k):  # the receiver dies after the data went in, before the header and the commit word
        raise SystemExit("killed")

    monkeypatch.setattr(mem.dataclasses, "replace", die)
    with pytest.raises(SystemExit):
        buddy.write_replica(src.newest_blob())
    monkeypatch.undo()
    # step 3 went into the slot of step 1 (the older one) and is torn; step 2 is intact and restorable
    assert [(r, st) for r, st, _ in buddy.provides(_job()[3]) if r == 1] == [(1, 2)]
    buddy.write_replica(src.newest_blob())  # the next transfer completes
    assert [(r, st) for r, st, _ in buddy.provides(_job()[3]) if r == 1] == [(1, 3), (1, 2)]


@pytest.mark.parametrize("domains, separated", [
    (["", "", ""], False),                       # no domains named: the next node
    (["r1", "r1", "r2", "r2"], True),            # two racks of two: every buddy in the other rack
    (["z1", "z2", "z1", "z2", "z1", "z2"], True),
    (["a", "a", "a", "b"], False),               # one domain holds 3 of 4 nodes: impossible, logged
    (["a", "b", "c"], True),
])
def test_node_buddies_form_a_rotation_across_failure_domains(domains, separated):
    from trainguard.checkpoint.replica import node_buddies

    plan, ok = node_buddies(domains)
    assert sorted(plan) == list(range(len(domains)))  # every node receives exactly one replica
    assert all(plan[i] != i for i in range(len(domains)))
    assert ok == separated
    if separated:
        assert all(domains[i] != domains[plan[i]] for i in range(len(domains)))
    if not any(domains):
        assert plan == [(i + 1) % len(domains) for i in range(len(domains))]


def test_buddies_by_rank_with_domains():
    from trainguard.checkpoint.replica import buddies

    # 4 nodes x 2 local ranks, racks r1 = nodes 0, 1 and r2 = nodes 2, 3: node 0 -> node 2, node 2 -> node 1, ...
    doms = ["r1", "r1", "r2", "r2"]
    pairs = {r: buddies(r, 8, 2, doms) for r in range(8)}
    assert all(pairs[dst][1] == r for r, (dst, _) in pairs.items())  # r sends to dst <=> dst receives from r
    assert all(dst % 2 == r % 2 and doms[dst // 2] != doms[r // 2] for r, (dst, _) in pairs.items())


def test_a_snapshot_that_fails_to_load_is_never_chosen_again(tmp_path):
    cfg = CheckpointConfig(url=f"memory://tier0-fail-{os.getpid()}-{id(tmp_path)}", memory_interval_steps=1)
    m, opt, trainer, state = _job()
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    _train(m, opt, trainer, 1)
    tier.snapshot(1, state, world=W)
    _train(m, opt, trainer, 2)
    tier.snapshot(2, state, world=W)

    def broken(*a, **k):
        raise RuntimeError("load_state_dict refused it")

    m2, opt2, trainer2, state2 = _job(seed=4)
    trainer2.load_local_state_dict = broken  # the trainer state fails to load (after the model loaded)
    from trainguard.checkpoint.errors import CheckpointError

    with CheckpointManager(cfg, "run", rank=0, world_size=1) as mgr:
        with pytest.raises(CheckpointError, match="invalidated.*start from step 0"):
            mgr.restore(state2, memory=tier)
    assert tier.available(_job()[3]) == []  # both slots: the next restart starts clean
    with CheckpointManager(cfg, "run", rank=0, world_size=1) as mgr:
        assert mgr.restore(_job(seed=5)[3], memory=tier) is None and mgr.last_restored_tier is CheckpointTier.NONE


def test_replicated_snapshots_restore_any_rank_at_any_world_size(tmp_path):
    m, opt, trainer, state = _job()
    _train(m, opt, trainer, 4)
    old = mem.MemoryTier(str(tmp_path), rank=2, world_size=3, replicated=True)  # rank 2 of a world of 3 (DDP)
    old.snapshot(4, state, world=W)
    old.settle()  # committed in the background: another process would read it once committed
    sharded = mem.MemoryTier(str(tmp_path), rank=0, world_size=2)  # the same files, not replicated (FSDP)
    assert sharded.provides(_job()[3]) == []
    new = mem.MemoryTier(str(tmp_path), rank=0, world_size=2, replicated=True)  # rank 0 of a world of 2
    assert new.provides(_job()[3]) == [(mem.ANY_RANK, 4, W)]
    m2, opt2, trainer2, state2 = _job(seed=3)
    new.load_blob(new.blob(mem.ANY_RANK, 4, W), state2)
    assert trainer2.step == 4 and all(torch.equal(x, y) for x, y in zip(m2.state_dict().values(), m.state_dict().values()))
    new.invalidate_all()  # after a restore from storage: nothing in the folder is a candidate any more
    assert new.provides(_job()[3]) == []


@pytest.mark.parametrize("nbytes", [0, 1, 4095, slots.CHUNK_BYTES, slots.CHUNK_BYTES + 1, 3 * slots.CHUNK_BYTES - 7])
def test_slot_checksum_is_the_same_for_any_thread_count_and_sees_a_flipped_byte_in_any_chunk(nbytes):
    """The slots' checksum (CRC32 of per-chunk CRC32s) depends on the data only, however many threads
    compute it, and a single flipped byte in the first or last chunk changes it."""
    data = bytearray(os.urandom(min(nbytes, 4096)) * (nbytes // 4096 + 1))[:nbytes]
    want = zlib.crc32(struct.pack(f"<{max(1, -(-nbytes // slots.CHUNK_BYTES))}I", *[
        zlib.crc32(data[i:i + slots.CHUNK_BYTES]) for i in range(0, max(nbytes, 1), slots.CHUNK_BYTES)]))
    got = {t: slots.checksum(data, t) for t in (1, 2, 3, 8)}
    assert set(got.values()) == {want}, got
    for pos in {0, nbytes - 1} if nbytes else set():
        data[pos] ^= 0x01
        assert slots.checksum(data, 4) != want
        data[pos] ^= 0x01
