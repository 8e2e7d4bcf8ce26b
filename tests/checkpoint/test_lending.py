"""Tier 2 fed from tier 0: a periodic save at the step of the snapshot just taken stages the tensors the
snapshot holds from its slot, in the persist thread, instead of copying them from the training tensors
on the training thread; the slot it reads is not overwritten until that copy is done."""

from __future__ import annotations

import copy
import os
import threading
import time

import pytest
import torch

from tests.checkpoint.test_memory import W, _job, _train, keep_sigterm_handler  # noqa: F401 - a fixture
from tests.runtime.test_finishing import train_loop
from trainguard.checkpoint import memory as mem
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.timeout(60)


def _n_tensors(m: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    return len(list(m.parameters())) + sum(isinstance(v, torch.Tensor) for s in opt.state.values() for v in s.values())


def test_the_save_stages_from_the_snapshot_in_the_persist_thread(tmp_path):
    """What the save writes is the snapshot's bytes, copied by the persist thread once the snapshot's
    own background half is done. Shown by changing the training tensors after the snapshot (which the
    runtime never does before such a save): the checkpoint holds the snapshot's values, and the save
    returned before any of them was copied."""
    from tests.checkpoint.test_memory import _held_pool

    cfg = CheckpointConfig(url=f"memory://feeds-{os.getpid()}-{id(tmp_path)}", async_save=True)
    m, opt, trainer, state = _job()
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    _train(m, opt, trainer, 1)
    want_m, want_o = copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict()["state"])
    tier._pool, release, entered = _held_pool()  # the snapshot's commit waits: so does the save's copy
    tier.snapshot(1, state, world=W)
    assert entered.wait(30)
    src = tier.lend(1)
    assert src is not None
    with CheckpointManager(cfg, "run", rank=0, world_size=1) as mgr:
        done = mgr.save(1, state, kind="periodic", source=src)
        assert mgr._stager.from_snapshot == _n_tensors(m, opt) == 16  # every parameter and Adam tensor (step too)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)  # the training tensors move on; the save must not see it
            for s in opt.state.values():
                s["exp_avg"].add_(1.0)
        time.sleep(0.2)
        assert not done.done() and not src.released  # the persist thread waits for the snapshot's commit
        release.set()
        r = done.result(30)
        assert r.step == 1 and src.released
        assert r.stage_s >= 0.2 and r.persist_s < r.stage_s  # the copy waited >= 0.2 s: staging, not persisting
        m2, opt2, trainer2, state2 = _job(seed=9)
        assert mgr.restore(state2, 1) == 1
    assert all(torch.equal(v, want_m[k]) for k, v in m2.state_dict().items())
    got_o = opt2.state_dict()["state"]
    assert all(torch.equal(got_o[i][k], want_o[i][k]) for i in want_o for k in want_o[i])
    assert trainer2.step == 1
    tier.close()


def test_the_slot_a_save_reads_is_not_overwritten_before_it_is_copied(tmp_path):
    m, opt, trainer, state = _job()
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    tier.background_commit = False
    _train(m, opt, trainer, 1)
    tier.snapshot(1, state, world=W)
    assert tier.lend(2) is None  # not the newest snapshot's step
    src = tier.lend(1)
    assert src is not None and tier.lend(1) is None  # held already
    _train(m, opt, trainer, 2)
    tier.snapshot(2, state, world=W)  # the other slot: goes ahead
    third = threading.Thread(target=lambda: (_train(m, opt, trainer, 3), tier.snapshot(3, state, world=W)))
    third.start()
    time.sleep(0.3)
    assert third.is_alive()  # snapshot 3 would overwrite step 1's slot: it waits for the save's copy
    assert [s for s, _ in tier.available(state)] == [2, 1]
    src.release()
    third.join(30)
    assert not third.is_alive() and [s for s, _ in tier.available(state)] == [3, 2]
    # a snapshot this process did not just take is not lent: after a load, an invalidation, a rebind
    tier.load(2, state, world=W)
    assert tier.lend(2) is None and tier.lend(3) is None
    tier.snapshot(4, state, world=W)
    tier.invalidate()
    assert tier.lend(4) is None
    tier.close()


def test_the_manager_releases_a_source_it_does_not_use(tmp_path):
    cfg = CheckpointConfig(url=f"memory://feeds-rel-{os.getpid()}-{id(tmp_path)}", async_save=True)
    m, opt, trainer, state = _job()
    tier = mem.MemoryTier(str(tmp_path), rank=0, world_size=1)
    tier.background_commit = False
    _train(m, opt, trainer, 1)
    with CheckpointManager(cfg, "run", rank=0, world_size=1) as mgr:
        mgr.save(1, state, block=True)
        tier.snapshot(1, state, world=W)
        src = tier.lend(1)
        assert mgr.save(1, state, source=src).result().skipped  # this world committed step 1 already
        assert src.released
        _train(m, opt, trainer, 2)
        tier.snapshot(2, state, world=W)
        src = tier.lend(2)
        assert mgr.save(2, state, block=True, source=src).result().step == 2  # a blocking save uses it too
        assert src.released and mgr._stager.from_snapshot == 16
    tier.close()


def _train_rt(url: str, folder: str, steps: int):
    from trainguard.runtime import Runtime

    os.makedirs(folder, exist_ok=True)
    rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_id="r", rdzv_round=0, memory_dir=folder,
                 checkpoint=CheckpointConfig(url=url, interval="3", memory_interval_steps=1, memory_max_overhead=0,
                                             async_save=True))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt, dataset_size=32, global_batch=4, micro_batch=2, seed=1)
    train_loop(rt, model, opt, steps)
    return rt, model


def test_runtime_periodic_saves_are_fed_from_the_snapshot(tmp_path, keep_sigterm_handler):
    from structlog.testing import capture_logs

    from trainguard.checkpoint.state import ModelOptimizerState, TrainerState

    url = str(tmp_path / "ckpt")
    with capture_logs() as logs:
        rt, _ = _train_rt(url, str(tmp_path / "node"), 7)
    staged = [e for e in logs if e["event"] == "checkpoint_staged"]
    assert [e["step"] for e in staged] == [3, 6]
    assert all(e["from_snapshot"] == 8 for e in staged), staged  # weight, bias, and Adam's 3 tensors of each
    rt.finish(barrier=False)
    ref, ref_model = _train_rt(str(tmp_path / "ref"), str(tmp_path / "node2"), 6)  # the same run to step 6
    m2 = torch.nn.Linear(4, 1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    with CheckpointManager(CheckpointConfig(url=url), "run", rank=0, world_size=1) as mgr:
        assert [(c.step, c.kind) for c in mgr.list()] == [(3, "periodic"), (6, "periodic"), (7, "final")]
        assert mgr.restore({"app": ModelOptimizerState(m2, opt2), "trainer": TrainerState(seed=1)}, 6) == 6
    assert torch.equal(m2.weight, ref_model.weight) and torch.equal(m2.bias, ref_model.bias)
    ref.finish(barrier=False)


def _fsdp_rank(rank: int, world: int, init: str, folder: str, url: str, out: str) -> None:
    """One FSDP2 rank (run by :func:`test_fsdp2_ranks_stage_their_dtensor_shards_from_the_snapshot`):
    train, snapshot, save fed from the snapshot, restore that save into a fresh model; report."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainguard.checkpoint.state import ModelOptimizerState, TrainerState

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def job(seed: int):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        fully_shard(m, mesh=mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
        trainer = TrainerState(seed=3, cursor={"epoch": 0, "consumed": 0})
        return m, opt, trainer, {"app": ModelOptimizerState(m, opt), "trainer": trainer}

    m, opt, trainer, state = job(0)
    for step in (1, 2):
        _train(m, opt, trainer, step)
    tier = mem.MemoryTier(folder, rank=rank, world_size=world)
    tier.snapshot(2, state, world="job/0")
    src = tier.lend(2)
    with CheckpointManager(CheckpointConfig(url=url, async_save=True), "run", rank=rank, world_size=world,
                           strategy="fsdp") as mgr:
        r = mgr.save(2, state, source=src).result(60)
        fed = mgr._stager.from_snapshot
    want = {k: v.to_local().clone() for k, v in m.state_dict().items()}
    want_o = {i: {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in s.items()}
              for i, s in enumerate(opt.state.values())}
    m2, opt2, trainer2, state2 = job(5)
    with CheckpointManager(CheckpointConfig(url=url), "run", rank=rank, world_size=world, strategy="fsdp") as mgr:
        restored = mgr.restore(state2, 2)
    got_o = {i: {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in s.items()}
             for i, s in enumerate(opt2.state.values())}
    with open(out, "w") as fh:
        json.dump({"step": r.step, "released": src.released, "fed": fed, "restored": restored,
                   "tensors": len(list(m.parameters())) + sum(len(s) for s in opt.state.values()),
                   "model_equal": all(torch.equal(v.to_local(), want[k]) for k, v in m2.state_dict().items()),
                   "optim_equal": all(torch.equal(got_o[i][k], want_o[i][k]) for i in want_o for k in want_o[i]),
                   "trainer_step": trainer2.step}, fh)
    tier.close()
    dist.barrier()
    os._exit(0)  # no C++ teardown of the mesh's gloo groups at exit


@pytest.mark.timeout(120)
def test_fsdp2_ranks_stage_their_dtensor_shards_from_the_snapshot(tmp_path):
    """Over a real gloo world of 2 with FSDP2: the durable save's DTensors (``get_state_dict``) are the
    snapshot's shards (``state_dict()``), so every one is staged from the slot, and the checkpoint
    restores the state exactly."""
    import json

    from tests.harness import run_ranks

    init, url = f"file://{tmp_path}/store", f"file://{tmp_path}/ckpt"
    outs = [str(tmp_path / f"r{r}.json") for r in range(2)]
    for r in range(2):
        os.makedirs(tmp_path / f"node{r}")
    codes, logs = run_ranks("tests.checkpoint.test_lending",
                            [[str(r), "2", init, str(tmp_path / f"node{r}"), url, outs[r]] for r in range(2)], timeout=100)
    assert codes == [0, 0], "".join(log[-3000:] for log in logs)
    for o in outs:
        got = json.load(open(o))
        assert got["step"] == 2 and got["released"] and got["restored"] == 2 and got["trainer_step"] == 2, got
        assert got["fed"] == got["tensors"] == 16, got  # 4 parameters; Adam's step, exp_avg, exp_avg_sq of each
        assert got["model_equal"] and got["optim_equal"], got


if __name__ == "__main__":
    import sys

    _fsdp_rank(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7])
