"""``systemd-analyze verify`` on the shipped units must print nothing at all.

``systemd-analyze verify`` exits 0 on unknown keys and unparsable values (it only warns), so any
line on stdout or stderr is a failure. It also checks that ``ExecStart=`` binaries exist: the
units are verified unchanged under ``--root`` of a temp tree holding the host's unit directory
(for ``sysinit.target`` & co.) and a stand-in ``/usr/local/bin/trainguard``.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = ["trainguard-agent.service", "trainguard-store.service"]
SYSTEM_UNIT_DIRS = [Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")]

pytestmark = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed: apt-get install systemd",
)


@pytest.fixture(scope="module")
def verify_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sdroot")
    host_units = next((d for d in SYSTEM_UNIT_DIRS if (d / "sysinit.target").exists()), None)
    if host_units is None:
        pytest.skip("no system unit directory with sysinit.target on this host")
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree(host_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "lib").symlink_to("usr/lib")
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(REPO / "systemd" / unit, root / "etc/systemd/system" / unit)
    shim = root / "usr/local/bin/trainguard"
    shim.parent.mkdir(parents=True)
    shim.write_text("#!/bin/sh\nexit 0\n")
    shim.chmod(0o755)
    return root


def _verify(root: Path, unit: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", unit],
        capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize("unit", UNITS)
def test_unit_verifies_without_any_output(verify_root: Path, unit: str) -> None:
    r = _verify(verify_root, unit)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", (
        f"systemd-analyze verify {unit}: rc={r.returncode}\n{r.stdout}{r.stderr}"
    )


def test_verify_would_catch_a_bad_key(verify_root: Path) -> None:
    """Guard against a vacuous pass: a broken copy of the unit does produce output."""
    bad = verify_root / "etc/systemd/system/trainguard-broken.service"
    text = (REPO / "systemd/trainguard-agent.service").read_text()
    bad.write_text(text.replace("LockPersonality=yes", "LockPersonality=yes\nFrobnicate=yes"))
    r = _verify(verify_root, bad.name)
    assert "Unknown key" in r.stdout + r.stderr
    bad.unlink()


def _service(unit: str) -> configparser.SectionProxy:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read(REPO / "systemd" / unit)
    return cp["Service"]


def test_agent_unit_contract() -> None:
    """The settings the drain protocol and GPU workers depend on."""
    s = _service("trainguard-agent.service")
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    assert s["ExecStart"].startswith("/usr/local/bin/trainguard agent --config /etc/trainguard/agent.yaml")
    # KillMode/KillSignal: what a stop *does* is tested in test_unit_stop.py, through the unit's semantics
    assert int(s["TimeoutStopSec"]) >= 120 + 30  # AWS notice window + checkpoint
    assert s["Restart"] == "on-failure" and s["OOMPolicy"] == "continue"
    assert s["EnvironmentFile"] == "-/etc/trainguard/agent.env"
    assert int(s["WatchdogSec"]) > 0
    for key in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "ProtectKernelTunables",
                "ProtectKernelModules", "RestrictSUIDSGID", "LockPersonality"):
        assert key in s, key
    assert s["SystemCallArchitectures"] == "native" and s["ProtectProc"] == "invisible"
    # the control socket's directory: private to the service user, $RUNTIME_DIRECTORY for the agent
    assert s["RuntimeDirectory"] == "trainguard" and s["RuntimeDirectoryMode"] == "0700"
    assert "ProcSubset" not in s
    # GPUs: workers need /dev/nvidia*; CUDA/Triton JIT needs W+X pages.
    assert "PrivateDevices" not in s and "MemoryDenyWriteExecute" not in s and "DevicePolicy" not in s


def test_store_unit_contract() -> None:
    s = _service("trainguard-store.service")
    assert s["Type"] == "notify"
    assert s["ExecStart"] == "/usr/local/bin/trainguard store --host 0.0.0.0 --port 29400"
    assert s["Restart"] == "on-failure"
