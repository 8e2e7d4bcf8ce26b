"""The ``deepspeed`` strategy (ZeRO 1/2/3 on CPU/gloo).

Unit: option and config errors, the merged DeepSpeed config, lazy import; in-process at world size 1:
accumulation matches plain torch, and the checkpoint state is world-size and stage independent (a
ZeRO-2 state loads into a ZeRO-3 engine and both continue identically).

Multi-process (``slow``, the pattern of ``test_elastic.py``): a 2-rank run with ZeRO-2 / ZeRO-3 saves
step 4 through the checkpoint manager; restored at 1 rank, the losses of steps 5..8 equal the
uninterrupted 2-rank run's within 1e-6 (fp32). Step 5 checks the parameters, steps 6..8 the optimizer
state (exp_avg, exp_avg_sq, step). The ZeRO-2 reference also matches DDP's losses within 1e-6.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import REPO
from tests.strategies._world import losses, run_segment
from trainguard.strategies import StrategyError, get_strategy

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def deepspeed():
    return pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install --no-build-isolation "
                                                   "'deepspeed>=0.15'); the deepspeed strategy is untested here")


# ---- options and config (no engine) ----------------------------------------------------------------

@pytest.mark.parametrize(("options", "words"), [
    ({"stage": 0}, ["`stage=0`", "strategy='ddp'"]),
    ({"stage": 4}, ["`stage=4`", "1, 2, 3"]),
    ({"stage": 3, "config": {"zero_optimization": {"stage": 2}}}, ["contradicts", "zero_optimization.stage=2"]),
    ({"config": {"optimizer": {"type": "Adam"}}}, ["`optimizer`", "Runtime.setup"]),
    ({"config": {"scheduler": {"type": "WarmupLR"}}}, ["`scheduler`"]),
    ({"config": {"bf16": {"enabled": True}}}, ["`bf16`", "precision=bf16-mixed"]),
    ({"precision": "bf16-mixed", "config": {"fp16": {"enabled": True}}}, ["`fp16`", "precision=16-mixed"]),
    ({"config": "/nonexistent/ds.json"}, ["cannot be read", "/nonexistent/ds.json"]),
    ({"bogus": 1}, ["invalid option", "docs/strategies.md"]),
])
def test_bad_options_name_the_setting_and_the_fix(options, words):
    with pytest.raises(StrategyError) as e:
        get_strategy("deepspeed", **options)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "Fix:" in str(e.value)


def test_config_merge_owns_batch_stage_precision_and_turns_clipping_off(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("zero_optimization:\n  stage: 3\n  reduce_bucket_size: 1000\ntrain_batch_size: auto\n"
                    "bf16:\n  enabled: true\n")
    s = get_strategy("deepspeed", config=str(path), precision="bf16-mixed")
    assert s.stage == 3 and s.reshard_native
    assert s.plan(24, 2, 4) == (3, 12)
    cfg = s.build_config(2)
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 3
    assert "train_batch_size" not in cfg
    assert cfg["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1000}
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed >= 0.18 clips at 1.0 by default; ddp/fsdp do not
    (tmp_path / "clip.json").write_text(json.dumps({"gradient_clipping": 0.5, "gradient_accumulation_steps": 3}))
    s2 = get_strategy("deepspeed", config=str(tmp_path / "clip.json"))
    s2.plan(24, 2, 4)
    assert s2.stage == 2 and s2.build_config(2)["gradient_clipping"] == 0.5
    s2.plan(24, 1, 4)  # 6 accumulation steps at world size 1: the config's 3 no longer fits
    with pytest.raises(StrategyError, match="gradient_accumulation_steps=3.*runtime owns it.*Fix"):
        s2.build_config(1)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(StrategyError, match="not valid JSON/YAML"):
        get_strategy("deepspeed", config=str(tmp_path / "bad.json"))


def test_trainguard_imports_without_deepspeed():
    code = ("import sys, trainguard.strategies, trainguard.runtime, trainguard.checkpoint.manager\n"
            "from trainguard.strategies import available_strategies\n"
            "assert 'deepspeed' in available_strategies()\n"
            "assert not any(m == 'deepspeed' or m.startswith('deepspeed.') for m in sys.modules), 'imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


# ---- in-process at world size 1 --------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.act = nn.Tanh()
        self.out = nn.Linear(16, 3)
        self.register_buffer("calls", torch.zeros(()))  # a persistent buffer travels with the state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x)))


def _train(strategy, model, opt, batches) -> None:
    for micro in batches:
        for i, x in enumerate(micro):
            with strategy.no_sync(model, last=i == len(micro) - 1):
                with strategy.autocast():
                    loss = model(x).pow(2).mean() / len(micro)
                strategy.backward(loss)
        strategy.optimizer_step(opt)
        opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def one_rank(deepspeed):
    """One one-rank gloo group for every in-process engine of this module. DeepSpeed caches its
    process groups in module globals, so a second default group in the same process would meet stale
    ones; a worker process sets up once, so the strategy never does that."""
    assert not dist.is_initialized(), "a previous test left a process group"
    old = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # what a launcher sets; deepspeed.initialize requires it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    if old is None:
        os.environ.pop("LOCAL_RANK", None)
    else:
        os.environ["LOCAL_RANK"] = old


def _engine(stage: int, model: nn.Module, precision: str = "32"):
    s = get_strategy("deepspeed", stage=stage, precision=precision)
    s.plan(4, 1, 2)  # 2 micro-batches of 2
    eng, opt = s.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return s, eng, opt


def _full_params(eng) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in eng.module.named_parameters()}


@pytest.mark.parametrize(("precision", "saved", "loaded"), [("32", 2, 3), ("bf16-mixed", 1, 1)])
def test_accumulation_matches_torch_and_state_moves_between_engines(one_rank, precision, saved, loaded):
    """fp32: a ZeRO-2 state continues identically in a ZeRO-3 engine. bf16 (DeepSpeed's bf16 optimizer
    under ZeRO-1): the fp32 master weights and optimizer state round-trip exactly."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randn(2, 4, generator=g) * 3 for _ in range(2)] for _ in range(3)]
    s2, eng2, opt2 = _engine(saved, model, precision)
    _train(s2, eng2, opt2, batches[:2])
    for micro in batches[:2]:  # plain torch, the same accumulation
        for x in micro:
            (ref(x).pow(2).mean() / len(micro)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = _full_params(eng2)
    for n, p in ref.named_parameters():
        assert precision != "32" or torch.equal(got[n], p.detach()), n

    st = s2.state(eng2, opt2).state_dict()
    assert set(st["params"]) == {n for n, _ in ref.named_parameters()}
    assert all(st["params"][n].shape == p.shape for n, p in ref.named_parameters())  # full, not partitions
    assert sorted(st["optim"]["inp.weight"]) == ["exp_avg", "exp_avg_sq"]
    assert float(st["optim_scalars"]["0"]["step"]) == 2.0 and st["buffers"] == {"calls": torch.zeros(())}
    for n, p in ref.named_parameters():
        assert precision != "32" or torch.equal(st["optim"][n]["exp_avg"], ref_opt.state[p]["exp_avg"]), n

    torch.manual_seed(5)  # a different initialisation: everything must come from the state
    s3, eng3, opt3 = _engine(loaded, Net(), precision)
    s3.state(eng3, opt3).load_state_dict(copy.deepcopy(st))
    assert all(torch.equal(_full_params(eng3)[n], got[n]) for n in got)
    _train(s2, eng2, opt2, batches[2:])
    _train(s3, eng3, opt3, batches[2:])
    after2, after3 = _full_params(eng2), _full_params(eng3)
    for n in after2:
        assert torch.allclose(after2[n], after3[n], rtol=0, atol=1e-6), n
        assert not torch.equal(after2[n], got[n]), f"{n} did not train"


def test_setup_refuses_a_stepped_optimizer_and_frozen_parameters():
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(StrategyError, match="already has state"):
        get_strategy("deepspeed").setup(model, opt)
    frozen = Net()
    frozen.inp.weight.requires_grad_(False)
    with pytest.raises(StrategyError, match="inp.weight.*Fix"):
        get_strategy("deepspeed").setup(frozen, torch.optim.AdamW(frozen.parameters()))


# ---- multi-process: save at 2 ranks, restore at 1 ----------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoint_of_2_ranks_resumes_exactly_at_1_rank(tmp_path, deepspeed, stage):
    zero = ["--zero-stage", str(stage)]
    ref_dir, el_dir = str(tmp_path / "ref"), str(tmp_path / "elastic")
    ref_log, el_log = str(tmp_path / "ref.jsonl"), str(tmp_path / "elastic.jsonl")
    run_segment(2, "deepspeed", ref_dir, steps=8, interval=4, fence=0, loss_log=ref_log, extra=zero, timeout=240)
    ref = losses(ref_log)
    assert sorted(ref) == list(range(1, 9))
    step4 = glob.glob(os.path.join(ref_dir, "run", "step-000000000004-e*"))[0]  # named by step and epoch
    with open(os.path.join(step4, "manifest.json")) as fh:
        manifest = json.load(fh)
    assert manifest["strategy"] == "deepspeed" and manifest["world_size"] == 2
    os.makedirs(os.path.join(el_dir, "run"))
    shutil.copytree(step4, os.path.join(el_dir, "run", os.path.basename(step4)))
    run_segment(1, "deepspeed", el_dir, steps=8, interval=0, fence=1, loss_log=el_log, extra=zero, timeout=240)
    el = losses(el_log)
    assert sorted(el) == [5, 6, 7, 8], "the 1-rank segment must resume at step 5"
    deltas = {s: abs(el[s] - ref[s]) for s in el}
    figures = {"restore_at_1_step5_delta": deltas[5], "max_delta_steps5_8": max(deltas.values())}
    if stage == 2:  # the accumulation mapping and defaults give DDP's numbers
        ddp_log = str(tmp_path / "ddp.jsonl")
        run_segment(2, "ddp", str(tmp_path / "ddp"), steps=8, interval=0, fence=0, loss_log=ddp_log, timeout=240)
        ddp = losses(ddp_log)
        figures["max_delta_vs_ddp_steps1_8"] = max(abs(ddp[s] - ref[s]) for s in ref)
    print(f"deepspeed zero-{stage}: " + " ".join(f"{k}={v:.3g}" for k, v in figures.items())
          + f" ref_loss8={ref[8]:.6f}")
    assert all(v <= 1e-6 for v in figures.values()), figures
