"""Spot clusters: with the rendezvous store outside the worker nodes (``trainguard store`` or etcd-v2),
losing any worker node — SIGKILL, no notice — is survivable."""

import socket
import subprocess
import sys
import time

import pytest

from tests.fixtures.etcd import start_etcd
from tests.harness import REPO, Node, free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ARGS = ["--steps", "100000", "--log-every", "5", "--step-sleep", "0.02", "--global-batch", "24"]


def worlds(node):
    return [e["world_size"] for e in node.events("rendezvous_complete")]


def _listening(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def external_store(tmp_path):
    port = free_port()
    log = open(tmp_path / "store.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.agent.cli", "store", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_until(lambda: _listening(port), 30, "trainguard store to listen")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


@pytest.fixture
def etcd(tmp_path):
    with start_etcd(tmp_path / "etcd") as server:
        yield server.endpoint


@pytest.mark.parametrize("backend", ["c10d-external-store", "etcd-v2"])
def test_sigkill_of_one_node_in_three_survivors_continue(tmp_path, backend, request):
    endpoint = request.getfixturevalue("external_store" if backend.startswith("c10d") else "etcd")
    rdzv = "c10d" if backend.startswith("c10d") else "etcd-v2"
    extra = ["--set", "rendezvous.is_host=false"] if rdzv == "c10d" else []
    nodes = [Node(n, str(tmp_path), endpoint, nnodes="2:3", script_args=ARGS, extra=extra, backend=rdzv) for n in "abc"]
    try:
        wait_until(lambda: all(worlds(n)[-1:] == [3] for n in nodes), 120, "world size 3")
        trainer = wait_until(lambda: next((n for n in nodes if n.events("train_step")), None), 90, "training")
        victim = trainer  # the hardest case: the node printing (global rank 0) is lost
        kids = victim.worker_pids()
        victim.proc.kill()  # a spot node vanishing: no notice, no drain
        victim.proc.wait(10)
        wait_until(lambda: not any(k for k in kids if _alive(k)), 10, "the victim's workers to die with it")
        survivors = [n for n in nodes if n is not victim]
        t0 = time.monotonic()
        wait_until(lambda: all(worlds(n)[-1:] == [2] for n in survivors), 120, "survivors re-form at 2")
        print(f"{backend}: re-formed {time.monotonic() - t0:.1f}s after SIGKILL")
        wait_until(lambda: any(e["world_size"] == 2 for n in survivors for e in n.events("train_step")), 90,
                   "training at world size 2")
        assert all(n.proc.poll() is None for n in survivors)
    except AssertionError:
        print(*(n.dump(30) for n in nodes), sep="\n")
        raise
    finally:
        for n in nodes:
            n.stop()


def _alive(pid):
    from tests.harness import alive

    return alive(pid)
