"""The worker's explicit state (runtime/state.py): the documented transitions are the table, and a
worker's path through one re-formation follows it."""

import pytest

from trainguard.runtime.state import TRANSITIONS, WorkerState as W


def test_every_state_is_reachable_and_every_state_but_running_leads_back_to_it():
    targets = {to for _, to in TRANSITIONS}
    assert targets | {W.STANDBY} == set(W)  # STANDBY is where a warmed-up joiner starts
    for state in set(W) - {W.RUNNING}:  # follow the table: every path ends training again
        seen, frontier = {state}, {state}
        while frontier:
            frontier = {to for s, to in TRANSITIONS if s in frontier} - seen
            seen |= frontier
        assert W.RUNNING in seen, state


@pytest.mark.parametrize("path", [
    [W.RUNNING, W.BROKEN, W.PARKED, W.RESUMING, W.RUNNING],  # a peer vanished mid-step
    [W.RUNNING, W.PARKED, W.RESUMING, W.RUNNING],  # an agreed drain or resize survived in place
    [W.STANDBY, W.RUNNING],  # a warmed-up joiner's first world
])
def test_the_paths_a_worker_takes_are_transitions(path):
    assert all((a, b) in TRANSITIONS for a, b in zip(path, path[1:]))


@pytest.mark.parametrize("step", [(W.BROKEN, W.RUNNING), (W.PARKED, W.RUNNING), (W.RUNNING, W.STANDBY)])
def test_no_shortcut_around_a_re_formation(step):
    assert step not in TRANSITIONS
