"""tests/fixtures/gloo_world.collect: a world that hangs fails the test with where it hangs, not a bare timeout."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures.gloo_world import FAULTHANDLER_ENV, collect

HANGS = "import time\nprint('started', flush=True)\ndef wait_for_peer():\n    time.sleep(600)\nwait_for_peer()\n"


def _spawn(code: str) -> subprocess.Popen:
    import os

    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **FAULTHANDLER_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_world_that_ends_gives_each_exit_code_and_output():
    procs = [_spawn("print('rank 0 done')"), _spawn("import sys; print('rank 1 failed'); sys.exit(3)")]
    assert collect(procs, 60) == [(0, "rank 0 done\n"), (3, "rank 1 failed\n")]


def test_a_hung_process_is_reported_with_its_stack_and_every_output():
    procs = [_spawn("print('rank 0 done')"), _spawn(HANGS)]
    with pytest.raises(TimeoutError) as err:
        collect(procs, 3)
    text = str(err.value)
    assert "still running after 3 s" in text
    assert "rank 0 done" in text and "started" in text  # what each printed, the hung one's before the timeout
    assert "wait_for_peer" in text  # its stack, from the SIGABRT
    assert all(p.poll() is not None for p in procs)  # nothing outlives the call
