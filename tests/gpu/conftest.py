"""The GPU tier (``pytest -m gpu``, or ``bench/gpu_smoke.sh``): needs 2+ CUDA GPUs; everywhere else
every test here is skipped with the reason. What it covers, and what has never run, is listed item by
item in docs/gpu.md."""

import pytest
import torch
import torch._dynamo  # noqa: F401 - its lazy import sets TORCHINDUCTOR_CACHE_DIR; do it before the env-leak guard


def pytest_collection_modifyitems(items):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return
    skip = pytest.mark.skip(reason=f"GPU tier: needs 2+ CUDA GPUs, this machine has {count} "
                                   f"(torch {torch.__version__}, CUDA {torch.version.cuda}); run bench/gpu_smoke.sh "
                                   f"on a GPU node; unverified items are listed in docs/gpu.md")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
