"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) — parameters, gradients and optimizer state
sharded over the ranks as ``DTensor``\\ s (dim 0, one shard per rank).

Wrap policy
    ``fully_shard`` is applied to each module the policy selects (bottom-up), then to the root. Each
    selected module becomes one all-gather/reduce-scatter unit; per transformer block is the usual
    choice. ``wrap`` is a list of module classes (or class *names*, for CLI flags), a callable
    ``module -> bool``, or None: every element of every ``nn.ModuleList`` (how transformer blocks are
    usually held).

Mixed precision
    ``bf16-mixed`` / ``16-mixed`` use ``MixedPrecisionPolicy(param_dtype=bf16|fp16,
    reduce_dtype=fp32)``: parameters are all-gathered in the low precision, gradients reduced in fp32,
    the sharded fp32 parameters stepped by the optimizer; the root's outputs are cast back to fp32
    (``output_dtype``) so the loss is computed in fp32. Forward code runs inside ``autocast`` as well,
    so ops mixing parameters with fp32 buffers (attention masks) follow autocast's rules.
    ``16-mixed`` uses ``ShardedGradScaler`` (the inf check is all-reduced: every rank skips the same
    step).

Options
    ``activation_checkpointing``: False, True (the wrapped modules), or a policy like ``wrap``; uses
    ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``) applied before sharding. The
    wrapper's ``_checkpoint_wrapped_module.`` prefix is removed from state-dict keys by torch, so
    checkpoints load with or without it.
    ``cpu_offload``: ``CPUOffloadPolicy`` — sharded parameters, gradients and the optimizer step live
    on the CPU (meaningful on GPU; a no-op on a CPU-only run).
    ``reshard_after_forward``: free the unsharded parameters after forward (ZeRO-3 like, default) or
    keep them until backward (ZeRO-2 like, more memory, one all-gather fewer).
    ``accumulate_unsharded``: with gradient accumulation > 1, keep full-size (unsharded, fp32)
    gradients locally until the last micro-batch (``set_requires_gradient_sync(False)``): one
    reduce-scatter per step instead of one per micro-batch, at the memory cost of a full gradient
    replica per GPU (about 28 GB at 7B parameters). Off by default: accumulation > 1 happens exactly
    after the world shrinks, so the fast path would make a resize OOM the survivors. When on, the
    estimate is logged (``fsdp_unsharded_gradients``) at every setup/re-formation that accumulates.

Device and meta-device initialisation
    The mesh is built on :attr:`~Strategy.device` (``rt.device``), never on the device the model sits
    on. A model built on the CPU is moved shard by shard to that device by ``fully_shard``; a model
    built on ``meta`` (``with torch.device("meta"): model = Net()``: no memory at all) is sharded
    there, materialised with ``to_empty(device=rt.device)`` (each rank allocates its shards only) and
    initialised by ``init_weights(module)`` (default: ``reset_parameters()`` of every module that has
    one, ``_reset_parameters()`` for ``nn.MultiheadAttention``; the model's own ``reset_parameters``
    must set its non-persistent buffers, which no checkpoint holds). Restoring a checkpoint then
    overwrites the parameters. In-place re-formation re-runs the initialiser on the fresh shards of a
    meta-built model before the checkpoint reload.

Optimizer
    ``fully_shard`` replaces every parameter with a sharded one, so :meth:`FSDPStrategy.setup` builds
    a new optimizer of the same class, param groups and hyperparameters over the new parameters; use
    the returned one. The optimizer must not have been stepped yet.

Resize: native. DCP reshards the ``DTensor`` state to the new world size on load. FSDP2 needs a
device mesh even at world size 1: without a process group, :meth:`setup` creates a one-rank gloo group
over an in-process ``HashStore`` (no port).

In-place re-formation (``reform_state = CHECKPOINT``, when the runtime sets ``keep_wrapped``):
FSDP2 shards a module in place and keys its state by the module object, so a sharded module cannot
be re-sharded for another mesh. :meth:`FSDPStrategy.setup` therefore keeps a *template* of the
unsharded model (a deep copy whose parameters are on the ``meta`` device: no memory; buffers are kept
for the non-persistent ones) and returns an :class:`ElasticModule` that forwards to the current
sharded module. :meth:`FSDPStrategy.reform` shards a fresh copy of the template over the new world's
mesh, materialises it (``to_empty``), swaps it into the same ``ElasticModule`` and re-points the
*same* optimizer object at the new parameters (its state is cleared); the runtime then reloads the
checkpoint committed at the stop, resharded by DCP. The script's ``model`` and ``optimizer`` (and an
LR scheduler built on it) stay valid. ``ElasticModule.module`` is the sharded module.

CPU: works with gloo in torch 2.13 — gloo implements the collectives FSDP2 issues
(``all_gather_into_tensor``, ``reduce_scatter_tensor`` via ``reduce_scatter_single``, ``ReduceOp.AVG``);
verified by a 2-process run (tests/strategies).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainguard.contract.log import get_logger
from trainguard.strategies.base import (
    ReformState,
    Strategy,
    StrategyError,
    param_names,
    rebuild_optimizer,
    register_strategy,
)

log = get_logger("trainguard.strategies.fsdp")

WrapPolicy = Sequence[type[nn.Module] | str] | Callable[[nn.Module], bool] | None


def _module_list_children(model: nn.Module) -> set[int]:
    return {id(c) for m in model.modules() if isinstance(m, nn.ModuleList) for c in m}


def resolve_policy(policy: WrapPolicy | bool, model: nn.Module, setting: str) -> Callable[[nn.Module], bool]:
    """Turn a wrap/checkpointing policy into a predicate over ``model``'s submodules (never the root)."""
    if policy is None or policy is True:
        ids = _module_list_children(model)
        return lambda m: id(m) in ids
    if callable(policy) and not isinstance(policy, type):
        return lambda m: m is not model and bool(policy(m))
    if isinstance(policy, (str, type)):
        policy = [policy]
    names: set[str] = set()
    classes: list[type] = []
    for p in policy:  # type: ignore[union-attr]
        if isinstance(p, str):
            names.add(p)
        elif isinstance(p, type) and issubclass(p, nn.Module):
            classes.append(p)
        else:
            raise StrategyError(f"`{setting}` entries must be nn.Module classes or class names, got {p!r}. Fix: "
                                f"e.g. {setting}=[Block] or {setting}=['Block']")
    present = {type(m).__name__ for m in model.modules()}
    unknown = names - present
    if unknown:
        raise StrategyError(f"`{setting}` names {sorted(unknown)}, which no module of the model is. Fix: use one of "
                            f"{sorted(present)}")
    cls_tuple = tuple(classes)
    return lambda m: m is not model and (type(m).__name__ in names or (bool(cls_tuple) and isinstance(m, cls_tuple)))


class ElasticModule(nn.Module):
    """What the script holds when FSDP re-forms in place: forwards to the current sharded module
    (``.module``), which :meth:`FSDPStrategy.reform` replaces."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, ElasticModule) else model


def group_names(optimizer: torch.optim.Optimizer, named: dict[str, nn.Parameter]) -> list[list[str]]:
    """The names (keys of ``named``) of each of ``optimizer``'s param groups' parameters, in order: what
    :func:`swap_in` re-points the groups by after an in-place re-formation."""
    by_id = {id(p): n for n, p in named.items()}
    return [[by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def swap_in(model: ElasticModule, fresh: nn.Module, buffers: dict[str, torch.Tensor],
            optimizer: torch.optim.Optimizer | None, names: list[list[str]],
            strip: Callable[[str], str]) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The end of an in-place re-formation (``fsdp``, ``model_parallel``): copy ``buffers`` (the template's,
    by stripped name) into ``fresh`` (materialised by ``to_empty``, which dropped their values;
    persistent ones reload too), make ``fresh`` the module ``model`` forwards to, in the same train/eval
    mode, and re-point ``optimizer``'s param groups (:func:`group_names`) at ``fresh``'s parameters, its
    state cleared (the runtime reloads it)."""
    with torch.no_grad():
        for n, b in fresh.named_buffers():
            src = buffers.get(strip(n))
            if src is not None and src.device.type != "meta":
                b.copy_(src)
    training = model.training
    model.module = fresh
    model.train(training)
    if optimizer is not None:
        new = {strip(n): p for n, p in fresh.named_parameters()}
        for g, group in zip(optimizer.param_groups, names, strict=True):
            g["params"] = [new[n] for n in group]
        optimizer.state.clear()
    return model, optimizer


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters live on the ``meta`` device (no memory) and whose
    buffers are real copies (non-persistent ones are not in any checkpoint)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


class FSDPStrategy(Strategy):
    """Args:
        precision: ``32``, ``bf16-mixed`` or ``16-mixed``.
        wrap: wrap policy (see the module docstring).
        activation_checkpointing: False, True (= the wrapped modules), or a policy like ``wrap``.
        cpu_offload: offload sharded parameters/gradients/optimizer step to CPU (``CPUOffloadPolicy``).
        reshard_after_forward: passed to ``fully_shard`` for the non-root modules.
        accumulate_unsharded: the one-reduce-scatter-per-step accumulation path (see the module docstring).
        init_weights: initialiser of a meta-device model after ``to_empty`` (default: ``reset_parameters``).
    """

    name = "fsdp"
    reshard_native = True
    reform_state = ReformState.CHECKPOINT

    def __init__(self, *, precision: Any = "32", wrap: WrapPolicy = None,
                 activation_checkpointing: WrapPolicy | bool = False, cpu_offload: bool = False,
                 reshard_after_forward: bool = True, accumulate_unsharded: bool = False,
                 init_weights: Callable[[nn.Module], None] | None = None) -> None:
        super().__init__(precision=precision)
        self.accumulate_unsharded = accumulate_unsharded
        self.init_weights = init_weights
        self.wrap = wrap
        self.activation_checkpointing = activation_checkpointing
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = reshard_after_forward
        self.wrapped: list[str] = []
        self.checkpointed: list[str] = []
        self.owns_process_group = False
        self._template: nn.Module | None = None
        self._accum = 1
        self._meta_init = False
        self._grad_bytes: int | None = None
        self._opt_names: list[list[str]] = []

    # -- setup -----------------------------------------------------------------------------------
    def _mesh(self, device_type: str) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            # FSDP2 needs a mesh even alone; an in-process store needs no port and no env.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.owns_process_group = True
        return init_device_mesh(device_type, (dist.get_world_size(),))

    def _policies(self, root: bool) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        kw: dict[str, Any] = {}
        dtype = self.precision.compute_dtype
        if dtype is not None:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                                   output_dtype=torch.float32 if root else None)
        if self.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        return kw

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """See base class. Returns the same (now sharded) model object and a rebuilt optimizer; with
        :attr:`keep_wrapped`, an :class:`ElasticModule` around it (see the module docstring)."""
        old = param_names(model)
        self._prepare_precision()
        device = self.target_device()
        on_meta = any(p.is_meta for p in model.parameters())
        if self.keep_wrapped:
            self._template = meta_copy(model)
        self._shard(model, device.type)
        if on_meta:
            self._materialise(model, device)
        new = {_strip_ckpt(n): p for n, p in model.named_parameters()}
        self._grad_bytes = self.unsharded_gradient_bytes(model)
        self._log_unsharded()
        opt = rebuild_optimizer(optimizer, old, new)
        if not self.keep_wrapped:
            return model, opt
        self._opt_names = group_names(opt, new)
        return ElasticModule(model), opt

    def _materialise(self, model: nn.Module, device: torch.device) -> None:
        """A meta-device model, sharded: allocate this rank's shards on ``device`` and initialise them."""
        model.to_empty(device=device)
        self._meta_init = True
        self._initialise(model)

    def _initialise(self, model: nn.Module) -> None:
        with torch.no_grad():
            if self.init_weights is not None:
                self.init_weights(model)
                return
            for m in model.modules():
                reset = getattr(m, "reset_parameters", None)
                if not callable(reset) and isinstance(m, nn.MultiheadAttention):
                    reset = m._reset_parameters
                if callable(reset):
                    reset()

    def unsharded_gradient_bytes(self, model: nn.Module) -> int:
        """Bytes of the full-size gradients the unsharded accumulation path keeps per rank (fp32 when
        mixed precision reduces in fp32). ``numel`` of a sharded ``DTensor`` is its global size."""
        total = 0
        for p in _inner(model).parameters():
            dtype = torch.float32 if self.precision.compute_dtype is not None else p.dtype
            total += p.numel() * torch.empty((), dtype=dtype).element_size()
        return total

    def _shard(self, model: nn.Module, device_type: str) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.activation_checkpointing is not False:
            self._apply_checkpointing(model)
        select = resolve_policy(self.wrap, model, "wrap")
        mesh = self._mesh(device_type)
        self.wrapped = []
        for name, m in reversed(list(model.named_modules())):  # bottom-up, as FSDP2 requires
            if m is not model and select(m):
                fully_shard(m, mesh=mesh, reshard_after_forward=self.reshard_after_forward, **self._policies(False))
                self.wrapped.append(name)
        fully_shard(model, mesh=mesh, **self._policies(True))

    def reform(self, model: nn.Module,
               optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """See base class and the module docstring: a fresh copy of the template, sharded over the new
        world's mesh, swapped into the same :class:`ElasticModule`; the same optimizer re-pointed at
        its parameters. Parameter values are undefined until the runtime reloads the checkpoint."""
        if self._template is None or not isinstance(model, ElasticModule):
            raise StrategyError("fsdp reform() needs the ElasticModule setup() returned with keep_wrapped set")
        fresh = copy.deepcopy(self._template)
        buffers = {n: b for n, b in fresh.named_buffers()}
        self._shard(fresh, self.target_device().type)
        fresh.to_empty(device=self.target_device())
        if self._meta_init:  # the template's buffers are on meta too: recompute them
            self._initialise(fresh)
        return swap_in(model, fresh, buffers, optimizer, self._opt_names, _strip_ckpt)

    def state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
        """See base class (the sharded module inside an :class:`ElasticModule`)."""
        return super().state(_inner(model), optimizer)

    def _apply_checkpointing(self, model: nn.Module) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        policy = self.wrap if self.activation_checkpointing is True else self.activation_checkpointing
        select = resolve_policy(policy, model, "activation_checkpointing")  # type: ignore[arg-type]
        chosen = [n for n, m in model.named_modules() if select(m)]
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=select)
        self.checkpointed = chosen

    def make_scaler(self) -> Any:
        """See base class: the inf check is all-reduced over the ranks (each holds only a shard)."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self._device_type)

    # -- step ------------------------------------------------------------------------------------
    def no_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        """See base class. Default: every micro-batch reduce-scatters its gradients, which accumulate
        sharded (1/world of the memory). With ``accumulate_unsharded``:
        ``set_requires_gradient_sync(False)`` keeps unsharded gradients locally until the last
        micro-batch, which reduce-scatters the accumulated sum."""
        return _gradient_sync(_inner(model), last or not self.accumulate_unsharded)

    def plan(self, global_batch: int, world_size: int, micro_batch: int) -> tuple[int, int]:
        """See base class; logs the unsharded-gradient memory when that path will be taken."""
        accum, per_rank = super().plan(global_batch, world_size, micro_batch)
        self._accum = accum
        self._log_unsharded()
        return accum, per_rank

    def _log_unsharded(self) -> None:
        if self._accum > 1 and self.accumulate_unsharded and self._grad_bytes is not None:
            log.info("fsdp_unsharded_gradients", accum_steps=self._accum, bytes_per_rank=self._grad_bytes,
                     effect="each rank holds full-size gradients until the last micro-batch",
                     fix="leave accumulate_unsharded off to reduce-scatter per micro-batch (sharded gradients)")

    def teardown(self) -> None:
        """See base class: destroys the one-rank group :meth:`setup` created, if it did."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "wrapped": self.wrapped, "activation_checkpointing": self.checkpointed,
                "cpu_offload": self.cpu_offload, "reshard_after_forward": self.reshard_after_forward,
                "accumulate_unsharded": self.accumulate_unsharded}


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, last: bool) -> Iterator[None]:
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None:  # not set up by this strategy
        raise StrategyError("fsdp no_sync() got a model that fully_shard did not wrap. Fix: pass the model "
                            "returned by Runtime.setup / FSDPStrategy.setup")
    setter(last)
    try:
        yield
    finally:
        if not last:
            setter(True)


def _strip_ckpt(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")


register_strategy("fsdp", FSDPStrategy)
register_strategy("fsdp2", FSDPStrategy)
