"""``bench/control_plane.py`` (issue 40) in a tiny configuration: its simulated nodes drive the agents'
real rendezvous path (torch's dynamic one and the keyed protocol) against a real ``trainguard store`` and
etcd with TLS, and every membership change forms the world the plan says (the figures themselves are the
bench's, not asserted here)."""

from __future__ import annotations

import math
import shutil

import pytest

from bench.control_plane import fit_exponent, measure, table


@pytest.mark.parametrize("protocol", ["dynamic", "keyed"])
@pytest.mark.parametrize("store", ["tcp", "etcd-tls"])
def test_four_simulated_nodes_form_leave_lose_and_join_worlds_of_the_planned_sizes(store, protocol):
    if store != "tcp" and shutil.which("etcd") is None:
        pytest.skip("etcd not installed (Debian package etcd-server; .ci/test installs it)")
    # keep-alive 5 s x 3: with 2 s x 2 the join phase failed twice under the suite's load, never alone ('no
    # round within 120 s' for one node), most likely a live node's starved keep-alive expiring after its
    # round completed (it then waits in the next round's wait list); not confirmed
    cfg = {"min_nodes": 2, "max_nodes": 5, "keep_alive_interval_s": 5, "keep_alive_max_attempts": 3,
           "join_timeout_s": 120.0, "last_call_timeout_s": 30.0}
    row = measure(4, 2, 6.0, cfg, store, protocol)  # a steady window longer than one keep-alive interval
    assert row["protocol"] == protocol
    for phase, world in (("form", 4), ("leave", 3), ("loss", 2), ("join", 3)):
        assert row[phase]["n_errors"] == 0, (phase, row[phase]["errors"])
        assert row[phase]["world_sizes"] == [world], (phase, row[phase])
        assert row[phase]["ops"] > 0 and row[phase]["bytes"] > 0
    assert row["steady"]["ops_per_s"] > 0  # the keep-alives reach the store
    assert "4" in table([row])


@pytest.mark.parametrize(("xs", "ys", "want"), [
    ([8, 32, 128], [1, 4, 16], 1.0),          # linear
    ([8, 32, 128], [1, 16, 256], 2.0),        # quadratic
    ([8, 32, 128], [5, 5, 5], 0.0),           # flat
    ([8], [1], None),                         # one point
    ([8, 32], [None, 3], None),               # a missing figure
])
def test_growth_exponent(xs, ys, want):
    got = fit_exponent(xs, ys)
    assert (got is None) if want is None else math.isclose(got, want, abs_tol=1e-9)
