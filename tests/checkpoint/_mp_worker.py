"""One rank of a small DDP job used by the multi-process checkpoint tests (run as a script).

``save`` phase (world W): train 3 steps with DDP over gloo, save step 3 asynchronously, keep training
while it persists, then record the expected state (at save time), the next step's loss and
parameters, and what each rank's RNGs draw next.
``restore`` phase (world W'): restore into a fresh model/optimizer and check all of it bit for bit.
Exit code 0 means every check passed; failures are printed and written to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import traceback

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.state import ModelOptimizerState, TrainerState, reseed

SAVE_STEP = 3
GLOBAL_BATCH = 12
SEED = 1234


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(1).item())]


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt)
    return copy.deepcopy({"model": msd, "optim": osd})


def next_step(model: torch.nn.Module, opt_state: dict) -> tuple[float, dict]:
    """Loss of step SAVE_STEP+1 on the full global batch, and the parameters after that step."""
    m = copy.deepcopy(model.module if isinstance(model, DDP) else model)
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    o.load_state_dict(copy.deepcopy(opt_state))  # Adam keeps (and bumps) the given "step" tensors
    x, y = batch(SAVE_STEP + 1)
    loss = loss_fn(m, x, y)
    loss.backward()
    o.step()
    return loss.item(), {k: v.detach().clone() for k, v in m.state_dict().items()}


def assert_equal(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "restore"], required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--opts", default="{}")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    cfg = CheckpointConfig(url=a.url, storage_options=json.loads(a.opts), keep_last=2, retry_deadline_s=30)
    mgr = CheckpointManager(cfg, "run", rank=a.rank, world_size=a.world)
    model: torch.nn.Module = make_model()
    if a.world > 1:
        model = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = TrainerState(seed=SEED, config_fingerprint="cfg-abc")
    state = {"model": ModelOptimizerState(model, opt), "trainer": trainer}
    out = a.out
    try:
        if a.phase == "save":
            random.seed(a.rank)
            np.random.seed(a.rank)
            torch.manual_seed(100 + a.rank)
            for step in range(1, SAVE_STEP + 1):
                x, y = batch(step)
                opt.zero_grad()
                loss_fn(model, x[a.rank::a.world], y[a.rank::a.world]).backward()
                opt.step()
            trainer.step = SAVE_STEP
            trainer.cursor = {"epoch": 0, "samples": SAVE_STEP * GLOBAL_BATCH}
            expected = full_state(model, opt)
            mgr.save(SAVE_STEP, state)
            rng_after = draws()  # the RNG stream right after the state was captured
            # Keep training (mutating parameters and optimizer state) while the save persists.
            x, y = batch(99)
            for _ in range(2):
                opt.zero_grad()
                loss_fn(model, x[a.rank::a.world], y[a.rank::a.world]).backward()
                opt.step()
            assert mgr.wait(timeout=120) == SAVE_STEP
            assert not torch.equal(full_state(model, opt)["model"]["0.weight"], expected["model"]["0.weight"])
            with open(f"{out}/rng_r{a.rank}.json", "w") as f:
                json.dump(rng_after, f)
            if a.rank == 0:
                base = make_model()
                base_opt = torch.optim.Adam(base.parameters(), lr=0.01)
                given = copy.deepcopy(expected)  # set_state_dict may keep references to the given tensors
                set_state_dict(base, base_opt, model_state_dict=given["model"], optim_state_dict=given["optim"])
                loss, params = next_step(base, base_opt.state_dict())
                torch.save({"state": expected, "next_loss": loss, "next_params": params}, f"{out}/expected.pt")
        else:
            restored = mgr.restore(state)
            assert restored == SAVE_STEP, f"restored {restored}, expected {SAVE_STEP}"
            exp = torch.load(f"{out}/expected.pt", weights_only=False)
            assert_equal(exp["state"], full_state(model, opt), "state")
            assert trainer.step == SAVE_STEP and trainer.cursor == {"epoch": 0, "samples": SAVE_STEP * GLOBAL_BATCH}
            assert trainer.config_fingerprint == "cfg-abc" and trainer.saved_world_size == 2
            got = draws()
            if os.path.exists(f"{out}/rng_r{a.rank}.json"):
                assert trainer.rng_restored is True
                with open(f"{out}/rng_r{a.rank}.json") as f:
                    assert got == json.load(f), f"rank {a.rank}: RNG streams differ after restore"
            else:
                assert trainer.rng_restored is False
                reseed(SEED, SAVE_STEP, a.rank)
                assert got == draws(), f"rank {a.rank}: reseed not deterministic"
            plain = model.module if isinstance(model, DDP) else model
            loss, params = next_step(plain, opt.state_dict())
            assert loss == exp["next_loss"], f"next-step loss {loss!r} != {exp['next_loss']!r}"
            assert_equal(exp["next_params"], params, "next_params")
        with open(f"{out}/ok_{a.phase}_{a.world}_r{a.rank}", "w") as f:
            f.write("ok")
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        mgr.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
