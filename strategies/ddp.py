"""``ddp``: ``DistributedDataParallel`` — every rank holds the whole model and optimizer state.

Resize: native. The state is replicated, so a checkpoint saved at any world size loads at any other
(``get_state_dict`` drops DDP's ``module.`` prefix); only gradient accumulation changes (see
:data:`~trainguard.strategies.base.BATCH_RULE`). At world size 1 the model is not wrapped, unless
worlds re-form in place (:attr:`~trainguard.strategies.base.Strategy.keep_wrapped`).

In-place re-formation (``reform_state = REPLICATED``): :meth:`DDPStrategy.reform` runs
``DistributedDataParallel.__init__`` again on the *same* wrapper object over the new default process
group, so the model and optimizer the script holds stay valid (DDP keeps the parameter objects; the
old reducer and its autograd hooks go with the old state). About 30 ms for the bundled model on CPU.

Where worlds re-form in place, DDP's own sync at construction is skipped (``init_sync=False``; the
parameter shapes are still compared across ranks): it broadcasts from rank 0, and the rendezvous
orders nodes by host name and pid, so rank 0 of a re-formed world can be a fresh process (a node that
joined, a restarted worker) whose initial weights would overwrite the survivors' trained ones before
the runtime hands the survivors' state over. Instead the runtime's ``restore`` / re-formation
broadcasts from a rank that holds the newest state (:func:`~trainguard.runtime.reform.sync_live_state`),
or from rank 0 when no rank does and nothing was restored (a fresh job: what DDP's sync would do).

Precision: ``bf16-mixed`` / ``16-mixed`` by ``torch.autocast`` around the forward pass, ``16-mixed``
with a ``GradScaler`` (gradients are all-reduced before the inf check, so every rank agrees).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from trainguard.strategies.base import ReformState, Strategy, StrategyError, register_strategy, world


class DDPStrategy(Strategy):
    """Args:
        precision: ``32``, ``bf16-mixed`` or ``16-mixed``.
        find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view: passed to DDP.
    """

    name = "ddp"
    reshard_native = True
    reform_state = ReformState.REPLICATED

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
        return self._wrap(model), optimizer

    def _wrap(self, inner: torch.nn.Module, into: DistributedDataParallel | None = None) -> DistributedDataParallel:
        """``inner`` wrapped in a new ``DistributedDataParallel`` (or ``into``, constructed again); where
        worlds re-form in place, without DDP's broadcast from rank 0 (see the module docstring), the
        parameter shapes compared across ranks as DDP does."""
        device = self.target_device()
        args: dict[str, Any] = {"device_ids": [device.index] if device.type == "cuda" else None, **self.ddp_kwargs}
        if self.keep_wrapped:
            args["init_sync"] = False
        if into is None:
            ddp = DistributedDataParallel(inner, **args)
        else:
            ddp = into
            DistributedDataParallel.__init__(ddp, inner, **args)
        if self.keep_wrapped:
            _verify_shapes(ddp.process_group, [p for p in inner.parameters() if p.requires_grad])
            self.init_synced = False
        return ddp

    def reform(self, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        """See base class: the same ``DistributedDataParallel`` object, rebuilt over the new default group."""
        if not isinstance(model, DistributedDataParallel):
            raise StrategyError("ddp reform() needs the DistributedDataParallel the strategy returned (set "
                                "keep_wrapped before setup)")
        training = model.training
        self._wrap(model.module, into=model)
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


def _verify_shapes(group: Any, params: list[torch.Tensor]) -> None:
    """Every rank's parameter shapes are the same (DDP's check at construction; a collective)."""
    from torch.distributed.utils import _verify_param_shape_across_processes

    _verify_param_shape_across_processes(group, params)


register_strategy("ddp", DDPStrategy)
