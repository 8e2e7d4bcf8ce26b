"""sync_live_state over a real gloo world: the newest in-memory state reaches the ranks that lack it."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

WORKER = r"""
import json, sys, torch, torch.distributed as dist
from trainguard.runtime.reform import sync_live_state
rank, world, init, step = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
w = torch.full((4,), float(rank if step is None else step))
got = {}
outcome, live = sync_live_state(step, {"w": w}, extra={"step": step, "who": rank}, load_extra=got.update)
print(json.dumps({"outcome": outcome, "live": live, "w": w.tolist(), "extra": got}))
dist.destroy_process_group()
"""


def run(tmp_path, steps):
    os.makedirs(tmp_path, exist_ok=True)
    init = f"file://{tmp_path}/store"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(len(steps)), init, json.dumps(s)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r, s in enumerate(steps)]
    out = []
    for p in procs:
        o, e = p.communicate(timeout=90)
        assert p.returncode == 0, e[-2000:]
        out.append(json.loads(o.strip().splitlines()[-1]))
    return out


def test_a_fresh_rank_receives_the_survivors_state(tmp_path):
    res = run(tmp_path, [12, 12, None])  # two survivors at step 12, a joiner with nothing
    assert {r["outcome"] for r in res} == {"broadcast"} and {r["live"] for r in res} == {12}
    assert all(r["w"] == [12.0] * 4 for r in res)
    assert res[2]["extra"] == {"step": 12, "who": 0}  # from the lowest rank holding the newest state
    assert res[0]["extra"] == {}  # the source loads nothing


def test_the_newest_step_wins_over_an_older_restore(tmp_path):
    res = run(tmp_path, [9, 12])  # a restarted rank restored step 9 from storage, a survivor holds 12
    assert all(r["w"] == [12.0] * 4 for r in res) and res[0]["extra"]["step"] == 12


def test_agreed_and_none(tmp_path):
    assert {r["outcome"] for r in run(tmp_path / "x", [5, 5])} == {"agreed"}
    assert {r["outcome"] for r in run(tmp_path / "y", [None, None])} == {"none"}
