"""Tier 1 over real processes and a real gloo group: a replication torn by a SIGKILL never replaces a
good replica. Two ranks on two "nodes" (two snapshot folders) replicate to each other after every
snapshot (steps 1 and 2 complete); at step 3 one of them is SIGKILLed in the middle of it:

* ``receiver``: rank 1 dies while it writes rank 0's step-3 replica into its folder (after the data,
  before the header and the commit word): the folder, which outlives the worker (its agent owns it),
  still offers rank 0's step 2, and never the torn step 3.
* ``sender``: rank 0 dies while its step-3 snapshot is on the wire (rank 1 reads late, so the send is
  still blocked on the socket): rank 1's receive fails, replication stops for the world, and its folder
  still offers rank 0's step 2.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import torch._dynamo  # noqa: F401 - its lazy import (by get_state_dict) sets TORCHINDUCTOR_CACHE_DIR; do it first

from tests.harness import free_port, run_ranks

pytestmark = pytest.mark.timeout(180)


def _state(width: int):  # noqa: ANN202 - the test's job: model, optimizer, trainer, checkpoint state
    import torch

    from trainguard.checkpoint.state import ModelOptimizerState, TrainerState

    torch.manual_seed(0)
    m = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    trainer = TrainerState(seed=3, cursor={"epoch": 0, "consumed": 0})
    return m, opt, trainer, {"app": ModelOptimizerState(m, opt), "trainer": trainer}


def _rank(rank: int, port: int, folder: str, mode: str, out: str, width: int) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.checkpoint import memory as mem
    from trainguard.checkpoint.replica import Replicator

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    m, opt, trainer, state = _state(width)
    tier = mem.MemoryTier(folder, rank=rank, world_size=2, copies=2)
    rep = Replicator(tier, group, rank=rank, world_size=2, local_world_size=1)
    for step in (1, 2, 3):
        opt.zero_grad()
        m(torch.randn(4, width)).pow(2).mean().backward()
        opt.step()
        trainer.step = step
        rep.settle()
        tier.snapshot(step, state, world="run/0")
        if step == 3 and mode == "receiver" and rank == 1:
            def die(*a, **k):  # in write_replica: the data is in, the header and commit word are not
                os.kill(os.getpid(), signal.SIGKILL)
            mem.dataclasses.replace = die  # type: ignore[assignment]
        if step == 3 and mode == "sender" and rank == 0:
            real_isend, sent = dist.isend, []

            def isend_then_die(tensor, *a, **k):
                work = real_isend(tensor, *a, **k)
                sent.append(tensor.numel())
                if len(sent) == 2:  # the data, not its length: the buddy is not reading it yet
                    time.sleep(0.5)
                    os.kill(os.getpid(), signal.SIGKILL)
                return work
            dist.isend = isend_then_die  # type: ignore[assignment]
        if step == 3 and mode == "sender" and rank == 1:
            real_irecv, asked = dist.irecv, []

            def late_irecv(tensor, *a, **k):
                asked.append(tensor.numel())
                if len(asked) == 2:  # the data: read late, the sender is blocked mid-send when it dies
                    time.sleep(1.5)
                return real_irecv(tensor, *a, **k)
            dist.irecv = late_irecv  # type: ignore[assignment]
        rep.replicate()
        rep.wait(60)
    with open(out, "w") as fh:
        json.dump({"failed": rep.failed, "last_step": rep.last_step}, fh)
    os._exit(0)  # no teardown collective with a peer that may be dead


def _held(folder: str, rank: int, width: int) -> list[tuple[int, int]]:
    from trainguard.checkpoint import memory as mem

    tier = mem.MemoryTier(folder, rank=rank, world_size=2, copies=2)
    try:
        return [(r, step) for r, step, _ in tier.provides(_state(width)[3]) if r != rank]
    finally:
        tier.close()


@pytest.mark.parametrize("mode, victim, width", [("receiver", 1, 64), ("sender", 0, 1024)])
def test_a_replication_torn_by_a_kill_never_replaces_the_good_replica(tmp_path, mode, victim, width):
    port = free_port()
    folders = [str(tmp_path / f"node{r}") for r in range(2)]
    outs = [str(tmp_path / f"r{r}.json") for r in range(2)]
    for f in folders:
        os.makedirs(f)
    codes, logs = run_ranks("tests.checkpoint.test_replica",
                            [[str(r), str(port), folders[r], mode, outs[r], str(width)] for r in range(2)], timeout=150)
    survivor = 1 - victim
    assert codes[victim] == -signal.SIGKILL, logs[victim][-3000:]
    assert codes[survivor] == 0, logs[survivor][-3000:]
    # The receiving node's folder offers the sender's step 2 (complete, checksummed), never a torn step 3:
    # step 3 was being received into step 1's slot (commit word zeroed first), step 2's stands.
    assert _held(folders[1], 1, width) == [(0, 2)]
    assert sorted(_commit_and_step(os.path.join(folders[1], n)) for n in os.listdir(folders[1])
                  if n.startswith("replica-")) == [(0, 1), (3, 2)]
    if mode == "sender":
        with open(outs[1]) as fh:
            got = json.load(fh)
        assert got["failed"] and got["last_step"] == 2, got
    # The other direction: rank 0 received rank 1's step 3 before rank 1 died (receiver case); rank 0 died
    # before it began to receive it (sender case: its slots are as step 2 left them).
    assert _held(folders[0], 0, width) == ([(1, 3), (1, 2)] if mode == "receiver" else [(1, 2), (1, 1)])


def _commit_and_step(path: str) -> tuple[int, int]:
    from trainguard.checkpoint import memory as mem

    with open(path, "rb") as fh:
        h = mem.Header.unpack(fh.read(mem.HEADER_BYTES))
    assert h is not None
    return h.commit, h.step


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]))
