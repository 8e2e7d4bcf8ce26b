"""The step-boundary agreement over two real gloo ranks: ``overlapped`` (the default) acts at step N+1
on what the ranks exchanged at step N, ``blocking`` at N; both stop every rank at the same step and
take periodic saves at the steps they are due at. Ranks configured apart agree blocking. With an
agreement period the ranks agree every ``stride`` steps (a divisor of the save interval) and nothing
is exchanged between but the step before each boundary, which issues its exchange."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import pytest
import torch

from tests.harness import free_port, run_ranks
from tests.runtime.test_finishing import committed


ASK_AT = 4  # rank 1's stop request arrives during this step


STEPS = {"strided": 12, "strided-uneven": 12}  # else 8


def _rank(rank: int, port: int, mode: str, ckpt: str, out: str) -> None:
    import torch.distributed as dist

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.contract import protocol as proto
    from trainguard.runtime import Runtime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    default_group_threads = _gloo_threads()
    # strided: both ranks ask for a 60 s period (every stride that divides the interval fits in it);
    # strided-uneven: rank 1 asks for every step (period 0), and the world takes the smaller stride.
    period = {"strided": (60.0, 60.0), "strided-uneven": (60.0, 0.0)}.get(mode, (0.0, 0.0))[rank]
    agreement = "overlapped" if mode.startswith("strided") else mode.split(",")[rank] if "," in mode else mode
    rt = Runtime(rank=rank, world_size=2, local_rank=0, job_id="run", rdzv_round=0,
                 step_agreement=agreement, step_agreement_period_s=period,
                 checkpoint=CheckpointConfig(url=ckpt, interval_steps=3, async_save=False, keep_last=10))
    stops: list[tuple[int, int]] = []
    exchanged: list[int] = []  # the step at the end of which each exchange was issued
    exchange = rt._agreement.exchange

    def counted(flags):
        exchanged.append(rt.step)
        return exchange(flags)

    rt._agreement.exchange = counted

    def stop(why, deadline=None):  # the real one saves and exits with the resize code
        stops.append((rt.step, int(why)))
        rt._session.signal_request = proto.StopReason.NONE

    rt._stop = stop
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt, dataset_size=64, global_batch=4, micro_batch=2, seed=1)
    x = torch.randn(64, 4)
    while rt.step < STEPS.get(mode, 8):
        for i, ids in enumerate(micro := rt.next_batches()):
            with rt.accumulating(last=i == len(micro) - 1):
                rt.backward(model(x[ids]).pow(2).mean() / len(micro))
        rt.optimizer_step(opt)
        opt.zero_grad()
        if rank == 1 and rt.step + 1 == ASK_AT:
            rt._session.signal_request = proto.StopReason.RESIZE
        rt.end_step()
        rt._tiers.manager.wait(60)  # these steps are faster than a save, which would defer the next periodic one
    running_threads = _gloo_threads()
    rt.finish()  # rt stays alive (rt._agreement.exchange -> counted -> rt): its groups must not
    with open(out, "w") as fh:
        json.dump({"stops": stops, "pending_after_finish": rt._agreement.pending is not None,
                   "mixed": rt._agreement.mixed, "exchanged": exchanged, "stride": rt._agreement.stride,
                   "gloo_threads": [default_group_threads, running_threads, _gloo_threads()]}, fh)


def _gloo_threads() -> int:
    """This process's gloo process-group worker threads, once their count holds for 0.1 s (a group's
    threads name themselves when they start)."""
    seen: list[int] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (len(seen) < 5 or len(set(seen[-5:])) > 1):
        names = []
        for t in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        seen.append(names.count("pt_gloo_runloop"))
        time.sleep(0.02)
    return seen[-1]


def _run_two(tmp_path, mode: str, ckpt) -> list[dict]:
    """Both ranks of ``mode`` (see :func:`_rank`) to the end; what each reported."""
    outs = [str(tmp_path / f"r{r}.json") for r in range(2)]
    port = free_port()
    codes, logs = run_ranks("tests.runtime.test_agreement",
                            [[str(r), str(port), mode, str(ckpt), outs[r]] for r in range(2)], timeout=120)
    assert codes == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    return [json.load(open(o)) for o in outs]


@pytest.mark.parametrize("mode,stop_step", [("overlapped", ASK_AT + 1), ("blocking", ASK_AT),
                                            ("overlapped,blocking", ASK_AT)])  # configured apart: all blocking
def test_every_rank_stops_at_the_same_step_and_saves_when_due(tmp_path, mode, stop_step):
    ckpt = tmp_path / "ck"
    res = _run_two(tmp_path, mode, ckpt)
    # A resize request on rank 1 alone: both ranks act on it, at the same step.
    assert [r["stops"] for r in res] == [[[stop_step, 1]], [[stop_step, 1]]]
    # Periodic saves at the steps they are due at (3, 6), the last one as final; nothing left in flight.
    assert committed(ckpt) == {3: "periodic", 6: "periodic", 8: "final"}
    assert not any(r["pending_after_finish"] for r in res)
    _groups_freed_at_finish(res)
    assert [r["mixed"] for r in res] == [mode == "overlapped,blocking"] * 2
    assert res[0]["exchanged"] == res[1]["exchanged"]
    assert res[0]["exchanged"] == ([1] + list(range(1, 9)) if mode == "overlapped" else list(range(1, 9)))


@pytest.mark.parametrize("mode", ["strided", "strided-uneven"])
def test_a_strided_agreement_exchanges_only_at_multiples_of_the_agreed_stride(tmp_path, mode):
    ckpt = tmp_path / "ck"
    res = _run_two(tmp_path, mode, ckpt)
    assert res[0]["exchanged"] == res[1]["exchanged"]
    if mode == "strided":
        # The world's first boundary exchanges and waits (step 1); the next boundary is the next multiple
        # of the agreed stride, 3 (the interval's largest divisor in the period), whose exchange is issued
        # the step before it (2); from then on every 3 steps, each one step before its boundary.
        assert res[0]["exchanged"] == [1, 2, 5, 8, 11]
        assert [r["stride"] for r in res] == [3, 3]
        # Rank 1's request of step 4 goes out with the exchange issued at step 5 and is acted on at the
        # boundary right after it, 6: within a stride and a step, not two strides (9, before 2026-11-29).
        assert [r["stops"] for r in res] == [[[6, 1]], [[6, 1]]]
    else:  # one rank agrees every step: so does the world
        assert res[0]["exchanged"] == [1] + list(range(1, 13))
        assert [r["stride"] for r in res] == [1, 1]
        assert [r["stops"] for r in res] == [[[ASK_AT + 1, 1]], [[ASK_AT + 1, 1]]]
    # The periodic saves keep their steps: the boundaries fall on them.
    assert committed(ckpt) == {3: "periodic", 6: "periodic", 9: "periodic", 12: "periodic"}
    assert not any(r["pending_after_finish"] for r in res)
    _groups_freed_at_finish(res)


def _groups_freed_at_finish(res: list[dict]) -> None:
    """The runtime's own gloo groups (the agreement's, the checkpoint manager's) are freed by ``finish``,
    their worker threads joined, though the runtime object lives on: only the default group's threads
    remain (the caller's DDP model holds it). A gloo worker left until interpreter exit once aborted a
    rank after a clean finish (exit -6, "terminate called without an active exception")."""
    for r in res:
        default, running, after = r["gloo_threads"]
        assert default > 0 and running > default  # the runtime made groups of its own
        assert after == default


def test_a_bad_step_agreement_is_refused_by_name():
    from trainguard.agent.config import WorkersConfig
    from trainguard.contract import protocol as proto
    from trainguard.contract.configbase import FieldError

    with pytest.raises(FieldError, match="step_agreement"):
        WorkersConfig(step_agreement="lazy")
    for bad in (-1.0, 61.0, float("nan")):
        with pytest.raises(FieldError, match="step_agreement_period_s"):
            WorkersConfig(step_agreement_period_s=bad)
    env = proto.RuntimeEnv(step_agreement_period_s=0.25).to_env()
    assert proto.RuntimeEnv.from_env(env).step_agreement_period_s == 0.25
    with pytest.raises(proto.ProtocolError, match="TRAINGUARD_RT_STEP_AGREEMENT"):
        proto.RuntimeEnv.from_env({"TRAINGUARD_RT_STEP_AGREEMENT": "lazy"})
    assert proto.RuntimeEnv.from_env(proto.RuntimeEnv(step_agreement="blocking").to_env()).step_agreement == "blocking"
    assert os.environ.get("TRAINGUARD_RT_STEP_AGREEMENT") is None


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
