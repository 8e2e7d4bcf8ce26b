"""The host memory a checkpoint save takes, as a ratio to the rank's share (issue 44): a memory check, not
a timing, on a small model, so that a change that adds a copy of the state to the save path fails here.

Ratio = the peak growth of this process's resident memory over one save (``VmHWM``, every thread: the
persist thread's writes count) / the bytes the rank stages. The first save allocates the staging buffers
(one copy: <= 1.1x); a later save reuses them (<= 0.1x): ``tests.fixtures.hostmem.check_save_ratios``.
Each staged-tensor kind the strategies produce is covered: plain tensors (``ddp``), ``DTensor``
(``fsdp`` / ``model_parallel``, FSDP2 on a one-rank group) and ``ShardedTensor`` (``deepspeed``'s ZeRO
ranges: ``tests/strategies/test_deepspeed.py``). The last tests plant an extra copy (the regression of
issue 44, and a clone held over the write) and show that the check catches it. Saves are blocking and
async (the async one measured until committed).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fixtures.hostmem import check_save_ratios, mlp_stack, save_ratios
from trainguard.checkpoint import pinned
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.state import ModelOptimizerState

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self (Linux)")]

HIDDEN = 512
"""The model: 4 blocks of Linear(512, 2048) + Linear(2048, 512), 8.4 M parameters; with AdamW's two states,
~100 MiB to stage: large enough that allocator noise (a few MiB) stays far below the 10% margins."""


def _model() -> nn.Module:
    return mlp_stack(HIDDEN, 4)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, HIDDEN)).pow(2).mean().backward()
    opt.step()


def _plain_state() -> dict:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    return {"model": ModelOptimizerState(model, opt)}


@pytest.mark.parametrize("block", [True, False], ids=["blocking", "async"])
def test_a_save_holds_one_staged_copy_of_plain_tensors(tmp_path, block):
    check_save_ratios(save_ratios(str(tmp_path / "c"), _plain_state(), block=block))


@pytest.fixture()
def one_rank():
    assert not dist.is_initialized(), "a previous test left a process group"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_save_holds_one_staged_copy_of_fsdp2_dtensors(tmp_path, one_rank):
    from trainguard.strategies import get_strategy

    s = get_strategy("fsdp")
    s.plan(2, 1, 2)
    plain = _model()
    model, opt = s.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    _step(model, opt)
    state = {"model": s.state(model, opt)}
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    assert any(isinstance(v, DTensor) for v in tree_leaves(state["model"].state_dict()))  # the DTensor path
    check_save_ratios(save_ratios(str(tmp_path / "c"), state, strategy="fsdp"))


# ---- the check fails on a planted extra copy -------------------------------------------------------

def _one_storage_take(self: pinned.HostArena, like: torch.Tensor) -> torch.Tensor:
    """Issue 44's regression: arena tensors as views of the arena's one storage (DCP's writer clones each)."""
    n = like.numel() * like.element_size()
    raw = self.buffer[self._offset:self._offset + n]
    self._offset += pinned._align(n)
    return raw.view(like.dtype).view(like.shape)


def test_the_check_fails_on_views_of_one_arena_storage(tmp_path, monkeypatch):
    monkeypatch.setattr(pinned.HostArena, "take", _one_storage_take)
    ratios = save_ratios(str(tmp_path / "c"), _plain_state())
    assert ratios[0] > 1.8 and ratios[1] > 0.8, ratios  # every save holds a second copy, as issue 44 measured
    with pytest.raises(AssertionError, match="second copy"):
        check_save_ratios(ratios)


def test_the_check_fails_on_a_copy_held_over_the_write(tmp_path, monkeypatch):
    real = CheckpointManager._write_shards

    def write_with_a_copy(self, ref, staged):
        held = [t.clone() for t in pinned._leaves(staged)]  # e.g. a "defensive" copy before writing
        out = real(self, ref, staged)
        del held
        return out

    monkeypatch.setattr(CheckpointManager, "_write_shards", write_with_a_copy)
    ratios = save_ratios(str(tmp_path / "c"), _plain_state())
    assert ratios[0] > 1.8, ratios
    with pytest.raises(AssertionError, match="second copy"):
        check_save_ratios(ratios)
