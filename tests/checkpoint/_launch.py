"""Launch a small gloo world of worker scripts on 127.0.0.1 and make sure none outlives the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.fixtures.gloo_world import FAULTHANDLER_ENV, collect
from tests.fixtures.storage import free_port

ROOT = Path(__file__).resolve().parents[2]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **FAULTHANDLER_ENV, "OMP_NUM_THREADS": "1", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(extra or {})
    return env


def run_world(script: str, world: int, args: list[str], *, env: dict[str, str] | None = None,
              timeout: float = 120.0) -> list[tuple[int, str]]:
    """Run ``world`` ranks of ``script`` (a path under tests/checkpoint); return (rc, output) per rank."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "checkpoint" / script), "--rank", str(r),
                               "--world", str(world), "--port", str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(env), cwd=ROOT)
             for r in range(world)]
    return collect(procs, timeout)


def opts_arg(storage_options: dict[str, Any]) -> str:
    return json.dumps(storage_options)
