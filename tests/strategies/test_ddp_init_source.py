"""Where worlds re-form in place, DDP's construction must not broadcast rank 0's weights: rank 0 of a
re-formed world can be a fresh process (the rendezvous orders nodes by address and pid), and its
initial weights would overwrite the survivors' trained ones. Real gloo worlds of 2 processes."""

import json
import os
import sys

import pytest

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _rank(rank: int, init: str, case: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.runtime import Runtime
    from trainguard.runtime.reform import sync_live_state
    from trainguard.strategies.ddp import DDPStrategy

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(100 + rank)  # every rank starts from other weights
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict = {}
    if case == "reform":  # rank 1 survived with trained weights (7.0, step 5); rank 0 is a fresh joiner
        if rank == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(7.0)
        s = DDPStrategy()
        s.keep_wrapped = True  # the runtime sets it where worlds re-form in place
        ddp, _ = s.setup(model, opt)
        out["after_wrap"] = float(model.weight.detach()[0, 0])
        outcome, _ = sync_live_state(5 if rank == 1 else None, s.replicated_tensors(ddp), extra={},
                                     load_extra=lambda d: None)
        out["outcome"], out["synced"] = outcome, not getattr(s, "init_synced", True)
    else:  # a fresh world, nothing to restore: rank 0's weights, as DDP's own sync gives them
        rt = Runtime(rank=rank, world_size=2, local_rank=0, job_id="j", checkpoint=CheckpointConfig(), device="cpu")
        rt.reform_enabled = case == "fresh-inplace"  # as under an agent (in place needs its link)
        rt.setup(model, opt, dataset_size=16, global_batch=4, micro_batch=2, seed=1)
        out["after_setup"] = float(model.weight.detach()[0, 0])
        rt.restore()
    out["final"] = [float(v) for v in model.weight.detach().flatten()]
    with open(out_path, "w") as fh:
        json.dump(out, fh)
    os._exit(0)  # the runtime's side group and threads are not torn down here (no rt.finish())


def run(tmp_path, case):
    init = f"file://{tmp_path}/store-{case}"
    outs = [str(tmp_path / f"{case}-r{r}.json") for r in range(2)]
    codes, logs = run_ranks("tests.strategies.test_ddp_init_source", [[str(r), init, case, outs[r]] for r in range(2)],
                            timeout=90)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    return [json.load(open(o)) for o in outs]


def test_a_fresh_rank_0_does_not_overwrite_the_survivors_weights(tmp_path):
    fresh, survivor = run(tmp_path, "reform")
    assert survivor["after_wrap"] == 7.0  # DDP's construction left them alone (rank 0's broadcast did not)
    assert fresh["synced"] and survivor["outcome"] == "broadcast"
    assert fresh["final"] == survivor["final"] == [7.0] * 6  # the survivor's state reached the joiner


@pytest.mark.parametrize("case", ["fresh-inplace", "fresh-restart"])
def test_a_fresh_world_starts_from_rank_0s_weights(tmp_path, case):
    r0, r1 = run(tmp_path, case)
    if case == "fresh-inplace":
        assert r0["after_setup"] != r1["after_setup"]  # construction did not sync ...
    assert r0["final"] == r1["final"]  # ... restore() did, from rank 0 (as DDP's own sync does without in-place)
    assert r0["final"][0] == r0["after_setup"]


if __name__ == "__main__":
    _rank(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
