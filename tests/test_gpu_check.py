"""The prepared GPU check (bench/gpu_check.py, issue 35) proven on the CPU: its dry run runs every part
in its own process and writes the JSON the GPU run will write; the verdicts are a pure function of the
parts' figures (table test); a part that hangs costs its own timeout only."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.harness import REPO

SCRIPT = os.path.join(REPO, "bench", "gpu_check.py")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_writes_every_part_and_verdict(tmp_path):
    out = tmp_path / "gpu-check.json"
    r = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    mod = _module()
    assert rep["dry_run"] is True and list(rep["parts"]) == list(mod.PARTS)
    parts = {k: v["result"] for k, v in rep["parts"].items()}
    assert all(v["rc"] == 0 for v in rep["parts"].values())
    assert parts["env"]["import_trainguard.runtime"] == "ok"
    assert parts["d2h"]["staged_equal"] is True and parts["d2h"]["staging_bytes"] == parts["d2h"]["state_bytes"]
    assert {"blocked_s_per_gb", "gpu_stall_s_per_gb"} <= set(parts["save_stall"]) and len(parts["save_stall"]["saves"]) == 4
    assert parts["reform"]["growth"] == {"fds": 0, "threads": 0} and all(w["ok"] for w in parts["reform"]["worlds"])
    assert [w["teardown"] for w in parts["reform"]["worlds"]] == ["abort", "planned", "abort", "planned"]
    assert parts["tier0"]["snapshot_committed"] is True and parts["tier0"]["overhead"] > 0
    # The single-GPU tier is collected and every test of it skipped with the reason, none failed.
    py = parts["pytest_1gpu"]
    assert py["failed"] == 0 and py["skipped"] >= 6 and py["passed"] == 0, py
    assert all("needs 1+ CUDA GPU" in t["message"] for t in py["tests"].values()), py["tests"]
    assert set(rep["verdicts"]) == {"d2h_staging_over_peak", "tier0_overhead", "tier0_no_gpu_memory_growth",
                                    "reform_no_growth", "single_gpu_tests_green"}


def _parts(**over):
    base = {"d2h": {"staging_over_peak": 0.85}, "tier0": {"overhead": 1.02, "gpu_peak_bytes": 25e9,
                                                          "gpu_peak_delta_bytes": 0},
            "reform": {"growth": {"fds": 0, "threads": 0, "gpu_used": 0}},
            "pytest_1gpu": {"failed": 0, "passed": 7}}
    base.update(over)
    return {k: {"rc": 0, "result": v} for k, v in base.items() if v is not None}


@pytest.mark.parametrize(("over", "key", "want"), [
    ({}, "d2h_staging_over_peak", True),
    ({"d2h": {"staging_over_peak": 0.79}}, "d2h_staging_over_peak", False),
    ({"d2h": None}, "d2h_staging_over_peak", None),  # not measured is not a pass
    ({}, "tier0_overhead", True),
    ({"tier0": {"overhead": 1.05, "gpu_peak_bytes": 25e9, "gpu_peak_delta_bytes": 0}}, "tier0_overhead", False),
    ({"tier0": {"overhead": 1.01, "gpu_peak_bytes": 5e9, "gpu_peak_delta_bytes": 0}}, "tier0_overhead", False),
    ({"tier0": {"overhead": 1.01, "gpu_peak_bytes": 25e9, "gpu_peak_delta_bytes": 2**20}}, "tier0_no_gpu_memory_growth", False),
    ({"reform": {"growth": {"fds": 1, "threads": 0}}}, "reform_no_growth", False),
    ({}, "single_gpu_tests_green", True),
    ({"pytest_1gpu": {"failed": 1, "passed": 6}}, "single_gpu_tests_green", False),
    ({"pytest_1gpu": {"failed": 0, "passed": 0}}, "single_gpu_tests_green", False),  # all skipped: nothing verified
])
def test_verdicts(over, key, want):
    assert _module().verdicts(_parts(**over))[key] is want


def test_a_part_that_hangs_costs_its_timeout_only(monkeypatch):
    mod = _module()
    rec = mod.run_part("env", 0.5, True)  # far too short for an import of torch: killed at 0.5 s
    assert rec["rc"] == "timeout" and rec["seconds"] < 5
