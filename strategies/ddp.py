"""``ddp``: ``DistributedDataParallel`` — every rank holds the whole model and optimizer state.

Resize: native. The state is replicated, so a checkpoint saved at any world size loads at any other
(``get_state_dict`` drops DDP's ``module.`` prefix); only gradient accumulation changes (see
:data:`~trainguard.strategies.base.BATCH_RULE`). At world size 1 the model is not wrapped, unless
worlds re-form in place (:attr:`~trainguard.strategies.base.Strategy.keep_wrapped`).

In-place re-formation (``reform_state = "replicated"``): :meth:`DDPStrategy.reform` runs
``DistributedDataParallel.__init__`` again on the *same* wrapper object over the new default process
group, so the model and optimizer the script holds stay valid (DDP keeps the parameter objects; the
old reducer and its autograd hooks go with the old state). About 30 ms for the bundled model on CPU.

Precision: ``bf16-mixed`` / ``16-mixed`` by ``torch.autocast`` around the forward pass, ``16-mixed``
with a ``GradScaler`` (gradients are all-reduced before the inf check, so every rank agrees).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from trainguard.strategies.base import Strategy, StrategyError, register_strategy, world


class DDPStrategy(Strategy):
    """Args:
        precision: ``32``, ``bf16-mixed`` or ``16-mixed``.
        find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view: passed to DDP.
    """

    name = "ddp"
    reshard_native = True
    reform_state = "replicated"

    def __init__(self, *, precision: Any = "32", find_unused_parameters: bool = False, static_graph: bool = False,
                 bucket_cap_mb: float | None = None, gradient_as_bucket_view: bool = False) -> None:
        super().__init__(precision=precision)
        self.ddp_kwargs: dict[str, Any] = {"find_unused_parameters": find_unused_parameters,
                                           "static_graph": static_graph,
                                           "gradient_as_bucket_view": gradient_as_bucket_view}
        if bucket_cap_mb is not None:
            self.ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb

    def setup(self, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """See base class. The model is moved to :attr:`~Strategy.device` (``Module.to`` keeps the
        parameter objects, so ``optimizer`` stays valid and is returned unchanged). A model built on
        ``meta`` is refused: DDP replicates real weights (use fsdp for meta-device initialisation)."""
        self._prepare_precision()
        if any(p.is_meta for p in model.parameters()):
            raise StrategyError("ddp got a model with parameters on the meta device. Fix: build it on the CPU or on "
                                "rt.device (or use strategy='fsdp', which materialises meta-device models shard by shard)")
        model.to(self.target_device())
        _, size = world()
        if size == 1 and not self.keep_wrapped:
            return model, optimizer
        return DistributedDataParallel(model, **self._ddp_args()), optimizer

    def _ddp_args(self) -> dict[str, Any]:
        device = self.target_device()
        return {"device_ids": [device.index] if device.type == "cuda" else None, **self.ddp_kwargs}

    def reform(self, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        """See base class: the same ``DistributedDataParallel`` object, rebuilt over the new default group."""
        if not isinstance(model, DistributedDataParallel):
            raise StrategyError("ddp reform() needs the DistributedDataParallel the strategy returned (set "
                                "keep_wrapped before setup)")
        training = model.training
        inner = model.module
        DistributedDataParallel.__init__(model, inner, **self._ddp_args())
        model.train(training)
        return model, optimizer

    def replicated_tensors(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """See base class."""
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        return {k: v for k, v in inner.state_dict().items() if isinstance(v, torch.Tensor)}

    def no_sync(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        """See base class (``DistributedDataParallel.no_sync``; nothing at world size 1)."""
        if last or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **self.ddp_kwargs}


register_strategy("ddp", DDPStrategy)
