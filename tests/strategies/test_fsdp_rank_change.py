"""FSDP2 re-formed in place when the survivor's rank changes: rank 0 of a world of 2, alone in a world of
1, then rank 1 of a new world of 2 (a joiner sorted first). A ``DeviceMesh`` compares without its rank, so
DTensor's caches handed the re-sharded module the first world's mesh (coordinate 0) unless the runtime's
teardown clears them. Real gloo worlds, three processes."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

WORKER = r"""
import json, os, sys, torch, torch.distributed as dist
from trainguard.runtime import reform as rf
from trainguard.strategies.fsdp import FSDPStrategy
role, base = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
s = FSDPStrategy()
s.keep_wrapped = True
def world(name, rank, size):
    dist.init_process_group("gloo", init_method=f"file://{base}/{name}", rank=rank, world_size=size)
def step(m, o):
    m(torch.randn(2, 8)).sum().backward(); o.step(); o.zero_grad()
def coords(m):
    return sorted({p.device_mesh.get_coordinate()[0] for p in m.module.parameters()})
if role == "survivor":
    world("w1", 0, 2); m, o = s.setup(model, opt); step(m, o)
    rf.teardown_world(torch.device("cpu"))
    world("w2", 0, 1); m, o = s.reform(m, o); step(m, o)
    rf.teardown_world(torch.device("cpu"))
    world("w3", 1, 2); m, o = s.reform(m, o)
    print(json.dumps({"rank": dist.get_rank(), "coords": coords(m)}), flush=True)
elif role == "peer":
    world("w1", 1, 2); m, o = s.setup(model, opt); step(m, o)
    os._exit(0)
else:  # the joiner, rank 0 of the third world
    world("w3", 0, 2); m, o = s.setup(model, opt)
    print(json.dumps({"rank": dist.get_rank(), "coords": coords(m)}), flush=True)
dist.barrier()
os._exit(0)
"""


def test_a_survivor_that_becomes_rank_1_shards_at_rank_1(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {role: subprocess.Popen([sys.executable, "-c", WORKER, role, str(tmp_path)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
             for role in ("survivor", "peer", "joiner")}
    out = {}
    for role, p in procs.items():
        o, e = p.communicate(timeout=90)
        assert p.returncode == 0, (role, e[-3000:])
        if role != "peer":
            out[role] = json.loads(o.strip().splitlines()[-1])
    assert out["joiner"] == {"rank": 0, "coords": [0]}
    assert out["survivor"] == {"rank": 1, "coords": [1]}  # [0] before the caches were cleared
