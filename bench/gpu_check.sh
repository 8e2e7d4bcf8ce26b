#!/usr/bin/env bash
# The GPU check on a lent machine as it is (docs/gpu.md): installs the carried wheels from .whl/
# (made here by bench/gpu_wheels.sh) with pip --no-index --target, then runs bench/gpu_check.py.
#
#   bash bench/gpu_check.sh [OUT_DIR] [gpu_check.py options]   (default OUT_DIR: $OUT, else gpu-check/)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-gpu-check}}
shift || true
mkdir -p "$OUT_DIR"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tg-site .whl/*.whl \
        || { echo "gpu_check: installing .whl/ failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/tg-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID
"$PY" bench/gpu_check.py --out "$OUT_DIR/gpu-check.json" "$@" 2>&1 | tee "$OUT_DIR/gpu-check.log"
exit "${PIPESTATUS[0]}"
