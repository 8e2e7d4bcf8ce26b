"""The bundled byte-level GPT as a plain HF Accelerate script (tier 1: runs unchanged under torchrun).

Nothing trainguard-specific: ``Accelerator()`` reads the torchelastic env (``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and joins a process group (NCCL on
``cuda:LOCAL_RANK`` when there are GPUs, else gloo on the CPU), ``prepare``
wraps model, optimizer and data loader, ``backward`` and ``save_state`` / ``load_state`` do the rest. As
in Accelerate's own examples (``--checkpointing_steps``, ``--resume_from_checkpoint``), the state is
saved to ``<ckpt-dir>/step_<n>`` every ``--ckpt-every`` steps and the newest one is loaded at start
(saved under a temporary name and renamed by the main process once every rank is done, so a
half-written folder is never picked up). Like most Accelerate scripts it does nothing about SIGTERM:
on a preemption notice it just dies, and the run resumes from its last periodic checkpoint (the data
order restarts with the epoch; see docs/strategies.md, "Unmodified scripts").

    trainguard run --nnodes 1:2 --nproc-per-node 1 ... examples/train_accelerate.py --ckpt-dir /tmp/ck

Prints one JSON line per logged step on rank 0: ``{"event": "train_step", "step": ..., "loss": ...}``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shutil
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

try:  # as a module (python -m trainguard.examples.train_accelerate) or as a plain file
    from .train_gpt import TinyGPT, Windows, load_corpus
except ImportError:
    from train_gpt import TinyGPT, Windows, load_corpus  # type: ignore[no-redef]


class Progress:
    """The step counter, checkpointed with ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = int(sd["step"])


def latest(ckpt_dir: str) -> str:
    found = [(int(m.group(1)), d) for d in glob.glob(os.path.join(ckpt_dir, "step_*"))
             if (m := re.fullmatch(r"step_(\d+)", os.path.basename(d)))]
    return max(found)[1] if found else ""


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
    p.add_argument("--ckpt-dir", default="", help="save_state folder ('' = none)")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (tests, demos)")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # cuda:LOCAL_RANK when there are GPUs
    set_seed(args.seed)
    world = accelerator.num_processes
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the world size {world}")

    model = TinyGPT(args.seq_len, args.d_model, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(Windows(load_corpus(args.max_bytes), args.seq_len), batch_size=args.global_batch // world,
                        shuffle=True, drop_last=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    if args.ckpt_dir and (found := latest(args.ckpt_dir)):
        accelerator.load_state(found)
        if accelerator.is_main_process:
            print(json.dumps({"event": "resumed", "step": progress.step, "world_size": world}), flush=True)

    epoch = 0
    while progress.step < args.steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            t0 = time.perf_counter()
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            opt.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            progress.step += 1
            done = progress.step
            if args.ckpt_dir and done % args.ckpt_every == 0:
                tmp = os.path.join(args.ckpt_dir, f"tmp_step_{done}")
                accelerator.save_state(tmp)
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    final = os.path.join(args.ckpt_dir, f"step_{done}")
                    shutil.rmtree(final, ignore_errors=True)  # left by an earlier run that went further
                    os.replace(tmp, final)
                    for old in sorted(glob.glob(os.path.join(args.ckpt_dir, "step_*")),
                                      key=lambda d: int(d.rsplit("_", 1)[1]))[:-args.keep]:
                        shutil.rmtree(old, ignore_errors=True)
            if accelerator.is_main_process and (done % args.log_every == 0 or done == args.steps):
                lv = loss.item()
                print(json.dumps({"event": "train_step", "step": done, "loss": round(lv, 4),
                                  "ppl": round(math.exp(lv), 2), "world_size": world,
                                  "step_s": round(time.perf_counter() - t0, 4)}), flush=True)
            if done >= args.steps:
                break
        epoch += 1
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
