"""The bundled GPT job on the trainguard worker API: emergency checkpoints on notices, async sharded
checkpoints, and exact data resumption at any world size (the global batch stays constant through
gradient accumulation). Runs under ``trainguard run``/``agent`` and under plain ``torchrun`` too.

``--strategy ddp|fsdp|deepspeed`` picks how the model is spread over the ranks (FSDP2 shards per transformer
block; DeepSpeed ZeRO stage ``--zero-stage``, optionally with ``--deepspeed-config FILE``),
``--precision 32|bf16-mixed|16-mixed`` the numeric precision (see docs/strategies.md).
``--loss-log FILE`` makes rank 0 append ``{"step", "loss"}`` with the global-batch loss of *every* step
(all-reduced over the ranks; the strategy tests compare runs with it).
``--sample-log DIR`` makes every rank append, per step, the sample ids of the whole global batch to
``DIR/samples-<pid>.jsonl``, and a ``rolled_back`` record when a vanished peer interrupted the step
(the end-to-end tests check that each id is used exactly once: ``tests/samples.py``), with the step's
wall-clock start and end (``t0``, ``t1``: unix seconds; ``bench/spot_trace.py`` computes the ground-truth
goodput from them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from trainguard.runtime import Runtime
from trainguard.examples.train_gpt import TinyGPT, batch_for, load_corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--sample-sleep", type=float, default=0.0,
                   help="emulated accelerator seconds per sample of this rank's share (slept in 2 ms slices, so a "
                        "stopped process makes no progress in it; the straggler bench)")
    p.add_argument("--sample-log", default="")
    p.add_argument("--loss-log", default="")
    p.add_argument("--strategy", default="ddp", help="ddp | fsdp | deepspeed (ZeRO, see --zero-stage)")
    p.add_argument("--precision", default="32", help="32 | bf16-mixed | 16-mixed")
    p.add_argument("--resume-step", type=int, default=None, help="restore this committed step (default: newest)")
    p.add_argument("--activation-checkpointing", action="store_true", help="fsdp: recompute each block in backward")
    p.add_argument("--meta-init", action="store_true",
                   help="fsdp: build the model on the meta device; fsdp materialises each rank's shards on rt.device")
    p.add_argument("--zero-stage", type=int, default=None, help="deepspeed: ZeRO stage 1 | 2 | 3 (default 2)")
    p.add_argument("--deepspeed-config", default=None, help="deepspeed: a DeepSpeed JSON/YAML config to merge")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rt = Runtime.from_env()
    corpus = load_corpus(args.max_bytes)
    n_samples = (len(corpus) - 1) // args.seq_len
    torch.manual_seed(args.seed)
    if args.meta_init:  # no memory until fsdp shards it: each rank allocates and initialises its shards only
        with torch.device("meta"):
            model = TinyGPT(args.seq_len, args.d_model, args.layers)
    else:  # built on the CPU (the same weights on every device), then moved to this worker's device
        model = TinyGPT(args.seq_len, args.d_model, args.layers).to(rt.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    options: dict[str, object] = {"activation_checkpointing": True} if args.activation_checkpointing else {}
    if args.strategy == "deepspeed":
        options.update(stage=args.zero_stage, config=args.deepspeed_config)
    model, opt = rt.setup(model, opt, dataset_size=n_samples, global_batch=args.global_batch,
                          micro_batch=args.micro_batch, seed=args.seed, tokens_per_sample=args.seq_len,
                          strategy=args.strategy, precision=args.precision, strategy_options=options)
    start = rt.restore(args.resume_step)
    if rt.rank == 0:
        print(json.dumps({"event": "resumed" if start else "started", "step": start, "world_size": rt.world_size,
                          "accum_steps": rt.accum_steps, "strategy": rt.strategy_name}), flush=True)
    samples = open(os.path.join(args.sample_log, f"samples-{os.getpid()}.jsonl"), "a") if args.sample_log else None
    losses = open(args.loss_log, "a") if args.loss_log else None  # rank 0 of each step writes
    reformations = 0
    while rt.step < args.steps:
        t0 = time.perf_counter()
        started = time.time()
        micro = rt.next_batches()
        total = torch.zeros((), device=rt.device)
        for i, ids in enumerate(micro):
            x, y = (t.to(rt.device, non_blocking=True) for t in batch_for(corpus, ids, args.seq_len))
            with rt.accumulating(last=i == len(micro) - 1):
                with rt.autocast():
                    loss = F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1)) / len(micro)
                rt.backward(loss)
                total += loss.detach()
            for _ in range(round(args.sample_sleep * len(ids) / 0.002)):
                time.sleep(0.002)
        rt.optimizer_step(opt)
        opt.zero_grad(set_to_none=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        done, rank, world, rnd = rt.step + 1, rt.rank, rt.world_size, rt.round
        if args.loss_log:  # the global-batch loss: mean of the ranks' (equal-sized) shares
            rt.all_reduce(total, "mean")
        if losses is not None and rank == 0:  # before end_step, as the samples (a redone step logs again)
            losses.write(json.dumps({"step": done, "loss": float(total), "world_size": world}) + "\n")
            losses.flush()
        if samples:  # before end_step: a draining rank exits inside it once the step is committed
            samples.write(json.dumps({"step": done, "rank": rank, "world_size": world, "round": rnd,
                                      "ids": rt.current_batch, "t0": started, "t1": time.time()}) + "\n")
            samples.flush()
        if not rt.end_step():  # a peer vanished mid-step: it is redone (same samples) in the re-formed world
            if samples:
                samples.write(json.dumps({"step": done, "rank": rank, "round": rnd, "rolled_back": True}) + "\n")
                samples.flush()
            continue
        if rank == 0 and (done % args.log_every == 0 or done == args.steps):
            lv = float(total)
            print(json.dumps({"event": "train_step", "step": done, "loss": round(lv, 6), "ppl": round(math.exp(lv), 2),
                              "world_size": world, "step_s": round(time.perf_counter() - t0, 4)}), flush=True)
        if rt.reformations != reformations:  # this process re-formed in place (same pid, new world)
            reformations = rt.reformations
            if rt.rank == 0:
                print(json.dumps({"event": "reformed", "step": rt.step, "world_size": rt.world_size,
                                  "accum_steps": rt.accum_steps, "pid": os.getpid()}), flush=True)
    rt.finish()


if __name__ == "__main__":
    main()
