"""Unit tests of ``model_parallel``: options, the (dp, tp) arithmetic and its refusal, the data-parallel
hook the runtime uses, and an in-process run at world size 1 (a 1 x 1 mesh on a one-rank gloo group:
FSDP2 through the user's function, ``block.compile()``, optimizer rebuilt, state round trip).

The multi-rank path — TP within a node, FSDP2 over the data-parallel dimension, resize (2, 2) -> (1, 2)
-> (2, 2) through real agents, and the refusal of a 3-rank world — is ``test_e2e_resize.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainguard.strategies import Strategy, StrategyError, get_strategy
from trainguard.strategies.model_parallel import DP, TP, ModelParallelStrategy, mesh_shape

pytestmark = pytest.mark.timeout(120)


def _fsdp_only(model, mesh):
    from torch.distributed.fsdp import fully_shard

    assert mesh.mesh_dim_names == (DP, TP)
    for b in model.blocks:
        fully_shard(b, mesh=mesh[DP])
    fully_shard(model, mesh=mesh[DP])


@pytest.mark.parametrize(("options", "words"), [
    ({}, ["`parallelize_fn`", "Fix:", "tp_size"]),
    ({"parallelize_fn": 3}, ["`parallelize_fn`"]),
    ({"parallelize_fn": _fsdp_only, "tp_size": 0}, ["`tp_size=0`", "--tp-size"]),
    ({"parallelize_fn": _fsdp_only, "tp_size": "2"}, ["`tp_size='2'`"]),
    ({"parallelize_fn": _fsdp_only, "tp_size": True}, ["`tp_size=True`"]),
])
def test_bad_options_name_the_setting(options, words):
    with pytest.raises(StrategyError) as e:
        get_strategy("model_parallel", **options)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize(("world", "tp", "shape"), [(4, 2, (2, 2)), (2, 2, (1, 2)), (8, 4, (2, 4)), (3, 1, (3, 1)),
                                                     (3, 2, None), (1, 2, None), (6, 4, None)])
def test_mesh_shape_and_the_refusal_of_a_world_tp_does_not_divide(world, tp, shape):
    if shape is not None:
        assert mesh_shape(world, tp) == shape
        return
    with pytest.raises(StrategyError) as e:
        mesh_shape(world, tp)
    msg = str(e.value)
    assert f"{world} ranks" in msg and f"`tp_size={tp}`" in msg and "Fix:" in msg and "--tp-size" in msg, msg


def test_data_parallel_groups_the_ranks_of_a_tp_group():
    s = get_strategy("model_parallel", parallelize_fn=_fsdp_only, tp_size=2)
    assert [s.data_parallel(r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [s.data_parallel(r, 2) for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(StrategyError, match="tp_size=2"):
        s.data_parallel(0, 3)
    assert get_strategy("ddp").data_parallel(3, 4) == (3, 4)  # the default: every rank its own share
    assert s.plan(16, 2, 4) == (2, 8)
    with pytest.raises(StrategyError, match="data-parallel size 3.*tp_size=2.*global_batch_size"):
        s.plan(16, 3, 4)
    assert "data-parallel size" in s.resize_rule and s.reshard_native


class FakeMesh:
    def __init__(self, dp: int) -> None:
        self.dp = dp

    def __getitem__(self, name: str):
        return type("Sub", (), {"size": lambda _: self.dp})()


def test_check_refuses_parameters_not_sharded_over_data_parallel():
    s = ModelParallelStrategy(parallelize_fn=_fsdp_only, tp_size=1)
    s.mesh = FakeMesh(2)
    with pytest.raises(StrategyError, match="not sharded over the data-parallel.*fully_shard"):
        s._check(nn.Linear(2, 2))
    s.mesh = FakeMesh(1)
    s._check(nn.Linear(2, 2))  # one data-parallel rank: nothing to average


# ---- in-process, world size 1 ----------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _compiled_fsdp(model, mesh):
    for b in model.blocks:
        b.compile(backend="eager")  # dynamo only: keeps the test fast (the e2e test does not compile)
    _fsdp_only(model, mesh)
    return model


def _train(strategy: Strategy, model, opt, steps: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        total = 0.0
        for i in range(2):
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g)
            with strategy.no_sync(model, last=i == 1):
                loss = nn.functional.mse_loss(model(x), y) / 2
                strategy.backward(loss)
            total += float(loss.detach())
        strategy.optimizer_step(opt)
        opt.zero_grad()
        out.append(total)
    return out


@pytest.fixture
def no_group():
    assert not dist.is_initialized(), "a previous test left a process group"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a process group")


def test_alone_trains_like_plain_torch_and_state_round_trips(no_group):
    torch.manual_seed(0)
    plain = Net()
    net = copy.deepcopy(plain)
    ref = _train(get_strategy("ddp"), plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    s = get_strategy("model_parallel", parallelize_fn=_compiled_fsdp)
    try:
        model, opt = s.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        assert s.owns_process_group and tuple(s.mesh.shape) == (1, 1)
        assert s.describe()["mesh"] == (1, 1) and s.describe()["tp_size"] == 1
        assert type(model.blocks[0].fc.weight).__name__ == "DTensor"
        assert opt.param_groups[0]["params"][0] is next(model.parameters())
        assert _train(s, model, opt) == pytest.approx(ref, abs=1e-6)
        sd = s.state(model, opt).state_dict()
        assert set(sd["model"]) == {n for n, _ in Net().named_parameters()}  # no _orig_mod. from compile
        with pytest.raises(StrategyError, match="called twice"):
            s.setup(net, opt)
    finally:
        s.teardown()
    assert not dist.is_initialized()


def test_wrapped_modules_keep_their_names_and_dropped_parameters_are_refused(no_group):
    def wraps(model, mesh):
        model.blocks[0] = torch.compile(model.blocks[0], backend="eager")  # names gain "_orig_mod."
        _fsdp_only(model, mesh)
        return model

    s = get_strategy("model_parallel", parallelize_fn=wraps)
    net = Net()
    try:
        model, opt = s.setup(net, torch.optim.AdamW(net.parameters()))
        assert len(opt.param_groups[0]["params"]) == len(list(Net().parameters()))
        assert set(s.state(model, opt).state_dict()["model"]) == {n for n, _ in Net().named_parameters()}
    finally:
        s.teardown()

    def drops(model, mesh):
        model.out = nn.Identity()

    for fn, words in ((drops, "lacks parameters \\['out.bias', 'out.weight'\\]"), (lambda m, mesh: 42, "returned int")):
        s = get_strategy("model_parallel", parallelize_fn=fn)
        net = Net()
        try:
            with pytest.raises(StrategyError, match=words):
                s.setup(net, torch.optim.AdamW(net.parameters()))
        finally:
            s.teardown()


# ---- the runtime uses the hook ----------------------------------------------------------------------

def test_runtime_splits_the_batch_over_data_parallel_shares(monkeypatch):
    """Rank 2 of 4 with tp_size 2 is in share 1 of 2: it gets exactly share 1's samples (what rank 3 gets
    too), the accumulation is planned for 2 shares, and only the first rank of a share counts samples."""
    import contextlib

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.runtime import runtime as rtmod
    from trainguard.runtime import session as sessmod
    from trainguard.strategies.batch import split
    from trainguard.runtime.cursor import GlobalSampleCursor

    class Grouped(Strategy):  # model_parallel's rank arithmetic without a mesh
        name = "grouped-test"
        reshard_native = True

        def data_parallel(self, rank, world):
            dp, tp = mesh_shape(world, 2)
            return rank // tp, dp

        def setup(self, model, optimizer):
            return model, optimizer

        def no_sync(self, model, last):
            return contextlib.nullcontext()

    monkeypatch.setattr(rtmod.dist, "new_group", lambda **kw: None)  # no process group in a unit test
    monkeypatch.setattr(sessmod.signal, "signal", lambda *a: None)  # keep pytest's SIGTERM handler
    observed = {}
    for rank in range(4):
        rt = rtmod.Runtime(rank=rank, world_size=4, local_rank=rank, job_id="t", rdzv_round=0,
                           checkpoint=CheckpointConfig(), strategy=Grouped())
        net = nn.Linear(2, 2)
        rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), dataset_size=64, global_batch=16, micro_batch=4, seed=3)
        assert (rt.dp_rank, rt.dp_size, rt.accum_steps) == (rank // 2, 2, 2)
        ids = GlobalSampleCursor(64, 16, 3).next_global_batch()
        assert rt.next_batches() == split(ids, rank // 2, 2, 4)
        monkeypatch.setattr(rt._metrics, "observe_step", lambda step, samples, tokens, s, r=rank, **kw: observed.update({r: samples}))
        rt.end_step()
    assert observed == {0: 8, 1: 0, 2: 8, 3: 0}  # the job's sum is the global batch
    with pytest.raises(StrategyError, match="tp_size=2"):
        rtmod.Runtime(rank=0, world_size=3, local_rank=0, job_id="t", rdzv_round=0, checkpoint=CheckpointConfig(),
                      strategy=Grouped()).setup(net, torch.optim.SGD(net.parameters(), lr=0.1), dataset_size=64,
                                                global_batch=12, micro_batch=2)
