"""The GPU tier (``pytest -m gpu tests/gpu``, or ``bench/gpu_check.py`` on a single-GPU machine): split by
how many GPUs a test needs - ``test_gpu_single.py`` needs one (``@pytest.mark.gpus(1)``), ``test_gpu.py``
two or more (the default). Everywhere else each test is skipped with the reason. What it covers, and
what has never run, is listed item by item in docs/gpu.md."""

import pytest
import torch
import torch._dynamo  # noqa: F401 - its lazy import sets TORCHINDUCTOR_CACHE_DIR; do it before the env-leak guard


def needed_gpus(item) -> int:
    marker = item.get_closest_marker("gpus")
    return int(marker.args[0]) if marker is not None else 2


def pytest_collection_modifyitems(items):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "tests/gpu/" not in str(item.fspath).replace("\\", "/"):
            continue
        need = needed_gpus(item)
        if count < need:
            item.add_marker(pytest.mark.skip(
                reason=f"GPU tier: needs {need}+ CUDA GPU(s), this machine has {count} (torch {torch.__version__}, "
                       f"CUDA {torch.version.cuda}); run bench/gpu_check.py on a GPU node; unverified items are "
                       f"listed in docs/gpu.md"))
