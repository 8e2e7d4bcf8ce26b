"""Unit tests of the strategy interface: registry, errors, precision, wrap policies, and single-rank
setup/state/accumulation for ddp and fsdp in-process (fsdp on a one-rank gloo group it creates)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainguard.strategies.batch import plan
from trainguard.strategies import (
    PRECISIONS,
    Precision,
    Strategy,
    StrategyError,
    available_strategies,
    get_strategy,
    register_strategy,
)
from trainguard.strategies.base import rebuild_optimizer
from trainguard.strategies.fsdp import FSDPStrategy, resolve_policy

pytestmark = pytest.mark.timeout(60)


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class Net(nn.Module):
    def __init__(self, d: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


@pytest.fixture
def no_group():
    assert not dist.is_initialized(), "a previous test left a process group"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a process group")


# ---- registry and errors ---------------------------------------------------------------------------

def test_registry_names_and_lookup():
    assert {"ddp", "fsdp"} <= set(available_strategies())
    assert get_strategy("ddp").name == "ddp"
    assert get_strategy("FSDP", precision="bf16-mixed").precision.name == "bf16-mixed"
    assert get_strategy("fsdp2").name == "fsdp"
    built = get_strategy("ddp")
    assert get_strategy(built) is built
    for name in ("ddp", "fsdp"):
        s = get_strategy(name)
        assert s.reshard_native is True
        assert "global batch stays constant" in s.resize_rule and "reshard" in s.resize_rule


def test_unknown_strategy_names_setting_and_fix():
    with pytest.raises(StrategyError) as e:
        get_strategy("zero9")
    msg = str(e.value)
    assert "strategy='zero9'" in msg and "ddp" in msg and "fsdp" in msg and "Fix:" in msg and "--strategy" in msg
    assert isinstance(e.value, ValueError)


def test_unknown_option_and_options_with_instance():
    with pytest.raises(StrategyError, match="invalid option for strategy 'fsdp'.*docs/strategies.md"):
        get_strategy("fsdp", shard_everything=True)
    with pytest.raises(StrategyError, match="already built strategy"):
        get_strategy(get_strategy("ddp"), precision="32")


@pytest.mark.parametrize("value,name", [("32", "32"), (32, "32"), ("32-true", "32"), (None, "32"),
                                        ("bf16-mixed", "bf16-mixed"), ("16-mixed", "16-mixed")])
def test_precision_parse(value, name):
    p = Precision.parse(value)
    assert p.name == name and p.name in PRECISIONS
    assert p.needs_scaler == (name == "16-mixed")


def test_unknown_precision_names_setting_and_fix():
    with pytest.raises(StrategyError) as e:
        get_strategy("ddp", precision="fp8")
    msg = str(e.value)
    assert "precision='fp8'" in msg and "bf16-mixed" in msg and "Fix:" in msg and "--precision" in msg


def test_register_custom_strategy_is_used_through_the_interface():
    class Plain(Strategy):
        name = "plain-test"
        reshard_native = False

        def setup(self, model, optimizer):
            return model, optimizer

        def no_sync(self, model, last):
            return contextlib.nullcontext()

    register_strategy("plain-test", Plain)
    s = get_strategy("plain-test")
    assert isinstance(s, Plain) and "converted" in s.resize_rule
    assert s.plan(24, 2, 4) == plan(24, 2, 4) == (3, 12)
    with pytest.raises(ValueError, match="global_batch_size"):
        s.plan(24, 5, 4)


# ---- wrap policies and optimizer rebuild --------------------------------------------------------------

def test_wrap_policy_forms():
    net = Net()
    default = resolve_policy(None, net, "wrap")
    assert [n for n, m in net.named_modules() if default(m)] == ["blocks.0", "blocks.1"]
    by_class = resolve_policy([Block], net, "wrap")
    by_name = resolve_policy(["Block"], net, "wrap")
    by_fn = resolve_policy(lambda m: isinstance(m, nn.Linear) and m.out_features == 3, net, "wrap")
    assert [n for n, m in net.named_modules() if by_class(m)] == ["blocks.0", "blocks.1"]
    assert [n for n, m in net.named_modules() if by_name(m)] == ["blocks.0", "blocks.1"]
    assert [n for n, m in net.named_modules() if by_fn(m)] == ["out"]
    with pytest.raises(StrategyError, match="`wrap` names \\['Blok'\\].*Fix"):
        resolve_policy(["Blok"], net, "wrap")
    with pytest.raises(StrategyError, match="nn.Module classes or class names"):
        resolve_policy([3], net, "wrap")


def test_rebuild_optimizer_keeps_groups_and_refuses_stepped_or_foreign():
    net = Net()
    opt = torch.optim.AdamW([{"params": list(net.inp.parameters()), "weight_decay": 0.0},
                             {"params": list(net.out.parameters()), "lr": 0.5}], lr=0.1, betas=(0.8, 0.9))
    old = {id(p): n for n, p in net.named_parameters()}
    new_params = {n: nn.Parameter(p.detach().clone()) for n, p in net.named_parameters()}
    new = rebuild_optimizer(opt, old, new_params)
    assert type(new) is torch.optim.AdamW
    assert [g["lr"] for g in new.param_groups] == [0.1, 0.5]
    assert new.param_groups[0]["weight_decay"] == 0.0 and new.param_groups[1]["betas"] == (0.8, 0.9)
    assert new.param_groups[0]["params"][0] is new_params["inp.weight"]
    foreign = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(StrategyError, match="not parameters of the model"):
        rebuild_optimizer(foreign, old, new_params)
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(StrategyError, match="already has state"):
        rebuild_optimizer(opt, old, new_params)


# ---- single rank, in-process ---------------------------------------------------------------------------

def _train(strategy: Strategy, steps: int = 3, micro: int = 2) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    torch.manual_seed(0)
    net = Net()
    model, opt = strategy.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        total = 0.0
        for i in range(micro):
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g)
            with strategy.no_sync(model, last=i == micro - 1):
                with strategy.autocast():
                    loss = nn.functional.mse_loss(model(x).float(), y) / micro
                strategy.backward(loss)
            total += float(loss.detach())
        strategy.optimizer_step(opt)
        opt.zero_grad()
        losses.append(total)
    return model, opt, losses


def test_fsdp_alone_matches_plain_training_and_state_round_trips(no_group):
    ref = _train(get_strategy("ddp"))[2]  # world size 1: an unwrapped module
    s = get_strategy("fsdp")
    try:
        model, opt, losses = _train(s)
        assert s.owns_process_group and dist.get_world_size() == 1
        assert s.wrapped == ["blocks.1", "blocks.0"]
        assert type(model.blocks[0].fc.weight).__name__ == "DTensor"
        assert opt.param_groups[0]["params"][0] is next(model.parameters())
        assert losses == pytest.approx(ref, abs=1e-6)
        sd = s.state(model, opt).state_dict()
        assert "model" in sd and "optim" in sd and "scaler" not in sd
        assert set(sd["model"]) == {n for n, _ in Net().named_parameters()}
    finally:
        s.teardown()
    assert not dist.is_initialized()


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_trains_on_cpu(no_group, name, precision):
    s = get_strategy(name, precision=precision)
    try:
        _, _, losses = _train(s, steps=4)
        ref = _train(get_strategy("ddp"), steps=4)[2]
        assert all(l == l for l in losses)  # no nan
        assert losses[0] == pytest.approx(ref[0], rel=2e-2)  # low-precision forward of the same weights
        assert (s.scaler is not None) == (precision == "16-mixed")
        if s.scaler is not None:
            assert s.scaler.get_scale() > 0 and "scale" in s.scaler.state_dict()
    finally:
        s.teardown()


def test_scaler_state_is_part_of_the_checkpoint_state():
    s = get_strategy("ddp", precision="16-mixed")
    model, opt, _ = _train(s, steps=2)
    sd = s.state(model, opt).state_dict()
    assert sd["scaler"]["scale"] == s.scaler.get_scale()
    s2 = get_strategy("ddp", precision="16-mixed")
    model2, opt2, _ = _train(s2, steps=0)
    s2.scaler.load_state_dict({**sd["scaler"], "scale": 1024.0})
    st = s2.state(model2, opt2)
    st.load_state_dict({**st.state_dict(), "scaler": {**sd["scaler"], "scale": 8.0}})
    assert s2.scaler.get_scale() == 8.0


def test_fsdp_activation_checkpointing_keeps_keys_and_numbers(no_group):
    ref = _train(get_strategy("ddp"))[2]
    s = get_strategy("fsdp", activation_checkpointing=True)
    try:
        model, opt, losses = _train(s)
        assert s.checkpointed == ["blocks.0", "blocks.1"]
        assert "CheckpointWrapper" in type(model.blocks[0]).__name__
        assert losses == pytest.approx(ref, abs=1e-6)
        assert set(s.state(model, opt).state_dict()["model"]) == {n for n, _ in Net().named_parameters()}
    finally:
        s.teardown()


def test_fsdp_cpu_offload_option_runs(no_group):
    s = get_strategy("fsdp", cpu_offload=True, wrap=[Block], reshard_after_forward=False)
    try:
        _, _, losses = _train(s, steps=2)
        assert s.describe()["cpu_offload"] is True and len(losses) == 2
    finally:
        s.teardown()


def test_fsdp_no_sync_refuses_an_unwrapped_model():
    with pytest.raises(StrategyError, match="fully_shard did not wrap"):
        with FSDPStrategy().no_sync(Net(), last=False):
            pass


def test_runtime_never_branches_on_a_concrete_strategy():
    """STYLE §1: the worker runtime and the checkpoint code only use the interface."""
    import ast
    import inspect

    import trainguard.runtime as worker
    import trainguard.checkpoint.durablesave as durablesave
    import trainguard.checkpoint.manager as manager
    import trainguard.checkpoint.nearest as nearest
    import trainguard.checkpoint.state as state

    concrete = {"DDPStrategy", "FSDPStrategy", "DistributedDataParallel", "fully_shard", "FSDPModule",
                "ddp", "fsdp"}
    for mod in (worker, manager, durablesave, nearest, state):
        tree = ast.parse(inspect.getsource(mod))
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {a.name.rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in n.names}
        used |= {n.module.rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not used & concrete, f"{mod.__name__} uses {sorted(used & concrete)}"
        compared = {c.value for n in ast.walk(tree) if isinstance(n, ast.Compare)
                    for side in [n.left, *n.comparators] for c in ast.walk(side) if isinstance(c, ast.Constant)}
        assert not compared & {"ddp", "fsdp"}, f"{mod.__name__} compares against a strategy name"
