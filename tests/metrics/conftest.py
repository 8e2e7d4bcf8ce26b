"""Fixtures for the metrics tests: fake NVML, worker processes, the real-Prometheus fixture."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCER = Path(__file__).with_name("producer.py")


def _load_fixture_module(name: str) -> Any:
    """Import ``tests/fixtures/<name>.py`` under a private module name (never via ``sys.path``)."""
    modname = f"trainguard_fixtures_{name}"
    if modname in sys.modules:
        return sys.modules[modname]
    spec = importlib.util.spec_from_file_location(modname, REPO / "tests" / "fixtures" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    spec.loader.exec_module(module)
    return module


_prom = _load_fixture_module("prometheus")
prometheus_factory = _prom.prometheus_factory
promtool = _prom.promtool


class FakeNvml:
    """The slice of the ``pynvml`` API the GPU sampler uses, with scripted devices.

    ``devices``: list of ``(used_bytes, total_bytes, util_percent)``; ``fail_init`` raises from
    ``nvmlInit``; ``broken`` lists device indices whose memory read raises.
    """

    class NVMLError(Exception):
        pass

    @dataclass
    class _Mem:
        used: int
        total: int
        free: int

    @dataclass
    class _Util:
        gpu: int
        memory: int

    def __init__(self, devices: list[tuple[int, int, int]], *, fail_init: bool = False,
                 broken: tuple[int, ...] = ()) -> None:
        self.devices = devices
        self.fail_init = fail_init
        self.broken = set(broken)
        self.init_calls = 0
        self.shutdown_calls = 0

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        if h in self.broken:
            raise self.NVMLError("GPU is lost")
        used, total, _ = self.devices[h]
        return self._Mem(used, total, total - used)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return self._Util(self.devices[h][2], 0)


@pytest.fixture
def fake_nvml() -> FakeNvml:
    """Two GPUs: 1 GiB of 80 GiB at 50 %, 2 GiB of 80 GiB at 75 %."""
    return FakeNvml([(1 << 30, 80 << 30, 50), (2 << 30, 80 << 30, 75)])


class Workers:
    """Producer processes started for one test; all killed at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
        full_env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen([sys.executable, str(PRODUCER), *args], env=full_env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        return p

    def wait_step(self, p: subprocess.Popen[str], step: int, timeout_s: float = 30.0) -> int:
        """Read ``p``'s output until it reported ``step`` (or more); returns the step reached."""
        import select
        import time

        assert p.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r, _, _ = select.select([p.stdout], [], [], 0.5)
            if not r:
                continue
            line = p.stdout.readline()
            if not line:
                raise AssertionError(f"worker {p.pid} exited with {p.poll()} before step {step}")
            if line.startswith("step "):
                n = int(line.split()[1])
                if n >= step:
                    return n
        raise AssertionError(f"worker {p.pid} did not reach step {step} in {timeout_s} s")

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()


@pytest.fixture
def workers() -> Iterator[Workers]:
    w = Workers()
    try:
        yield w
    finally:
        w.kill_all()
