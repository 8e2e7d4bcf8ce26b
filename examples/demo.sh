#!/usr/bin/env bash
# The demo command (README): installs trainguard into .venv on a machine with Python 3.11, then runs
# two local agents (two "nodes") through a spot notice, a resize and a rejoin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
# The package maps trainguard.agent -> agent/ etc. (pyproject.toml package-dir), which is not a layout
# setuptools can install editable with a plain .pth, so it installs an import finder and always says
# "Editable installation ... folders in your working directory with the same name as your package".
# No setting removes it without harm: editable_mode=compat puts the checkout on sys.path (agent/,
# runtime/, ... importable as top-level packages: what the notice warns of), strict mode prints its
# own notice, and a non-editable install would leave .venv (the tests' too) on a stale copy after
# an edit. The notice says nothing to act on here, so this one call filters it (by its text, through
# the warning filter pip's build-backend process inherits).
PYTHONWARNINGS="ignore:Editable installation" \
  .venv/bin/python -m pip install -q -e . 2>&1 | grep -v "^WARNING: Location" || true
exec .venv/bin/python examples/demo.py "$@"
