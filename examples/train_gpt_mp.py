"""The bundled GPT, model-parallel, on the trainguard worker API: tensor parallelism on attention and MLP
within groups of ``--tp-size`` ranks, FSDP2 over the data-parallel dimension, optionally
``torch.compile`` per block (``strategy="model_parallel"``, see docs/strategies.md). The data-parallel
size (world / tp size) grows and shrinks with the nodes; checkpoints reshard to it.

The model is ``train_gpt.TinyGPT`` with an attention whose query, key, value and output projections
are separate ``nn.Linear`` layers (``nn.MultiheadAttention`` packs them into one weight, which
``ColwiseParallel`` cannot split by head): column-wise parallel q/k/v and MLP input, row-wise parallel
attention output and MLP output, so each rank of a tensor-parallel group holds ``heads / tp`` heads
and ``4d / tp`` MLP features. Same corpus, samples and flags as ``train_gpt_elastic.py``, plus
``--tp-size N`` and ``--compile none|inductor|aot_eager``. ``--sample-log DIR`` records, per rank and
step, the whole global batch as ``train_gpt_elastic.py`` does (``tests/samples.py``) plus the rank's
data-parallel rank and share (``mine``: the ranks of one tensor-parallel group train on the same
samples); ``--loss-log FILE`` as in ``train_gpt_elastic.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainguard.examples.train_gpt import batch_for, load_corpus
from trainguard.runtime import Runtime


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank computes only its own heads.
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class ParallelGPT(nn.Module):
    """Byte-level decoder-only transformer (vocabulary 256), tensor-parallel friendly."""

    def __init__(self, seq_len: int, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq_len, seq_len), float("-inf")), 1), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def parallelize(compile_backend: str = "none"):
    """The ``parallelize_fn`` for :class:`ParallelGPT`: TP on attention and MLP over the mesh's
    ``tensor_parallel`` dimension, ``block.compile()`` when asked, FSDP2 per block and on the root over
    ``data_parallel``."""

    def fn(model: ParallelGPT, mesh) -> ParallelGPT:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
        if tp.size() > 1:
            plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                    "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
            for block in model.blocks:
                parallelize_module(block, tp, plan)
        if compile_backend != "none":
            for block in model.blocks:
                block.compile(backend=compile_backend)
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
        return model

    fn.__qualname__ = f"parallelize(compile_backend={compile_backend!r})"
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--sample-log", default="")
    p.add_argument("--loss-log", default="")
    p.add_argument("--strategy", default="model_parallel", choices=["model_parallel"],
                   help="always model_parallel (the flag exists for the shared test harness)")
    p.add_argument("--tp-size", type=int, default=2, help="tensor-parallel degree (divides nproc per node)")
    p.add_argument("--compile", default="none", choices=["none", "inductor", "aot_eager"],
                   help="torch.compile backend per transformer block")
    p.add_argument("--precision", default="32", help="32 | bf16-mixed")
    p.add_argument("--resume-step", type=int, default=None, help="restore this committed step (default: newest)")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rt = Runtime.from_env()
    corpus = load_corpus(args.max_bytes)
    n_samples = (len(corpus) - 1) // args.seq_len
    torch.manual_seed(args.seed)
    model = ParallelGPT(args.seq_len, args.d_model, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    try:
        model, opt = rt.setup(model, opt, dataset_size=n_samples, global_batch=args.global_batch,
                              micro_batch=args.micro_batch, seed=args.seed, tokens_per_sample=args.seq_len,
                              strategy="model_parallel", precision=args.precision,
                              strategy_options={"parallelize_fn": parallelize(args.compile), "tp_size": args.tp_size})
    except ValueError as e:  # a setting that cannot work at this world size: one clear line, no traceback
        print(json.dumps({"event": "setup_refused", "rank": rt.rank, "world_size": rt.world_size, "error": str(e)}),
              flush=True)
        raise SystemExit(2) from None
    start = rt.restore(args.resume_step)
    if rt.rank == 0:
        print(json.dumps({"event": "resumed" if start else "started", "step": start, "world_size": rt.world_size,
                          "dp_size": rt.dp_size, "tp_size": args.tp_size, "accum_steps": rt.accum_steps,
                          "strategy": rt.strategy_name}), flush=True)
    samples = open(os.path.join(args.sample_log, f"samples-{os.getpid()}.jsonl"), "a") if args.sample_log else None
    losses = open(args.loss_log, "a") if args.loss_log else None  # rank 0 of each step writes
    reformations = rt.reformations
    while rt.step < args.steps:
        t0 = time.perf_counter()
        micro = rt.next_batches()
        total = torch.zeros(())
        for i, ids in enumerate(micro):
            x, y = batch_for(corpus, ids, args.seq_len)
            with rt.accumulating(last=i == len(micro) - 1):
                with rt.autocast():
                    loss = F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1)) / len(micro)
                rt.backward(loss)
                total += loss.detach()
        rt.optimizer_step(opt)
        opt.zero_grad(set_to_none=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        done, rank, world, rnd = rt.step + 1, rt.rank, rt.world_size, rt.round
        if args.loss_log:  # every rank of a TP group holds its share's loss: the mean over all ranks
            rt.all_reduce(total, "mean")
        if losses is not None and rank == 0:  # before end_step: a draining rank exits inside it
            losses.write(json.dumps({"step": done, "loss": float(total), "world_size": world,
                                     "dp_size": rt.dp_size}) + "\n")
            losses.flush()
        if samples:  # the whole global batch (tests/samples.py) and this rank's data-parallel share of it
            samples.write(json.dumps({"step": done, "rank": rank, "world_size": world, "round": rnd,
                                      "dp_rank": rt.dp_rank, "dp_size": rt.dp_size, "ids": rt.current_batch,
                                      "mine": [i for ids in micro for i in ids]}) + "\n")
            samples.flush()
        if done == start + 1 and args.compile != "none" and rank == 0:  # what the first step compiled
            from torch._dynamo.utils import counters

            print(json.dumps({"event": "compiled", "backend": args.compile,
                              "graphs": int(counters["stats"]["unique_graphs"])}), flush=True)
        if not rt.end_step():  # a peer vanished mid-step: it is redone (same samples) in the re-formed world
            if samples:
                samples.write(json.dumps({"step": done, "rank": rank, "round": rnd, "rolled_back": True}) + "\n")
                samples.flush()
            continue
        if rank == 0 and (done % args.log_every == 0 or done == args.steps):
            lv = float(total)
            print(json.dumps({"event": "train_step", "step": done, "loss": round(lv, 6), "ppl": round(math.exp(lv), 2),
                              "world_size": world, "dp_size": rt.dp_size,
                              "step_s": round(time.perf_counter() - t0, 4)}), flush=True)
        if rt.reformations != reformations:  # this process re-formed in place (same pid, new world and mesh)
            reformations = rt.reformations
            if rt.rank == 0:
                print(json.dumps({"event": "reformed", "step": rt.step, "world_size": rt.world_size,
                                  "dp_size": rt.dp_size, "tp_size": args.tp_size, "accum_steps": rt.accum_steps,
                                  "pid": os.getpid()}), flush=True)
    rt.finish()


if __name__ == "__main__":
    main()
