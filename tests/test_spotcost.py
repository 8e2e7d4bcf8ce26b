"""The spot simulator's cost model (``bench/spotcost.py``): parameters carry their source, and the
derived costs follow the physics (bytes over bandwidth, shares of sharded state, per-kind detection)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.spotcost import GB, GPU_7B_FSDP, NOTICE_S, PROFILES, Cloud, P, without_tier1
from bench.spotsim import FailureKind, StateLayout, Tier1


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
    """98 GB sharded over 24 nodes: each writes 4.08 GB at min(1 GB/s, 25/24 GB/s) = 1 GB/s; at twice the
    per-node bandwidth the aggregate (25 GB/s / 24) caps it; a replicated state is read whole per node."""
    p = replace(GPU_7B_FSDP, state_bytes=P(96 * GB, "assumption: t"))
    c = p.costs(24)
    share = 4 * GB
    assert c.periodic_persist_s.mean == pytest.approx(p.save_fixed_s.value + share / GB)
    assert c.periodic_overhead_s.mean == pytest.approx(p.stage_fixed_s.value + share / (20 * GB * 8))
    assert c.emergency_s.mean == pytest.approx(c.periodic_persist_s.mean + c.periodic_overhead_s.mean)
    fast = replace(p, storage_bw_node=P(2 * GB, "assumption: t")).costs(24)
    assert fast.periodic_persist_s.mean == pytest.approx(p.save_fixed_s.value + share / (25 * GB / 24))
    assert c.cold_restore_s.mean == pytest.approx(share / GB + p.comm_init_s.value)
    rep = replace(p, state=StateLayout.REPLICATED).costs(24)
    assert rep.cold_restore_s.mean == pytest.approx(96 * GB / GB + p.comm_init_s.value)
    assert rep.failure_restore_s.mean == pytest.approx(p.comm_abort_s.value + p.comm_init_s.value)


@pytest.mark.parametrize("kind, detect, waits", [(FailureKind.KILL, 0.09, 6 - 0.09), (FailureKind.FROZEN, 6, 0)])
def test_a_loss_waits_out_the_keep_alive_once(kind, detect, waits) -> None:
    c = GPU_7B_FSDP.costs(24, kind)
    assert GPU_7B_FSDP.detect_s(kind) == detect
    assert c.failure_reformation_s.mean == pytest.approx(GPU_7B_FSDP.rendezvous_s.value + waits)


def test_the_job_carries_layout_tier1_and_failure_kind() -> None:
    job = GPU_7B_FSDP.job(FailureKind.FROZEN)
    assert job.in_place and job.state is StateLayout.SHARDED and job.tier1 is Tier1.PARITY
    assert job.unannounced_kind is FailureKind.FROZEN
    assert job.step_time_s(32) == pytest.approx(1.0) and job.step_time_s(16) == pytest.approx(2.0)
    assert without_tier1(GPU_7B_FSDP).job().tier1 is Tier1.NONE
