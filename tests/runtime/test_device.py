"""The runtime owns the worker's device (issue 19): ``cuda:<LOCAL_RANK>`` made current *before*
``init_process_group``, which gets ``device_id`` and the configured timeout; strategies train on the
runtime's device and never derive it from where the model sits.

No GPU here: torch's CUDA entry points (``torch.cuda.is_available`` / ``device_count`` /
``set_device``) and ``init_process_group`` are patched, and the order of the calls is recorded."""

from __future__ import annotations

import datetime
import os
import re
import signal
from unittest import mock

import pytest
import torch
import torch._dynamo  # noqa: F401 - its lazy import sets TORCHINDUCTOR_CACHE_DIR; do it before the env-leak guard
import torch.distributed as dist

from tests.harness import REPO
from trainguard.contract import protocol as proto
from trainguard.runtime import Runtime
from trainguard.runtime import device as dev
from trainguard.runtime import reform as rf
from trainguard.strategies.base import StrategyError, get_strategy


@pytest.fixture(autouse=True)
def keep_sigterm_handler():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Eight fake GPUs: records ``set_device`` and ``init_process_group`` calls, in order."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))

    def init_pg(backend, **kw):
        calls.append(("init_process_group", (backend, kw)))

    monkeypatch.setattr(dist, "init_process_group", init_pg)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    return calls


def test_from_env_binds_local_rank_device_before_init_with_device_id_and_timeout(fake_cuda):
    env = {"RANK": "11", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
           proto.RT_PREFIX + "PG_TIMEOUT_S": "45"}
    rt = Runtime.from_env(env)
    assert rt.device == torch.device("cuda", 3)
    assert [c[0] for c in fake_cuda] == ["set_device", "init_process_group"]  # current device first
    assert fake_cuda[0][1] == torch.device("cuda", 3)
    backend, kw = fake_cuda[1][1]
    assert backend == "nccl"
    assert kw["device_id"] == torch.device("cuda", 3)
    assert kw["timeout"] == datetime.timedelta(seconds=45)


def test_from_env_without_timeout_keeps_torch_default(fake_cuda):
    Runtime.from_env({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    _, kw = fake_cuda[-1][1]
    assert "timeout" not in kw and kw["device_id"] == torch.device("cuda", 0)


def test_reform_init_world_binds_the_device_too(fake_cuda, monkeypatch):
    arrivals = []
    monkeypatch.setattr(rf, "arrive", lambda **kw: arrivals.append(kw) or torch.distributed.HashStore())
    with mock.patch.dict(os.environ):  # init_world exports the torchelastic variables
        rf.init_world(rank=5, world_size=8, local_rank=5, local_world_size=8, master_addr="127.0.0.1",
                      master_port=1, device=torch.device("cuda", 5), timeout_s=30)
    assert fake_cuda[0] == ("set_device", torch.device("cuda", 5))
    backend, kw = fake_cuda[1][1]
    assert (backend, kw["device_id"], kw["timeout"]) == ("nccl", torch.device("cuda", 5),
                                                           datetime.timedelta(seconds=30))
    # the process group is made on the world's store, after the arrival count, as rank 5 of 8
    assert (kw["rank"], kw["world_size"]) == (5, 8) and arrivals[0]["master_port"] == 1


@pytest.mark.parametrize("available,count,local_rank,expected", [
    (False, 0, 0, "cpu"),
    (False, 0, 5, "cpu"),
    (True, 8, 0, "cuda:0"),
    (True, 8, 7, "cuda:7"),
])
def test_select_device(monkeypatch, available, count, local_rank, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert dev.select_device(local_rank) == torch.device(expected)


def test_more_workers_than_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(dev.DeviceError, match=r"LOCAL_RANK=2 .* 2 GPU.*nproc_per_node"):
        dev.select_device(2)


def test_device_named_in_barrier_and_kwargs():
    assert dev.barrier_kwargs(torch.device("cuda", 6)) == {"device_ids": [6]}
    assert dev.barrier_kwargs(torch.device("cpu")) == {}
    assert dev.init_kwargs(torch.device("cpu"), 0) == {}
    assert dev.backend_for(torch.device("cpu")) == "gloo"


def test_cpu_runtime_device_and_strategy_device():
    rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="j",
                 checkpoint=__import__("trainguard.checkpoint.config", fromlist=["x"]).CheckpointConfig())
    assert rt.device == torch.device("cpu")
    model = torch.nn.Linear(2, 2)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_size=8, global_batch=2, micro_batch=2)
    assert rt.strategy is not None and rt.strategy.device == rt.device


# ---- strategies take the device from the runtime, never from the model ------------------------------
# Deriving a device from a parameter (a decision); copying a value *to* where a parameter already is, is fine.
_MODEL_DEVICE = re.compile(r"module_device|parameters\(\)\)\.device|next\([^)]*parameters\(\)\)|"
                           r"\bp\.device\.(type|index)|=\s*p\.device\b")


def test_strategies_never_read_the_models_device():
    """Grep: no strategy module derives a device from the model's parameters."""
    hits = []
    for name in sorted(os.listdir(os.path.join(REPO, "strategies"))):
        if name.endswith(".py"):
            with open(os.path.join(REPO, "strategies", name)) as fh:
                for i, line in enumerate(fh, 1):
                    if _MODEL_DEVICE.search(line):
                        hits.append(f"strategies/{name}:{i}: {line.strip()}")
    assert not hits, "strategies must use Strategy.device (rt.device):\n" + "\n".join(hits)


def test_fsdp_mesh_follows_the_strategy_device_not_a_meta_model():
    """A meta-device model used to give a ``meta`` mesh; the mesh is now on the strategy's device and
    the autocast device type follows it."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    s = get_strategy("fsdp", precision="bf16-mixed")
    s.device = torch.device("cpu")
    try:
        model, _ = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        meshes = {p.device_mesh.device_type for p in model.parameters()}
        assert meshes == {"cpu"}
        assert all(not p.is_meta and p.device.type == "cpu" for p in model.parameters())
        assert s._device_type == "cpu"
    finally:
        s.teardown()


def test_ddp_moves_the_model_to_the_strategy_device_and_refuses_meta():
    s = get_strategy("ddp")
    s.device = torch.device("cpu")
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    with pytest.raises(StrategyError, match="meta device.*fsdp"):
        s.setup(meta, torch.optim.SGD(meta.parameters(), lr=0.1))


def test_deepspeed_autocast_follows_the_engine_device(monkeypatch):
    """DeepSpeed moves the module inside ``initialize``: the autocast device type is the engine's."""
    with mock.patch.dict(os.environ):  # deepspeed's import and the strategy set env vars
        _deepspeed_autocast(monkeypatch)


def _deepspeed_autocast(monkeypatch):
    deepspeed = pytest.importorskip("deepspeed")

    class Engine:
        device = torch.device("cuda", 0)

    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: (Engine(), kw["optimizer"], None, None))
    s = get_strategy("deepspeed", precision="bf16-mixed")
    model = torch.nn.Linear(2, 2)  # sits on the CPU before initialize
    try:
        s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert s._device_type == "cuda"
        ctx = s.autocast()
        assert isinstance(ctx, torch.autocast) and ctx.device == "cuda"
    finally:
        s.teardown()  # the one-rank group setup made

    s2 = get_strategy("deepspeed", precision="bf16-mixed")
    s2.device = torch.device("cpu")  # the runtime's device disagrees with the engine's: refused
    try:
        with pytest.raises(StrategyError, match="DeepSpeed placed the model on cuda:0.*rt.device"):
            s2.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        s2.teardown()
    assert not dist.is_initialized()


def test_worker_gpu_label_is_the_uuid_nvml_writes(monkeypatch):
    """The worker's allocator-peak series and the agent's NVML series carry the same label."""
    class Props:
        uuid = "bd5e6b3c-1111-2222"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    assert dev.gpu_label(torch.device("cuda", 2)) == "GPU-bd5e6b3c-1111-2222"
    assert dev.gpu_label(torch.device("cpu")) is None
    assert dev.normalise_uuid(b"GPU-bd5e6b3c-1111-2222\0") == "GPU-bd5e6b3c-1111-2222"


def test_step_timer_reads_cuda_events_without_synchronising():
    """On CUDA a step's time is the elapsed time between its boundary events, read once the end event
    completed (no host synchronize); on the CPU it is the host clock."""
    done: set[int] = set()

    class Ev:
        n = 0

        def __init__(self):
            Ev.n += 1
            self.i, self.t = Ev.n, None

        def record(self, stream):
            self.t = self.i * 100.0  # ms

        def query(self):
            return self.i in done

        def synchronize(self):
            done.add(self.i)

        def elapsed_time(self, end):
            return end.t - self.t

    timer = dev.StepTimer(torch.device("cuda", 0), event_factory=Ev, stream_of=lambda d: None, max_pending=2)
    timer.start()
    assert timer.lap() == []  # the GPU has not finished step 1 yet
    done.update({1, 2})
    assert timer.lap() == [0.1]  # step 1 (events 1 -> 2) now known; step 2 still pending
    assert timer.lap() == []
    assert timer.lap() == [0.1]  # more than max_pending steps waiting: the oldest is waited for
    clock = iter([10.0, 10.5, 11.25]).__next__
    cpu = dev.StepTimer(torch.device("cpu"), clock=clock)
    cpu.start()
    assert cpu.lap() == [0.5] and cpu.lap() == [0.75]
