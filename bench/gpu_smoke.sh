#!/usr/bin/env bash
# GPU smoke run: everything issue 19 could not verify on CPU (docs/gpu.md lists it item by item).
# Needs 2+ NVIDIA GPUs and a CUDA build of torch. On any other machine it prints why and exits 0
# without running anything (nothing is then verified on GPU).
#
#   bench/gpu_smoke.sh [OUT_DIR]     (default: gpu-smoke/; PYTHON=... picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-gpu-smoke}
count=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$count" -lt 2 ]; then
    echo "gpu_smoke: SKIPPED: needs 2+ CUDA GPUs, this machine has $count ($("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)')); nothing verified on GPU, see docs/gpu.md"
    exit 0
fi
mkdir -p "$OUT"
export CUDA_DEVICE_ORDER=PCI_BUS_ID   # as the agent sets for its workers
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
echo "== NVML view" | tee "$OUT/summary.txt"
nvidia-smi --query-gpu=index,uuid,pci.bus_id,name,memory.used,memory.total,utilization.gpu --format=csv \
    | tee "$OUT/nvml.csv" | tee -a "$OUT/summary.txt"
echo "== GPU test tier (pytest -m gpu)" | tee -a "$OUT/summary.txt"
"$PY" -m pytest -m gpu tests/gpu -v -rs 2>&1 | tee "$OUT/pytest.txt" | tail -20 | tee -a "$OUT/summary.txt"
echo "== device-generic tests on a CUDA build (device, staging, fsdp meta-init)" | tee -a "$OUT/summary.txt"
"$PY" -m pytest tests/test_device.py tests/test_checkpoint_staging.py tests/strategies/test_fsdp_meta.py -q 2>&1 \
    | tail -5 | tee -a "$OUT/summary.txt"
echo "== D2H staging throughput vs pinned memcpy" | tee -a "$OUT/summary.txt"
"$PY" bench/gpu_d2h.py --json "$OUT/gpu_d2h.json" | tee -a "$OUT/summary.txt"
echo "== checkpoint stall from the GPU" | tee -a "$OUT/summary.txt"
"$PY" bench/checkpoint_stall.py --device cuda --size-mb 2048 --json "$OUT/checkpoint_stall.json" | tee -a "$OUT/summary.txt"
echo "gpu_smoke: done; results in $OUT/" | tee -a "$OUT/summary.txt"
