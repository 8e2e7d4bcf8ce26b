"""FSDP with a meta-device model (issue 19): built with no memory, sharded on the runtime's device,
materialised with ``to_empty`` and initialised; it trains, checkpoints, and restores into another
meta-built model bit for bit. Per-micro-batch reduce-scatter (the default) and the unsharded path
give the same update."""

from __future__ import annotations

import signal

import pytest
import torch
import torch.nn.functional as F

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.examples.train_gpt import TinyGPT
from trainguard.runtime import Runtime
from trainguard.strategies.base import get_strategy


@pytest.fixture(autouse=True)
def keep_sigterm_handler():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


SEQ = 8


def _runtime(url: str) -> Runtime:
    return Runtime(rank=0, world_size=1, local_rank=0, job_id="run",
                   checkpoint=CheckpointConfig(url=url, interval_steps=2, async_save=False))


def _meta_setup(rt: Runtime) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT(SEQ, d=16, layers=2, heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return rt.setup(model, opt, dataset_size=64, global_batch=8, micro_batch=2, seed=1, strategy="fsdp")


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _train(rt: Runtime, model, opt, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (64, SEQ + 1), generator=g)
    losses = []
    while rt.step < steps:
        micro = rt.next_batches()
        total = 0.0
        for i, ids in enumerate(micro):
            x, y = data[ids, :-1].to(rt.device), data[ids, 1:].to(rt.device)
            with rt.accumulating(last=i == len(micro) - 1):
                loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)) / len(micro)
                rt.backward(loss)
            total += float(loss.detach())
        rt.optimizer_step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        rt.end_step()
    return losses


def test_meta_device_model_trains_checkpoints_and_restores(tmp_path):
    url = str(tmp_path / "ckpt")
    rt = _runtime(url)
    model, opt = _meta_setup(rt)
    try:
        params = list(model.parameters())
        assert params and all(not p.is_meta and p.device == rt.device for p in params)
        assert all(torch.isfinite(p.to_local()).all() for p in params)
        mha = model.blocks[0].attn.in_proj_weight.full_tensor()
        assert mha.abs().sum() > 0 and mha.std() < 1.0  # xavier-initialised, not garbage from to_empty
        expected_mask = torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1)
        assert torch.equal(model.mask, expected_mask)  # the non-persistent buffer was recomputed
        assert rt.accum_steps == 4
        before = _full(model)
        losses = _train(rt, model, opt, 4)
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
        after = _full(model)
        assert any(not torch.equal(before[n], after[n]) for n in after)
    finally:
        rt.finish()  # waits for the step-4 save; tears the strategy's one-rank group down

    rt2 = _runtime(url)
    model2, opt2 = _meta_setup(rt2)
    try:
        assert rt2.restore() == 4
        restored = _full(model2)
        assert restored.keys() == after.keys()
        for n in after:
            assert torch.equal(restored[n], after[n]), n
        more = _train(rt2, model2, opt2, 6)
        assert len(more) == 2 and all(torch.isfinite(torch.tensor(more)))
    finally:
        rt2.finish()


@pytest.mark.parametrize("unsharded", [False, True])
def test_fsdp_accumulation_paths_agree(unsharded):
    """Per-micro-batch reduce-scatter (default) and the unsharded fast path: the same gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ref = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(8, 4)
    expected = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
    s = get_strategy("fsdp", accumulate_unsharded=unsharded)
    s.device = torch.device("cpu")
    try:
        m, _ = s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for p, r in zip(m.parameters(), ref):
            assert torch.equal(p.full_tensor(), r)
        for i in range(4):
            with s.no_sync(m, last=i == 3):
                (m(x[2 * i:2 * i + 2]).pow(2).mean() / 4).backward()
        for p, e in zip(m.parameters(), expected):
            torch.testing.assert_close(p.grad.full_tensor(), e, rtol=1e-5, atol=1e-6)
        assert s.describe()["accumulate_unsharded"] is unsharded
    finally:
        s.teardown()


@pytest.mark.slow
def test_example_meta_init_fsdp_over_two_ranks_then_one(tmp_path):
    """The bundled elastic job with ``--meta-init`` (model on ``meta``, shards materialised on
    rt.device = cpu here) trains over 2 gloo ranks, checkpoints, and resumes at 1 rank."""
    import math

    from tests.strategies._world import losses, run_segment

    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "loss.jsonl")
    run_segment(2, "fsdp", ckpt, steps=4, interval=2, fence=1, loss_log=log, extra=["--meta-init"])
    run_segment(1, "fsdp", ckpt, steps=6, interval=2, fence=2, loss_log=log, extra=["--meta-init"])
    logged = losses(log)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in logged.values())
    assert logged[6] < logged[1]  # it learns across the resize (restored, not re-initialised)
