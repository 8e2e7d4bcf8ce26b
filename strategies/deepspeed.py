"""``deepspeed``: DeepSpeed ZeRO stage 1, 2 or 3 — optimizer state (1), + gradients (2), + parameters (3)
partitioned over the ranks by a ``DeepSpeedEngine``; optionally ZeRO-Offload (optimizer state, and at
stage 3 parameters, in host memory, stepped by DeepSpeed's CPU Adam).

Mapping onto the :class:`~trainguard.strategies.base.Strategy` interface
    :meth:`DeepSpeedStrategy.setup` calls ``deepspeed.initialize(model=, optimizer=, config=)`` with the
    script's own torch optimizer and returns ``(engine, engine.optimizer)``: the engine is the model from
    then on, the ZeRO optimizer wrapper the optimizer. Gradient accumulation stays the runtime's:
    DeepSpeed's ``gradient_accumulation_steps`` is the runtime's accumulation steps at the current world
    size and ``train_micro_batch_size_per_gpu`` its micro-batch (the runtime calls :meth:`plan` before
    :meth:`setup`), and the accumulation boundary is set explicitly per micro-batch
    (``engine.set_gradient_accumulation_boundary(last)`` in :meth:`no_sync`), so DeepSpeed reduces
    (ZeRO-1) or finishes the reduce-scatter (ZeRO-2/3) on the last micro-batch only. :meth:`backward` is
    ``engine.backward(loss, scale_wrt_gas=False)`` — the script already divides the loss by the number
    of micro-batches — and :meth:`optimizer_step` is ``engine.step()``, called once per optimizer step
    (DeepSpeed's documented "set the boundary, step once" style). Scripts must use
    ``rt.backward``/``rt.optimizer_step`` with this strategy: a bare ``loss.backward()`` bypasses the
    engine's gradient partitioning.

ZeRO-Offload
    ``zero_optimization.offload_optimizer: {device: cpu}`` (any stage) and ``offload_param: {device:
    cpu}`` (stage 3) in the config. DeepSpeed then steps with its C++ ``DeepSpeedCPUAdam``: the script's
    ``torch.optim.Adam``/``AdamW`` is replaced by one with the same param groups and hyperparameters
    (``adamw_mode`` for AdamW); other optimizers are refused unless the config sets
    ``zero_force_ds_cpu_optimizer: false``. The op is JIT-built once per host, every wait on its build
    lock bounded (:mod:`~trainguard.strategies.deepspeed_ops`, option ``op_build_timeout_s``). NVMe
    offload is refused: swapped-out partitions are not in memory for the checkpoint to read.

Precision
    ``32``: fp32 everywhere. ``bf16-mixed``: DeepSpeed's ``bf16`` section — the module is cast to bf16,
    the optimizer keeps fp32 master weights and fp32 optimizer state (gradients accumulate in
    DeepSpeed's default dtype for the stage unless the config's ``data_types`` says otherwise).
    ``16-mixed``: the ``fp16`` section with DeepSpeed's dynamic loss scaler, whose state is checkpointed;
    DeepSpeed refuses fp16 on a CPU without fp16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported``),
    so :meth:`setup` raises :class:`StrategyError` there. The engine casts the module to bf16/fp16;
    :meth:`autocast` is still ``torch.autocast`` to that dtype (base class), so floating-point inputs
    and buffers the script creates in fp32 meet the low-precision weights without a dtype error.

Checkpoint: each rank saves and loads what it owns, and loads at any world size and stage
    :meth:`state` is a :class:`~trainguard.strategies.deepspeed_state.DeepSpeedState`: per parameter
    name, the fp32 master weight and each per-element optimizer state as a flat global tensor of which
    this rank holds its ZeRO range (views of the live partitions, no copies), plus the replicated scalars
    (optimizer ``step``, engine counters, buffers, fp16 loss scaler). DCP writes each rank's ranges; a
    load at another world size or ZeRO stage reads exactly the saved ranges that overlap what the
    loading rank owns. Host memory for a save or a load is therefore O(what the rank owns) — with Adam
    12 bytes x parameters / world size for the staged copy — not the full model (measured by
    ``bench/deepspeed_memory.py``). It goes through the checkpoint manager's manifest/commit/fence path
    like every strategy's state; ``reshard_native = True``. Checkpoints written by the earlier
    full-state format (full-shape tensors per parameter) do not load into this format.

Limits
    Every parameter must be trainable (``requires_grad``); DeepSpeed ``optimizer``/``scheduler`` config
    sections are refused (build the optimizer in the script; create LR schedulers on the returned
    optimizer); no NVMe offload, pipeline or tensor parallelism, MoE; stage 0 is ``ddp``.

CPU (torch 2.13, gloo)
    DeepSpeed picks its CPU accelerator when CUDA is absent (``DS_ACCELERATOR`` overrides it) and uses
    gloo when oneCCL is not installed. Creating its communication backend JIT-builds a shared-memory
    all-reduce op (``deepspeed_shm_comm``, used only by inference all-reduce); setup marks that op
    incompatible before ``deepspeed.initialize`` (a build lock left by a killed process once made every
    later start wait forever on it), so gloo does every collective. ZeRO-Offload's CPU Adam is built
    (see above). Verified with ZeRO-1/2/3 at 1 to 4 processes and ZeRO-2/3 offload at 1 and 2
    (tests/strategies).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.strategies.base import (
    BATCH_RULE,
    Strategy,
    StrategyError,
    register_strategy,
    world,
)
from trainguard.strategies.deepspeed_state import DeepSpeedState, OptimizerProbe, ZeroPartitions

STAGES = (1, 2, 3)
_OWNED_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
_REFUSED_SECTIONS = {
    "optimizer": "build the optimizer in the training script and pass it to Runtime.setup",
    "scheduler": "create the LR scheduler in the training script (its state is then the script's)",
}


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as e:
        raise StrategyError(
            f"strategy 'deepspeed' needs the deepspeed package ({e}). Fix: pip install --no-build-isolation "
            f"'deepspeed>=0.15' (without --no-build-isolation pip installs another torch)") from e
    return deepspeed


def _no_jit_comm_ops() -> None:
    """Keep DeepSpeed's CPU comm backend from JIT-compiling its shared-memory op (see the module docstring)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def load_config(config: dict[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """The user's DeepSpeed config: a dict (copied), or a path to a JSON or YAML file, or None."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = os.fspath(config)
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as e:
        raise StrategyError(f"deepspeed option `config={path!r}` cannot be read: {e}. Fix: pass a dict or the path "
                            f"of an existing DeepSpeed JSON/YAML config") from e
    import yaml

    try:
        data = yaml.safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
    except (ValueError, yaml.YAMLError) as e:
        raise StrategyError(f"deepspeed option `config={path!r}` is not valid JSON/YAML: {e}. Fix: correct the "
                            f"file (.yaml/.yml are read as YAML, anything else as JSON)") from e
    if not isinstance(data, dict):
        raise StrategyError(f"deepspeed option `config={path!r}` holds a {type(data).__name__}, not a mapping. Fix: "
                            f"the file must be a DeepSpeed config object ({{\"zero_optimization\": ...}})")
    return data


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


class DeepSpeedStrategy(Strategy):
    """Args:
        precision: ``32``, ``bf16-mixed`` or ``16-mixed`` (DeepSpeed's ``bf16``/``fp16`` sections).
        stage: ZeRO stage 1, 2 or 3 (default: the config's ``zero_optimization.stage``, else 2).
        config: a DeepSpeed config dict or the path of a JSON/YAML one; merged with the keys the
            runtime owns (micro-batch, accumulation steps, stage, precision flags), which it may only
            leave out, set to ``"auto"`` or to the same value. ZeRO-Offload is configured here
            (``zero_optimization.offload_optimizer`` / ``offload_param``, device ``cpu``).
        op_build_timeout_s: the longest wait for the build lock of DeepSpeed's CPU Adam op (ZeRO-Offload
            only; the first build on a host takes minutes).
    """

    name = "deepspeed"
    reshard_native = True

    def __init__(self, *, precision: Any = "32", stage: int | str | None = None,
                 config: dict[str, Any] | str | os.PathLike[str] | None = None,
                 op_build_timeout_s: float = 900.0) -> None:
        super().__init__(precision=precision)
        self.user_config = load_config(config)
        zero = self.user_config.get("zero_optimization") or {}
        if not isinstance(zero, dict):
            raise StrategyError(f"deepspeed config `zero_optimization` must be a mapping, got {zero!r}. Fix: e.g. "
                                f"{{\"zero_optimization\": {{\"stage\": 2}}}}")
        cfg_stage = zero.get("stage")
        if stage is None:
            stage = 2 if cfg_stage is None else cfg_stage
        elif cfg_stage is not None and _as_int(cfg_stage) != _as_int(stage):
            raise StrategyError(f"deepspeed option `stage={stage!r}` contradicts the config's "
                                f"`zero_optimization.stage={cfg_stage!r}`. Fix: set one of them, or both alike")
        if _as_int(stage) not in STAGES:
            raise StrategyError(f"invalid deepspeed option `stage={stage!r}`. Available: 1, 2, 3 (ZeRO stages; "
                                f"stage 0 is plain data parallel: use strategy='ddp'). Fix: pass stage=1|2|3 (the "
                                f"example's --zero-stage flag)")
        self.stage = _as_int(stage)
        for key, fix in _REFUSED_SECTIONS.items():
            if key in self.user_config:
                raise StrategyError(f"deepspeed config section `{key}` is not supported by trainguard (its state "
                                    f"would not be checkpointed). Fix: remove it; {fix}")
        wanted = {"32": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}[self.precision.name]
        for section in ("bf16", "fp16"):
            if _enabled(self.user_config.get(section)) and section != wanted:
                raise StrategyError(
                    f"deepspeed config enables `{section}` but `precision={self.precision.name!r}`. Fix: pass "
                    f"precision={'bf16-mixed' if section == 'bf16' else '16-mixed'} (the strategy sets the "
                    f"`enabled` flags from the precision) or remove `{section}.enabled` from the config")
        self.offload = _offload(zero, self.stage)
        if not op_build_timeout_s > 0:
            raise StrategyError(f"invalid deepspeed option `op_build_timeout_s={op_build_timeout_s!r}`. Fix: a "
                                f"positive number of seconds (default 900)")
        self.op_build_timeout_s = float(op_build_timeout_s)
        self.engine: Any = None
        self._probe: OptimizerProbe | None = None
        self._parts: ZeroPartitions | None = None
        self.accum_steps = 1
        self.micro_batch = 1
        self.owns_process_group = False
        self._set_local_rank = False
        self.ds_config: dict[str, Any] = {}

    # -- resize ----------------------------------------------------------------------------------
    def plan(self, global_batch: int, world_size: int, micro_batch: int) -> tuple[int, int]:
        """See base class. Also remembers the result: :meth:`setup` gives it to DeepSpeed as
        ``gradient_accumulation_steps`` / ``train_micro_batch_size_per_gpu``."""
        accum, per_rank = super().plan(global_batch, world_size, micro_batch)
        self.accum_steps, self.micro_batch = accum, micro_batch
        return accum, per_rank

    @property
    def resize_rule(self) -> str:
        """See base class."""
        return (f"{BATCH_RULE}; each rank saves the ranges of the fp32 parameters and optimizer states its ZeRO "
                f"partition owns, per parameter name; a load at any world size and ZeRO stage reads the ranges the "
                f"new partition owns (DCP reshards, no conversion)")

    # -- setup -----------------------------------------------------------------------------------
    def build_config(self, world_size: int) -> dict[str, Any]:
        """The config given to ``deepspeed.initialize``: the user's, plus the keys the runtime owns."""
        cfg = copy.deepcopy(self.user_config)
        ours = {"train_micro_batch_size_per_gpu": self.micro_batch, "gradient_accumulation_steps": self.accum_steps,
                "train_batch_size": self.micro_batch * self.accum_steps * world_size}
        for key in _OWNED_BATCH_KEYS:
            if key in cfg and cfg[key] != "auto" and _as_int(cfg[key]) != ours[key]:
                raise StrategyError(
                    f"deepspeed config sets `{key}={cfg[key]!r}`, but the runtime owns it: it is {ours[key]} at "
                    f"world size {world_size} ({BATCH_RULE}). Fix: remove `{key}` from the config or set it to "
                    f"\"auto\"; choose the batch with Runtime.setup(global_batch=..., micro_batch=...)")
            cfg.pop(key, None)
        cfg["train_micro_batch_size_per_gpu"] = self.micro_batch
        cfg["gradient_accumulation_steps"] = self.accum_steps
        cfg["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "stage": self.stage}
        for section, on in (("bf16", self.precision.name == "bf16-mixed"), ("fp16", self.precision.name == "16-mixed")):
            if on or section in cfg:
                cfg[section] = {**(cfg.get(section) or {}), "enabled": on}
        # Recent DeepSpeed versions clip gradients at norm 1.0 by default; ddp/fsdp step the script's
        # optimizer on the unclipped gradients, and so does this strategy unless the config says otherwise.
        cfg.setdefault("gradient_clipping", 0.0)
        cfg.setdefault("steps_per_print", 2**31 - 1)  # the runtime logs steps; DeepSpeed's lines are noise
        return cfg

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """See base class. Returns ``(engine, engine.optimizer)``; ``optimizer`` must be a torch optimizer
        over ``model``'s parameters that has not been stepped."""
        if self.engine is not None:
            raise StrategyError("DeepSpeedStrategy.setup() was called twice. Fix: build one strategy per model")
        if any(optimizer.state.values()):
            raise StrategyError(
                "the optimizer passed to Runtime.setup already has state (it was stepped). Fix: create the "
                "optimizer fresh and call setup() before training; restore state with Runtime.restore()")
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            raise StrategyError(f"deepspeed: parameters {frozen[:5]} do not require gradients; the strategy's "
                                f"checkpoint covers trainable parameters only. Fix: make them trainable or remove "
                                f"them from the model")
        deepspeed = _import_deepspeed()
        from deepspeed.accelerator import get_accelerator

        if self.precision.name == "16-mixed" and not get_accelerator().is_fp16_supported():
            raise StrategyError(
                f"`precision='16-mixed'` with strategy 'deepspeed': DeepSpeed's {get_accelerator().device_name()} "
                f"accelerator reports no fp16 support on this machine and refuses the fp16 section. Fix: use "
                f"precision='bf16-mixed' (or '32')")
        _no_jit_comm_ops()
        if not dist.is_initialized():
            # DeepSpeed needs a process group even alone; an in-process store needs no port and no env.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.owns_process_group = True
            if "LOCAL_RANK" not in os.environ:
                # deepspeed.initialize asserts that a launcher set LOCAL_RANK; alone, there was none.
                # Removed again by teardown().
                os.environ["LOCAL_RANK"] = "0"
                self._set_local_rank = True
        _, size = world()
        self.ds_config = self.build_config(size)
        if self.offload and self.user_config.get("zero_force_ds_cpu_optimizer", True):
            from trainguard.strategies.deepspeed_ops import load_cpu_adam

            load_cpu_adam(self.op_build_timeout_s)
            optimizer = cpu_adam_like(optimizer)
        self._probe = OptimizerProbe(optimizer)
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        self.engine = engine
        # The engine moved the module to its device (DeepSpeed's accelerator + LOCAL_RANK): autocast and
        # the scaler follow that device, never where the module sat before initialize().
        self._device_type = torch.device(engine.device).type
        if self.device is not None and torch.device(engine.device) != self.device:
            raise StrategyError(f"DeepSpeed placed the model on {engine.device}, but this worker's device is {self.device} "
                                f"(rt.device, from LOCAL_RANK). Fix: leave DS_ACCELERATOR and LOCAL_RANK as the launcher "
                                f"set them; one worker per GPU")
        return engine, ds_optimizer

    # -- step ------------------------------------------------------------------------------------
    def _engine(self, model: Any = None) -> Any:
        if self.engine is None or (model is not None and model is not self.engine):
            raise StrategyError("deepspeed: got a model that DeepSpeedStrategy.setup did not return. Fix: use the "
                                "(engine, optimizer) pair returned by Runtime.setup / DeepSpeedStrategy.setup")
        return self.engine

    def no_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        """See base class: ``engine.set_gradient_accumulation_boundary(last)`` before the micro-batch;
        DeepSpeed then finishes the gradient reduction on the last one only."""
        return _boundary(self._engine(model), last)

    def backward(self, loss: torch.Tensor) -> None:
        """See base class: ``engine.backward(loss, scale_wrt_gas=False)`` (loss scaling for ``16-mixed``)."""
        self._engine().backward(loss, scale_wrt_gas=False)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """See base class: ``engine.step()`` (unscale/skip/clip/step/zero_grad, as configured)."""
        engine = self._engine()
        if optimizer is not engine.optimizer:
            raise StrategyError("deepspeed optimizer_step() got an optimizer that DeepSpeedStrategy.setup did not "
                                "return. Fix: pass the optimizer returned by Runtime.setup (or none)")
        engine.step()

    # -- checkpoint ------------------------------------------------------------------------------
    def state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Stateful:
        """See base class: this rank's ranges of the fp32 parameters and optimizer states, per parameter
        name (:mod:`~trainguard.strategies.deepspeed_state`). ``optimizer`` None: parameters only."""
        engine = self._engine(model)
        if self._parts is None:
            self._parts = ZeroPartitions(engine)
        return DeepSpeedState(self._parts, self._probe if optimizer is not None else None)

    def teardown(self) -> None:
        """See base class: destroys the one-rank group :meth:`setup` created, if it did."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False
        if self._set_local_rank:
            os.environ.pop("LOCAL_RANK", None)
            self._set_local_rank = False

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "zero_stage": self.stage, "ds_accum_steps": self.accum_steps,
                "ds_micro_batch": self.micro_batch, "offload": sorted(self.offload)}


@contextlib.contextmanager
def _boundary(engine: Any, last: bool) -> Iterator[None]:
    engine.set_gradient_accumulation_boundary(last)
    yield


def _offload(zero: dict[str, Any], stage: int) -> set[str]:
    """Which ZeRO-Offload sections the config enables (``optimizer``, ``param``); refuses what the
    checkpoint cannot cover (NVMe) or DeepSpeed cannot do (parameters below stage 3)."""
    out: set[str] = set()
    for what in ("optimizer", "param"):
        key = f"offload_{what}"
        section = zero.get(key)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise StrategyError(f"deepspeed config `zero_optimization.{key}` must be a mapping, got {section!r}. "
                                f"Fix: e.g. {{\"device\": \"cpu\"}}")
        device = str(section.get("device", "none")).lower()
        if device == "none":
            continue
        if device != "cpu":
            raise StrategyError(f"deepspeed config `zero_optimization.{key}.device={section.get('device')!r}` is not "
                                f"supported: trainguard checkpoints read partitions from memory, and NVMe-swapped ones "
                                f"are not there. Fix: device \"cpu\" (ZeRO-Offload to host memory) or \"none\"")
        if what == "param" and stage != 3:
            raise StrategyError(f"deepspeed config enables `zero_optimization.offload_param` at stage {stage}; "
                                f"DeepSpeed offloads parameters at ZeRO stage 3 only. Fix: stage=3, or remove "
                                f"offload_param (offload_optimizer works at every stage)")
        out.add(what)
    return out


def cpu_adam_like(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A ``DeepSpeedCPUAdam`` with ``optimizer``'s param groups and hyperparameters (ZeRO-Offload steps
    host-resident partitions with it); a ``DeepSpeedCPUAdam`` is returned as it is."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if isinstance(optimizer, DeepSpeedCPUAdam):
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise StrategyError(
            f"deepspeed ZeRO-Offload steps with DeepSpeed's CPU Adam, which can replace torch.optim.Adam or AdamW "
            f"but not {type(optimizer).__name__}. Fix: use Adam/AdamW (or deepspeed.ops.adam.DeepSpeedCPUAdam), or set "
            f"\"zero_force_ds_cpu_optimizer\": false in the DeepSpeed config to step it on the CPU as it is (slow)")
    adamw = type(optimizer) is torch.optim.AdamW or bool(optimizer.defaults.get("decoupled_weight_decay"))
    groups = []
    for g in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if g.get(flag):
                raise StrategyError(f"deepspeed ZeRO-Offload: {type(optimizer).__name__}({flag}=True) has no "
                                    f"DeepSpeedCPUAdam equivalent. Fix: drop {flag}, or remove the offload sections")
        groups.append({"params": g["params"], "lr": float(g["lr"]), "betas": tuple(g["betas"]), "eps": g["eps"],
                       "weight_decay": g["weight_decay"]})
    d = optimizer.defaults
    return DeepSpeedCPUAdam(groups, lr=float(d["lr"]), betas=tuple(d["betas"]), eps=d["eps"],
                            weight_decay=d["weight_decay"], adamw_mode=adamw)


def _as_int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


register_strategy("deepspeed", DeepSpeedStrategy)
