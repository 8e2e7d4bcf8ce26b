"""The GPU paths on a CPU-only machine (issue 35): each test stands for a defect the torch source
predicts on the first GPU, with a strict fake (tests/fixtures/strict_cuda.py) or the same call
sequence on gloo, and fails on the code before its fix."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch._dynamo  # noqa: F401 - its lazy import sets TORCHINDUCTOR_CACHE_DIR; do it before the env-leak guard

from tests.fixtures.strict_cuda import StrictCuda, on_fake_gpu
from trainguard.checkpoint import pinned, staging
from trainguard.checkpoint.staging import Stager
from trainguard.runtime import reform as rf


def _adamw_state_on_fake_gpu() -> tuple[dict, list]:
    """A real AdamW state after one step, its parameters and moments "on the GPU" and ``step`` on the
    CPU, as torch keeps it (not fused, not capturable)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(2, 6)).sum().backward()
    opt.step()
    osd = opt.state_dict()
    gpu = []
    for st in osd["state"].values():
        assert st["step"].device.type == "cpu"  # what the predicted failure rests on
        for k in ("exp_avg", "exp_avg_sq"):
            st[k] = on_fake_gpu(st[k])
            gpu.append(st[k])
    model = {k: on_fake_gpu(v) for k, v in m.state_dict().items()}
    gpu.extend(model.values())
    return {"model": model, "optim": osd}, gpu


def test_staging_a_real_adamw_state_records_streams_on_gpu_tensors_only(monkeypatch):
    cuda = StrictCuda()
    monkeypatch.setattr(staging, "HostArena", functools.partial(
        pinned.HostArena, register=lambda p, n: None, unregister=lambda p: None))
    state, gpu = _adamw_state_on_fake_gpu()
    stager = Stager(cuda=cuda)
    staged = stager.stage(state)  # aten::record_stream on the CPU step raised NotImplementedError here
    assert all(len(t.recorded) == 1 and t.recorded[0].label == "side" for t in gpu)
    assert stager.ready is not None and "DEVICE_SYNCHRONIZE" not in cuda.log
    for k, st in state["optim"]["state"].items():
        assert torch.equal(staged["optim"]["state"][k]["step"], st["step"])
        assert torch.equal(staged["optim"]["state"][k]["exp_avg"], st["exp_avg"].as_subclass(torch.Tensor))


def test_a_guarded_save_holds_back_only_the_optimizer_step(monkeypatch):
    """Item 8: the compute stream waited for the whole D2H copy (the next forward too); with the optimizer
    guarded it waits only for the tensors the forward may change, and the optimizer's step for the rest."""
    cuda = StrictCuda()
    monkeypatch.setattr(staging, "HostArena", functools.partial(
        pinned.HostArena, register=lambda p, n: None, unregister=lambda p: None))
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(2, 6)).sum().backward()
    opt.step()
    state = {"model": {k: on_fake_gpu(v) for k, v in m.state_dict().items()},
             "optim": {k: {n: on_fake_gpu(t) if n != "step" else t for n, t in st.items()}
                       for k, st in opt.state_dict()["state"].items()},
             "stats": on_fake_gpu(torch.zeros(3))}  # not the optimizer's: the forward may change it
    stager = Stager(cuda=cuda)
    stager.guard.attach(opt)
    stager.stage(state)
    assert cuda.log.count("compute.wait_event") == 1  # for "stats" only, not for the copy of the rest
    m(torch.randn(2, 6)).sum().backward()
    cuda.log.clear()
    opt.step()
    assert cuda.log == ["current_stream(cpu)", "compute.wait_event"]  # the step waits, GPU-side


def test_strict_fake_rejects_record_stream_on_a_cpu_tensor():
    cuda = StrictCuda()
    with pytest.raises(NotImplementedError, match="record_stream"):
        torch.ones(2).record_stream(cuda.Stream())


# ---- fix 2: tearing an NCCL world down ----------------------------------------------------------

@pytest.fixture
def gloo_world(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dist.new_group(backend="gloo")  # a side group, as the runtime's flag and checkpoint groups
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(("backend", "initialized", "peer_lost", "plan"), [
    ("nccl", True, True, rf.Teardown.ABORT),                 # preempt the hung kernels; the abort clears every group
    ("nccl", True, False, rf.Teardown.SYNCHRONIZE_DESTROY),  # healthy kernels finish first
    ("gloo", True, True, rf.Teardown.DESTROY),               # its connections were ended before (end_world_connections)
    ("gloo", True, False, rf.Teardown.DESTROY),
    ("nccl", False, True, rf.Teardown.NONE),                 # aborted earlier in the park: nothing left
    ("gloo", False, False, rf.Teardown.NONE),
])
def test_teardown_plan(backend, initialized, peer_lost, plan):
    assert rf.teardown_plan(backend=backend, initialized=initialized, peer_lost=peer_lost) is plan


def test_teardown_of_a_lost_nccl_world_aborts_and_does_not_destroy_after(gloo_world, monkeypatch):
    """The sequence an NCCL survivor runs, on gloo (``_abort_process_group`` works there too): the
    abort already tears every group down and clears the default one; destroying after it raised
    ``AssertionError: Process group cannot be None`` and the re-formation became a restart."""
    cleared = []
    monkeypatch.setattr(rf, "clear_dtensor_caches", lambda: cleared.append(True))
    rf._WORLD_SOCKETS[999] = 1
    done = rf.teardown_world(torch.device("cuda", 0), peer_lost=True)
    assert done is rf.Teardown.ABORT and not dist.is_initialized()
    assert cleared == [True] and rf._WORLD_SOCKETS == {}  # the rest of the teardown ran
    assert rf.teardown_world(torch.device("cuda", 0), peer_lost=True) is rf.Teardown.NONE  # idempotent


def test_planned_teardown_of_an_nccl_world_synchronizes_the_device_then_destroys(gloo_world):
    seen = []

    def synchronize(device):
        seen.append((str(device), dist.is_initialized()))

    done = rf.teardown_world(torch.device("cuda", 3), peer_lost=False, synchronize=synchronize)
    assert done is rf.Teardown.SYNCHRONIZE_DESTROY and seen == [("cuda:3", True)] and not dist.is_initialized()


# ---- item 5: a mesh in the second world of a process ----------------------------------------------

@pytest.mark.parametrize(("shape", "dim", "groups"), [
    ((4,), 0, [[0, 1, 2, 3]]),
    ((2, 3), 1, [[0, 1, 2], [3, 4, 5]]),          # tp: consecutive ranks
    ((2, 3), 0, [[0, 3], [1, 4], [2, 5]]),        # dp: strided
    ((1, 1), 0, [[0]]),
])
def test_mesh_dim_ranks(shape, dim, groups):
    from trainguard.strategies.mesh import dim_ranks

    assert dim_ranks(shape, dim) == groups


def test_mesh_of_a_second_world_is_built_without_split_group(tmp_path, monkeypatch):
    """``init_device_mesh`` splits the default group when it is bound to a device (NCCL), which reads
    out of bounds in a re-created default group; the runtime's meshes come from ``new_group`` groups."""
    import torch.distributed.device_mesh as dm

    from trainguard.strategies.mesh import build_mesh

    def no_split(*a, **k):
        raise AssertionError("split_group called")

    monkeypatch.setattr(dm, "split_group", no_split, raising=False)
    monkeypatch.setattr(dist.distributed_c10d, "split_group", no_split)
    for world in range(2):  # the first world of the process, then a re-created one
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / f"s{world}"), 1), rank=0, world_size=1)
        mesh = build_mesh("cpu", (1, 1), ("dp", "tp"))
        x = torch.ones(3)
        dist.all_reduce(x, group=mesh.get_group("tp"))
        assert mesh.mesh_dim_names == ("dp", "tp") and list(mesh.get_coordinate()) == [0, 0] and torch.equal(x, torch.ones(3))
        rf.teardown_world(torch.device("cpu"), peer_lost=False)


# ---- item 3: a survivor on NCCL aborts before it waits on anything -------------------------------

@pytest.mark.parametrize(("device", "reason", "order"), [
    ("cuda", "peer_lost", ["teardown(peer_lost=True)", "settle", "parked", "close", "teardown(peer_lost=True)"]),
    ("cuda", "resize", ["settle", "parked", "close", "teardown(peer_lost=False)"]),
    ("cpu", "peer_lost", ["settle", "parked", "close", "teardown(peer_lost=True)"]),  # gloo: connections ended instead
])
def test_park_aborts_a_lost_nccl_world_before_settling_snapshots_and_saves(tmp_path, monkeypatch, device, reason, order):
    """The persist thread and a tier-0 copy wait on events queued behind a kernel that waits for the
    lost peer: settling them before the abort kept the survivor for ``pg_timeout_s``."""
    import signal

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.contract import protocol as proto
    from trainguard.runtime import runtime as runtime_mod
    from trainguard.runtime.runtime import Runtime

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    previous = signal.getsignal(signal.SIGTERM)
    seen: list[str] = []
    try:
        rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_round=0,
                     checkpoint=CheckpointConfig(url=str(tmp_path / "ckpt"), interval_steps=1000))
        model = torch.nn.Linear(4, 1)
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_size=32, global_batch=4, micro_batch=2,
                 seed=1)
        rt.reform_enabled = True
        rt.device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
        real_teardown, real_close = rf.teardown_world, rt._tiers.manager.close

        def teardown(dev_, *, peer_lost, **kw):
            seen.append(f"teardown(peer_lost={peer_lost})")
            return real_teardown(dev_, peer_lost=peer_lost, synchronize=lambda d: None)

        def close(collect=True):
            seen.append("close" if collect is False else "close(collect=True)")  # a survivor leaves it to the next world
            real_close(collect)

        monkeypatch.setattr(runtime_mod.rf, "teardown_world", teardown)
        monkeypatch.setattr(rt._tiers, "settle", lambda abandon_after=None: seen.append("settle"))
        monkeypatch.setattr(rt._tiers.manager, "close", close)

        class Link:
            request = proto.StopReason.NONE

            def report(self, msg):
                seen.append("parked")

            def wait_reform(self, timeout_s, abort=None):
                raise SystemExit("parked")  # what follows (the new world) is not under test

        rt._session.link = Link()
        with pytest.raises(SystemExit, match="parked"):
            rt._reform.park(proto.ParkReason(reason))
        assert rt.worker_state.value == "parked"  # waiting for the new world
    finally:
        signal.signal(signal.SIGTERM, previous)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert seen == order


# ---- item 6: a joiner's optimizer state is sent from the host --------------------------------------

def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_live_state_pickles_no_gpu_tensor(tmp_path, monkeypatch):
    """A pickled CUDA tensor is restored on the sender's ``cuda:<i>`` in every receiver: the small state a
    DDP joiner receives over gloo (optimizer state included) must hold host tensors only, and be made on
    the sending rank only."""
    import signal

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.runtime import runtime as runtime_mod
    from trainguard.runtime.runtime import Runtime

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_round=0, checkpoint=CheckpointConfig())
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters())
        rt.setup(model, opt, dataset_size=32, global_batch=4, micro_batch=2, seed=1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        for st in opt.state.values():  # the moments "on the GPU", as on a CUDA rank
            st["exp_avg"], st["exp_avg_sq"] = on_fake_gpu(st["exp_avg"]), on_fake_gpu(st["exp_avg_sq"])
        sent = {}

        def fake_sync(step, tensors, *, extra, load_extra, group=None, tensor_group=None):
            sent["extra"] = extra() if callable(extra) else extra
            return "broadcast", step

        monkeypatch.setattr(runtime_mod.rf, "sync_live_state", fake_sync)
        rt._reform.sync_live_state(rt.step)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if dist.is_initialized():
            dist.destroy_process_group()
    leaves = _tensors(sent["extra"]["optimizer"])
    assert len(leaves) >= 6 and not any(t.is_cuda for t in leaves)


# ---- item 10: the flight recorder after an in-place re-formation ---------------------------------

def test_flight_recorder_is_dumped_by_the_worker_in_a_re_formed_world(tmp_path, monkeypatch):
    """torch's own dump runs from the first NCCL group's monitor only; the worker dumps itself, and the
    trace of the process holds the collectives of the re-formed world too."""
    import pickle

    from trainguard.runtime import flight

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(tmp_path / "trace_rank_"))
    for world in range(2):
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / f"s{world}"), 1), rank=0, world_size=1)
        for _ in range(world + 1):
            dist.all_reduce(torch.ones(2))
        if world == 1:
            path, nbytes = flight.dump(rank=0, world=world)
        rf.teardown_world(torch.device("cpu"), peer_lost=world == 0)
    assert path == str(tmp_path / "trace_rank_0.world-1") and nbytes > 0
    with open(path, "rb") as f:
        entries = pickle.load(f)["entries"]
    assert [e["profiling_name"] for e in entries][-3:] == ["gloo:all_reduce"] * 3  # 1 of world 0, 2 of world 1


def test_flight_trace_path():
    from trainguard.runtime.flight import trace_path

    assert trace_path({}, 3, 2) == "/tmp/nccl_trace_rank_3.world-2"
    assert trace_path({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/var/log/fr_"}, 0, 0) == "/var/log/fr_0.world-0"


# ---- item 7: tier 0 from GPU tensors -------------------------------------------------------------

def test_tier0_snapshot_of_gpu_state_copies_async_into_the_pinned_slot_without_device_clones(tmp_path, monkeypatch):
    """GPU tensors go to the slot on a side stream (the slot page-locked in place once), the compute
    stream waits only for what the forward may change, nothing is cloned on the device, and the
    optimizer's next step waits until the commit thread has seen the copies complete."""
    from trainguard.checkpoint.memory import MemoryTier

    cuda = StrictCuda()
    pins = []
    monkeypatch.setattr(pinned, "_register", lambda ptr, n: pins.append(("register", n)))
    monkeypatch.setattr(pinned, "_unregister", lambda ptr: pins.append(("unregister",)))
    monkeypatch.setattr(pinned, "bind_thread", lambda device, cuda=None: pins.append(("bind", str(device))))
    monkeypatch.setattr(pinned, "pin_refusal", lambda path, mounts=None: None)  # as on a tmpfs

    def no_clone(self, *a, **k):
        raise AssertionError("a GPU tensor was cloned on the device")

    from tests.fixtures.strict_cuda import FakeCudaTensor

    monkeypatch.setattr(FakeCudaTensor, "clone", no_clone, raising=False)
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 8)).sum().backward()
    opt.step()
    for p in m.parameters():  # the parameters and moments "on the GPU" (same storages)
        p.data = on_fake_gpu(p.data)
    for st in opt.state.values():
        st["exp_avg"], st["exp_avg_sq"] = on_fake_gpu(st["exp_avg"]), on_fake_gpu(st["exp_avg_sq"])
    from trainguard.checkpoint.state import ModelOptimizerState

    state = {"model": ModelOptimizerState(m, opt), "stats": on_fake_gpu(torch.arange(3.0))}
    tier = MemoryTier(str(tmp_path), rank=0, world_size=1, replicated=True, cuda=cuda)
    tier.guard(opt)
    tier.snapshot(5, state, world="w")
    # Two events on the side stream; the compute stream waits for the first (the non-optimizer tensors) only.
    assert cuda.log.count("event.record(side)") == 2 and cuda.log.count("compute.wait_event") == 1
    assert pins[0][0] == "register" and pins[0][1] == tier._slots[tier._newest].size  # the whole mapping, once
    expected = {k: v.detach().as_subclass(torch.Tensor).clone() for k, v in m.state_dict().items()}
    m(torch.randn(2, 8)).sum().backward()
    opt.step()  # after the copies (the guard), which the commit thread waited for on the device
    tier.settle()
    assert ("bind", "cpu") in pins and "event.synchronize" in cuda.log
    m2 = torch.nn.Linear(8, 4)
    opt2 = torch.optim.AdamW(m2.parameters())
    m2(torch.randn(2, 8)).sum().backward()
    opt2.step()
    tier.load(5, {"model": ModelOptimizerState(m2, opt2), "stats": torch.zeros(3)}, world="w")
    for k, v in m2.state_dict().items():
        assert torch.equal(v, expected[k])
    tier.snapshot(6, state, world="w")
    tier.settle()
    tier.close()
    assert [p[0] for p in pins].count("register") == 2 and [p[0] for p in pins].count("unregister") == 2  # a slot each


MOUNTS = """overlay / overlay rw 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
/dev/nvme0n1p1 /data ext4 rw 0 0
tmpfs /data/ram tmpfs rw 0 0
hugetlbfs /mnt/huge hugetlbfs rw 0 0
/dev/sdb1 /mnt/my\\040disk xfs rw 0 0
"""


@pytest.mark.parametrize(("path", "kind", "pinnable"), [
    ("/dev/shm/trainguard-job-n0/rank-0.slot-0", "tmpfs", True),
    ("/data/ram/x/slot", "tmpfs", True),           # the longest mount point wins
    ("/data/ramdisk/slot", "ext4", False),         # a prefix of a name is not a mount point
    ("/data/slot", "ext4", False),
    ("/mnt/huge/slot", "hugetlbfs", True),
    ("/mnt/my disk/slot", "xfs", False),           # /proc/mounts escapes a space as \\040
    ("/tmp/slot", "overlay", False),
])
def test_a_slot_is_page_locked_only_on_shared_memory(path, kind, pinnable):
    """cudaHostRegister of a regular file's mapping fails (cudaErrorInvalidValue, gpu-check of
    2026-11-27) and left the error for the next kernel to raise: it is tried on tmpfs/hugetlbfs only."""
    assert pinned.fs_type(path, MOUNTS) == kind
    why = pinned.pin_refusal(path, MOUNTS)
    assert (why is None) == pinnable
    if not pinnable:
        assert "checkpoint.memory_dir" in why and "/dev/shm" in why and kind in why


def test_a_slot_off_shared_memory_is_not_registered_and_says_why(tmp_path, monkeypatch):
    """The refusal is decided before any registration: the copies go through pageable memory and the
    tier's ``pin_error`` names the setting to change."""
    from trainguard.checkpoint.slots import _Slot

    calls = []
    monkeypatch.setattr(pinned, "_register", lambda ptr, n: calls.append(n))
    monkeypatch.setattr(pinned, "fs_type", lambda path, mounts=None: "ext4")
    slot = _Slot(str(tmp_path / "rank-0.slot-0"))
    slot.ensure(1 << 16)
    why = slot.pin()
    assert calls == [] and why is not None and "ext4" in why and "checkpoint.memory_dir" in why
    monkeypatch.setattr(pinned, "fs_type", lambda path, mounts=None: "tmpfs")
    slot.close()
    slot.ensure(1 << 16)
    assert slot.pin() is None and calls == [1 << 16]
    slot.close()


# ---- item 4: no silent corruption after an aborted collective ------------------------------------

def test_step_timer_polls_the_last_boundary_with_a_bound():
    from trainguard.runtime import device as devmod

    now = [0.0]

    class Ev:
        def __init__(self, done_after):
            self.done_after = done_after

        def record(self, stream):
            pass

        def query(self):
            return now[0] >= self.done_after

    def sleep(s):
        now[0] += s

    events = iter([Ev(0.0), Ev(0.5)])
    t = devmod.StepTimer(torch.device("cuda", 0), clock=lambda: now[0], event_factory=lambda: next(events),
                         stream_of=lambda d: None)
    assert t.completed(1.0, sleep=sleep)  # nothing recorded yet
    t.start()
    t._last = Ev(0.5)  # the step's update still queued: finishes after 0.5 s
    assert t.completed(1.0, poll_s=0.1, sleep=sleep) and now[0] >= 0.5
    now[0], t._last = 0.0, Ev(10.0)  # held behind a kernel that waits for the lost peer
    assert not t.completed(1.0, poll_s=0.1, sleep=sleep) and now[0] < 1.2
    assert devmod.StepTimer(torch.device("cpu")).completed(0.0)


def test_param_checksum_sees_one_ulp():
    from trainguard.runtime.reformation import checksums_agree, param_checksum

    a = [torch.randn(5, 3), torch.randn(4)]
    b = [t.clone() for t in a]
    assert checksums_agree([param_checksum(a), param_checksum(b)])
    b[1][2] = torch.nextafter(b[1][2], torch.tensor(float("inf")))
    assert not checksums_agree([param_checksum(a), param_checksum(b), param_checksum(a)])
    assert checksums_agree([param_checksum(a)])


@pytest.fixture
def ddp_rt(tmp_path, monkeypatch):
    import signal

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.runtime.runtime import Runtime

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    previous = signal.getsignal(signal.SIGTERM)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_round=0,
                     checkpoint=CheckpointConfig(url=str(tmp_path / "ckpt"), interval_steps=1000))
        model = torch.nn.Linear(4, 2)
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_size=32, global_batch=4,
                 micro_batch=2, seed=1)
        rt.reform_enabled = True
        rt.step = 7
        yield rt
    finally:
        signal.signal(signal.SIGTERM, previous)
        if dist.is_initialized():
            dist.destroy_process_group()


class _Mem:
    def __init__(self):
        self.discarded = []
        self.parity = False

    def discard_from(self, step):
        self.discarded.append(step)

    def settle(self):
        pass


@pytest.mark.parametrize("case", ["suspect", "mismatch", "clean"])
def test_untrusted_live_state_is_not_offered_and_the_world_restores_from_the_tiers(ddp_rt, monkeypatch, case):
    """A rank whose last step had not finished on the GPU at the abort offers no live state and drops its
    snapshots of that step; replicas whose checksums differ are refused; either way the world restores
    from the tiers (nearest first) instead of going on with what it holds."""
    from trainguard.contract import protocol as proto
    from trainguard.runtime import runtime as runtime_mod

    rt = ddp_rt
    offered, restored = [], []
    mem = _Mem()
    rt._tiers.memory = mem
    def sync(step, tensors, *, extra, load_extra, group=None, tensor_group=None):
        offered.append(step)
        return ("none", None) if step is None else ("agreed", step)  # no rank else holds live state

    monkeypatch.setattr(runtime_mod.rf, "sync_live_state", sync)
    monkeypatch.setattr(rt._tiers, "restore", lambda step=None: (restored.append(True), 5)[1])
    if case == "suspect":
        rt._reform.suspect_step = 7
    if case == "mismatch":
        def gather(out, mine, group=None):  # a peer that holds other parameters
            out[0].copy_(mine)
            out[1].copy_(mine + 1)

        monkeypatch.setattr(runtime_mod.dist, "all_gather", gather)
        monkeypatch.setattr(runtime_mod.dist, "get_world_size", lambda group=None: 2)
    outcome, live = rt._reform.resume_state(proto.ParkReason.PEER_LOST)
    rt._tiers.memory = None
    if case == "clean":
        assert offered == [7] and outcome == "agreed" and not restored and mem.discarded == []
    elif case == "suspect":
        assert offered == [None] and mem.discarded == [7] and restored and (outcome, live) == ("restored", 5)
    else:
        assert offered == [7] and mem.discarded == [7] and restored and (outcome, live) == ("restored", 5)


def test_discard_from_drops_the_suspect_step_and_keeps_the_one_before(tmp_path):
    from trainguard.checkpoint.memory import MemoryTier

    state = {"w": {"t": torch.ones(4)}}
    tier = MemoryTier(str(tmp_path), rank=0, world_size=1)
    tier.snapshot(1, state, world="w")
    state["w"]["t"] += 1
    tier.snapshot(2, state, world="w")
    assert [s for s, _ in tier.available(state)] == [2, 1]
    assert tier.discard_from(2) == 1
    assert [s for s, _ in tier.available(state)] == [1] and tier.lend(2) is None
    tier.close()
