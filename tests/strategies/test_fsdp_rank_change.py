"""FSDP2 re-formed in place when the survivor's rank changes: rank 0 of a world of 2, alone in a world of
1, then rank 1 of a new world of 2 (a joiner sorted first). A ``DeviceMesh`` compares without its rank, so
DTensor's caches handed the re-sharded module the first world's mesh (coordinate 0) unless the runtime's
teardown clears them. Real gloo worlds, three processes."""

import json
import os
import sys

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)
ROLES = ("survivor", "peer", "joiner")


def _role(role: str, base: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.runtime import reform as rf
    from trainguard.strategies.fsdp import FSDPStrategy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    s = FSDPStrategy()
    s.keep_wrapped = True

    def world(name: str, rank: int, size: int) -> None:
        dist.init_process_group("gloo", init_method=f"file://{base}/{name}", rank=rank, world_size=size)

    def step(m, o) -> None:
        m(torch.randn(2, 8)).sum().backward()
        o.step()
        o.zero_grad()

    def report(m) -> None:
        with open(out_path, "w") as fh:
            json.dump({"rank": dist.get_rank(),
                       "coords": sorted({p.device_mesh.get_coordinate()[0] for p in m.module.parameters()})}, fh)

    if role == "survivor":
        world("w1", 0, 2)
        m, o = s.setup(model, opt)
        step(m, o)
        rf.teardown_world(torch.device("cpu"), peer_lost=False)
        world("w2", 0, 1)
        m, o = s.reform(m, o)
        step(m, o)
        rf.teardown_world(torch.device("cpu"), peer_lost=False)
        world("w3", 1, 2)
        report(s.reform(m, o)[0])
    elif role == "peer":
        world("w1", 1, 2)
        step(*s.setup(model, opt))
        os._exit(0)
    else:  # the joiner, rank 0 of the third world
        world("w3", 0, 2)
        report(s.setup(model, opt)[0])
    dist.barrier()
    os._exit(0)


def test_a_survivor_that_becomes_rank_1_shards_at_rank_1(tmp_path):
    outs = {role: str(tmp_path / f"{role}.json") for role in ROLES}
    codes, logs = run_ranks("tests.strategies.test_fsdp_rank_change",
                            [[role, str(tmp_path), outs[role]] for role in ROLES], timeout=90)
    assert codes == [0, 0, 0], "\n".join(log[-3000:] for log in logs)
    assert json.load(open(outs["joiner"])) == {"rank": 0, "coords": [0]}
    assert json.load(open(outs["survivor"])) == {"rank": 1, "coords": [1]}  # [0] before the caches were cleared


if __name__ == "__main__":
    _role(sys.argv[1], sys.argv[2], sys.argv[3])
