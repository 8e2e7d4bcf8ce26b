"""The distribution installs one namespace, ``trainguard.*``, and never generic top-level modules."""

import subprocess
import sys

import pytest


def run_outside_repo(tmp_path, code):
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("generic", ["agent", "metrics", "checkpoint", "strategies", "examples"])
def test_generic_top_level_modules_are_not_installed(tmp_path, generic):
    r = run_outside_repo(tmp_path, f"import {generic}")
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr


def test_namespace_imports_and_console_script(tmp_path):
    r = run_outside_repo(tmp_path, "import trainguard.agent, trainguard.checkpoint, trainguard.metrics, "
                                   "trainguard.strategies, trainguard.examples.train_gpt; print(trainguard.agent.__version__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and r.stdout.strip() != "0.0.0+unknown"
