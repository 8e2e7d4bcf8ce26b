"""The tiny job on the trainguard worker API (``examples/train_gpt_elastic.py`` in miniature): the global
sample cursor, periodic async checkpoints every ``checkpoint.interval`` steps (agent config), emergency
checkpoints on notices, in-place re-formation. ``--sample-log DIR`` writes the records
``tests/samples.py`` checks (every id trained exactly once in the committed lineage)."""

from __future__ import annotations

import json
import os
import time

import common
from trainguard.runtime import Runtime


def main() -> None:
    args = common.parser(__doc__).parse_args()
    common.setup_torch()
    rt = Runtime.from_env()
    data = common.dataset()
    model = common.model()
    opt = common.optimizer(model)
    model, opt = rt.setup(model, opt, dataset_size=common.N_SAMPLES, global_batch=common.GLOBAL_BATCH,
                          micro_batch=4, seed=common.SEED, strategy="ddp")
    rt.restore()
    samples = open(os.path.join(args.sample_log, f"samples-{os.getpid()}.jsonl"), "a") if args.sample_log else None
    while rt.step < args.steps:
        micro = rt.next_batches()
        for i, ids in enumerate(micro):
            with rt.accumulating(last=i == len(micro) - 1):
                rt.backward(common.loss_of(model, data, ids, 1.0 / len(micro)))
        rt.optimizer_step(opt)
        opt.zero_grad(set_to_none=True)
        time.sleep(args.step_sleep)
        done, rank, world, rnd = rt.step + 1, rt.rank, rt.world_size, rt.round
        mine = [i for ids in micro for i in ids]
        if samples:  # before end_step: a draining rank exits inside it once the step is committed
            samples.write(json.dumps({"step": done, "rank": rank, "world_size": world, "round": rnd,
                                      "ids": rt.current_batch}) + "\n")
            samples.flush()
        if not rt.end_step():  # a peer vanished mid-step: redone (same samples) in the re-formed world
            if samples:
                samples.write(json.dumps({"step": done, "rank": rank, "round": rnd, "rolled_back": True}) + "\n")
                samples.flush()
            continue
        common.log_step(args.step_log, done, rank, world, rnd, mine)
    rt.finish()


if __name__ == "__main__":
    main()
