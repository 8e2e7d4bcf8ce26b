"""Same script, same flags, under ``torchrun`` and ``trainguard run --standalone --nproc-per-node 2``: the
workers' environments match, except for what is per-run (ports, run id, error file) and what
trainguard adds on purpose (``TRAINGUARD_RT_*``, its metrics channel, store sharing turned off — see
:mod:`trainguard.agent.supervisor`). In particular ``OMP_NUM_THREADS=1`` (torchrun's default with
several workers per node, with its warning) and ``ROLE_NAME=default``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import short_tmp  # noqa: F401 - a fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
SCRIPT = os.path.join(os.path.dirname(__file__), "_dump_env.py")
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
# CUDA_DEVICE_ORDER=PCI_BUS_ID: LOCAL_RANK k, NVML device k and nvidia-smi name the same GPU (workerenv.gpu_defaults)
TRAINGUARD_ONLY = {"PROMETHEUS_MULTIPROC_DIR", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "CUDA_DEVICE_ORDER",
                   "TORCH_FR_BUFFER_SIZE"}
DELIBERATE = {"TORCHELASTIC_USE_AGENT_STORE",  # trainguard turns store sharing off (see the supervisor's docstring)
              "TORCH_NCCL_ASYNC_ERROR_HANDLING"}  # 2 in place (abort the communicator, survive), 3 on restarts


def worker_envs(cmd: list[str], out: str, env: dict[str, str], cwd: str) -> tuple[dict[int, dict[str, str]], str]:
    os.makedirs(out)
    r = subprocess.run([*cmd, SCRIPT, out], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    envs = {}
    for rank in (0, 1):
        with open(os.path.join(out, f"rank-{rank}.json")) as fh:
            envs[rank] = json.load(fh)
    return envs, r.stderr


def test_worker_env_matches_torchrun(short_tmp):
    tmp = short_tmp
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINGUARD_", "TORCHELASTIC_")) and k not in ("OMP_NUM_THREADS", "XDG_RUNTIME_DIR")}
    env["TMPDIR"] = tmp
    torchrun, torchrun_err = worker_envs([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc-per-node", "2"], os.path.join(tmp, "torchrun"), env, tmp)
    ours, ours_err = worker_envs([sys.executable, "-m", "trainguard.agent.cli", "run", "--standalone", "--nproc-per-node",
                                  "2", "--max-restarts", "0", "--set", "metrics.port=0", "--set", "preemption.sources=none",
                                  "--set", "agent.log_format=json"], os.path.join(tmp, "trainguard"), env, tmp)
    assert "Setting OMP_NUM_THREADS environment variable for each process to be 1" in torchrun_err
    assert '"event": "omp_num_threads_defaulted"' in ours_err  # the same warning, in our words
    for rank in (0, 1):
        a, b = torchrun[rank], ours[rank]
        assert a["OMP_NUM_THREADS"] == b["OMP_NUM_THREADS"] == "1"
        assert a["ROLE_NAME"] == b["ROLE_NAME"] == "default"
        assert b["TRAINGUARD_RT_PG_TIMEOUT_S"] == "600.0"  # workers.pg_timeout_s reaches the runtime
        only_torchrun = set(a) - set(b)
        assert not only_torchrun, f"torchrun gives workers {sorted(only_torchrun)}, trainguard does not"
        extra = {k for k in set(b) - set(a) if not k.startswith("TRAINGUARD_RT_")}
        assert extra <= TRAINGUARD_ONLY, sorted(extra)
        differ = {k for k in set(a) & set(b) if a[k] != b[k]} - PER_RUN - DELIBERATE
        assert not differ, {k: (a[k], b[k]) for k in differ}
        assert {k for k in set(a) & set(b) if a[k] != b[k]} >= {"MASTER_PORT"}  # two runs really took place
