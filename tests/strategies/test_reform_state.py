"""Each strategy says, as a :class:`ReformState`, how a world re-formed in place gets its state; the
runtime's choices (broadcast from a live peer, reload resharded, restart) follow from it."""

import importlib

import pytest

from trainguard.strategies import ReformState, Strategy, available_strategies
from trainguard.strategies.base import _LAZY, _REGISTRY

EXPECTED = {"ddp": ReformState.REPLICATED, "fsdp": ReformState.CHECKPOINT, "fsdp2": ReformState.CHECKPOINT,
            "model_parallel": ReformState.CHECKPOINT, "deepspeed": ReformState.RESTART}


@pytest.mark.parametrize("name", available_strategies())
def test_reform_state_of_each_strategy(name):
    if name not in _REGISTRY:
        importlib.import_module(_LAZY[name])
    factory = _REGISTRY[name]
    cls = factory if isinstance(factory, type) else type(factory())
    assert cls.reform_state is EXPECTED[name]


def test_a_strategy_that_says_nothing_restarts():
    assert Strategy.reform_state is ReformState.RESTART
