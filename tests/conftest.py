"""Suite-wide guards (Lightning's conftest idea): a test that leaks child processes, non-daemon
threads or environment variables fails, so every fixture has to clean up what it starts."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.harness import alive, children

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def no_leaks(request):
    env_before = dict(os.environ)
    kids_before = set(children(os.getpid()))
    threads_before = set(threading.enumerate())
    yield
    problems = []
    env_after = dict(os.environ)
    changed = sorted(k for k in set(env_before) | set(env_after)
                     if env_before.get(k) != env_after.get(k) and k != "PYTEST_CURRENT_TEST")
    if changed:
        problems.append(f"environment variables changed and not restored: {changed}")
        for k in changed:
            if k in env_before:
                os.environ[k] = env_before[k]
            else:
                os.environ.pop(k, None)
    deadline = time.monotonic() + 5
    leaked = []
    while time.monotonic() < deadline:
        leaked = [p for p in set(children(os.getpid())) - kids_before if alive(p)]
        if not leaked:
            break
        time.sleep(0.1)
    if leaked:
        problems.append(f"child processes left running: {leaked}")
        for p in leaked:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 3
    stray = []
    while time.monotonic() < deadline:
        stray = [t for t in set(threading.enumerate()) - threads_before if t.is_alive() and not t.daemon]
        if not stray:
            break
        time.sleep(0.05)
    if stray:
        problems.append(f"non-daemon threads left running: {[t.name for t in stray]}")
    if problems:
        pytest.fail(f"{request.node.nodeid} leaked: " + "; ".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def _structlog_config_restored():
    """A test that configures logging the way a worker does (``Runtime.from_env``) must not change
    where the next test's log lines go (``capsys`` reads stdout): the suite runs in any order."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
