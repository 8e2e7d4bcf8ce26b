"""Checkpoint tests use the shared storage-server fixtures (the owner may also list the plugin in
``tests/conftest.py``; importing the fixtures here keeps this folder runnable on its own)."""

from tests.fixtures.storage import (  # noqa: F401
    chaos_proxy_factory,
    file_backend,
    gcs_env,
    gcs_server,
    gs_backend,
    moto_server,
    s3_backend,
    s3_env,
    storage_backend,
)

# torch imports torch._dynamo lazily on the first get_state_dict/DCP call, and that import sets
# TORCHINDUCTOR_CACHE_DIR in os.environ; do it at collection so the suite's env-leak guard does not
# blame whichever test happens to run first.
import torch._dynamo  # noqa: E402,F401

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _storage_servers(request: pytest.FixtureRequest) -> None:
    """Start the S3/GCS servers before any function-scoped fixture, so the suite's process-leak
    guard counts them as already running (they live for the session and are killed at its end).
    Tests reach them through ``request.getfixturevalue``, which would otherwise start them inside
    a test."""
    request.getfixturevalue("moto_server")
    request.getfixturevalue("gcs_server")
