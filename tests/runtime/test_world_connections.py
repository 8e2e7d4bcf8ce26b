"""A rank that parks after a peer failure ends its world's connections (runtime.reform
``end_world_connections``): a survivor blocked in a collective step that waits on it fails at once as
a peer failure, instead of waiting out the process-group timeout while it is parked (gloo closes a
group's connections only when its last reference goes, and DDP's reducer keeps one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import REPO, free_port
from trainguard.runtime.reform import is_peer_failure

HELPER = os.path.join(REPO, "tests", "_ended_world.py")


def run_pair(tmp_path, mode: str) -> str:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, HELPER, mode, str(r), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    done = tmp_path / "rank1_done"
    assert done.exists(), "\n".join(o[-2000:] for o in outs)
    return done.read_text()


@pytest.mark.timeout(200)
def test_a_parked_rank_ends_its_connections_and_the_blocked_peer_fails_at_once(tmp_path):
    ended = run_pair(tmp_path / "end", "end") if (tmp_path / "end").mkdir() is None else ""
    assert ended.startswith("rank0_alive "), ended  # failed while rank 0 was parked, not at its exit
    assert is_peer_failure(RuntimeError(ended)), ended
    assert int((tmp_path / "end" / "ended").read_text()) >= 1
    # Without it the blocked rank fails only when rank 0's process exits.
    kept = run_pair(tmp_path / "keep", "keep") if (tmp_path / "keep").mkdir() is None else ""
    assert kept.startswith("after_rank0_exit "), kept
