"""Host memory of a DeepSpeed checkpoint save and load, per rank: O(shard) ranges vs the full-state path
(benchmark, not a timed test).

Starts ``--world`` local worker processes (gloo, torchrun-style env, no agent) per ZeRO stage in
``--stages`` (default 2 and 3). Each builds the same MLP stack (``--layers`` blocks of ``--hidden`` x
4 ``--hidden`` and back; the defaults give 100.7 M parameters), wraps it with the ``deepspeed``
strategy (fp32, AdamW), trains one step, then measures through :class:`CheckpointManager` (the path
``Runtime`` uses: staging into reusable host buffers, ``dcp.save``, manifest commit; blocking), in
this order and on the same engine:

* ``save``  the strategy's state (:mod:`trainguard.strategies.deepspeed_state`: each rank's ZeRO
            ranges, views of the live partitions);
* ``load``  of that checkpoint, into the engine with its optimizer state dropped first (as after a
            restart: the load allocates it, as the first step would);
* ``full_save`` / ``full_load``  the same with :class:`FullState`, the strategy's state before issue 16
            (kept here as the baseline): full fp32 parameters and optimizer states per parameter on
            every rank, gathered with ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``
            and written back with ``safe_set_full_*``.

For each, the peak growth of the process's resident memory over the operation (``tests/fixtures/hostmem.py``,
what the CI memory-ratio check uses: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, with
the heap trimmed before; a 2 ms RSS sampler where that reset is not allowed) is divided by ``full state /
world`` = 12 bytes x parameters (fp32 weight, exp_avg, exp_avg_sq) / world size. Target (issue 44): <= 1.1
for ``save`` (one staged copy: the save is the first, so it allocates the staging buffers) and ``load``. The figure is
the maximum over ranks. Prints a table, writes JSON (``--json PATH``): per stage and operation the
per-rank growth in bytes and the ratio, plus the model size and the checkpoint bytes.

Memory (defaults, 4 ranks): about 1.5 GB per rank at rest and up to 2.4 GB more per rank during the
full-state save: hold ~16 GB free. Time: about 4 minutes on 2 CPU cores.

    OMP_NUM_THREADS=1 .venv/bin/python bench/deepspeed_memory.py --json deepspeed_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.fixtures.gloo_world import join, run_world  # noqa: E402
from tests.fixtures.hostmem import PeakGrowth, mlp_stack  # noqa: E402  (the memory-ratio check's measurement)

OPS = ("save", "load", "full_save", "full_load")
TARGET = 1.1
"""Save and load, growth / share (issue 44; issue 16 asked for 1.5)."""


# ---- the full-state baseline (the strategy's checkpoint state before issue 16) -------------------------

class FullState:
    """Full fp32 parameters and optimizer states per parameter name on every rank (gathered with
    DeepSpeed's tensor-fragment API), as ``DeepSpeedState`` did before issue 16. Same collectives."""

    def __init__(self, strategy: Any, engine: Any) -> None:
        self.strategy = strategy
        self.engine = engine
        self.parts = strategy._parts
        self.probe = strategy._probe

    def state_dict(self) -> dict[str, Any]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self.parts.ensure_optimizer_state(self.probe)
        params = {n: safe_get_full_fp32_param(p).detach().cpu() for n, p in self.parts.params}
        optim = {n: {k: safe_get_full_optimizer_state(p, k).detach().cpu() for k in self.probe.element_keys}
                 for n, p in self.parts.params}
        state = self.parts.torch_optimizer.state
        scalars = {}
        for i, flat in self.parts.flat_partitions():
            scalars.setdefault(str(i), {k: (v.clone() if hasattr(v, "clone") else v) for k, v in state[flat].items()
                                        if k not in self.probe.element_keys})
        return {"params": params, "optim": optim, "optim_scalars": scalars}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        import deepspeed
        import torch
        import torch.distributed as dist
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        for name, p in self.parts.params:
            full = sd["params"][name]
            if hasattr(p, "ds_id"):
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if dist.get_rank() == 0:
                        with torch.no_grad():
                            p.data.copy_(full.to(p.dtype))
            else:
                with torch.no_grad():
                    p.data.copy_(full.to(p.dtype))
            safe_set_full_fp32_param(p, full)
            for k in self.probe.element_keys:
                safe_set_full_optimizer_state(p, sd["optim"][name][k], k)


def _drop_optimizer_state(strategy: Any) -> None:
    """Forget the optimizer state, as a restarted process has none before its restore."""
    parts = strategy._parts
    parts.torch_optimizer.state.clear()
    for _, p in parts.params:
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None:
            mapping.optim_fragment = {}
    if hasattr(parts.zero, "_hp_optimizer_states_linked"):
        parts.zero._hp_optimizer_states_linked = False


# ---- one worker --------------------------------------------------------------------------------------

def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.strategies import get_strategy

    rank, world = join()
    h = a.hidden
    model = mlp_stack(h, a.layers)
    n_params = sum(p.numel() for p in model.parameters())
    buckets = int(2e7)  # DeepSpeed's default buckets (5e8 elements) would dwarf what is measured
    zero = {"reduce_bucket_size": buckets, "allgather_bucket_size": buckets}
    if a.stage == 3:
        zero.update(stage3_prefetch_bucket_size=buckets, stage3_max_live_parameters=buckets,
                    stage3_param_persistence_threshold=0)
    strategy = get_strategy("deepspeed", stage=a.stage, config={"zero_optimization": zero})
    strategy.plan(world, world, 1)
    engine, opt = strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(1, 8, h, generator=torch.Generator().manual_seed(rank))
    with strategy.no_sync(engine, last=True):
        strategy.backward(engine(x).pow(2).mean())
    strategy.optimizer_step(opt)
    out: dict[str, Any] = {"rank": rank, "params": n_params, "peak_reset": True}

    def manager(sub: str) -> CheckpointManager:
        return CheckpointManager(CheckpointConfig(url=os.path.join(a.dir, sub), keep_last=2), "run", rank=rank,
                                 world_size=world, strategy="deepspeed")

    for prefix, make in (("", lambda: strategy.state(engine, opt)), ("full_", lambda: FullState(strategy, engine))):
        strategy.state(engine, opt).state_dict()  # the range table is gathered once per engine, not measured
        m = manager(prefix or "ranges")
        dist.barrier()
        with PeakGrowth() as g:
            m.save(1, {"app": make()}, kind="periodic", block=True)
        out[prefix + "save"] = g.growth
        out["peak_reset"] &= g.exact
        out[prefix + "staging_bytes"] = m.staging_bytes
        _drop_optimizer_state(strategy)
        dist.barrier()
        with PeakGrowth() as g:
            got = m.restore({"app": make()})
        assert got == 1, got
        out[prefix + "load"] = g.growth
        m.close()
        del m
        dist.barrier()
    with open(os.path.join(a.dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()


# ---- the launcher ------------------------------------------------------------------------------------

def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run_stage(stage: int, a: argparse.Namespace, work: str) -> dict[str, Any]:
    d = os.path.join(work, f"zero{stage}")
    os.makedirs(d)
    t0 = time.monotonic()
    run_world([os.path.abspath(__file__), "--worker", "--stage", str(stage), "--dir", d, "--hidden", str(a.hidden),
               "--layers", str(a.layers)], a.world, a.timeout, f"ZeRO-{stage}")
    ranks = []
    for r in range(a.world):
        with open(os.path.join(d, f"rank{r}.json")) as fh:
            ranks.append(json.load(fh))
    n = ranks[0]["params"]
    share = 12 * n / a.world  # fp32 weight + exp_avg + exp_avg_sq, over the ranks
    res: dict[str, Any] = {"stage": stage, "world": a.world, "params": n, "full_state_bytes": 12 * n,
                           "share_bytes": share, "peak_reset": all(r["peak_reset"] for r in ranks),
                           "checkpoint_bytes": _dir_bytes(os.path.join(d, "ranges")),
                           "full_checkpoint_bytes": _dir_bytes(os.path.join(d, "full_")),
                           "staging_bytes_per_rank": max(r["staging_bytes"] for r in ranks),
                           "full_staging_bytes_per_rank": max(r["full_staging_bytes"] for r in ranks),
                           "seconds": round(time.monotonic() - t0, 1)}
    for op in OPS:
        per_rank = [r[op] for r in ranks]
        res[op] = {"growth_bytes_per_rank": per_rank, "ratio": round(max(per_rank) / share, 3)}
    shutil.rmtree(d, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--stages", default="2,3", help="ZeRO stages, comma-separated")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per stage")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    work = tempfile.mkdtemp(prefix="tg-dsmem-")
    try:
        results = [run_stage(int(s), a, work) for s in a.stages.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = 1 / 2**20
    print(f"{'stage':>5} {'params':>11} {'share MiB':>10} | " + " | ".join(f"{op:>16}" for op in OPS))
    for r in results:
        cells = " | ".join(f"{max(r[op]['growth_bytes_per_rank']) * mb:8.0f} {r[op]['ratio']:6.2f}x" for op in OPS)
        print(f"{r['stage']:>5} {r['params']:>11,} {r['share_bytes'] * mb:>10.0f} | {cells}")
    print("cells: peak RSS growth per rank (MiB, max over ranks) and its ratio to full state / world; "
          f"target <= {TARGET}x for save and load")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"results": results, "target_ratio": TARGET}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
