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
.venv/bin/python -m pip install -q -e . 2>&1 | grep -v "^WARNING: Location" || true
exec .venv/bin/python examples/demo.py "$@"
