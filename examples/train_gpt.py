"""A small, real, deterministic training job: a byte-level GPT on the Python standard library's sources.

Plain DDP, runnable unchanged under ``torchrun`` (this is the "unmodified torchrun script" tier): it
reads the torchelastic env, saves a ``torch.save`` checkpoint every ``--ckpt-every`` steps (what
users do today) and resumes from it. ``examples/train_gpt_elastic.py`` is the same job on the
trainguard worker API (emergency checkpoints, exact data resumption at any world size).

Every machine has the text (``os.path.dirname(os.__file__)``), so no download is needed.
Prints one JSON line per logged step on rank 0: ``{"event": "train_step", "step": ..., "loss": ...}``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The stdlib's top-level ``.py`` files, sorted by name, concatenated, as a uint8 tensor."""
    root = os.path.dirname(os.__file__)
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as fh:
            data += fh.read()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8).clone()


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Byte-level decoder-only transformer (vocabulary 256)."""

    def __init__(self, seq_len: int, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq_len, seq_len), float("-inf")), 1), persistent=False)

    def reset_parameters(self) -> None:
        """(Re)compute the causal mask: after ``to_empty`` (a meta-device model materialised by fsdp) it
        holds garbage, and it is in no checkpoint (non-persistent). The submodules reset their own weights."""
        n = self.mask.shape[0]
        with torch.no_grad():
            self.mask.copy_(torch.triu(torch.full((n, n), float("-inf"), device=self.mask.device), 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def batch_for(corpus: torch.Tensor, ids: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample id i is the window starting at byte ``i * seq_len``; targets are shifted by one."""
    starts = torch.tensor(ids, dtype=torch.long) * seq_len
    offs = torch.arange(seq_len + 1)
    win = corpus[(starts[:, None] + offs[None, :])].long()
    return win[:, :-1], win[:, 1:]


class Windows(torch.utils.data.Dataset):
    """Map-style dataset for DataLoader-based scripts (the Fabric and Accelerate examples): sample ``i``
    is the ``seq_len + 1`` byte window starting at ``i * seq_len`` (input, target)."""

    def __init__(self, corpus: torch.Tensor, seq_len: int) -> None:
        self.corpus, self.seq_len = corpus, seq_len

    def __len__(self) -> int:
        return (len(self.corpus) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch_for(self.corpus, [i], self.seq_len)
        return x[0], y[0]


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
    p.add_argument("--ckpt-dir", default="", help="torch.save checkpoint folder ('' = none)")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (tests, demos)")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    distributed = "WORLD_SIZE" in os.environ
    if backend == "nccl":  # this worker's GPU, current before the process group exists (as torchrun scripts should)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if distributed:
        dist.init_process_group(backend)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if backend == "nccl" else "cpu")
    if rank == 0 and distributed:  # the world exists: what follows (model build, torch.load) is the restore
        print(json.dumps({"event": "world_formed", "world_size": world}), flush=True)

    corpus = load_corpus(args.max_bytes)
    n_samples = (len(corpus) - 1) // args.seq_len
    torch.manual_seed(args.seed)
    model = TinyGPT(args.seq_len, args.d_model, args.layers).to(device)
    ddp = nn.parallel.DistributedDataParallel(model) if distributed else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start = 0
    ckpt = os.path.join(args.ckpt_dir, "checkpoint.pt") if args.ckpt_dir else ""
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
        if rank == 0:
            print(json.dumps({"event": "resumed", "step": start, "world_size": world}), flush=True)

    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the world size {world}")
    per_rank = args.global_batch // world
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        # Same global batch at every world size: a seeded permutation per epoch, sliced per step.
        per_epoch = n_samples // args.global_batch
        epoch, idx = divmod(step, per_epoch)
        perm = torch.randperm(n_samples, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        ids = perm[idx * args.global_batch:(idx + 1) * args.global_batch].tolist()
        x, y = batch_for(corpus, ids[rank * per_rank:(rank + 1) * per_rank], args.seq_len)
        logits = ddp(x.to(device))
        loss = F.cross_entropy(logits.reshape(-1, 256), y.to(device).reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        done = step + 1
        if ckpt and done % args.ckpt_every == 0 and rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": done}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        if rank == 0 and (done % args.log_every == 0 or done == args.steps):
            lv = loss.item()
            print(json.dumps({"event": "train_step", "step": done, "loss": round(lv, 4), "ppl": round(math.exp(lv), 2),
                              "world_size": world, "step_s": round(time.perf_counter() - t0, 4), "t": time.time()}),
                  flush=True)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
