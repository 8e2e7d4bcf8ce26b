"""The bundled byte-level GPT as a plain Lightning Fabric script (tier 1: runs unchanged under torchrun).

Nothing trainguard-specific: it reads the torchelastic env the way a Fabric script launched by
``torchrun`` does (``devices`` = ``LOCAL_WORLD_SIZE``, ``num_nodes`` = ``WORLD_SIZE // LOCAL_WORLD_SIZE``,
Fabric's ``TorchElasticEnvironment`` takes ranks and the rendezvous address from the env), uses
``setup`` / ``setup_dataloaders`` / ``backward`` / ``save`` / ``load``, saves ``<ckpt-dir>/checkpoint.ckpt``
every ``--ckpt-every`` steps and resumes from it. Like most Fabric scripts it does nothing about
SIGTERM: on a preemption notice it just dies, and the run resumes from its last periodic checkpoint
(the data order restarts with the epoch; see docs/strategies.md, "Unmodified scripts").

    trainguard run --nnodes 1:2 --nproc-per-node 1 ... examples/train_fabric.py --ckpt-dir /tmp/ck

Prints one JSON line per logged step on rank 0: ``{"event": "train_step", "step": ..., "loss": ...}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric
from torch.utils.data import DataLoader

try:  # as a module (python -m trainguard.examples.train_fabric) or as a plain file
    from .train_gpt import TinyGPT, Windows, load_corpus
except ImportError:
    from train_gpt import TinyGPT, Windows, load_corpus  # type: ignore[no-redef]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step, all ranks together")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default="", help="Fabric checkpoint folder ('' = none)")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (tests, demos)")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = max(1, int(os.environ.get("WORLD_SIZE", "1")) // local_world)
    # One GPU per worker when there are GPUs (Fabric picks cuda:LOCAL_RANK), else the CPU.
    fabric = Fabric(accelerator="cuda" if torch.cuda.is_available() else "cpu", strategy="ddp", devices=local_world,
                    num_nodes=nodes)
    fabric.launch()  # under torchrun (or trainguard): the processes exist already; joins the process group
    fabric.seed_everything(args.seed)
    world = fabric.world_size

    model = TinyGPT(args.seq_len, args.d_model, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt = fabric.setup(model, opt)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the world size {world}")
    loader = fabric.setup_dataloaders(DataLoader(
        Windows(load_corpus(args.max_bytes), args.seq_len), batch_size=args.global_batch // world,
        shuffle=True, drop_last=True))

    state = {"model": model, "optimizer": opt, "step": 0}
    ckpt = os.path.join(args.ckpt_dir, "checkpoint.ckpt") if args.ckpt_dir else ""
    if ckpt and os.path.exists(ckpt):
        fabric.load(ckpt, state)
        if fabric.is_global_zero:
            print(json.dumps({"event": "resumed", "step": state["step"], "world_size": world}), flush=True)

    epoch = 0
    while state["step"] < args.steps:
        loader.sampler.set_epoch(epoch)  # DistributedSampler, added by setup_dataloaders
        for x, y in loader:
            t0 = time.perf_counter()
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            fabric.backward(loss)
            opt.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            state["step"] += 1
            done = state["step"]
            if ckpt and done % args.ckpt_every == 0:
                fabric.save(ckpt, state)  # rank 0 writes, then every rank meets at a barrier
            if fabric.is_global_zero and (done % args.log_every == 0 or done == args.steps):
                lv = loss.item()
                print(json.dumps({"event": "train_step", "step": done, "loss": round(lv, 4),
                                  "ppl": round(math.exp(lv), 2), "world_size": world,
                                  "step_s": round(time.perf_counter() - t0, 4)}), flush=True)
            if done >= args.steps:
                break
        epoch += 1
    fabric.barrier()


if __name__ == "__main__":
    main()
