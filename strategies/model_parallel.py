"""``model_parallel``: tensor parallelism within a group of ``tp_size`` ranks, FSDP2 over the data-parallel
dimension, on a 2-D ``(data_parallel, tensor_parallel)`` device mesh — Lightning Fabric's
``ModelParallelStrategy`` on the trainguard runtime, with a data-parallel dimension that resizes.

The user's function does the parallelising
    ``parallelize_fn(model, device_mesh) -> model | None`` gets the model and the mesh (dimension names
    ``"data_parallel"`` and ``"tensor_parallel"``, as in Fabric, so Fabric scripts port unchanged) and
    applies what the model needs, in the usual order: tensor parallelism (DTensor
    ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on ``device_mesh["tensor_parallel"]``),
    low-precision linear layers (torchao fp8, GPU only), activation checkpointing, ``torch.compile``
    (per block, ``block.compile()``, which keeps parameter names), then FSDP2 ``fully_shard`` over
    ``device_mesh["data_parallel"]`` per block and on the root. The strategy builds the mesh, checks the
    result and rebuilds the optimizer over the new (DTensor) parameters, as ``fsdp`` does.

Ranks and data
    ``tp_size`` is the tensor-parallel degree (ranks ``dp * tp_size .. dp * tp_size + tp_size - 1`` form
    one tensor-parallel group; keep ``tp_size`` a divisor of ``nproc_per_node`` so each group stays within
    a node). The data-parallel size is ``world / tp_size`` and is what resizes: the runtime splits each
    global batch over the data-parallel ranks only (:meth:`ModelParallelStrategy.data_parallel`), so the
    ranks of a tensor-parallel group train on the same samples, and the global batch stays
    ``dp x accumulation x micro_batch``. A world that is not a multiple of ``tp_size`` is refused with a
    :class:`~trainguard.strategies.base.StrategyError` naming the setting.

Checkpoint and resize
    Every parameter and optimizer state is a ``DTensor`` (sharded over ``tensor_parallel`` by TP and
    over ``data_parallel`` by FSDP2); ``state()`` is ``get_state_dict``/``set_state_dict`` like ``fsdp``.
    After a resize the new world builds its mesh with the new data-parallel size, the function
    parallelises again, and DCP reads into the new shards whatever overlaps them
    (``reshard_native = True``).

In-place re-formation (``reform_state = CHECKPOINT``, when the runtime sets ``keep_wrapped``): as
``fsdp`` does, :meth:`ModelParallelStrategy.setup` keeps a meta-device template of the model and returns
an :class:`~trainguard.strategies.fsdp.ElasticModule`; :meth:`ModelParallelStrategy.reform` hands a fresh
copy of the template to the function with the new world's mesh, materialises it, swaps it in and
re-points the same optimizer; the runtime then reloads the state committed at the stop (or the newest
in-memory snapshots), resharded. The function runs once per world (``torch.compile`` compiles again).

CPU (torch 2.13, gloo): TP, FSDP2 and ``torch.compile`` (inductor, C++ codegen) run with gloo; verified
with ``(dp, tp) = (2, 2) -> (1, 2) -> (2, 2)`` through real agents (tests/strategies). fp8 (torchao
``Float8Linear``) needs Hopper-class GPUs and is not verified here.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainguard.strategies.base import (
    BATCH_RULE,
    ReformState,
    Strategy,
    StrategyError,
    param_names,
    rebuild_optimizer,
    register_strategy,
)
from trainguard.strategies.fsdp import ElasticModule, _inner, group_names, meta_copy, swap_in
from trainguard.strategies.mesh import build_mesh

DP, TP = "data_parallel", "tensor_parallel"
ParallelizeFn = Callable[[nn.Module, Any], nn.Module | None]


def mesh_shape(world: int, tp_size: int) -> tuple[int, int]:
    """``(dp, tp)`` for a world of ``world`` ranks; :class:`StrategyError` when ``tp_size`` does not divide it."""
    if world % tp_size:
        ok = [tp_size * k for k in range(1, 5)]
        raise StrategyError(
            f"strategy 'model_parallel' cannot run {world} ranks with `tp_size={tp_size}`: the world must be a "
            f"multiple of the tensor-parallel degree (the ranks form {world} / {tp_size} tensor-parallel groups). "
            f"Fix: run {', '.join(map(str, ok))}, ... ranks (nodes x nproc_per_node a multiple of {tp_size}; keep "
            f"nproc_per_node a multiple of tp_size), or pass another tp_size "
            f"(Runtime.setup(strategy_options={{'tp_size': ...}}), the example's --tp-size flag)")
    return world // tp_size, tp_size


def _strip(name: str) -> str:
    """Parameter names without the wrappers ``torch.compile`` and activation checkpointing insert."""
    return name.replace("._orig_mod", "").replace("_orig_mod.", "").replace(
        "._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")


class ModelParallelStrategy(Strategy):
    """Args:
        parallelize_fn: ``(model, device_mesh) -> model | None``, applies TP / FSDP2 / compile (see the
            module docstring). Required.
        tp_size: the tensor-parallel degree (default 1: FSDP2 over all ranks through the function).
        precision: ``32``, ``bf16-mixed`` (autocast; the function may add FSDP2's
            ``MixedPrecisionPolicy``) or ``16-mixed`` (``ShardedGradScaler``).
    """

    name = "model_parallel"
    reshard_native = True
    reform_state = ReformState.CHECKPOINT
    makes_groups = True  # the (data_parallel, tensor_parallel) mesh's sub-groups

    def __init__(self, *, parallelize_fn: ParallelizeFn | None = None, tp_size: int = 1,
                 precision: Any = "32") -> None:
        super().__init__(precision=precision)
        if parallelize_fn is None or not callable(parallelize_fn):
            raise StrategyError(
                f"strategy 'model_parallel' needs `parallelize_fn`, a function (model, device_mesh) -> model that "
                f"applies tensor parallelism and fully_shard, got {parallelize_fn!r}. Fix: pass "
                f"Runtime.setup(strategy='model_parallel', strategy_options={{'parallelize_fn': fn, 'tp_size': 2}}); "
                f"see examples/train_gpt_mp.py")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise StrategyError(f"invalid model_parallel option `tp_size={tp_size!r}`: a positive integer (the "
                                f"tensor-parallel degree). Fix: e.g. tp_size=2 (the example's --tp-size flag)")
        self.parallelize_fn = parallelize_fn
        self.tp_size = tp_size
        self.mesh: Any = None
        self.owns_process_group = False
        self._template: nn.Module | None = None
        self._opt_names: list[list[str]] = []

    # -- ranks and batch -------------------------------------------------------------------------
    def data_parallel(self, rank: int, world: int) -> tuple[int, int]:
        """See base class: the ranks of one tensor-parallel group share a data-parallel rank."""
        dp, tp = mesh_shape(world, self.tp_size)
        return rank // tp, dp

    def plan(self, global_batch: int, world_size: int, micro_batch: int) -> tuple[int, int]:
        """See base class; ``world_size`` is the data-parallel size here (world / ``tp_size``)."""
        try:
            return super().plan(global_batch, world_size, micro_batch)
        except ValueError as e:
            raise StrategyError(f"model_parallel splits the global batch over the data-parallel size {world_size} "
                                f"(world size / tp_size={self.tp_size}): {e}") from None

    @property
    def resize_rule(self) -> str:
        """See base class."""
        return (f"{BATCH_RULE}, where world_size is the data-parallel size (world / tp_size={self.tp_size}); the "
                f"(data_parallel, tensor_parallel) mesh is rebuilt with the new data-parallel size and DCP reshards "
                f"the DTensor parameters and optimizer state on load")

    # -- setup -----------------------------------------------------------------------------------
    def _build_mesh(self, device_type: str) -> Any:
        if not dist.is_initialized():
            # A mesh needs a process group even alone; an in-process store needs no port and no env.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.owns_process_group = True
        shape = mesh_shape(dist.get_world_size(), self.tp_size)
        return build_mesh(device_type, shape, (DP, TP))  # no split_group: see strategies/mesh.py

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """See base class. Returns the parallelised model and a rebuilt optimizer over its parameters; with
        :attr:`keep_wrapped` (in-place re-formation), an :class:`~trainguard.strategies.fsdp.ElasticModule`
        around the model, and a meta-device template of it is kept for :meth:`reform`."""
        if self.mesh is not None:
            raise StrategyError("ModelParallelStrategy.setup() was called twice. Fix: build one strategy per model")
        old = param_names(model)
        self._prepare_precision()
        if self.keep_wrapped:
            self._template = meta_copy(model)
        model = self._parallelize(model)
        new = {_strip(n): p for n, p in model.named_parameters()}
        missing = sorted(set(old.values()) - set(new))
        if missing:
            raise StrategyError(f"model_parallel: after parallelize_fn the model lacks parameters {missing[:5]}. Fix: "
                                f"parallelise the modules in place (torch.compile with module.compile(), not by "
                                f"replacing them with torch.compile(module)); do not drop parameters")
        opt = rebuild_optimizer(optimizer, old, new)
        if not self.keep_wrapped:
            return model, opt
        self._opt_names = group_names(opt, new)
        return ElasticModule(model), opt

    def _parallelize(self, model: nn.Module) -> nn.Module:
        """Build the mesh of the current world and hand ``model`` to the function; checked."""
        self.mesh = self._build_mesh(self.target_device().type)  # rt.device, never where the model sits
        out = self.parallelize_fn(model, self.mesh)
        model = model if out is None else out
        if not isinstance(model, nn.Module):
            raise StrategyError(f"model_parallel: parallelize_fn returned {type(model).__name__}, not the model. Fix: "
                                f"return the (parallelised) model, or None")
        self._check(model)
        return model

    def reform(self, model: nn.Module,
               optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """See base class; as ``fsdp`` re-forms: a fresh copy of the meta-device template, parallelised by the
        function over the new world's mesh (the new data-parallel size), materialised and swapped into the
        same :class:`~trainguard.strategies.fsdp.ElasticModule`; the same optimizer re-pointed at its
        parameters (its state cleared). Parameter values are undefined until the runtime reloads the
        state committed at the stop (or the newest in-memory snapshots), resharded."""
        if self._template is None or not isinstance(model, ElasticModule):
            raise StrategyError("model_parallel reform() needs the ElasticModule setup() returned with keep_wrapped set")
        fresh = copy.deepcopy(self._template)
        buffers = {_strip(n): b for n, b in fresh.named_buffers()}
        fresh = self._parallelize(fresh)
        fresh.to_empty(device=self.target_device())
        return swap_in(model, fresh, buffers, optimizer, self._opt_names, _strip)

    def state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
        """See base class (the parallelised module inside an :class:`ElasticModule`)."""
        return super().state(_inner(model), optimizer)

    def _check(self, model: nn.Module) -> None:
        """With more than one data-parallel rank, every parameter must be sharded over ``data_parallel``
        (FSDP2): a replicated one would train on its own rank's gradients only."""
        from torch.distributed.tensor import DTensor

        dp = self.mesh[DP].size()
        if dp == 1:
            return
        bad = [n for n, p in model.named_parameters()
               if not isinstance(p, DTensor) or DP not in (p.device_mesh.mesh_dim_names or ())]
        if bad:
            raise StrategyError(
                f"model_parallel: parameters {bad[:5]} are not sharded over the data-parallel mesh dimension, so their "
                f"gradients would not be averaged over the {dp} data-parallel ranks. Fix: end parallelize_fn with "
                f"fully_shard(module, mesh=device_mesh['data_parallel']) per block and on the root")

    def make_scaler(self) -> Any:
        """See base class: the inf check is all-reduced over the ranks."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self._device_type)

    # -- step ------------------------------------------------------------------------------------
    def no_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        """See base class: FSDP2's ``set_requires_gradient_sync`` on the root (nothing to skip without it)."""
        setter = getattr(_inner(model), "set_requires_gradient_sync", None)
        if setter is None:
            return contextlib.nullcontext()
        return _gradient_sync(setter, last)

    def teardown(self) -> None:
        """See base class: destroys the one-rank group :meth:`setup` created, if it did."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False

    def describe(self) -> dict[str, Any]:
        shape = tuple(self.mesh.shape) if self.mesh is not None else None
        return {**super().describe(), "tp_size": self.tp_size, "mesh": shape,
                "parallelize_fn": getattr(self.parallelize_fn, "__qualname__", repr(self.parallelize_fn))}


@contextlib.contextmanager
def _gradient_sync(setter: Callable[[bool], None], last: bool) -> Any:
    setter(last)
    try:
        yield
    finally:
        if not last:
            setter(True)


register_strategy("model_parallel", ModelParallelStrategy)
