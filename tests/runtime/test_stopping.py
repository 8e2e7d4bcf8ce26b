"""A survivor whose peer vanished without a reset gives up its emergency save at the drain deadline
(issue 19), not after the process-group timeout (``workers.pg_timeout_s``, here 600 s; torch's gloo
default is 30 minutes): it exits with the resize code, the last committed step stands and the loss is
logged (``checkpoint_abandoned``).

The peer is frozen with SIGSTOP after both ranks committed step 1: its sockets stay open and the
kernel keeps acknowledging, so the survivor's gloo collective sees neither a reset nor data — what a
host that dropped off the network looks like."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.harness import REPO, free_port
from trainguard.contract import protocol as proto

DEADLINE_S = 3.0


def test_emergency_save_abandoned_at_drain_deadline(tmp_path):
    port = free_port()
    ready = str(tmp_path / "rank1-stopping")
    rtenv = proto.RuntimeEnv(job_id="run", pg_timeout_s=600,
                             checkpoint={"url": str(tmp_path / "ckpt"), "interval_steps": 1, "async_save": False}).to_env()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    procs = []
    for r in range(2):
        env = {**base, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RANK": str(r), "LOCAL_RANK": str(r),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               **rtenv}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.deadline_worker", ready, str(DEADLINE_S)],
                                      env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    survivor, frozen = procs
    try:
        out, _ = survivor.communicate(timeout=120)
        ended = time.time()
    finally:
        frozen.send_signal(signal.SIGKILL)  # SIGKILL ends a stopped process too
        frozen.wait(timeout=30)
        if survivor.poll() is None:
            survivor.kill()
            survivor.wait(timeout=30)
    assert survivor.returncode == proto.EXIT_RESIZE, out[-3000:]
    started = float(next(line.split()[1] for line in out.splitlines() if line.startswith("EMERGENCY_START")))
    waited = ended - started
    assert DEADLINE_S - 0.5 <= waited < DEADLINE_S + 15, (waited, out[-3000:])  # not 600 s
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    abandoned = [e for e in events if e.get("event") == "checkpoint_abandoned"]
    assert len(abandoned) == 1, out[-3000:]
    assert abandoned[0]["last_committed"] == 1 and abandoned[0]["lost_steps"] == 1 and abandoned[0]["step"] == 2
    committed = sorted(d for d in os.listdir(tmp_path / "ckpt" / "run")
                       if os.path.exists(tmp_path / "ckpt" / "run" / d / "manifest.json"))
    assert [d.split("-e")[0] for d in committed] == ["step-000000000001"]  # step 1 stands; step 2 never committed
