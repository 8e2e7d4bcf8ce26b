#!/usr/bin/env bash
# Make .whl/: the pure-Python wheels the lent GPU machines lack (their image has Python 3.12, its own
# torch, fsspec, PyYAML, prometheus-client, pytest, nvidia-ml-py - but no structlog, and not this
# package), for `bash bench/gpu_check.sh` there. Run here, in the repository root's checkout:
#
#   bash bench/gpu_wheels.sh          (then carry .whl with the device command; see docs/gpu.md)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    -d .whl 'structlog>=24.1'
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl . 2>&1 | grep -v "^WARNING" || true
rm -rf build  # pip wheel's staging folder
ls -l .whl
