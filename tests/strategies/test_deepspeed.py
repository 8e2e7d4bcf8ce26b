"""The ``deepspeed`` strategy (ZeRO 1/2/3 and ZeRO-Offload on CPU/gloo).

Unit: option and config errors, the merged DeepSpeed config, lazy import, the optimizer conversion for
ZeRO-Offload; in-process at world size 1: accumulation matches plain torch, the checkpoint state is views
of the live partitions (no copies), and it moves between engines of another stage through DCP.

Multi-process (``slow``, 12-sample global batch = 4 ranks x 3 = 3 x 4 = 2 x 6 micro-batches of 1): ZeRO-2
and ZeRO-3 references at 4 ranks save step 4; restored at 2 and at 3 ranks, and a ZeRO-2 checkpoint
restored into ZeRO-3 at 3 ranks, the losses of steps 5 (parameters) and 6 (optimizer state) equal the
uninterrupted run's within 1e-6 (fp32). ZeRO-Offload (ZeRO-3, optimizer and parameters in host memory,
DeepSpeed's CPU Adam): a 2-rank run's step-4 checkpoint resumed at 1 rank gives the same losses.
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
    ({"config": {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}},
     ["`zero_optimization.offload_optimizer.device='nvme'`", "device \"cpu\""]),
    ({"stage": 2, "config": {"zero_optimization": {"offload_param": {"device": "cpu"}}}},
     ["offload_param", "stage 2", "stage=3"]),
    ({"config": {"zero_optimization": {"offload_optimizer": "cpu"}}}, ["must be a mapping"]),
    ({"op_build_timeout_s": 0}, ["`op_build_timeout_s=0`"]),
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


def _engine(stage: int, model: nn.Module, precision: str = "32", config: dict | None = None):
    s = get_strategy("deepspeed", stage=stage, precision=precision, config=config)
    s.plan(4, 1, 2)  # 2 micro-batches of 2
    eng, opt = s.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return s, eng, opt


def _full_params(eng) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in eng.module.named_parameters()}


def _batches():
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(2, 4, generator=g) * 3 for _ in range(2)] for _ in range(3)]


def _move(tmp_path, src_strategy, src_eng, src_opt, dst_strategy, dst_eng, dst_opt) -> None:
    """Save one engine's state with DCP and load it into another (what a restore at another stage does)."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    dcp.save({"app": src_strategy.state(src_eng, src_opt)}, checkpoint_id=path)
    dcp.load({"app": dst_strategy.state(dst_eng, dst_opt)}, checkpoint_id=path)


@pytest.mark.parametrize(("precision", "saved", "loaded"), [("32", 2, 3), ("32", 3, 1), ("bf16-mixed", 1, 1)])
def test_accumulation_matches_torch_and_state_moves_between_engines(one_rank, tmp_path, precision, saved, loaded):
    """fp32: a ZeRO-2 state continues identically in a ZeRO-3 engine (and ZeRO-3 in ZeRO-1). bf16
    (DeepSpeed's bf16 optimizer under ZeRO-1): the fp32 master weights and optimizer state round-trip."""
    from trainguard.strategies.flat_shards import local_shard

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = _batches()
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
    assert set(st["fp32"]) == {n for n, _ in ref.named_parameters()}
    assert st["shapes"] == {n: list(p.shape) for n, p in ref.named_parameters()}
    assert sorted(st["optim"]["inp.weight"]) == ["exp_avg", "exp_avg_sq"]
    assert float(st["optim_scalars"]["0"]["step"]) == 2.0 and st["buffers"] == {"calls": torch.zeros(())}
    for n, p in ref.named_parameters():  # flat global tensors; at world size 1 this rank owns all of it
        assert st["fp32"][n].size() == (p.numel(),)
        assert torch.equal(local_shard(st["fp32"][n]), got[n].flatten()), n
        assert precision != "32" or torch.equal(local_shard(st["optim"][n]["exp_avg"]),
                                                ref_opt.state[p]["exp_avg"].flatten()), n

    torch.manual_seed(5)  # a different initialisation: everything must come from the checkpoint
    s3, eng3, opt3 = _engine(loaded, Net(), precision)
    _move(tmp_path, s2, eng2, opt2, s3, eng3, opt3)
    assert all(torch.equal(_full_params(eng3)[n], got[n]) for n in got)
    _train(s2, eng2, opt2, batches[2:])
    _train(s3, eng3, opt3, batches[2:])
    after2, after3 = _full_params(eng2), _full_params(eng3)
    for n in after2:
        assert torch.allclose(after2[n], after3[n], rtol=0, atol=1e-6), n
        assert not torch.equal(after2[n], got[n]), f"{n} did not train"


@pytest.mark.parametrize("stage", [2, 3])
def test_state_is_views_of_the_live_partitions_not_copies(one_rank, stage):
    """What makes a save O(shard): the state hands DCP views of DeepSpeed's own fp32 and optimizer
    partitions; nothing is gathered or copied before the checkpoint manager stages it."""
    from trainguard.strategies.flat_shards import local_shard

    torch.manual_seed(0)
    s, eng, opt = _engine(stage, Net())
    _train(s, eng, opt, _batches()[:1])
    flats = ([t for t in eng.optimizer.fp32_partitioned_groups_flat] if stage == 3
             else [p for g in eng.optimizer.optimizer.param_groups for p in g["params"]])
    storages = {f.untyped_storage().data_ptr() for f in flats}
    storages |= {eng.optimizer.optimizer.state[f][k].untyped_storage().data_ptr() for f in flats
                 for k in ("exp_avg", "exp_avg_sq")}
    st = s.state(eng, opt).state_dict()
    shards = [local_shard(t) for t in st["fp32"].values()]
    shards += [local_shard(t) for per in st["optim"].values() for t in per.values()]
    assert shards and all(t.untyped_storage().data_ptr() in storages for t in shards)
    with torch.no_grad():  # writing through the state (what DCP's load does) changes the engine
        local_shard(st["fp32"]["out.bias"]).fill_(0.25)
    s.state(eng, opt).load_state_dict(st)
    assert torch.equal(_full_params(eng)["out.bias"], torch.full((3,), 0.25))
    assert torch.equal(eng.module.out.bias.detach() if stage != 3 else _full_params(eng)["out.bias"],
                       torch.full((3,), 0.25))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_save_holds_one_staged_copy_of_the_zero_ranges(one_rank, tmp_path, stage):
    """Issue 44's memory-ratio check on DeepSpeed's ``ShardedTensor`` ranges (the other staged-tensor kinds:
    ``tests/checkpoint/test_save_memory.py``): save 1 <= 1.1x the rank's share of host memory, a later
    save <= 0.1x. 8.4 M parameters, ~100 MiB of fp32 weights and AdamW states to stage."""
    from tests.fixtures.hostmem import check_save_ratios, mlp_stack, save_ratios

    s, eng, opt = _engine(stage, mlp_stack(512, 4))
    with s.no_sync(eng, last=True):
        s.backward(eng(torch.randn(2, 512)).pow(2).mean())
    s.optimizer_step(opt)
    state = {"app": s.state(eng, opt)}
    state["app"].state_dict()  # the range table is gathered once per engine (a collective), not per save
    check_save_ratios(save_ratios(str(tmp_path / "c"), state, strategy="deepspeed"))


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


# ---- flat shards (pure) --------------------------------------------------------------------------------

@pytest.mark.parametrize(("pieces", "ok"), [
    ([(0, 0, 10)], True),
    ([(1, 4, 6), (0, 0, 4)], True),  # any order, any rank
    ([(0, 0, 4), (1, 5, 5)], False),  # a gap
    ([(0, 0, 6), (1, 4, 6)], False),  # an overlap
    ([(0, 0, 4), (1, 4, 4)], False),  # short
    ([], False),
])
def test_piece_table_requires_an_exact_tiling(pieces, ok):
    from trainguard.strategies.flat_shards import Piece, PieceTable

    build = lambda: PieceTable({"w": 10}, {"w": [Piece(*p) for p in pieces]})  # noqa: E731
    if ok:
        t = build()
        assert [p.start for p in t.pieces["w"]] == sorted(p[1] for p in pieces)
        assert t.local("w", 0).start == 0 and t.local("w", 7) is None
    else:
        with pytest.raises(ValueError, match="tile"):
            build()


# ---- the CPU Adam op's build lock ----------------------------------------------------------------------

def test_stale_build_lock_is_removed_and_a_held_one_times_out(tmp_path):
    import time

    from trainguard.strategies import deepspeed_ops as ops

    lock = str(tmp_path / "lock")
    open(lock, "w").close()  # what a builder killed mid-build leaves: nobody has it open
    assert ops.holders(lock) == []
    ops.clear_stale_lock(lock, time.monotonic() + 5)
    assert not os.path.exists(lock)
    with open(lock, "w"):  # a live build holds the file open (torch keeps the descriptor for the build)
        assert ops.holders(lock) == [os.getpid()]
        t0 = time.monotonic()
        with pytest.raises(StrategyError, match=f"{lock}.*held by pid.*{os.getpid()}.*Fix"):
            ops.clear_stale_lock(lock, time.monotonic() + 1)
        assert time.monotonic() - t0 < 5
    assert os.path.exists(lock)


def test_build_flock_waits_then_times_out_naming_the_setting(tmp_path):
    import fcntl
    import time

    from trainguard.strategies import deepspeed_ops as ops

    path = str(tmp_path / "trainguard.lock")
    other = os.open(path, os.O_CREAT | os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)  # another process building (an flock is per open file)
    try:
        with pytest.raises(StrategyError, match="op_build_timeout_s"):
            ops._flock(path, time.monotonic() + 1)
    finally:
        fcntl.flock(other, fcntl.LOCK_UN)
        os.close(other)
    fd = ops._flock(path, time.monotonic() + 1)  # released: taken at once
    os.close(fd)


# ---- ZeRO-Offload: optimizer conversion and an in-process round trip -------------------------------------

@pytest.mark.slow  # builds DeepSpeed's cpu_adam op on a fresh host (about 75 s, once)
@pytest.mark.timeout(600)
def test_offload_converts_the_optimizer_and_its_state_loads_without_offload(one_rank, tmp_path):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from trainguard.strategies.deepspeed import cpu_adam_like

    net = Net()
    with pytest.raises(StrategyError, match="SGD.*zero_force_ds_cpu_optimizer"):
        cpu_adam_like(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(StrategyError, match="amsgrad"):
        cpu_adam_like(torch.optim.Adam(net.parameters(), amsgrad=True))
    torch.manual_seed(0)
    offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    s, eng, opt = _engine(2, Net(), config=offload)
    assert isinstance(eng.optimizer.optimizer, DeepSpeedCPUAdam) and eng.optimizer.optimizer.adam_w_mode
    assert s.describe()["offload"] == ["optimizer"]
    batches = _batches()
    _train(s, eng, opt, batches[:2])
    st = s.state(eng, opt).state_dict()
    assert st["optim_scalars"]["0"]["step"] == 2  # DeepSpeed's CPU Adam counts in a python int
    torch.manual_seed(5)
    s3, eng3, opt3 = _engine(3, Net())  # no offload: the format is the same
    _move(tmp_path, s, eng, opt, s3, eng3, opt3)
    before = _full_params(eng)
    assert all(torch.equal(_full_params(eng3)[n], before[n]) for n in before)
    assert float(eng3.optimizer.optimizer.state[eng3.optimizer.fp32_partitioned_groups_flat[0]]["step"]) == 2.0


# ---- multi-process: 4 ranks -> 2 and 3 ranks, ZeRO-2 -> ZeRO-3; offload 2 -> 1 ---------------------------

RESIZE_JOB = ["--global-batch", "12", "--micro-batch", "1"]


def _restore(tmp_path, ref_dir: str, name: str, world: int, args: list[str], steps: int = 6) -> dict[int, float]:
    """Copy ``ref_dir``'s step-4 checkpoint alone into a new run and train it to ``steps`` at ``world``."""
    d = str(tmp_path / name)
    os.makedirs(os.path.join(d, "run"))
    step4 = glob.glob(os.path.join(ref_dir, "run", "step-000000000004-e*"))[0]  # named by step and epoch
    shutil.copytree(step4, os.path.join(d, "run", os.path.basename(step4)))
    log = d + ".jsonl"
    run_segment(world, "deepspeed", d, steps=steps, interval=0, fence=1, loss_log=log, extra=args, timeout=300)
    got = losses(log)
    assert sorted(got) == list(range(5, steps + 1)), f"the {world}-rank segment must resume at step 5"
    return got


@pytest.fixture(scope="module")
def zero_refs(tmp_path_factory, deepspeed):
    """ZeRO-2 and ZeRO-3 at 4 ranks, steps 1..6, checkpoint at step 4: stage -> (run dir, losses)."""
    tmp = tmp_path_factory.mktemp("zero-refs")
    out = {}
    for stage in (2, 3):
        d, log = str(tmp / f"zero{stage}"), str(tmp / f"zero{stage}.jsonl")
        run_segment(4, "deepspeed", d, steps=6, interval=4, fence=0, loss_log=log,
                    extra=[*RESIZE_JOB, "--zero-stage", str(stage)], timeout=300)
        with open(glob.glob(os.path.join(d, "run", "step-000000000004-e*", "manifest.json"))[0]) as fh:
            manifest = json.load(fh)
        assert manifest["strategy"] == "deepspeed" and manifest["world_size"] == 4
        out[stage] = (d, losses(log))
        assert sorted(out[stage][1]) == list(range(1, 7))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("stage", "worlds"), [(2, (3,)), (3, (2, 3))], ids=["2", "3"])
def test_zero_checkpoint_of_4_ranks_resumes_exactly_at_2_and_3_ranks(tmp_path, zero_refs, stage, worlds):
    """ZeRO-2 at 3 ranks (uneven partitions; 2 ranks is the even case ZeRO-3 covers below) and ZeRO-3
    at 2 and 3; test_zero2_checkpoint_of_4_ranks_resumes_as_zero3_at_3_ranks crosses the stages."""
    ref_dir, ref = zero_refs[stage]
    deltas = {}
    for world in worlds:
        got = _restore(tmp_path, ref_dir, f"at{world}", world, [*RESIZE_JOB, "--zero-stage", str(stage)])
        deltas.update({f"at{world}_step{s}": abs(got[s] - ref[s]) for s in got})
    print(f"deepspeed zero-{stage} 4 -> 2, 3: " + " ".join(f"{k}={v:.3g}" for k, v in deltas.items())
          + f" ref_loss6={ref[6]:.6f}")
    assert all(v <= 1e-6 for v in deltas.values()), deltas


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero2_checkpoint_of_4_ranks_resumes_as_zero3_at_3_ranks(tmp_path, zero_refs):
    ref_dir, ref = zero_refs[2]
    got = _restore(tmp_path, ref_dir, "as-zero3", 3, [*RESIZE_JOB, "--zero-stage", "3"])
    deltas = {s: abs(got[s] - ref[s]) for s in got}
    print(f"deepspeed zero-2 (4 ranks) -> zero-3 (3 ranks): deltas={deltas}")
    assert all(v <= 1e-6 for v in deltas.values()), deltas


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first use on a host builds DeepSpeed's cpu_adam op (about 75 s)
def test_zero_offload_checkpoint_of_2_ranks_resumes_exactly_at_1_rank(tmp_path, deepspeed):
    cfg = tmp_path / "offload.json"
    cfg.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": False},
                                                     "offload_param": {"device": "cpu", "pin_memory": False}}}))
    args = ["--zero-stage", "3", "--deepspeed-config", str(cfg)]
    ref_dir, ref_log = str(tmp_path / "ref"), str(tmp_path / "ref.jsonl")
    outs = run_segment(2, "deepspeed", ref_dir, steps=6, interval=4, fence=0, loss_log=ref_log, extra=args,
                       timeout=600)
    assert '"offload": ["optimizer", "param"]' in outs[0][1], "the workers did not run with ZeRO-Offload"
    ref = losses(ref_log)
    got = _restore(tmp_path, ref_dir, "at1", 1, args)
    deltas = {s: abs(got[s] - ref[s]) for s in got}
    print(f"deepspeed zero-3 offload 2 -> 1: deltas={deltas} ref_loss6={ref[6]:.6f}")
    assert all(v <= 1e-6 for v in deltas.values()), deltas


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_snapshots_of_2_ranks_reshard_from_memory_at_1_rank(tmp_path, deepspeed, stage):
    """Tier 0 at another world size for ZeRO's ranges (ShardedTensors): 2 ranks train 4 steps with a
    snapshot every step into one node's folder; storage is then emptied (as if the job died after the
    step-4 snapshot and before any save), and 1 rank restores step 4 resharded from the two ranks'
    snapshots (``tier: peer``, ``resharded_from: 2``) and trains on: the losses of steps 5 (parameters)
    and 6 (optimizer state) equal the uninterrupted 2-rank run's within 1e-6."""
    args = [*RESIZE_JOB, "--zero-stage", str(stage)]
    shm = str(tmp_path / "shm")
    os.makedirs(shm)
    ref_log = str(tmp_path / "ref.jsonl")
    run_segment(2, "deepspeed", str(tmp_path / "ref"), steps=6, interval=0, fence=0, loss_log=ref_log, extra=args,
                timeout=300)
    run_dir = str(tmp_path / "run")
    run_segment(2, "deepspeed", run_dir, steps=4, interval=0, fence=0, loss_log=str(tmp_path / "a.jsonl"),
                extra=args, timeout=300, memory_dir=shm)
    assert sorted(f for f in os.listdir(shm) if f.startswith("rank-")) == [f"rank-0000{r}-{k}.snap" for r in (0, 1)
                                                                          for k in (0, 1)]
    for d in glob.glob(os.path.join(run_dir, "run", "step-*")):
        shutil.rmtree(d)  # the final save at step 4: gone, so only memory holds step 4
    log = str(tmp_path / "b.jsonl")
    outs = run_segment(1, "deepspeed", run_dir, steps=6, interval=0, fence=1, loss_log=log, extra=args, timeout=300,
                       memory_dir=shm)
    restored = [json.loads(line) for line in outs[0][1].splitlines()
                if line.startswith("{") and '"checkpoint_restored"' in line]
    assert len(restored) == 1 and restored[0]["tier"] == "peer" and restored[0]["resharded_from"] == 2, restored
    assert restored[0]["step"] == 4 and restored[0]["needed"] == [0, 1]
    ref, got = losses(ref_log), losses(log)
    assert sorted(got) == [5, 6]
    deltas = {s: abs(got[s] - ref[s]) for s in got}
    print(f"deepspeed zero-{stage} 2 ranks -> 1 from memory: deltas={deltas}")
    assert all(v <= 1e-6 for v in deltas.values()), deltas
