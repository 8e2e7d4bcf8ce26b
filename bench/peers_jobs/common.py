"""What every peer's copy of the tiny job shares (``bench/peers.py``): the model, the data, the global
batch of each step, the arguments and the one JSON line per finished step that the harness reads.

The data is synthetic (``N_SAMPLES`` fixed random vectors labelled by a fixed random projection), so no
job reads a file; sample ids are row indices. A peer without a sampler of its own trains step ``s`` on
``global_batch(s)`` (a seeded permutation per epoch, as ``examples/train_gpt.py`` does) split over the
ranks of the current world as ``ids[rank::world]``; trainguard's job uses its global sample cursor.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

N_SAMPLES = 8192  # 340 steps per epoch: a run of the bench stays in its first epoch
DIM = 32
CLASSES = 8
HIDDEN = 64
SEED = 1234
GLOBAL_BATCH = 24  # divides over 1, 2 and 3 ranks


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="the job ends after this many finished steps")
    p.add_argument("--step-sleep", type=float, default=0.03, help="seconds each step sleeps (stands in for compute)")
    p.add_argument("--ckpt-dir", default="", help="durable checkpoints (peers that keep their own)")
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every K steps")
    p.add_argument("--sample-log", default="", help="trainguard's job: the folder of tests/samples.py's log")
    p.add_argument("--step-log", default="", help="folder of the per-process step logs the harness reads")
    return p


def setup_torch() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(N_SAMPLES, DIM, generator=g)
    y = (x @ torch.randn(DIM, CLASSES, generator=g)).argmax(1)
    return x, y


def model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def optimizer(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3)


_perms: dict[int, list[int]] = {}


def global_batch(step: int) -> list[int]:
    """The ids of finished step ``step`` (1-based) for the jobs without a sampler of their own."""
    per_epoch = N_SAMPLES // GLOBAL_BATCH
    epoch, idx = divmod(step - 1, per_epoch)
    if epoch not in _perms:
        _perms[epoch] = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(SEED * 1000 + epoch)).tolist()
    return _perms[epoch][idx * GLOBAL_BATCH:(idx + 1) * GLOBAL_BATCH]


def loss_of(m: nn.Module, data: tuple[torch.Tensor, torch.Tensor], ids: list[int], share: float = 1.0) -> torch.Tensor:
    """Mean cross-entropy over ``ids``, times ``share`` (a rank's part of the global mean)."""
    x, y = data
    idx = torch.tensor(ids, dtype=torch.long)
    return nn.functional.cross_entropy(m(x[idx]), y[idx]) * share


_log: list = []


def log_step(folder: str, step: int, rank: int, world: int, gen: object, ids: list[int], **extra: object) -> None:
    """One line per rank and finished step in ``folder/steps-<pid>.jsonl`` (a file, not stdout: a launcher
    that forwards its workers' output loses the last lines when it is killed). ``gen`` names the world the
    step belongs to (torchrun: the restart count; trainguard: the rendezvous round; torchft: the quorum
    id), ``ids`` this rank's samples, ``t`` the wall clock when the step finished."""
    if not _log:
        os.makedirs(folder, exist_ok=True)
        _log.append(open(os.path.join(folder, f"steps-{os.getpid()}.jsonl"), "a"))
    _log[0].write(json.dumps({"step": step, "rank": rank, "world": world, "gen": gen, "pid": os.getpid(),
                              "ids": ids, "t": time.time(), **extra}) + "\n")
    _log[0].flush()
