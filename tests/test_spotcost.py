"""The spot simulator's cost model (``bench/spotcost.py``): parameters carry their source, and the
derived costs follow the physics (bytes over bandwidth, shares of sharded state, per-kind detection)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.spotcost import GB, GPU_7B_FSDP, NOTICE_S, PROFILES, Cloud, P, without_tier1
from bench.spotsim import FailureKind, StateLayout, Tier1, Trace, TraceEvent, simulate
from trainguard.checkpoint.interval import AutoSettings, IntervalMode, IntervalPolicy


def test_a_parameter_names_its_bench_or_says_it_is_assumed() -> None:
    assert P(1.0, "bench/step_agreement.py: x").measured
    assert not P(1.0, "assumption: y").measured
    with pytest.raises(ValueError, match="assumption"):
        P(1.0, "from the tiny model")
    with pytest.raises(ValueError, match="finite"):
        P(-1.0, "assumption: negative")
    for prof in PROFILES.values():
        assert all(v["source"].startswith(("bench/", "assumption:")) for v in prof.params().values())


def test_notice_windows_per_cloud() -> None:
    assert NOTICE_S[Cloud.AWS] == 120 and NOTICE_S[Cloud.GCP] == 30 and NOTICE_S[Cloud.AZURE] == 30


def test_save_and_restore_costs_are_bytes_over_bandwidth() -> None:
    """98 GB sharded over 24 nodes: each writes 4.08 GB at min(1 GB/s, 25/24 GB/s) = 1 GB/s, after its
    checkpoint threads' pipeline (8 GB/s) in series; at twice the per-node bandwidth the aggregate
    (25 GB/s / 24) caps it; a replicated state is read whole per node."""
    p = replace(GPU_7B_FSDP, state_bytes=P(96 * GB, "assumption: t"))
    c = p.costs(24)
    share = 4 * GB
    host = p.host_pipeline_bw_node.value
    assert host == 8 * GB
    assert c.periodic_persist_s.mean == pytest.approx(p.save_fixed_s.value + share / GB + share / host)
    assert c.periodic_overhead_s.mean == pytest.approx(p.stage_fixed_s.value + share / (p.d2h_bw_gpu.value * 8))
    assert p.d2h_bw_gpu.measured  # the GPU check measured it (one H100)
    assert c.emergency_s.mean == pytest.approx(c.periodic_persist_s.mean + c.periodic_overhead_s.mean)
    fast = replace(p, storage_bw_node=P(2 * GB, "assumption: t")).costs(24)
    assert fast.periodic_persist_s.mean == pytest.approx(p.save_fixed_s.value + share / (25 * GB / 24) + share / host)
    assert c.cold_restore_s.mean == pytest.approx(share / GB + share / host + p.comm_init_s.value)
    slow_host = replace(p, host_pipeline_bw_node=P(1 * GB, "assumption: t")).costs(24)
    assert slow_host.periodic_persist_s.mean == pytest.approx(p.save_fixed_s.value + share / GB + share / GB)
    rep = replace(p, state=StateLayout.REPLICATED).costs(24)
    assert rep.cold_restore_s.mean == pytest.approx(96 * GB / GB + 96 * GB / host + p.comm_init_s.value)
    assert rep.failure_restore_s.mean == pytest.approx(p.comm_abort_s.value + p.comm_init_s.value)


@pytest.mark.parametrize("kind, detect, waits", [
    (FailureKind.KILL, 0.09, 0.9),     # evicted on evidence (a reset + a missed agent heartbeat)
    (FailureKind.HANG, 6.69, 0.9),     # the culprit's agent ends it: the same evidence
    (FailureKind.FROZEN, 5.35, 0.65),  # the keep-alive's rest (6 s), never waited twice
])
def test_a_loss_is_out_of_the_rendezvous_after_its_eviction_wait(kind, detect, waits) -> None:
    c = GPU_7B_FSDP.costs(24, kind)
    assert GPU_7B_FSDP.detect_s(kind) == detect
    assert c.failure_reformation_s.mean == pytest.approx(GPU_7B_FSDP.rendezvous_s.value + waits)
    assert GPU_7B_FSDP.detect_hang_s.measured and GPU_7B_FSDP.evict_s.measured


def test_the_job_carries_layout_tier1_and_failure_kind() -> None:
    job = GPU_7B_FSDP.job(FailureKind.FROZEN)
    assert job.in_place and job.state is StateLayout.SHARDED and job.tier1 is Tier1.PARITY
    assert job.unannounced_kind is FailureKind.FROZEN
    assert job.step_time_s(32) == pytest.approx(1.0) and job.step_time_s(16) == pytest.approx(2.0)
    assert without_tier1(GPU_7B_FSDP).job().tier1 is Tier1.NONE


@pytest.mark.parametrize("field", ["storage_bw_node", "storage_bw_total"])
def test_the_simulated_job_pays_for_a_slower_store(field) -> None:
    """The storage bandwidth reaches the simulation, not only the derived costs: 4 nodes of the 7B job
    (24.5 GB of state each) for 2 h, one reclaimed with a GCP notice (30 s) and replaced, one lost
    without notice. At a quarter of the bandwidth (per node, or aggregate) every save and restore
    takes longer and the emergency checkpoint no longer fits the notice: lower ETTR, more waste from
    checkpoints, restores and recomputed work. With the runtime before 2026-11-29 (``abandon_in_place=
    False``) the cut-off save restarted the world from storage; since, the survivors keep their memory
    (parity covers the leaver's shard), so the slow store costs less than it did."""
    nodes = [f"n{i}" for i in range(4)]
    t = Trace((*(TraceEvent(0, "add", n) for n in nodes), TraceEvent(2400, "remove", "n3"), TraceEvent(2500, "add", "n4"),
               TraceEvent(5000, "remove", "n1"), TraceEvent(5100, "add", "n5")), 7200)
    auto, settings = IntervalPolicy(IntervalMode.AUTO), AutoSettings(min_s=60, max_s=3600, prior_mtbf_s=3600)

    def run(p, in_place=True):
        job = replace(p.job(), abandon_in_place=in_place)
        return simulate(t, p.costs(4), job, auto, settings=settings, lead_s=30.0, unannounced=[1])

    bw = getattr(GPU_7B_FSDP, field).value / (4 if field == "storage_bw_node" else 100)
    slow_profile = replace(GPU_7B_FSDP, **{field: P(bw, "assumption: t")})
    assert slow_profile.costs(4).periodic_persist_s.mean > 3 * GPU_7B_FSDP.costs(4).periodic_persist_s.mean
    storage = ("checkpoint", "restore", "recompute")

    def waste(r):
        return sum(r.waste_node_s[c] for c in storage)

    fast, slow = run(GPU_7B_FSDP, False), run(slow_profile, False)
    assert waste(slow) > waste(fast) + 4 * 60
    assert slow.ettr < fast.ettr - 0.01
    fast_now, slow_now = run(GPU_7B_FSDP), run(slow_profile)
    assert waste(slow_now) > waste(fast_now) and slow_now.ettr < fast_now.ettr
    assert waste(slow_now) < waste(slow) - 4 * 60 and slow_now.ettr > slow.ettr


def test_validation_costs_move_the_bytes_through_the_store_and_the_host_pipeline() -> None:
    """``spot_trace --validate``: a throttled store adds its transfer to the host pipeline the
    unthrottled replay measured (behind training for a periodic persist, stopped for an emergency
    checkpoint and a restore from storage, which reads the whole replicated state)."""
    from bench.spotsim import ChangeCosts, Dist
    from tests.harness import bench_module

    with bench_module("spot_trace.py") as st:
        _validation_costs(st, ChangeCosts, Dist)


def _validation_costs(st, ChangeCosts, Dist) -> None:
    base = {"measured_costs": {"trainguard": {"periodic_persist_s": [0.1], "periodic_overhead_s": [0.01]}}}
    host = st.HostPipeline(background=50e6, foreground=100e6, stage=500e6, source="t")
    measured = ChangeCosts(startup_s=Dist.of(7.0))
    c = st.physics_costs(measured, base, state_bytes=150e6, nodes=3, copy_bw=1e9, store_bw=25e6, host=host)
    share = 50e6
    assert c.periodic_overhead_s.mean == pytest.approx(0.01 + share / 500e6)
    assert c.periodic_persist_s.mean == pytest.approx(0.1 + share / 25e6 + share / 50e6)
    assert c.emergency_s.mean == pytest.approx(0.01 + share / 500e6 + 0.1 + share / 25e6 + share / 100e6)
    assert c.storage_restore_s.mean == pytest.approx(7.0 + 150e6 / 25e6 + 150e6 / 100e6)
    assert c.periodic_interference_s.mean == pytest.approx(share / 100e6)
    twice = st.physics_costs(measured, base, state_bytes=150e6, nodes=3, copy_bw=1e9, store_bw=50e6, host=host)
    assert twice.periodic_persist_s.mean == pytest.approx(c.periodic_persist_s.mean - share / 50e6)
    run = {"store_bytes_per_s": None, "runs": {"trainguard-auto": {"checkpoint_bytes": 150e6,
                                                                    "training_s_by_world_size": {"3": 10.0}}},
           "measured_costs": {"trainguard": {"periodic_persist_s": [1.1], "periodic_overhead_s": [0.05],
                                             "emergency_s": [0.65]}}}
    h = st.host_pipeline(run, base, "big.json")
    assert h.background == pytest.approx(share / 1.0) and h.foreground == pytest.approx(share / 0.5)
    assert h.stage == pytest.approx(share / 0.04)
    with pytest.raises(ValueError, match="unthrottled"):
        st.host_pipeline({**run, "store_bytes_per_s": 25e6}, base, "throttled.json")
