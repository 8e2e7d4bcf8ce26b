"""Multi-process (gloo, localhost) checks that ddp and fsdp survive world-size changes.

One reference run per strategy trains 12 steps at a fixed world size 2 with checkpoints at 4, 8, 12.
Then, from its step-4 checkpoint:

* **exact resume** — restored at 2 ranks (``--resume-step 4``) and at 1 rank, the loss of step 5 (the
  first step after the restore) equals the reference's step-5 loss within 1e-6 (fp32);
* **elastic determinism** — the 1-rank segment trains 4 -> 8 and checkpoints, a 2-rank segment
  restores 8 and trains to 12 (a 2 -> 1 -> 2 run: the reference's first segment is shared); its step-12
  loss is within 1e-3 of the reference's.

The global batch is 8 at every size (2 ranks x 2 micro-batches x 2 samples, or 1 x 4 x 2).
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest

from tests.strategies._world import losses, run_segment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
STEPS, EVERY = 12, 4


def _elastic(tmp_path, strategy: str, *, exact_at_2: bool) -> dict[str, float]:
    ref_dir, el_dir = str(tmp_path / "ref"), str(tmp_path / "elastic")
    ref_log, el_log = str(tmp_path / "ref.jsonl"), str(tmp_path / "elastic.jsonl")
    run_segment(2, strategy, ref_dir, steps=STEPS, interval=EVERY, fence=0, loss_log=ref_log)
    ref = losses(ref_log)
    assert sorted(ref) == list(range(1, STEPS + 1))
    # The elastic run's first segment (0 -> 4 at 2 ranks) is the reference's: start from its step 4.
    os.makedirs(os.path.join(el_dir, "run"))
    step4 = glob.glob(os.path.join(ref_dir, "run", "step-000000000004-e*"))[0]  # named by step and epoch
    shutil.copytree(step4, os.path.join(el_dir, "run", os.path.basename(step4)))

    figures: dict[str, float] = {}
    if exact_at_2:
        at2 = str(tmp_path / "at2.jsonl")
        run_segment(2, strategy, ref_dir, steps=5, interval=0, fence=1, loss_log=at2, extra=["--resume-step", "4"])
        figures["restore_at_2_step5_delta"] = abs(losses(at2)[5] - ref[5])
    run_segment(1, strategy, el_dir, steps=8, interval=EVERY, fence=1, loss_log=el_log)
    first = losses(el_log)
    assert sorted(first) == [5, 6, 7, 8], "the 1-rank segment must resume at step 5"
    figures["restore_at_1_step5_delta"] = abs(first[5] - ref[5])
    run_segment(2, strategy, el_dir, steps=STEPS, interval=EVERY, fence=2, loss_log=el_log)
    el = losses(el_log)
    assert sorted(el) == list(range(5, STEPS + 1))
    figures["final_step12_delta"] = abs(el[STEPS] - ref[STEPS])
    figures["max_delta_steps5_12"] = max(abs(el[s] - ref[s]) for s in el)
    print(f"{strategy}: " + " ".join(f"{k}={v:.3g}" for k, v in figures.items()) + f" ref_loss12={ref[STEPS]:.6f}")
    return figures


def test_fsdp_exact_resume_at_1_and_2_and_elastic_determinism(tmp_path):
    f = _elastic(tmp_path, "fsdp", exact_at_2=True)
    assert f["restore_at_2_step5_delta"] <= 1e-6
    assert f["restore_at_1_step5_delta"] <= 1e-6
    assert f["final_step12_delta"] <= 1e-3


def test_ddp_elastic_determinism(tmp_path):
    f = _elastic(tmp_path, "ddp", exact_at_2=False)
    assert f["restore_at_1_step5_delta"] <= 1e-6
    assert f["final_step12_delta"] <= 1e-3
