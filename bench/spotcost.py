"""The spot simulator's cost model: the physics of a job as named parameters, turned into the
per-change costs (:class:`~bench.spotsim.ChangeCosts`) and the job (:class:`~bench.spotsim.JobModel`)
that :func:`~bench.spotsim.simulate` runs.

Every parameter (:class:`P`) carries its source: the bench of this project that measured it
(``bench/<name>.py: ...``) or ``assumption: ...``; the report prints them all, so no cost is taken from
the tiny replayed model without saying so. :meth:`Physics.costs` derives, at a world of ``n`` nodes:

* each node's share of the durable checkpoint ``state / n`` (DCP writes replicated state once, split
  among the ranks); the state a node holds: all of it (replicated) or its share (sharded);
* storage bandwidth per node ``min(per node, aggregate / n)``;
* a periodic save blocks for ``stage_fixed + share / (D2H per GPU x GPUs)`` and persists in
  ``save_fixed + share / bandwidth + share / host pipeline``: the checkpoint threads serialise, CRC and
  hand the bytes over, then wait for the store, in series (on the 2-core CPU machine the pipeline, not
  the disk, set the persist time: ``bench/spot_trace.py --validate``); an emergency (or resize)
  checkpoint is both, before the node goes;
* a restore from storage reads what a node holds at that bandwidth and through the pipeline, then builds
  the process groups (``comm_init``); a cold start from zero nodes is that restore after the first rendezvous;
* a joiner takes what it holds from a peer over the network; after a loss survived in place the world
  aborts its communicators (``comm_abort``), rebuilds them, and (sharded) rebuilds the lost share from
  tier 1 over the network;
* detection per failure kind; the re-formation after a loss waits out what is left of the keep-alive
  after the detection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any

from bench.spotsim import ChangeCosts, Dist, FailureKind, JobModel, StateLayout, Tier1

GB = 1e9


class Cloud(str, Enum):
    AWS = "aws"
    GCP = "gcp"
    AZURE = "azure"


NOTICE_S: dict[Cloud, float] = {Cloud.AWS: 120.0, Cloud.GCP: 30.0, Cloud.AZURE: 30.0}
"""The preemption notice each cloud documents: EC2 spot's two-minute interruption notice, GCP spot/
preemptible VMs' 30 s ACPI soft-off, Azure Scheduled Events' Preempt with at least 30 s."""


@dataclass(frozen=True, slots=True)
class P:
    """One parameter: its value (SI units: seconds, bytes, bytes per second) and where it comes from."""

    value: float
    source: str
    """``bench/<name>.py: <what it measured>`` or ``assumption: <why this value>``."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.value) or self.value < 0:
            raise ValueError(f"a cost-model parameter must be finite and >= 0, got {self.value!r} ({self.source})")
        if not (self.source.startswith("bench/") or self.source.startswith("assumption:")):
            raise ValueError(f"a cost-model parameter names the bench that measured it ('bench/<name>.py: ...') "
                             f"or says 'assumption: ...', got {self.source!r}")

    @property
    def measured(self) -> bool:
        return self.source.startswith("bench/")


@dataclass(frozen=True, kw_only=True, slots=True)
class Physics:
    """A job's physics on a cluster (see the module docstring for how each one is used)."""

    name: str
    state_bytes: P
    """The whole job's training state in a checkpoint (parameters and optimizer state)."""
    state: StateLayout
    tier1: Tier1 = Tier1.NONE
    parity_group: int = 4
    gpus_per_node: P
    step_s: P
    """One step at ``ref_nodes`` nodes; constant global batch, so node-seconds per step are constant."""
    ref_nodes: int
    step_overhead_s: P
    """Per step outside the step itself (the step agreement)."""
    samples_per_step: int
    storage_bw_node: P
    storage_bw_total: P
    host_pipeline_bw_node: P
    """A node's checkpoint threads (DCP serialisation, CRC32, the write/read calls), all ranks together,
    in series with the store's transfer."""
    d2h_bw_gpu: P
    network_bw_node: P
    stage_fixed_s: P
    """A periodic save's blocking with no bytes to copy."""
    save_fixed_s: P
    """A durable commit with no bytes to write (DCP plan, manifest, fsync, the commit protocol)."""
    detect_notice_s: P
    detect_kill_s: P
    detect_frozen_s: P
    detect_hang_s: P
    keep_alive_s: P
    evict_s: P
    """After a detected kill or hang: until the lost member leaves the rendezvous (eviction on evidence: a
    connection reset plus a missed agent heartbeat). A frozen node's detection is the keep-alive itself."""
    """The rendezvous gives a lost member up after this long without its heartbeat."""
    rendezvous_s: P
    """A planned re-formation's control plane (the round, the store keys)."""
    start_rendezvous_s: P
    comm_init_s: P
    comm_abort_s: P
    warmup_s: P
    """A node from its arrival until it is warm in standby (boot, agent, imports, model build, device init)."""
    spot_per_hour: P
    on_demand_per_hour: P

    def __post_init__(self) -> None:
        if self.ref_nodes < 1 or self.samples_per_step < 1:
            raise ValueError(f"{self.name}: ref_nodes and samples_per_step must be >= 1")
        if self.gpus_per_node.value < 1 or self.storage_bw_node.value <= 0 or self.storage_bw_total.value <= 0 \
                or self.d2h_bw_gpu.value <= 0 or self.network_bw_node.value <= 0 or self.host_pipeline_bw_node.value <= 0:
            raise ValueError(f"{self.name}: GPUs per node >= 1 and every bandwidth > 0")

    def params(self) -> dict[str, dict[str, Any]]:
        """Every parameter with its source, for the report."""
        return {f.name: {"value": getattr(self, f.name).value, "source": getattr(self, f.name).source}
                for f in fields(self) if isinstance(getattr(self, f.name), P)}

    def detect_s(self, kind: FailureKind) -> float:
        return {FailureKind.KILL: self.detect_kill_s, FailureKind.FROZEN: self.detect_frozen_s,
                FailureKind.HANG: self.detect_hang_s}[kind].value

    def eviction_wait_s(self, kind: FailureKind) -> float:
        """Seconds after the detection until the lost member is out of the rendezvous: a frozen node's
        keep-alive expiry is its detection (whatever of it is left); a killed or hung member (its agent ends
        it) goes on evidence (:attr:`evict_s`)."""
        if kind is FailureKind.FROZEN:
            return max(0.0, self.keep_alive_s.value - self.detect_s(kind))
        return self.evict_s.value

    def costs(self, n: int, kind: FailureKind = FailureKind.FROZEN) -> ChangeCosts:
        """The costs of each change at a world of ``n`` nodes, for losses of ``kind``."""
        n = max(1, n)
        share = self.state_bytes.value / n
        held = self.state_bytes.value if self.state is StateLayout.REPLICATED else share
        bw = min(self.storage_bw_node.value, self.storage_bw_total.value / n)
        per_byte = 1.0 / bw + 1.0 / self.host_pipeline_bw_node.value
        net = self.network_bw_node.value
        stage = self.stage_fixed_s.value + share / (self.d2h_bw_gpu.value * self.gpus_per_node.value)
        persist = self.save_fixed_s.value + share * per_byte
        init = self.comm_init_s.value
        from_storage = held * per_byte + init
        rebuild = 0.0 if self.state is StateLayout.REPLICATED else share / net
        d = Dist.of
        return ChangeCosts(
            agent_start_s=d(self.warmup_s.value), warmup_s=d(self.warmup_s.value),
            detect_notice_s=d(self.detect_notice_s.value), detect_failure_s=d(self.detect_kill_s.value),
            detect_frozen_s=d(self.detect_frozen_s.value), detect_hang_s=d(self.detect_hang_s.value),
            emergency_s=d(stage + persist), resize_checkpoint_s=d(stage + persist),
            reformation_s=d(self.rendezvous_s.value), join_reformation_s=d(self.rendezvous_s.value),
            start_reformation_s=d(self.start_rendezvous_s.value), cold_reformation_s=d(self.start_rendezvous_s.value),
            failure_reformation_s=d(self.rendezvous_s.value + self.eviction_wait_s(kind)),
            restore_s=d(init + rebuild), join_restore_s=d(init + held / net),
            failure_restore_s=d(self.comm_abort_s.value + init + rebuild),
            storage_restore_s=d(self.comm_abort_s.value + from_storage), cold_restore_s=d(from_storage),
            startup_s=d(init), periodic_overhead_s=d(stage), periodic_persist_s=d(persist))

    def job(self, kind: FailureKind = FailureKind.FROZEN) -> JobModel:
        return JobModel(node_s_per_step=self.step_s.value * self.ref_nodes, samples_per_step=self.samples_per_step,
                        in_place=True, step_overhead_s=self.step_overhead_s.value, state=self.state, tier1=self.tier1,
                        parity_group=self.parity_group, unannounced_kind=kind)


# ---- profiles -------------------------------------------------------------------------------------------
# Measured on this machine by the replay (bench/spot_trace.py, 2026-11-27, tier0-ab run: medians) and the
# step-agreement bench and the GPU check (one H100); what only a GPU cluster can measure is an assumption
# until a multi-GPU replay measures it.
_REPLAY = "bench/spot_trace.py: replay 2026-11-27 (docs/results/spot/tier0-ab-2026-11-27.json), median"
_GPU_ASSUMED = {
    "gpus_per_node": P(8, "assumption: 8-GPU nodes (p4d/p5, a3)"),
    "storage_bw_node": P(1 * GB, "assumption: 1 GB/s from one node to object storage"),
    "storage_bw_total": P(25 * GB, "assumption: 25 GB/s aggregate to the bucket"),
    "host_pipeline_bw_node": P(8 * GB, "assumption: 8 checkpoint threads (one per rank) at ~1 GB/s each "
                                       "(DCP serialisation + zlib CRC32); bench/spot_trace.py --validate measured "
                                       "48 MB/s behind training, 117 MB/s stopped, on the 2-core CPU machine"),
    "d2h_bw_gpu": P(54 * GB, "bench/gpu_check.py: d2h part, checkpoint staging 54.6 GB/s into the pinned arena "
                             "(1.005 of cudaMemcpy) on one H100, 2026-11-27 (docs/results/gpu/)"),
    "network_bw_node": P(25 * GB, "assumption: 200 Gb/s effective node-to-node (EFA / GPUDirect-TCPX)"),
    "stage_fixed_s": P(0.012, f"{_REPLAY} periodic_overhead_s of a 1.9 MB state"),
    "save_fixed_s": P(0.10, f"{_REPLAY} periodic_persist_s of a 1.9 MB state"),
    "detect_notice_s": P(1.0, f"{_REPLAY} detect_notice_s"),
    "detect_kill_s": P(0.09, f"{_REPLAY} detect_failure_s (a SIGKILL: sockets reset)"),
    "detect_frozen_s": P(5.35, "bench/recovery.py: freeze_node detect_s 5.35 s and 4.46 s (two runs, "
                               "docs/results/recovery-dirty-2026-11-27*.json, loaded CPU machine): the keep-alive "
                               "(2 s x 3) bounds it; the hang watch evicts a frozen node within hang.min_s (6 s)"),
    "detect_hang_s": P(6.69, "bench/recovery.py: hang_worker detect_s 6.69 s and 6.48 s (two runs, CPU); the "
                             "threshold is max(hang.min_s 6 s, 3 x p99 step): a 1 s GPU step keeps it at 6 s"),
    "keep_alive_s": P(6.0, "assumption: rendezvous.keep_alive_interval_s 2 x keep_alive_max_attempts 3 (defaults)"),
    "evict_s": P(0.9, "bench/recovery.py: kill -> first step of the re-formed world 0.99 s and 1.16 s with detection "
                      "0.12 / 0.11 s (two runs, 2026-11-27, CPU): a member whose agent missed its 1 s heartbeat "
                      "after a reset is evicted at once"),
    "rendezvous_s": P(0.12, f"{_REPLAY} join_reformation_s (3 agents on loopback; not measured at 32 nodes)"),
    "start_rendezvous_s": P(1.4, "bench/spot_trace.py: --quick replay 2026-11-27, start_reformation_s"),
    "comm_init_s": P(5.0, "assumption: NCCL communicators for a new world of up to 256 GPUs"),
    "comm_abort_s": P(5.0, "assumption: NCCL abort and CUDA stream/allocator recovery after a lost peer at 256 "
                           "GPUs; bench/gpu_check.py's reform part measured 1.0-3.4 s for a world of 1 on an H100"),
    "warmup_s": P(60.0, "assumption: boot to agent 20 s (image cached), imports + model build + CUDA init 40 s"),
    "step_overhead_s": P(0.00028, "bench/step_agreement.py: 0.28 ms per step (CPU/gloo; NCCL unmeasured)"),
    "spot_per_hour": P(39.33, "assumption: p5.48xlarge spot at 60 % below on-demand"),
    "on_demand_per_hour": P(98.32, "assumption: p5.48xlarge on-demand list price, us-east-1"),
}

GPU_7B_FSDP = Physics(
    name="7b-fsdp", state_bytes=P(7e9 * 14, "assumption: 7B params x 14 B (bf16 params, fp32 master, Adam m and v)"),
    state=StateLayout.SHARDED, tier1=Tier1.PARITY, parity_group=4,
    step_s=P(1.0, "assumption: 1 s per step at 32 nodes (2.4M tokens at ~40 % MFU on 256 H100)"), ref_nodes=32,
    samples_per_step=512, **_GPU_ASSUMED)
GPU_70B = Physics(
    name="70b-fsdp", state_bytes=P(70e9 * 14, "assumption: 70B params x 14 B (bf16 params, fp32 master, Adam)"),
    state=StateLayout.SHARDED, tier1=Tier1.PARITY, parity_group=4,
    step_s=P(5.0, "assumption: 5 s per step at 32 nodes (1M tokens at ~40 % MFU on 256 H100)"), ref_nodes=32,
    samples_per_step=256, **_GPU_ASSUMED)
PROFILES: dict[str, Physics] = {p.name: p for p in (GPU_7B_FSDP, GPU_70B)}


def without_tier1(p: Physics) -> Physics:
    """The same job with no in-memory copies on other nodes: sharded state survives no loss in place."""
    return replace(p, name=f"{p.name}-no-tier1", tier1=Tier1.NONE)


__all__ = ["GB", "Cloud", "GPU_70B", "GPU_7B_FSDP", "NOTICE_S", "P", "PROFILES", "Physics", "without_tier1"]
