"""examples/slurm/elastic.sbatch without a cluster: the batch script run by bash with stand-ins for ``srun``,
``scontrol`` and ``trainguard`` on PATH, to check what it does with its background store when a signal ends it
(scancel, the time limit). bash runs no EXIT trap when a signal kills it: before the fix the store outlived the
job (one was left behind by a cancelled test job of tests/service/test_slurm.py)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time

import pytest

from tests.harness import REPO

SCRIPT = os.path.join(REPO, "examples", "slurm", "elastic.sbatch")

STUBS = {
    # the store stand-in records its pid and waits (as `trainguard store` would, until a signal ends it)
    "trainguard": '#!/bin/bash\necho $$ > "$STUB_DIR/store.pid"\nexec sleep 600\n',
    "srun": '#!/bin/bash\necho $$ > "$STUB_DIR/srun.pid"\nexec sleep 600\n',  # the step: runs until the job ends
    "scontrol": "#!/bin/bash\necho node-a\n",  # `scontrol show hostnames`
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_that_ends_the_batch_script_ends_its_store(tmp_path, sig):
    for name, body in STUBS.items():
        path = tmp_path / name
        path.write_text(body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "STUB_DIR": str(tmp_path),
           "SLURM_JOB_ID": "4711", "SLURM_JOB_NODELIST": "node-a"}
    # (SIGINT at its default, as slurmd starts a batch script: a suite started in the background by a shell
    # inherits SIGINT ignored, and bash cannot trap a signal ignored at its start)
    batch = subprocess.Popen(["bash", SCRIPT, "trainguard", "run", "train.py"], env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pid_file = tmp_path / "store.pid"
    store = None
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.02)
        store = int(pid_file.read_text())
        time.sleep(0.3)  # the script is in its wait for the step now
        batch.send_signal(sig)
        assert batch.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while _alive(store) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(store), "the batch script's store outlived it"
    finally:
        batch.kill()
        batch.wait()
        for name in ("store.pid", "srun.pid"):  # Slurm would end the step; here the test does
            f = tmp_path / name
            if f.exists() and f.read_text().strip() and _alive(pid := int(f.read_text())):
                os.kill(pid, signal.SIGKILL)
