"""trainguard.strategies: how model + optimizer are spread over the ranks (``ddp``, ``fsdp``, ``deepspeed``).

See :mod:`trainguard.strategies.base` for the interface and ``docs/strategies.md`` for the options.
"""

from trainguard.strategies.base import (
    PRECISIONS,
    Precision,
    ReformState,
    Strategy,
    StrategyError,
    StrategyState,
    available_strategies,
    get_strategy,
    register_strategy,
)

__all__ = ["PRECISIONS", "Precision", "ReformState", "Strategy", "StrategyError", "StrategyState", "available_strategies",
           "get_strategy", "register_strategy"]
