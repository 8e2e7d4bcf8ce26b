"""The distribution installs one namespace, ``trainguard.*``, and never generic top-level modules."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_outside_repo(tmp_path, code):
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("generic", ["contract", "agent", "metrics", "checkpoint", "strategies", "examples"])
def test_generic_top_level_modules_are_not_installed(tmp_path, generic):
    r = run_outside_repo(tmp_path, f"import {generic}")
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr


def test_namespace_imports_and_console_script(tmp_path):
    r = run_outside_repo(tmp_path, "import trainguard.contract, trainguard.agent, trainguard.checkpoint, trainguard.metrics, "
                                   "trainguard.strategies, trainguard.examples.train_gpt; print(trainguard.agent.__version__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and r.stdout.strip() != "0.0.0+unknown"


@pytest.mark.parametrize("generic", ["runtime"])
def test_runtime_is_not_a_top_level_module(tmp_path, generic):
    r = run_outside_repo(tmp_path, f"import {generic}")
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr


def test_wheel_builds_without_setuptools_warnings_and_ships_the_data(tmp_path):
    import os
    import zipfile

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                        repo], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = (r.stdout + r.stderr).lower()
    assert "deprecat" not in out and "setuptoolswarning" not in out, out[-3000:]
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    assert "trainguard/metrics/dashboards/trainguard.json" in names
    assert any(n.startswith("trainguard/metrics/rules/") and n.endswith(".yml") for n in names)
    assert {f"trainguard/contract/protocol/{m}.py" for m in ("__init__", "env", "fields", "messages", "values")} <= set(names)
    assert not [n for n in names if n.split("/")[0] in ("contract", "agent", "metrics", "runtime", "checkpoint", "strategies")]


def test_demo_editable_install_prints_no_setuptools_notice(tmp_path):
    """examples/demo.sh's editable install, run as the script runs it (with this venv's setuptools,
    into a scratch --target, which leaves this venv's own install alone): setuptools' "Editable
    installation ... same name as your package" notice, which pip shows as BuildBackendWarning, does
    not reach the user."""
    import shlex

    with open(os.path.join(REPO, "examples", "demo.sh")) as fh:
        script = fh.read().replace("\\\n", "")
    (line,) = [ln for ln in script.splitlines() if "pip install" in ln and " -e ." in ln]
    line = line.replace(".venv/bin/python", shlex.quote(sys.executable)).replace(
        " -e .", f" --no-deps --no-build-isolation --target {shlex.quote(str(tmp_path / 'target'))} -e .")
    r = subprocess.run(["bash", "-c", f"set -o pipefail; {line}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert "Editable installation" not in out and "BuildBackendWarning" not in out, out[-3000:]
    assert any(n.startswith("__editable__") for n in os.listdir(tmp_path / "target")), out[-3000:]
    assert subprocess.run([sys.executable, "-c", "import trainguard.agent"], cwd=tmp_path).returncode == 0  # untouched
