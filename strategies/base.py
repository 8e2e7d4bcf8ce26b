"""The strategy interface: how a model and its optimizer are spread over the ranks of the current world.

A :class:`Strategy` wraps model + optimizer for the current world (:meth:`Strategy.setup`), skips the
gradient synchronisation on all but the last micro-batch of a step (:meth:`Strategy.no_sync`), gives
the checkpoint a ``Stateful`` for its DCP app-state (:meth:`Strategy.state`), owns the numeric
precision (:attr:`Strategy.precision`: autocast, loss scaling), says which ranks share a data-parallel
share of the batch (:meth:`Strategy.data_parallel`) and what a world-size change needs
(:attr:`Strategy.reshard_native`, :attr:`Strategy.resize_rule`, :meth:`Strategy.plan`).

The worker runtime and the checkpoint code only ever talk to this interface (STYLE §1: no
``isinstance`` on a concrete strategy). Strategies are looked up by name with :func:`get_strategy`;
implementations register themselves with :func:`register_strategy` (``ddp``, ``fsdp``, ``deepspeed``,
``model_parallel``; imported lazily, so ``deepspeed`` is needed only when that strategy is used).

Precision (:class:`Precision`)
    ``32``            fp32 everywhere (aliases ``32-true``, ``fp32``).
    ``bf16-mixed``    fp32 weights and optimizer state, bf16 compute (autocast, or FSDP2's
                      ``MixedPrecisionPolicy``); no loss scaling. Works on CPU.
    ``16-mixed``      fp32 weights, fp16 compute, dynamic loss scaling with a ``GradScaler`` (FSDP:
                      ``ShardedGradScaler``, whose inf check is all-reduced so every rank skips the same
                      steps). On CPU it runs (fp16 kernels exist for the common ops) but slowly and is
                      meant for tests; use ``bf16-mixed`` on CPU.
    The scaler's state (scale, growth tracker) is part of the checkpoint.
"""

from __future__ import annotations

import contextlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.strategies.batch import plan as _plan
from trainguard.checkpoint.state import ModelOptimizerState


class StrategyError(ValueError):
    """A strategy or precision setting is invalid; the message names the setting and the fix."""


class ReformState(str, Enum):
    """How a world re-formed in place (live processes, new process groups) gets a strategy's state
    (:attr:`Strategy.reform_state`)."""

    REPLICATED = "replicated"
    """Every rank holds all of it; a live rank broadcasts it to ranks that lack it
    (:meth:`Strategy.replicated_tensors`)."""
    CHECKPOINT = "checkpoint"
    """Every rank reloads the checkpoint committed at the stop (or the memory tier's step), resharded."""
    RESTART = "restart"
    """The strategy cannot re-form in place: its workers restart and restore (the fallback)."""


# ---- precision ---------------------------------------------------------------------------------

_PRECISION_ALIASES = {"32": "32", "32-true": "32", "fp32": "32",
                      "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}
PRECISIONS = ("32", "bf16-mixed", "16-mixed")


@dataclass(frozen=True, slots=True)
class Precision:
    """A parsed precision setting. ``compute_dtype`` is None for fp32."""

    name: str

    @classmethod
    def parse(cls, value: str | int | Precision | None) -> Precision:
        """``"32" | 32 | "bf16-mixed" | "16-mixed"`` (and aliases) -> :class:`Precision`."""
        if isinstance(value, Precision):
            return value
        key = "32" if value is None else str(value).strip().lower()
        if key not in _PRECISION_ALIASES:
            raise StrategyError(
                f"unknown precision `precision={value!r}`. Available: {', '.join(PRECISIONS)} (aliases: "
                f"32-true, fp32). Fix: pass one of them to Runtime.setup(precision=...) or the example's "
                f"--precision flag; on CPU prefer bf16-mixed")
        return cls(_PRECISION_ALIASES[key])

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[self.name]

    @property
    def needs_scaler(self) -> bool:
        """fp16's narrow range needs dynamic loss scaling; bf16 and fp32 do not."""
        return self.name == "16-mixed"


# ---- resize ------------------------------------------------------------------------------------

BATCH_RULE = ("the global batch stays constant: global_batch = world_size x accumulation_steps x "
              "micro_batch, so accumulation_steps = global_batch / (world_size x micro_batch) is recomputed "
              "at every world size (a ValueError names the valid world sizes when it cannot divide)")


# ---- checkpoint state --------------------------------------------------------------------------

class StrategyState(ModelOptimizerState):
    """Model + optimizer through ``get_state_dict``/``set_state_dict`` (resharded by DCP), plus the
    loss scaler's state when the precision uses one (a few plain numbers, identical on every rank)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 scaler: Any = None, options: Any = None) -> None:
        super().__init__(model, optimizer, options)
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self.scaler is not None:
            sd["scaler"] = dict(self.scaler.state_dict())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])

    def local_extras(self) -> dict[str, Any]:
        return {"scaler": dict(self.scaler.state_dict())} if self.scaler is not None else {}

    def load_local_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_local_state_dict(state_dict)
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])


# ---- the interface -----------------------------------------------------------------------------

def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def default_device() -> torch.device:
    """The device a strategy uses when nobody set :attr:`Strategy.device`: the current CUDA device
    when CUDA is available, else the CPU. The worker runtime always sets it (``rt.device``)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Strategy(ABC):
    """How model + optimizer are spread over the current world. One instance per worker process.

    Not thread-safe; the training loop owns it. Subclasses set :attr:`name` and
    :attr:`reshard_native` and implement :meth:`setup` and :meth:`no_sync`; they may override the
    precision hooks (:meth:`autocast`, :meth:`make_scaler`) when they handle precision natively.

    **Device rule:** a strategy trains on :attr:`device`, which the runtime sets (``rt.device``) before
    :meth:`setup`; it never derives the device from where the model's parameters sit (a model built on
    the CPU or on ``meta`` is moved or materialised there).
    """

    name: ClassVar[str]
    """Registry name, recorded in every checkpoint manifest."""
    reshard_native: ClassVar[bool]
    """True when a checkpoint saved at world size W loads at any W' with no conversion step."""
    reform_state: ClassVar[ReformState] = ReformState.RESTART
    """How a world re-formed in place (live processes, new process groups) gets its state
    (:class:`ReformState`); by default it cannot: its workers restart."""
    makes_groups: ClassVar[bool] = False
    """True when :meth:`setup` and :meth:`reform` create process groups of their own (device-mesh
    sub-groups): the runtime records their connections with the world's, to end them when a peer fails."""

    def __init__(self, *, precision: str | int | Precision | None = "32") -> None:
        self.precision = Precision.parse(precision)
        self.scaler: Any = None
        self.device: torch.device | None = None
        """Where this worker trains (set by the runtime before :meth:`setup`; None: :func:`default_device`)."""
        self._device_type = "cpu"
        self.keep_wrapped = False
        """Set by the runtime when worlds re-form in place: wrap even at world size 1, so that the
        object the script holds stays the same when the world grows."""
        self.init_synced = True
        """False when :meth:`setup` left the ranks' replicated state unsynchronised (``ddp`` in a job that
        re-forms in place skips DDP's broadcast from rank 0: see :mod:`~trainguard.strategies.ddp`); the
        runtime's ``restore`` then makes the ranks agree, from a live peer, a checkpoint or rank 0."""

    # -- wrapping --------------------------------------------------------------------------------
    @abstractmethod
    def setup(self, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Wrap ``model`` (and, where parameters are replaced, rebuild ``optimizer``) for the current
        world. Call once, after ``init_process_group``; use the returned objects from then on."""

    @abstractmethod
    def no_sync(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-batch's forward+backward: gradients are synchronised only when
        ``last`` (the last micro-batch of the optimizer step); before that they accumulate locally."""

    def reform(self, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        """Re-wrap ``model`` for the new default process group after an in-place re-formation, keeping
        the objects the script holds; see :attr:`reform_state`. The default cannot."""
        raise StrategyError(f"strategy {self.name!r} cannot re-form in place (reform_state is RESTART); its workers "
                            f"restart at a membership change")

    def replicated_tensors(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers, by name, that a live rank broadcasts to the ranks that
        lack them after an in-place re-formation (``reform_state`` is ``REPLICATED``)."""
        raise StrategyError(f"strategy {self.name!r} does not replicate its state")

    # -- checkpoint ------------------------------------------------------------------------------
    def state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Stateful:
        """The DCP app-state entry for ``model`` + ``optimizer`` (+ the loss scaler). Loads at any
        world size when :attr:`reshard_native`."""
        return StrategyState(model, optimizer, self.scaler)

    # -- resize ----------------------------------------------------------------------------------
    def data_parallel(self, rank: int, world: int) -> tuple[int, int]:
        """``(dp_rank, dp_size)``: which share of every global batch ``rank`` of ``world`` trains on.

        The runtime splits each global batch over ``dp_size`` shares (:meth:`plan` gets ``dp_size``)
        and gives rank ``rank`` share ``dp_rank``. Ranks with the same ``dp_rank`` train on the same
        samples (e.g. one tensor-parallel group). Default: every rank is its own share (identity).
        Raises :class:`StrategyError` for a world the strategy cannot split."""
        return rank, world

    @property
    def resize_rule(self) -> str:
        """What a world-size change needs, in words (logged at setup, shown in docs)."""
        how = ("parameters and optimizer state reshard on load (DCP)" if self.reshard_native
               else "the checkpoint must be converted before it loads at another world size")
        return f"{BATCH_RULE}; {how}"

    def plan(self, global_batch: int, world_size: int, micro_batch: int) -> tuple[int, int]:
        """``(accumulation_steps, samples_per_rank)`` at ``world_size`` data-parallel shares (see
        :attr:`resize_rule`, :meth:`data_parallel`)."""
        return _plan(global_batch, world_size, micro_batch)

    # -- precision -------------------------------------------------------------------------------
    def target_device(self) -> torch.device:
        """:attr:`device`, filled in with :func:`default_device` when the runtime did not set it."""
        if self.device is None:
            self.device = default_device()
        return self.device

    def _prepare_precision(self, model: torch.nn.Module | None = None) -> None:
        """Record the device type (of :attr:`device`; ``model`` is not looked at) and build the loss
        scaler (call from :meth:`setup`)."""
        self._device_type = self.target_device().type
        if self.precision.needs_scaler and self.scaler is None:
            self.scaler = self.make_scaler()

    def make_scaler(self) -> Any:
        """The loss scaler for ``16-mixed`` (a plain ``GradScaler``: gradients are identical on every
        rank after the all-reduce, so every rank takes the same skip decision)."""
        return torch.amp.GradScaler(self._device_type)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Context for the forward pass (and loss): autocast to the compute dtype, or nothing."""
        dtype = self.precision.compute_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled when the precision uses a loss scaler."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; with a scaler: unscale, skip on inf/nan, update the scale."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def teardown(self) -> None:
        """Release what :meth:`setup` created beyond the model (e.g. a process group). Idempotent."""

    def describe(self) -> dict[str, Any]:
        """Settings for the ``worker_setup`` log line."""
        return {"strategy": self.name, "precision": self.precision.name, "reshard_native": self.reshard_native}


# ---- helpers shared by implementations -----------------------------------------------------------

def rebuild_optimizer(optimizer: torch.optim.Optimizer, old: dict[int, str],
                      new: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class, param groups and hyperparameters over replaced parameters.

    ``old`` maps ``id(parameter)`` before wrapping to its name; ``new`` maps names to the parameters
    after wrapping (FSDP2 swaps every parameter for a sharded DTensor one, so an optimizer built
    before ``fully_shard`` would step tensors the model no longer uses).
    """
    if any(optimizer.state.values()):
        raise StrategyError(
            "the optimizer passed to Runtime.setup already has state (it was stepped). Fix: create the "
            "optimizer fresh and call setup() before training; restore state with Runtime.restore()")
    groups = []
    for g in optimizer.param_groups:
        missing = [p for p in g["params"] if id(p) not in old]
        if missing:
            raise StrategyError(
                f"the optimizer holds {len(missing)} parameter(s) that are not parameters of the model "
                f"given to Runtime.setup. Fix: build the optimizer from model.parameters()")
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [new[old[id(p)]] for p in g["params"]]})
    # Each group carries every hyperparameter; constructor defaults are passed only where the
    # constructor takes them (AdamW's defaults hold keys its __init__ does not accept).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}


# ---- registry ----------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., Strategy]] = {}
_LAZY: dict[str, str] = {"ddp": "trainguard.strategies.ddp", "fsdp": "trainguard.strategies.fsdp",
                         "fsdp2": "trainguard.strategies.fsdp", "deepspeed": "trainguard.strategies.deepspeed",
                         "model_parallel": "trainguard.strategies.model_parallel"}


def register_strategy(name: str, factory: Callable[..., Strategy]) -> None:
    """Make ``get_strategy(name, **options)`` call ``factory(**options)``."""
    _REGISTRY[name] = factory


def available_strategies() -> list[str]:
    return sorted(set(_REGISTRY) | set(_LAZY))


def get_strategy(name: str | Strategy, **options: Any) -> Strategy:
    """The strategy called ``name``, built with ``options`` (``precision=...`` and its own options).

    A :class:`Strategy` instance is returned as it is (``options`` must then be empty).
    """
    if isinstance(name, Strategy):
        if options:
            raise StrategyError(f"options {sorted(options)} given with an already built strategy "
                                f"{name.name!r}. Fix: pass them to its constructor instead")
        return name
    key = str(name).strip().lower()
    if key not in _REGISTRY and key in _LAZY:
        import importlib

        importlib.import_module(_LAZY[key])
    if key not in _REGISTRY:
        raise StrategyError(
            f"unknown strategy `strategy={name!r}`. Available: {', '.join(available_strategies())}. Fix: pass "
            f"one of them to Runtime.setup(strategy=...) or the example's --strategy flag")
    try:
        return _REGISTRY[key](**options)
    except TypeError as e:
        raise StrategyError(f"invalid option for strategy {key!r}: {e}. Fix: see docs/strategies.md for the "
                            f"options of {key!r}") from e

