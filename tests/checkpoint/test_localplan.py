"""A snapshot replays a plain model + optimizer's state dict from its objects (checkpoint/localplan.py):
it writes what the full ``local_state_dict()`` path writes, re-reads what changes from step to step
(hyperparameters, a loss scaler's extras), and takes the full path again whenever any object the plan
names was replaced, resized, retyped or joined by another; hooked modules and optimizers get no plan."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported lazily by load_state_dict paths, it sets TORCHINDUCTOR_CACHE_DIR)

from trainguard.checkpoint import memory as mem
from trainguard.checkpoint.localplan import LocalPlan
from trainguard.checkpoint.state import ModelOptimizerState
from trainguard.strategies.base import StrategyState

pytestmark = pytest.mark.timeout(60)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6))
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied: two state-dict keys, one parameter
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        x = torch.randint(0, 11, (8,))
        torch.nn.functional.cross_entropy(model(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


class Counting(ModelOptimizerState):
    """Counts the full path (``local_state_dict``); the class attribute stays ModelOptimizerState's."""

    full = 0

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        inner = super().local_state_dict

        def counted():
            Counting.full += 1
            return inner()

        self.local_state_dict = counted  # type: ignore[method-assign]


Counting.local_state_dict = ModelOptimizerState.local_state_dict  # type: ignore[method-assign]


@pytest.fixture
def job(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt)
    entry = Counting(model, opt)
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    Counting.full = 0
    yield model, opt, entry, tier
    tier.close()


def _content(tier: mem.MemoryTier) -> tuple[dict, list[torch.Tensor]]:
    blob = tier.newest_blob()
    assert blob is not None
    h = mem.Header.unpack(blob[:mem.HEADER_BYTES])
    meta, views = mem._parse(h, blob[mem.HEADER_BYTES:])
    return meta["skeleton"], [v.clone() for v in views]


def _full_reference(entry, tmp_path, step) -> tuple[dict, list[torch.Tensor]]:
    """What the full path writes for the same state (a second tier that never replays)."""
    ref_dir = tmp_path / f"ref-{step}"
    ref_dir.mkdir()
    ref = mem.MemoryTier(str(ref_dir), rank=0, world_size=1)
    ref.replay_state = False
    try:
        ref.snapshot(step, {"app": entry})
        return _content(ref)
    finally:
        ref.close()


def test_replay_writes_what_the_full_path_writes_and_restores(job, tmp_path):
    model, opt, entry, tier = job
    tier.snapshot(1, {"app": entry})
    assert isinstance(tier._plans["app"], LocalPlan)
    assert Counting.full == 1
    for step in range(2, 5):
        train(model, opt)
        opt.param_groups[0]["lr"] = 0.001 * step  # a scheduler: hyperparameters change every step
        tier.snapshot(step, {"app": entry})
        assert Counting.full == 1, "the snapshot took the full path although nothing but values changed"
        got_skel, got = _content(tier)
        Counting.full -= 1  # the reference's own full pass
        want_skel, want = _full_reference(entry, tmp_path, step)
        assert got_skel == want_skel
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    lr, w, m = opt.param_groups[0]["lr"], model.emb.weight.detach().clone(), opt.state[model.emb.weight]["exp_avg"].clone()
    train(model, opt, 2)
    opt.param_groups[0]["lr"] = 0.5
    tier.load(4, {"app": entry})
    assert opt.param_groups[0]["lr"] == lr == pytest.approx(0.004)
    assert torch.equal(model.emb.weight, w) and torch.equal(opt.state[model.emb.weight]["exp_avg"], m)
    assert model.head.weight is model.emb.weight  # the tie survives the load


def _replace_param(model, opt):
    model.body[0].weight = torch.nn.Parameter(torch.randn(6, 6))


def _resize_data(model, opt):
    model.body[0].bias.data = torch.zeros(6, 1)


def _retype(model, opt):
    model.double()


def _swap_same_shape(model, opt):  # not a layout change: the replay must copy the new storage
    model.body[0].weight.data = torch.full((6, 6), 7.0)


def _reload_optimizer(model, opt):
    opt.load_state_dict(opt.state_dict())


def _new_group(model, opt):
    model.extra = torch.nn.Linear(2, 2)
    opt.add_param_group({"params": model.extra.parameters()})


def _new_buffer(model, opt):
    model.register_buffer("seen", torch.ones(2))


def _replace_buffer(model, opt):
    model.body[1].running_mean = torch.full((6,), 3.0)


def _drop_state(model, opt):
    del opt.state[model.body[0].bias]


def _reassign_state_tensor(model, opt):  # optimizers that rebind their state every step
    st = opt.state[model.body[0].weight]
    st["exp_avg"] = st["exp_avg"] + 1


def _state_key_added(model, opt):
    opt.state[model.body[0].weight]["extra"] = torch.ones(2)


def _delete_submodule(model, opt):  # Module.__delattr__ runs no registration hook
    del model.body


def _param_dict_entry(model, opt):  # what Module._apply and FSDP2 do: no registration hook runs
    model.body[0]._parameters["weight"] = torch.nn.Parameter(torch.full((6, 6), 2.0))


@pytest.mark.parametrize("change, replays", [
    (_replace_param, False), (_resize_data, False), (_retype, False), (_reload_optimizer, False),
    (_new_group, False), (_new_buffer, False), (_replace_buffer, False), (_drop_state, False),
    (_reassign_state_tensor, False), (_state_key_added, False), (_param_dict_entry, False),
    (_delete_submodule, False),
    (_swap_same_shape, True),
])
def test_any_change_to_what_the_plan_names_takes_the_full_path(job, tmp_path, change, replays):
    model, opt, entry, tier = job
    tier.snapshot(1, {"app": entry})
    tier.snapshot(2, {"app": entry})
    assert Counting.full == 1
    change(model, opt)
    tier.snapshot(3, {"app": entry})
    assert Counting.full == (1 if replays else 2)
    got_skel, got = _content(tier)
    want_skel, want = _full_reference(entry, tmp_path, 3)
    assert got_skel == want_skel
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))
    Counting.full = 0
    # and the plan rebuilt from the new objects replays from then on
    tier.snapshot(4, {"app": entry})
    assert Counting.full == 0 and isinstance(tier._plans["app"], LocalPlan)


def test_another_model_or_optimizer_on_the_entry_takes_the_full_path(job):
    model, opt, entry, tier = job
    other = Net()  # made before the plan: constructing it registers parameters, which the plan counts
    other.load_state_dict(model.state_dict())
    tier.snapshot(1, {"app": entry})
    entry.model = other
    tier.snapshot(2, {"app": entry})
    assert Counting.full == 2
    entry.optimizer = torch.optim.AdamW(other.parameters())
    train(other, entry.optimizer)
    tier.snapshot(3, {"app": entry})
    assert Counting.full == 3
    with torch.no_grad():
        other.emb.weight.fill_(5.0)
    tier.snapshot(4, {"app": entry})  # replayed from the new objects
    assert Counting.full == 3
    _, got = _content(tier)
    assert torch.equal(got[0], other.emb.weight.detach())


class HookedOptimizer(torch.optim.SGD):
    def state_dict(self):
        return super().state_dict()


def _hooked_module(model, opt):
    model.body[0].register_state_dict_pre_hook(lambda *a, **k: None)  # as FSDP2 registers one
    return model, opt


def _extra_state(model, opt):
    class WithExtra(torch.nn.Linear):
        def get_extra_state(self):
            return {"n": 1}

        def set_extra_state(self, state):
            pass

    model.body[0] = WithExtra(6, 6)
    return model, torch.optim.AdamW(model.parameters())


def _overriding_optimizer(model, opt):
    return model, HookedOptimizer(model.parameters(), lr=0.1, momentum=0.9)


def _optimizer_hook(model, opt):
    opt.register_state_dict_pre_hook(lambda o: None)
    return model, opt


def _scalar_state(model, opt):
    opt = torch.optim.AdamW(model.parameters())
    train(model, opt)
    opt.state[model.emb.weight]["note"] = 3  # a non-tensor value changes without the plan seeing it
    return model, opt


@pytest.mark.parametrize("setup", [_hooked_module, _extra_state, _overriding_optimizer, _optimizer_hook,
                                   _scalar_state])
def test_no_plan_where_the_full_path_is_not_plain(tmp_path, setup):
    torch.manual_seed(0)
    model = Net()
    model, opt = setup(model, torch.optim.AdamW(model.parameters()))
    train(model, opt)
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    try:
        entry = ModelOptimizerState(model, opt)
        tier.snapshot(1, {"app": entry})
        assert tier._plans["app"] is False
        tier.snapshot(2, {"app": entry})
        assert tier._plans["app"] is False  # not tried again
    finally:
        tier.close()


class Scaler:
    def __init__(self) -> None:
        self.scale = 1.0

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, sd):
        self.scale = sd["scale"]


def test_extras_are_read_at_every_replayed_snapshot(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    train(model, opt)
    scaler = Scaler()
    entry = StrategyState(model, opt, scaler=scaler)
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    try:
        tier.snapshot(1, {"app": entry})
        assert isinstance(tier._plans["app"], LocalPlan)
        scaler.scale = 1024.0
        tier.snapshot(2, {"app": entry})
        scaler.scale = 2.0
        tier.load(2, {"app": entry})
        assert scaler.scale == 1024.0
    finally:
        tier.close()


def test_pickled_parts_unpickle_as_themselves():
    from trainguard.checkpoint.localplan import _Pickled

    skel = {"a": (0, (2, 3), "torch.float32"), "b": [1, 2]}
    assert pickle.loads(pickle.dumps({"x": _Pickled(skel)})) == {"x": skel}
