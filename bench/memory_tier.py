"""In-memory checkpoint tier (tier 0): what a snapshot costs and what it saves (benchmark, not a timed test).

Scenarios, side by side in one invocation:

* **overhead** -- one process trains the bundled byte-level GPT (``examples/train_gpt.py``'s ``TinyGPT``,
  the example's defaults: d_model 64, 2 layers, seq 64, global batch 24 in micro-batches of 4, AdamW)
  and alternates blocks of ``--block`` steps *with* a tier-0 snapshot after every step (the call the
  worker runtime makes: :meth:`MemoryTier.snapshot` of ``{"app": model + optimizer, "trainer": ...}``
  into ``/dev/shm``) and *without*, for ``--overhead-steps`` steps. ``snapshot_overhead_ratio`` = mean
  step time with / without (the snapshot included in the step). ``memory_ratio`` = host memory of this
  rank's tier 0 (both slot files) / its state's tensor bytes (tier 1 does not exist yet: nothing added).
* **durable_feed** -- one process, a snapshot and a periodic save (``file://``, each waited for) after
  every step, the save staged alternately from the training tensors and from the snapshot just taken
  (tier 2 fed from tier 0): the medians of the time the save blocks the training thread, both ways, on
  the bench model and the larger one (``--only-feed``: the overhead and this scenario only).
* **worker_kill** -- two ``trainguard run`` agents on 127.0.0.1 (c10d, gloo, DDP, one worker each,
  ``workers.reform: restart``) train ``examples/train_gpt_elastic.py`` with a snapshot every step
  (``checkpoint.memory_interval_steps=1``) and no periodic checkpoint in storage; after ``--kill-at``
  steps node b's worker is SIGKILLed (its agent lives). ``worker_kill_lost_steps``: the newest step any
  rank finished before the kill minus the step the new world restored; ``worker_kill_resume_s``: from
  the kill until the new world finished its first step (the workers' own clock, from the sample log).
* **worker_kill_inplace** -- the same kill with tier 0 on and ``workers.reform: in-process`` (the default for
  worker-API jobs): the killed worker's node leaves the round at once and the survivor re-forms without it,
  from its own live state (``restore_tier`` ``live``: no restore; the new world's first step is the
  resume), then the node rejoins warm and its new worker takes the state from the survivor. Before
  2026-11-27 the survivor waited for the restarted worker (``restore_tier`` ``peer``).
* **worker_kill_storage** (unless ``--no-baseline``) -- the same kill with tier 0 off and a periodic
  checkpoint in storage every ``--baseline-interval`` steps: today's path, the same figures.
* **node_kill** -- three agents train the same job with FSDP2 (``--strategy fsdp``), a snapshot every
  step and tier 1 on (``checkpoint.memory_replica``: each rank's snapshot copied to the next node in the
  background); after ``--kill-at`` steps node c is SIGKILLed (agent and worker) and a replacement node d
  is started at once (``min_nodes`` 3). ``node_kill_lost_steps`` / ``node_kill_resume_s`` as above;
  ``memory_ratio`` = node a's tier-0 + tier-1 bytes (its own two slots + the replica of c's rank) / its
  state's tensor bytes, read from the files.
* **node_kill_ddp** -- three DDP agents (tier 0 only, min nodes 2); node c is SIGKILLed whole and not
  replaced: the survivors form a world of 2 and restore from their own nodes' memory (replicated state
  restores at any world size). ``node_kill_ddp_lost_steps`` / ``node_kill_ddp_resume_s``.
* **node_kill_shrink** -- as node_kill (FSDP2, tier 1) but min nodes 2 and no replacement: the survivors
  form a world of 2 and reshard the three ranks' snapshots (their own, c's replica on its buddy) into
  their new shards. ``node_kill_shrink_lost_steps`` / ``node_kill_shrink_resume_s``.
* **node_kill_shrink_inplace** -- the same with ``workers.reform: in-process``: the survivors' worker
  processes re-form the world of 2 in place and reshard from memory without a restart.
  ``node_kill_shrink_inplace_lost_steps`` / ``node_kill_shrink_inplace_resume_s``.

Run: ``OMP_NUM_THREADS=1 python bench/memory_tier.py [--json out.json]`` (about four minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests import samples  # noqa: E402  (the sample-log reader the e2e tests use)
from tests.harness import Node, free_port, wait_listening, wait_until  # noqa: E402

ELASTIC = os.path.join(REPO, "examples", "train_gpt_elastic.py")


class _Job:
    """The bench model (the bundled TinyGPT), AdamW, the trainer state, and a tier-0 snapshot folder in
    ``shm_root`` whose optimizer is guarded as the runtime guards it (parameters and Adam state copied
    beside the next forward/backward). A context manager: leaving it closes the tier, removes the folder."""

    def __init__(self, shm_root: str, d_model: int, layers: int, corpus_bytes: int) -> None:
        import torch

        from trainguard.checkpoint.memory import MemoryTier
        from trainguard.checkpoint.state import ModelOptimizerState, TrainerState
        from trainguard.examples.train_gpt import TinyGPT, load_corpus

        torch.set_num_threads(1)
        torch.manual_seed(1234)
        self.corpus = load_corpus(corpus_bytes)
        self.model = TinyGPT(64, d_model, layers)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.trainer = TrainerState(seed=1234, cursor={"epoch": 0, "consumed": 0})
        self.state = {"app": ModelOptimizerState(self.model, self.opt), "trainer": self.trainer}
        self.folder = tempfile.mkdtemp(prefix="trainguard-bench-", dir=shm_root)
        self.tier = MemoryTier(self.folder, rank=0, world_size=1)
        self.tier.guard(self.opt)
        self._n = (len(self.corpus) - 1) // 64
        self._g = torch.Generator().manual_seed(0)

    def step(self, i: int, batch: int, micro: int) -> None:
        """Train step ``i`` on ``batch`` random sequences of 64 bytes, in micro-batches of ``micro``."""
        import torch

        from trainguard.examples.train_gpt import batch_for

        ids = torch.randint(0, self._n, (batch,), generator=self._g).tolist()
        parts = batch // micro
        for k in range(parts):
            x, y = batch_for(self.corpus, ids[micro * k:micro * k + micro], 64)
            loss = torch.nn.functional.cross_entropy(self.model(x).reshape(-1, 256), y.reshape(-1)) / parts
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.trainer.step, self.trainer.cursor = i, {"epoch": 0, "consumed": batch * i}

    def state_bytes(self) -> int:
        """Tensor bytes of the parameters and the optimizer state."""
        import torch

        n = sum(t.numel() * t.element_size() for t in self.model.parameters())
        return n + sum(v.numel() * v.element_size() for s in self.opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor))

    def __enter__(self) -> _Job:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tier.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def overhead(steps: int, block: int, shm_root: str, d_model: int = 64, layers: int = 2) -> dict[str, Any]:
    """Alternate blocks of steps with and without a snapshot after each step; return the figures."""
    with _Job(shm_root, d_model, layers, 2_000_000) as job:
        tier, state = job.tier, job.state
        for i in range(1, 6):  # warm-up: allocator, optimizer state, the slot files
            job.step(i, 24, 4)
            tier.snapshot(i, state)
        times: dict[bool, list[float]] = {True: [], False: []}
        snap_s: list[float] = []
        i = 5
        while i < 5 + steps:
            on = ((i - 5) // block) % 2 == 0
            i += 1
            t0 = time.perf_counter()
            job.step(i, 24, 4)
            if on:
                snap_s.append(tier.snapshot(i, state).seconds)
            times[on].append(time.perf_counter() - t0)
        state_bytes = job.state_bytes()
        with_s, without_s = statistics.mean(times[True]), statistics.mean(times[False])
        return {"d_model": d_model, "layers": layers, "overhead_steps": steps, "overhead_block": block,
                "step_s_with_snapshots": round(with_s, 6), "step_s_without_snapshots": round(without_s, 6),
                "step_s_with_snapshots_median": round(statistics.median(times[True]), 6),
                "step_s_without_snapshots_median": round(statistics.median(times[False]), 6),
                "snapshot_overhead_ratio": round(with_s / without_s, 4),
                "snapshot_overhead_ratio_median": round(statistics.median(times[True]) / statistics.median(times[False]), 4),
                "snapshot_s_mean": round(statistics.mean(snap_s), 6),
                "snapshot_s_p95": round(sorted(snap_s)[int(0.95 * len(snap_s))], 6),
                "state_bytes": state_bytes, "tier0_bytes": tier.nbytes, "tier1_bytes": 0,
                "memory_ratio": round(tier.nbytes / state_bytes, 4)}


def durable_feed(saves: int, shm_root: str, d_model: int = 64, layers: int = 2) -> dict[str, Any]:
    """Tier 2 fed from tier 0: the time a periodic save blocks the training thread, staged from the
    training tensors (as without a memory tier) and from the snapshot just taken (the persist thread
    copies out of its slot), alternating, on the same state. Each save is waited for before the next step
    (so ``blocked`` is the staging alone, no in-flight save), to ``file://`` in a temporary folder."""
    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager

    store = tempfile.mkdtemp(prefix="trainguard-bench-durable-")
    blocked: dict[bool, list[float]] = {True: [], False: []}
    stage_bg: list[float] = []
    try:
        with _Job(shm_root, d_model, layers, 200_000) as job, CheckpointManager(
                CheckpointConfig(url=f"file://{store}", async_save=True, keep_last=2), "bench", rank=0,
                world_size=1) as mgr:
            for i in range(1, 2 * saves + 3):
                job.step(i, 8, 8)
                job.tier.snapshot(i, job.state)
                fed = i % 2 == 0
                r = mgr.save(i, job.state, source=job.tier.lend(i) if fed else None).result(120)
                if i > 2:  # after the warm-up (staging buffers, optimizer state)
                    blocked[fed].append(r.blocked_s)
                    if fed:
                        stage_bg.append(r.stage_s)
            state_bytes = job.state_bytes()
        fed_s, own_s = statistics.median(blocked[True]), statistics.median(blocked[False])
        return {"d_model": d_model, "layers": layers, "saves_each": len(blocked[True]), "state_bytes": state_bytes,
                "blocked_s_from_training": round(own_s, 6), "blocked_s_from_snapshot": round(fed_s, 6),
                "blocked_ratio": round(fed_s / own_s, 4), "stage_s_from_snapshot": round(statistics.median(stage_bg), 6)}
    finally:
        shutil.rmtree(store, ignore_errors=True)


MODES = ("none", "copies", "parity")


def _overhead_rank(rank: int, port: int, out: str, steps: int, block: int, shm_root: str) -> None:
    """One of 3 ranks (3 "nodes") of an FSDP2 TinyGPT job over gloo that cycles blocks of ``block``
    steps through :data:`MODES`: no snapshot, a snapshot per step with tier 1 as copies (a buddy's
    replica), and with tier 1 as parity; rank 0 writes each step's time (a step's time includes its
    ``optimizer.step()``'s wait for the previous snapshot's background work)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from trainguard.checkpoint import parity
    from trainguard.checkpoint.memory import MemoryTier
    from trainguard.checkpoint.replica import Replicator
    from trainguard.checkpoint.state import ModelOptimizerState, TrainerState
    from trainguard.examples.train_gpt import TinyGPT, batch_for, load_corpus

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    g_copies, g_parity = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    torch.manual_seed(1234)
    model = TinyGPT(64, 64, 2)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = TrainerState(seed=1234, cursor={"epoch": 0, "consumed": 0})
    state = {"app": ModelOptimizerState(model, opt), "trainer": trainer}
    folders = {m: tempfile.mkdtemp(prefix=f"trainguard-bench-{m}{rank}-", dir=shm_root) for m in MODES[1:]}
    tiers = {"copies": MemoryTier(folders["copies"], rank=rank, world_size=3, copies=2),
             "parity": MemoryTier(folders["parity"], rank=rank, world_size=3)}
    rep = Replicator(tiers["copies"], g_copies, rank=rank, world_size=3, local_world_size=1)
    members, index = parity.group_of(rank, 3, 1) or ([], 0)
    tiers["parity"].set_parity(g_parity, members, index)
    for t in tiers.values():
        t.guard(opt)
    corpus = load_corpus(2_000_000)
    n = (len(corpus) - 1) // 64
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    snap: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    opt_s: dict[str, list[float]] = {m: [] for m in MODES}
    exchange_s: list[float] = []
    total = 15 + steps
    for i in range(1, total + 1):
        mode = MODES[(i - 1) // 5 % 3] if i <= 15 else MODES[(i - 16) // block % 3]
        t0 = time.perf_counter()
        for _ in range(2):  # global batch 24 = 3 ranks x 2 micro-batches x 4
            x, y = batch_for(corpus, torch.randint(0, n, (4,), generator=gen).tolist(), 64)
            (torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)) / 2).backward()
        t_opt = time.perf_counter()
        opt.step()  # waits for the previous snapshot's background half (parity: its exchange too)
        t_opt = time.perf_counter() - t_opt
        opt.zero_grad(set_to_none=True)
        trainer.step = i
        if mode == "copies":
            rep.settle()
            snap[mode].append(tiers[mode].snapshot(i, state, world="bench/0").seconds)
            rep.replicate()
        elif mode == "parity":
            snap[mode].append(tiers[mode].snapshot(i, state, world="bench/0").seconds)
        dt = time.perf_counter() - t0
        if i > 15 and (i - 16) % block:  # the first step of a block pays the previous block's last snapshot
            times[mode].append(dt)
            opt_s[mode].append(t_opt)
            if mode == "parity":
                exchange_s.append(tiers[mode].parity_seconds)
    rep.wait(60)
    for t in tiers.values():
        t.settle()
    nbytes = {m: [t.nbytes, t.replica_bytes] for m, t in tiers.items()}
    state_bytes = sum(t.numel() * t.element_size() for t in (p.to_local() for p in model.parameters()))
    state_bytes += sum(v.to_local().numel() * v.element_size() for st in opt.state.values() for v in st.values()
                       if hasattr(v, "to_local") and v.dim() > 0)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"times": times, "snapshot_s": snap, "opt_s": opt_s, "exchange_s": exchange_s,
                       "bytes": nbytes, "state_bytes": state_bytes,
                       "parity_failed": tiers["parity"].parity_failed, "replica_failed": rep.failed}, fh)
    for t in tiers.values():
        t.close()
    for f in folders.values():
        shutil.rmtree(f, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def overhead_3_nodes(steps: int, block: int, shm_root: str) -> dict[str, Any]:
    """Tier 1's cost on the step, 3 FSDP2 ranks (3 "nodes", gloo, on this machine's cores): blocks of
    steps with no snapshot, with snapshots + copies, with snapshots + parity, alternating in one run."""
    port = free_port()
    out = os.path.join(tempfile.mkdtemp(prefix="trainguard-bench-"), "rank0.json")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--overhead-rank", str(r), str(port), out,
                               str(steps), str(block), shm_root], env=env, cwd=REPO) for r in range(3)]
    codes = [p.wait(900) for p in procs]
    if codes != [0, 0, 0]:
        raise RuntimeError(f"the 3-rank overhead run failed: exit codes {codes}")
    with open(out) as fh:
        got = json.load(fh)
    shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    t = got["times"]
    res: dict[str, Any] = {"steps_each": {m: len(t[m]) for m in MODES}, "state_bytes": got["state_bytes"]}
    for m in MODES:
        res[f"step_s_{m}"] = round(statistics.mean(t[m]), 5)
        res[f"step_s_{m}_median"] = round(statistics.median(t[m]), 5)
    for m in MODES[1:]:
        res[f"overhead_ratio_{m}"] = round(statistics.mean(t[m]) / statistics.mean(t["none"]), 4)
        res[f"overhead_ratio_{m}_median"] = round(statistics.median(t[m]) / statistics.median(t["none"]), 4)
        res[f"snapshot_s_{m}"] = round(statistics.mean(got["snapshot_s"][m]), 6)
        own, tier1 = got["bytes"][m]
        res[f"memory_ratio_{m}"] = round((own + tier1) / got["state_bytes"], 4)
    for m in MODES:  # how long optimizer.step() took, incl. its wait for the previous snapshot
        res[f"optimizer_step_s_{m}"] = round(statistics.mean(got["opt_s"][m]), 5)
    res["parity_exchange_s"] = round(statistics.mean(got["exchange_s"]), 5)  # exchange + agreement + own write
    res["parity_failed"], res["replica_failed"] = got["parity_failed"], got["replica_failed"]
    return res


def _memory_ratio(kill: dict[str, Any]) -> float:
    """Node a's tier 0 + tier 1 bytes over its state's tensor bytes, in a node kill's figures."""
    return round((kill["tier0_bytes"] + kill["tier1_bytes"]) / kill["state_bytes"], 4)


def _folder_bytes(folder: str) -> dict[str, int]:
    """Bytes of own slots (tier 0) and replicas (tier 1) in a node folder, and the state's tensor bytes."""
    from trainguard.checkpoint.memory import HEADER_BYTES, Header

    out = {"tier0_bytes": 0, "tier1_bytes": 0, "state_bytes": 0}
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        out["tier1_bytes" if name.startswith(("replica-", "parity-")) else "tier0_bytes"] += os.path.getsize(path)
        if name.startswith("rank-"):
            with open(path, "rb") as fh:
                h = Header.unpack(fh.read(HEADER_BYTES))
            if h is not None:
                out["state_bytes"] = max(out["state_bytes"], h.tensor_bytes)
    return out


def worker_kill(tmp: str, *, memory: bool, kill_at: int, baseline_interval: int, shm_root: str,
                node_kill: str = "", reform: str = "restart") -> dict[str, Any]:
    """Two agents, SIGKILL node b's worker at step ``kill_at``; the figures of the restart. ``node_kill``:
    ``"fsdp"``: three FSDP2 agents with tier 1, node c killed whole and replaced by node d; ``"ddp"``:
    three DDP agents (tier 0 only, min nodes 2), node c killed whole, no replacement (a world of 2)."""
    os.makedirs(tmp)
    folder = os.path.join(tmp, "samples")
    os.makedirs(folder)
    ep = f"127.0.0.1:{free_port()}"
    job = f"bench{os.getpid()}{'m' if memory else 's'}{'i' if reform != 'restart' else ''}"
    common = ["--set", f"checkpoint.url={os.path.join(tmp, 'ckpt')}", "--set", f"workers.reform={reform}",
              "--set", f"checkpoint.memory_dir={shm_root}"]
    common += (["--set", "checkpoint.interval=off", "--set", "checkpoint.memory_interval_steps=1",
                "--set", "checkpoint.memory_max_overhead=0",
                # tier 0 also where DDP re-forms in place (worker_kill_inplace: snapshots on, as measured since run 6)
                "--set", "checkpoint.memory_replicated_in_place=true"] if memory else
               ["--set", f"checkpoint.interval={baseline_interval}", "--set", "checkpoint.memory_interval_steps=0"])
    args = ["--steps", "100000", "--log-every", "1", "--sample-log", folder]
    nnodes, size = "1:2", 2
    if node_kill:
        job += node_kill
        common += ["--set", "rendezvous.keep_alive_interval_s=1", "--set", "rendezvous.keep_alive_max_attempts=3"]
        if node_kill.startswith("fsdp"):
            common += ["--set", "checkpoint.memory_replica=true"]
            args += ["--strategy", "fsdp"]
        if node_kill.endswith("-parity"):
            common += ["--set", "checkpoint.memory_replica_parity=true"]
        nnodes, size = ("3:3" if node_kill.startswith("fsdp") and "shrink" not in node_kill else "2:3"), 3
    a = Node("a", tmp, ep, job=job, nnodes=nnodes, script=ELASTIC, script_args=args, extra=common)
    wait_listening(ep)
    b = Node("b", tmp, ep, job=job, nnodes=nnodes, script=ELASTIC, script_args=args, extra=common)
    nodes = [a, b]
    if node_kill:
        nodes.append(Node("c", tmp, ep, job=job, nnodes=nnodes, script=ELASTIC, script_args=args, extra=common))
    try:
        wait_until(lambda: any(e["world_size"] == size and e["step"] >= kill_at for e in a.events("train_step")), 180,
                   f"{kill_at} steps at world size {size}")
        extra: dict[str, Any] = {}
        if node_kill:
            extra = _folder_bytes(os.path.join(shm_root, f"trainguard-{job}-a"))
            victims = nodes[2].worker_pids()
            nodes[2].proc.kill()
            for v in victims:
                os.kill(v, signal.SIGKILL)
            t_kill = time.time()
            if node_kill.startswith("fsdp") and "shrink" not in node_kill:
                nodes.append(Node("d", tmp, ep, job=job, nnodes=nnodes, script=ELASTIC, script_args=args,
                                  extra=common))
        else:
            (victim,) = b.worker_pids()
            os.kill(victim, signal.SIGKILL)
            t_kill = time.time()
        old_rounds = {r["round"] for r in samples.read(folder)}
        first = wait_until(lambda: sorted((r["t1"], r["step"]) for r in samples.read(folder)
                                          if r["round"] not in old_rounds and "t1" in r), 120,
                           "the first step of the new world")
        time.sleep(1.0)  # both ranks' restore reports reach the agents' logs
        back = [e for n in nodes for e in n.events("worker_restored")]
        before = [r for r in samples.read(folder) if r["round"] in old_rounds]  # incl. what the survivor finished
        last = max(r["step"] for r in before)
        # In place, the survivors may go on from their own live state without any restore (a failed
        # worker's node leaves and rejoins warm later): the new world then continues from the step
        # before its first one.
        tiers = sorted({e.get("source") for e in back}) or ["live"]
        step = min((e["step"] for e in back), default=min(s for _, s in first) - 1)
        steps_before = sorted({r["step"] for r in before if r.get("world_size") == size})
        done0 = sorted((r for r in before if r["rank"] == 0 and "t1" in r), key=lambda r: r["step"])  # not rolled back
        step_s = statistics.median(r2["t1"] - r1["t1"] for r1, r2 in zip(done0[-21:-1], done0[-20:]))
        return {"lost_steps": last - step, "resume_s": round(first[0][0] - t_kill, 3), "restored_step": step,
                "last_step_before_kill": last, "restore_tier": tiers[0] if len(tiers) == 1 else tiers,
                "ranks_restored": len(back), "step_s": round(step_s, 4), "steps_before_kill": len(steps_before),
                **extra}
    finally:
        for n in nodes:
            n.stop()
        for n in ("a", "b", "c", "d"):
            shutil.rmtree(os.path.join(shm_root, f"trainguard-{job}-{n}"), ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--json", default="")
    p.add_argument("--overhead-steps", type=int, default=1000)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=75,
                   help="kill after this many steps (75 with the baseline's interval 50: it loses half an interval)")
    p.add_argument("--baseline-interval", type=int, default=50)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--larger", default="256x4", help="also measure the overhead on TinyGPT d_model x layers ('' = skip)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--feed-saves", type=int, default=20, help="saves of each kind in the durable_feed scenario")
    p.add_argument("--only-feed", action="store_true", help="run the overhead and durable_feed scenarios only")
    p.add_argument("--parity", action="store_true",
                   help="also run the FSDP2 node kills with tier 1 as XOR parity (checkpoint.memory_replica_parity)")
    p.add_argument("--three-node-steps", type=int, default=600,
                   help="with --parity: steps of the 3-rank overhead scenario (none / copies / parity blocks)")
    p.add_argument("--only-node-kill", action="store_true",
                   help="run the FSDP2 node kills only (copies, and with --parity parity too)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t_start = time.time()
    out: dict[str, Any] = {"model": "TinyGPT d_model=64 layers=2 seq=64, global batch 24 (micro 4), AdamW"}
    if args.only_node_kill:
        return node_kills_only(args, out, t_start)
    print("overhead: alternating blocks with / without a snapshot per step ...", flush=True)
    out.update(overhead(args.overhead_steps, args.block, args.shm))
    if args.larger:
        d, n = (int(x) for x in args.larger.split("x"))
        print(f"overhead: the same on a larger TinyGPT (d_model {d}, {n} layers) ...", flush=True)
        out["larger_model"] = overhead(max(100, args.overhead_steps // 4), args.block, args.shm, d, n)
    if args.parity:
        print("overhead_3_nodes: 3 FSDP2 ranks, blocks with no snapshot / snapshots + copies / snapshots + "
              "parity ...", flush=True)
        out["overhead_3_nodes"] = overhead_3_nodes(args.three_node_steps, args.block, args.shm)
    print("durable_feed: a periodic save's blocking time, staged from the training tensors / from the "
          "snapshot ...", flush=True)
    out["durable_feed"] = durable_feed(args.feed_saves, args.shm)
    if args.larger:
        out["durable_feed_larger"] = durable_feed(args.feed_saves, args.shm, d, n)
    if args.only_feed:
        print(json.dumps({k: out[k] for k in ("durable_feed", "durable_feed_larger") if k in out}, indent=1))
        return 0
    tmp = tempfile.mkdtemp(prefix="trainguard-memtier-")
    try:
        print("worker_kill: tier 0 ...", flush=True)
        k = worker_kill(os.path.join(tmp, "memory"), memory=True, kill_at=args.kill_at,
                        baseline_interval=args.baseline_interval, shm_root=args.shm)
        out.update({"worker_kill_lost_steps": k["lost_steps"], "worker_kill_resume_s": k["resume_s"],
                    "worker_kill": k})
        print("worker_kill_inplace: tier 0, workers.reform in-process ...", flush=True)
        k = worker_kill(os.path.join(tmp, "inplace"), memory=True, kill_at=args.kill_at,
                        baseline_interval=args.baseline_interval, shm_root=args.shm, reform="in-process")
        out.update({"worker_kill_inplace_lost_steps": k["lost_steps"], "worker_kill_inplace_resume_s": k["resume_s"],
                    "worker_kill_inplace": k})
        if not args.no_baseline:
            print("worker_kill_storage: tier 0 off, storage every "
                  f"{args.baseline_interval} steps ...", flush=True)
            s = worker_kill(os.path.join(tmp, "storage"), memory=False, kill_at=args.kill_at,
                            baseline_interval=args.baseline_interval, shm_root=args.shm)
            out.update({"worker_kill_storage_lost_steps": s["lost_steps"], "worker_kill_storage_resume_s": s["resume_s"],
                        "worker_kill_storage": s})
        node_kill_copies(tmp, args, out)
        print("node_kill_ddp: 3 DDP nodes, tier 0 only, node c SIGKILLed, the survivors form a world of 2 ...",
              flush=True)
        n = worker_kill(os.path.join(tmp, "node-ddp"), memory=True, kill_at=args.kill_at,
                        baseline_interval=args.baseline_interval, shm_root=args.shm, node_kill="ddp")
        out.update({"node_kill_ddp_lost_steps": n["lost_steps"], "node_kill_ddp_resume_s": n["resume_s"],
                    "node_kill_ddp": n})
        print("node_kill_shrink: 3 FSDP2 nodes, tier 1 on, node c SIGKILLed, not replaced: the survivors "
              "reshard from memory at 2 ...", flush=True)
        n = worker_kill(os.path.join(tmp, "node-shrink"), memory=True, kill_at=args.kill_at,
                        baseline_interval=args.baseline_interval, shm_root=args.shm, node_kill="fsdp-shrink")
        out.update({"node_kill_shrink_lost_steps": n["lost_steps"], "node_kill_shrink_resume_s": n["resume_s"],
                    "node_kill_shrink": n})
        print("node_kill_shrink_inplace: the same, workers.reform in-process: the survivors re-form in place ...",
              flush=True)
        n = worker_kill(os.path.join(tmp, "node-shrink-inplace"), memory=True, kill_at=args.kill_at,
                        baseline_interval=args.baseline_interval, shm_root=args.shm, node_kill="fsdp-shrink",
                        reform="in-process")
        out.update({"node_kill_shrink_inplace_lost_steps": n["lost_steps"],
                    "node_kill_shrink_inplace_resume_s": n["resume_s"], "node_kill_shrink_inplace": n})
        if args.parity:
            out.update(parity_kills(tmp, args))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    out["wall_s"] = round(time.time() - t_start, 1)
    out["tier0_ratio"] = out.pop("memory_ratio")  # one process, tier 0 only
    nk = out.get("node_kill")
    if nk:
        out["memory_ratio"] = _memory_ratio(nk)
    out["restore_tier"] = {"worker_kill": out["worker_kill"]["restore_tier"],
                           "worker_kill_inplace": out["worker_kill_inplace"]["restore_tier"],
                           "worker_kill_storage": out.get("worker_kill_storage", {}).get("restore_tier"),
                           "node_kill": nk["restore_tier"] if nk else None,
                           "node_kill_ddp": out["node_kill_ddp"]["restore_tier"] if "node_kill_ddp" in out else None,
                           "node_kill_shrink": (out["node_kill_shrink"]["restore_tier"] if "node_kill_shrink" in out
                                                else None),
                           "node_kill_shrink_inplace": (out["node_kill_shrink_inplace"]["restore_tier"]
                                                        if "node_kill_shrink_inplace" in out else None)}
    rows = [("snapshot_overhead_ratio (mean step with/without)", out["snapshot_overhead_ratio"]),
            ("  step s with / without snapshots", f"{out['step_s_with_snapshots']} / {out['step_s_without_snapshots']}"),
            ("  snapshot s mean / p95", f"{out['snapshot_s_mean']} / {out['snapshot_s_p95']}"),
            *([(f"  larger model ({out['larger_model']['d_model']}x{out['larger_model']['layers']}, "
                f"{out['larger_model']['state_bytes']} B): ratio", out["larger_model"]["snapshot_overhead_ratio"])]
              if "larger_model" in out else []),
            *[(f"durable save blocked s, from training / from snapshot ({f['d_model']}x{f['layers']})",
               f"{f['blocked_s_from_training']} / {f['blocked_s_from_snapshot']} (x{f['blocked_ratio']}; "
               f"background copy {f['stage_s_from_snapshot']} s)")
              for f in (out.get("durable_feed"), out.get("durable_feed_larger")) if f],
            ("tier-0 ratio (one process: tier0 / state)",
             f"{out['tier0_ratio']} ({out['tier0_bytes']} / {out['state_bytes']} B)"),
            ("worker_kill_lost_steps (tier 0)", out["worker_kill_lost_steps"]),
            ("worker_kill_resume_s (tier 0)", out["worker_kill_resume_s"]),
            ("restore_tier (worker_kill)", out["restore_tier"]["worker_kill"]),
            ("worker_kill in place: lost steps / resume s / tier",
             f"{out['worker_kill_inplace_lost_steps']} / {out['worker_kill_inplace_resume_s']} / "
             f"{out['restore_tier']['worker_kill_inplace']}")]
    if "worker_kill_storage" in out:
        rows += [("worker_kill_lost_steps (storage only)", out["worker_kill_storage_lost_steps"]),
                 ("worker_kill_resume_s (storage only)", out["worker_kill_storage_resume_s"]),
                 ("restore_tier (worker_kill_storage)", out["restore_tier"]["worker_kill_storage"])]
    if "node_kill" in out:
        nk = out["node_kill"]
        rows += [("node_kill_lost_steps (tier 1)", out["node_kill_lost_steps"]),
                 ("node_kill_resume_s (tier 1)", out["node_kill_resume_s"]),
                 ("restore_tier (node_kill)", out["restore_tier"]["node_kill"]),
                 ("node_kill_ddp lost steps / resume s / tier (3 -> 2, no replacement)",
                  f"{out['node_kill_ddp_lost_steps']} / {out['node_kill_ddp_resume_s']} / "
                  f"{out['restore_tier']['node_kill_ddp']}"),
                 ("node_kill_shrink lost steps / resume s / tier (FSDP2 3 -> 2, resharded)",
                  f"{out['node_kill_shrink_lost_steps']} / {out['node_kill_shrink_resume_s']} / "
                  f"{out['restore_tier']['node_kill_shrink']}"),
                 ("  the same in place (workers.reform in-process)",
                  f"{out['node_kill_shrink_inplace_lost_steps']} / {out['node_kill_shrink_inplace_resume_s']} / "
                  f"{out['restore_tier']['node_kill_shrink_inplace']}"),
                 ("memory_ratio (node a: tier0+tier1 / state)",
                  f"{out['memory_ratio']} ({nk['tier0_bytes']} + {nk['tier1_bytes']} / {nk['state_bytes']} B)")]
    rows += parity_rows(out)
    return report(rows, out, args)


def report(rows: list[tuple[str, Any]], out: dict[str, Any], args: argparse.Namespace) -> int:
    width = max(len(r[0]) for r in rows)
    print()
    for name, v in rows:
        print(f"{name:<{width}}  {v}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"\nwrote {args.json}")
    return 0


PARITY_KILLS = [("node_kill_parity", "fsdp-parity", "restart", "node c SIGKILLed, node d replaces it"),
                # the copies' shrink scenarios with parity
                ("node_kill_shrink_parity", "fsdp-shrink-parity", "restart", "node c SIGKILLed, not replaced (3 -> 2)"),
                ("node_kill_shrink_inplace_parity", "fsdp-shrink-parity", "in-process", "the same, re-formed in place")]


def parity_kills(tmp: str, args: argparse.Namespace) -> dict[str, Any]:
    """The FSDP2 node kills with tier 1 as XOR parity: what the copies' scenarios measure, and memory."""
    out: dict[str, Any] = {}
    for idx, (key, kind, reform, what) in enumerate(PARITY_KILLS):
        print(f"{key}: 3 FSDP2 nodes, tier 1 as parity, {what} ...", flush=True)
        try:  # a short folder: the agents' control sockets live under it (a Unix socket path is <= 107 bytes)
            n = worker_kill(os.path.join(tmp, f"parity{idx}"), memory=True, kill_at=args.kill_at,
                            baseline_interval=args.baseline_interval, shm_root=args.shm, node_kill=kind, reform=reform)
        except AssertionError as e:  # the scenario's agents did not come up, or the job did not reach its kill
            print(f"  failed: {e}", flush=True)
            out[key] = {"error": str(e)[:300], "lost_steps": None, "resume_s": None, "restore_tier": None, "step_s": None}
            continue
        print(f"  {json.dumps(n)}", flush=True)
        out.update({f"{key}_lost_steps": n["lost_steps"], f"{key}_resume_s": n["resume_s"], key: n})
    nk = out["node_kill_parity"]
    out["memory_ratio_parity"] = _memory_ratio(nk)
    return out


def parity_rows(out: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    o = out.get("overhead_3_nodes")
    if o:
        rows += [("3 FSDP2 ranks: step s none / copies / parity (mean)",
                  f"{o['step_s_none']} / {o['step_s_copies']} / {o['step_s_parity']}"),
                 ("3 FSDP2 ranks: overhead ratio copies / parity (mean; median)",
                  f"{o['overhead_ratio_copies']} / {o['overhead_ratio_parity']} "
                  f"({o['overhead_ratio_copies_median']} / {o['overhead_ratio_parity_median']})"),
                 ("3 FSDP2 ranks: optimizer.step() s none / copies / parity; parity's exchange + write s",
                  f"{o['optimizer_step_s_none']} / {o['optimizer_step_s_copies']} / {o['optimizer_step_s_parity']}; "
                  f"{o['parity_exchange_s']}"),
                 ("3 FSDP2 ranks: memory ratio copies / parity (rank 0: tier0+tier1 / state)",
                  f"{o['memory_ratio_copies']} / {o['memory_ratio_parity']} ({o['state_bytes']} B state)")]
    if "node_kill_parity" not in out:
        return rows
    rows += [(f"{key} lost steps / resume s / tier / step s",
                                    f"{out[key]['lost_steps']} / {out[key]['resume_s']} / {out[key]['restore_tier']} / "
                                    f"{out[key]['step_s']}") for key, *_ in PARITY_KILLS]
    nk = out["node_kill_parity"]
    rows.append(("memory_ratio_parity (node a: tier0+tier1 / state)",
                 f"{out['memory_ratio_parity']} ({nk['tier0_bytes']} + {nk['tier1_bytes']} / {nk['state_bytes']} B)"))
    return rows


def node_kill_copies(tmp: str, args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    """The FSDP2 node kill with tier 1 as copies (node d replaces c), into ``out``; returns its figures."""
    print("node_kill: 3 FSDP2 nodes, tier 1 on (copies), node c SIGKILLed, node d replaces it ...", flush=True)
    n = worker_kill(os.path.join(tmp, "node"), memory=True, kill_at=args.kill_at,
                    baseline_interval=args.baseline_interval, shm_root=args.shm, node_kill="fsdp")
    out.update({"node_kill_lost_steps": n["lost_steps"], "node_kill_resume_s": n["resume_s"], "node_kill": n})
    return n


def node_kills_only(args: argparse.Namespace, out: dict[str, Any], t_start: float) -> int:
    """``--only-node-kill``: the FSDP2 node kill with copies, and with ``--parity`` the parity ones."""
    tmp = tempfile.mkdtemp(prefix="trainguard-memtier-")
    try:
        n = node_kill_copies(tmp, args, out)
        out["memory_ratio"] = _memory_ratio(n)
        if args.parity:
            out.update(parity_kills(tmp, args))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    out["wall_s"] = round(time.time() - t_start, 1)
    rows: list[tuple[str, Any]] = [("node_kill lost steps / resume s / tier / step s (copies)",
                                    f"{n['lost_steps']} / {n['resume_s']} / {n['restore_tier']} / {n['step_s']}"),
                                   ("memory_ratio (node a: tier0+tier1 / state, copies)",
                                    f"{out['memory_ratio']} ({n['tier0_bytes']} + {n['tier1_bytes']} / {n['state_bytes']} B)")]
    return report(rows + parity_rows(out), out, args)


if __name__ == "__main__" and sys.argv[1:2] == ["--overhead-rank"]:
    a = sys.argv[2:]
    _overhead_rank(int(a[0]), int(a[1]), a[2], int(a[3]), int(a[4]), a[5])
    sys.exit(0)
if __name__ == "__main__":
    sys.exit(main())
