"""The spot-trace bench's lineage (pure part of ``bench/spot_trace.py``): which records of the sample
log end up in the final model. Regression: a rank 0 SIGKILLed mid-step never writes the step that a
surviving rank finished and handed to the re-formed world; that step is in the lineage all the same."""

from __future__ import annotations

import pytest

from tests.harness import bench_module


@pytest.fixture(scope="module")
def spot():
    with bench_module("spot_trace.py") as mod:
        yield mod


def ex(spot, agent, step, rank, world, rnd, t):
    return spot.Exec(agent, step, rank, world, t - 1.0, t, (step,), rnd)


def test_a_step_only_a_surviving_rank_logged_stays_in_the_lineage(spot):
    # Round 0: ranks 0 (a) and 1 (b) train steps 1-2; a dies during step 3, which b finished (its
    # all-reduce completed). Round 1: b alone is rank 0 and continues at step 4.
    execs = [ex(spot, "a", 1, 0, 2, 0, 1), ex(spot, "b", 1, 1, 2, 0, 1.01), ex(spot, "a", 2, 0, 2, 0, 2),
             ex(spot, "b", 2, 1, 2, 0, 2.01), ex(spot, "b", 3, 1, 2, 0, 3.01), ex(spot, "b", 4, 0, 1, 1, 5)]
    kept, final = spot.lineage(execs)
    assert final == 4
    assert sorted({e.step for e in kept}) == [1, 2, 3, 4]
    leads = spot.leads(execs)
    assert [(e.step, e.rank) for e in leads] == [(1, 0), (2, 0), (3, 1), (4, 0)]


def test_a_redone_step_keeps_its_last_attempt_only(spot):
    # Step 2 was trained in round 0, then the world restored step 1 and trained step 2 again (round 1).
    execs = [ex(spot, "a", 1, 0, 2, 0, 1), ex(spot, "b", 1, 1, 2, 0, 1), ex(spot, "a", 2, 0, 2, 0, 2),
             ex(spot, "b", 2, 1, 2, 0, 2), ex(spot, "a", 2, 0, 1, 1, 4)]
    kept, final = spot.lineage(execs)
    assert final == 2
    assert sorted((e.step, e.round, e.rank) for e in kept) == [(1, 0, 0), (1, 0, 1), (2, 1, 0)]
