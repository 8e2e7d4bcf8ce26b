"""Run real ``trainguard`` agents as subprocesses on localhost and read their JSON log events."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "train_gpt.py")


@contextmanager
def bench_module(script: str) -> Iterator[Any]:
    """``bench/<script>`` imported as a module (for its pure parts), registered while in use."""
    import importlib.util

    name = "tg_bench_" + script.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", script))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(name, None)


@pytest.fixture
def short_tmp():
    """A fresh folder with a short path (``/tmp/tg-XXXX``), removed after the test: a TMPDIR under
    which the agent's control socket path stays within the 107 bytes Unix sockets allow (pytest's own
    tmp_path is longer under pytest-xdist, ``.../popen-gw0/<test name>0``)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="tg-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(module: str, argv: list[list[str]], timeout: float) -> tuple[list[int], list[str]]:
    """Run ``python -m <module> *argv[r]`` once per rank, side by side (in the repository, one thread
    each, no ``TRAINGUARD_*`` variables); return their exit codes and outputs. What is still running at
    ``timeout`` is killed."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", module, *args], env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for args in argv]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    return [p.returncode for p in procs], logs


def parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process, from one scan of /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    out[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    return [p for p, pp in parent_pids().items() if pp == pid]


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid``, breadth first (from one scan of /proc)."""
    ppids = parent_pids()
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in ppids.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_listening(endpoint: str, timeout: float = 60.0) -> None:
    """Wait until something accepts TCP connections at ``host:port`` (the c10d store a hosting agent
    opens). Start the other nodes only then: under load a later agent could otherwise win the port
    and host the store itself, and a test that drains "the node that does not host" would drain it."""
    host, port = endpoint.rsplit(":", 1)

    def listening() -> bool:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            return False

    wait_until(listening, timeout, f"a store listening at {endpoint}")


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


LATE_NODES_S = float(os.environ.get("TG_TEST_LATE_NODES_S", "0") or 0)
"""A check of the multi-node tests by hand (``TG_TEST_LATE_NODES_S=6 bash .ci/test tests/e2e``): every node
but ``a`` starts this much later, as on a loaded machine where the first agent forms a world alone before
the others' are up (``nnodes 1:N``). The tests must hold either way. 0 (the default): no delay."""


def memory_root(tmp: str) -> str:
    """The ``checkpoint.memory_dir`` of the test whose temporary folder is ``tmp`` (a tmpfs folder of its own)."""
    return os.path.join("/dev/shm", "tg-test-" + hashlib.sha1(os.path.abspath(tmp).encode()).hexdigest()[:12])


def json_events(lines: list[str], name: str | None = None) -> list[dict[str, Any]]:
    """The JSON events among an agent's output ``lines`` (agent events, and its workers' lines with the
    ``[default0]:`` prefix stripped), those named ``name`` only when given."""
    out = []
    for line in lines:
        if line.startswith("[default"):
            line = line.split("]:", 1)[-1]
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if name is None or ev.get("event") == name:
            out.append(ev)
    return out


RDZV_PROTOCOL = os.environ.get("TG_TEST_RDZV_PROTOCOL", "")
"""``TG_TEST_RDZV_PROTOCOL=keyed pytest tests/e2e/...``: every :class:`Node` runs with that
``rendezvous.protocol`` (the agents otherwise get no ``TRAINGUARD_*`` variable of the test process)."""


class Node:
    """One agent (``trainguard run``) standing in for one node."""

    def __init__(self, name: str, tmp: str, endpoint: str, *, nnodes: str = "1:2", job: str = "job",
                 script_args: list[str] | None = None, extra: list[str] | None = None, env: dict[str, str] | None = None,
                 script: str = EXAMPLE, backend: str = "c10d", prefix: list[str] | None = None) -> None:
        """``prefix``: a command the agent runs under, e.g. ``ip netns exec <ns>`` (tests/fixtures/netns.py
        ``Netns.prefix``); it must exec the agent, so that ``pid`` stays the agent's."""
        if LATE_NODES_S > 0 and name != "a":
            time.sleep(LATE_NODES_S)
        self.name = name
        self.log_path = os.path.join(tmp, f"{name}.log")
        self.state_dir = os.path.join(tmp, f"state-{name}")
        cmd = [*(prefix or []), sys.executable, "-m", "trainguard.agent.cli", "run", "--nnodes", nnodes, "--nproc-per-node", "1",
               "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--node-name", name,
               "--state-dir", self.state_dir, "--log-dir", os.path.join(tmp, f"logs-{name}"),
               "--monitor-interval", "0.2", "--set", "agent.log_format=json", "--set", "preemption.sources=signal", "--set", "metrics.port=0",
               *(extra or []), script, *(script_args or [])]
        penv = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        # Tier 0 is on by default: each test's nodes keep their snapshots under a folder of that test's
        # own (two test processes run tests with the same job id and node names side by side).
        self.memory_root = memory_root(tmp)
        self._job = job
        penv.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                     "TRAINGUARD_CHECKPOINT_MEMORY_DIR": self.memory_root, **(env or {})})
        if RDZV_PROTOCOL and backend in ("c10d", "etcd"):  # the suite on another rendezvous protocol (issue 40)
            penv.setdefault("TRAINGUARD_RENDEZVOUS_PROTOCOL", RDZV_PROTOCOL)
        self._fh = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT, env=penv, cwd=REPO)
        self.socket = os.path.join(self.state_dir, f"{job}.sock")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def lines(self) -> list[str]:
        with open(self.log_path, errors="replace") as fh:
            return fh.read().splitlines()

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """Agent JSON events, and worker JSON lines (the ``[default0]:`` prefix stripped)."""
        return json_events(self.lines(), name)

    def worker_pids(self) -> list[int]:
        return [c for c in children(self.pid) if alive(c)]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Teardown: SIGKILL the agent and whatever it left (the test must not leak processes)."""
        if self.proc.poll() is None:
            kids = self.worker_pids()
            self.proc.kill()
            self.proc.wait(10)
            for k in kids:
                try:
                    os.kill(k, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._fh.close()
        # A killed agent leaves its tier-0 folder (by design: a restarted agent restores from it).
        from trainguard.agent.memtier import node_dir

        shutil.rmtree(node_dir(self.memory_root, self._job, self.name), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.memory_root)  # the test's last node removes it

    def dump(self, n: int = 40) -> str:
        return f"--- {self.name} (last {n} lines) ---\n" + "\n".join(self.lines()[-n:])


@contextmanager
def running(nodes: list[Node], tail: int = 40) -> Iterator[list[Node]]:
    """The e2e convention for a test's nodes (``nodes`` may grow inside): on a failed assertion print each
    node's last ``tail`` lines, and always stop them all."""
    try:
        yield nodes
    except AssertionError:
        for n in nodes:
            print(n.dump(tail))
        raise
    finally:
        for n in nodes:
            n.stop()


def continued(node: Node, world: int) -> list[dict[str, Any]]:
    """The job's rank 0 on ``node`` continuing at ``world``: ``resumed`` after a restart from a
    checkpoint, or ``reformed`` after an in-place re-formation (both carry the step it continues from)."""
    return [e for e in node.events() if e.get("event") in ("resumed", "reformed") and e.get("world_size") == world]


def notice_checkpoints(*nodes: Node) -> list[dict[str, Any]]:
    """The out-of-cycle checkpoints (``kind: notice``: an early warning's, or the insurance a notice that is
    trained through takes) the ranks of ``nodes`` committed."""
    return [e for n in nodes for e in n.events("checkpoint_committed")
            if e.get("kind") == "notice" and e.get("component") == "trainguard.checkpoint"]
