"""The worker runtime's end and its process groups: ``rt.finish()`` saves the last step as a ``final``
checkpoint (unless that step is already saved or was just restored), a script without
``checkpoint.url`` is warned, and every process group gets ``workers.pg_timeout_s``."""

from __future__ import annotations

import datetime
import json
import os
import signal

import pytest
import structlog
import torch
import torch._dynamo  # noqa: F401 - its lazy import sets TORCHINDUCTOR_CACHE_DIR; do it before the env-leak guard

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.contract import protocol as proto
from trainguard.runtime import Runtime


@pytest.fixture(autouse=True)
def keep_sigterm_handler():
    """The runtime installs a SIGTERM handler in the main thread (plain torchrun's notice)."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def train(url: str, steps: int, *, interval_steps: int = 0, restore: bool = False) -> Runtime:
    rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_round=0,
                 checkpoint=CheckpointConfig(url=url, interval_steps=interval_steps, async_save=False))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt, dataset_size=32, global_batch=4, micro_batch=2, seed=1)
    if restore:
        rt.restore()
    train_loop(rt, model, opt, steps)
    return rt


def train_loop(rt: Runtime, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, *,
               settle: bool = True) -> None:
    """Train a set-up single-rank runtime on a fixed random dataset until step ``steps``. ``settle``:
    wait for each background save after its step (these steps are faster than a save, which would
    otherwise defer the next periodic one: see the deferral test)."""
    x = torch.randn(32, 4)
    while rt.step < steps:
        micro = rt.next_batches()
        for i, ids in enumerate(micro):
            with rt.accumulating(last=i == len(micro) - 1):
                rt.backward(model(x[ids]).pow(2).mean() / len(micro))
        rt.optimizer_step(opt)
        opt.zero_grad()
        rt.end_step()
        if settle and rt._tiers.manager is not None:
            rt._tiers.manager.wait(60)


def committed(ckpt) -> dict[int, str]:
    out: dict[int, str] = {}
    if not (ckpt / "run").exists():
        return out
    for d in sorted(os.listdir(ckpt / "run")):
        if d.startswith("step-") and os.path.exists(ckpt / "run" / d / "manifest.json"):
            with open(ckpt / "run" / d / "manifest.json") as fh:
                m = json.load(fh)
            out[m["step"]] = m["kind"]
    return out


def test_finish_saves_the_last_step_once(tmp_path):
    ckpt = tmp_path / "ck"
    train(str(ckpt), 5, interval_steps=2).finish()
    assert committed(ckpt) == {2: "periodic", 4: "periodic", 5: "final"}
    # a re-run that restores step 5 and has nothing left to do saves nothing new
    rt = train(str(ckpt), 5, interval_steps=2, restore=True)
    assert rt.step == 5
    rt.finish()
    assert committed(ckpt) == {2: "periodic", 4: "periodic", 5: "final"}
    # the last step already saved by the periodic interval is not saved twice
    ckpt2 = tmp_path / "ck2"
    train(str(ckpt2), 4, interval_steps=2).finish()
    assert committed(ckpt2) == {2: "periodic", 4: "periodic"}


def test_a_periodic_save_due_while_the_previous_persists_is_deferred_not_waited_for(tmp_path, monkeypatch):
    """Interval 2 steps; step 2's save is held in its upload: step 4's save is deferred (training goes on,
    nothing waits on the held save), and taken at the first step boundary after step 2's commit (5)."""
    import threading

    from trainguard.checkpoint import storage as storage_mod

    ckpt = tmp_path / "ck"
    rt = Runtime(rank=0, world_size=1, local_rank=0, job_id="run", rdzv_round=0,
                 checkpoint=CheckpointConfig(url=str(ckpt), interval_steps=2))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt, dataset_size=32, global_batch=4, micro_batch=2, seed=1)
    release = threading.Event()
    write = storage_mod._DigestWriter.write

    def held(w, b):
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(60)
        return write(w, b)

    monkeypatch.setattr(storage_mod._DigestWriter, "write", held)
    with structlog.testing.capture_logs() as logs:
        train_loop(rt, model, opt, 4, settle=False)  # returns: nothing waited on the held save
        assert rt._tiers.manager.in_flight == 2 and committed(ckpt) == {}
        release.set()
        rt._tiers.manager.wait(60)
        train_loop(rt, model, opt, 5, settle=False)
        rt._tiers.manager.wait(60)
    assert committed(ckpt) == {2: "periodic", 5: "periodic"}
    assert [e["step"] for e in logs if e["event"] == "checkpoint_deferred"] == [4]


def test_without_checkpoint_url_the_runtime_warns_and_finish_saves_nothing(tmp_path):
    with structlog.testing.capture_logs() as logs:
        rt = train("", 2)
        rt.finish()
    assert [e for e in logs if e["event"] == "checkpoint_url_unset"]
    assert not [e for e in logs if e["event"] == "checkpoint_committed"]


def test_process_groups_get_the_configured_timeout(monkeypatch):
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: calls.append(("init", k)))
    monkeypatch.setattr(torch.distributed, "new_group", lambda *a, **k: calls.append(("new_group", k)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
           **proto.RuntimeEnv(job_id="j", pg_timeout_s=42.0).to_env()}
    rt = Runtime.from_env(env)
    assert rt.pg_timeout_s == 42.0
    assert calls == [("init", {"timeout": datetime.timedelta(seconds=42)}),
                     ("new_group", {"backend": "gloo", "timeout": datetime.timedelta(seconds=42)})]
    # under plain torchrun (no agent) torch's default stays
    calls.clear()
    Runtime.from_env({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert calls == [("init", {}), ("new_group", {"backend": "gloo"})]


def test_finish_beats_as_finished_through_the_teardown_and_once_more_as_it_stops(tmp_path, monkeypatch):
    """The teardown waits on the peers (the barrier), then the interpreter exits: the rank beats
    ``finished`` from the moment its training is over (one beat sent at once), and once more as its beats
    stop once the process group is gone, so a slow end of training on a loaded machine is never named a
    hang (chaos late_joiner: the agent ended a worker that had finished, then quarantined its node)."""
    rt = train(str(tmp_path / "ck"), 3)
    seen: list[tuple[str, object]] = []

    class Reporter:
        def set_phase(self, phase):
            seen.append(("phase", phase))

        def beat(self):
            seen.append(("beat", None))
            return proto.Progress(rank=0, local_rank=0, step=3, phase=proto.Phase.FINISHED, beat=1, progress=1, where="")

        def close(self, final=None):
            seen.append(("close", (final, dist_initialized())))

    def dist_initialized():
        return torch.distributed.is_initialized()

    monkeypatch.setattr(rt, "_progress", Reporter())
    real_teardown = rt.strategy.teardown
    monkeypatch.setattr(rt.strategy, "teardown", lambda: (seen.append(("teardown", None)), real_teardown())[1])
    rt.finish()
    assert seen[:3] == [("phase", proto.Phase.FINISHED), ("beat", None), ("teardown", None)], seen
    assert seen[-1] == ("close", (proto.Phase.FINISHED, False))  # stopped only once the process group is destroyed
