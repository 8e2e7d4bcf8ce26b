"""``deepspeed``: DeepSpeed ZeRO stage 1, 2 or 3 — optimizer state (1), + gradients (2), + parameters (3)
partitioned over the ranks by a ``DeepSpeedEngine``.

Mapping onto the :class:`~trainguard.strategies.base.Strategy` interface
    :meth:`DeepSpeedStrategy.setup` calls ``deepspeed.initialize(model=, optimizer=, config=)`` with the
    script's own torch optimizer (no DeepSpeed fused/CPU-Adam ops: nothing is JIT-compiled) and returns
    ``(engine, engine.optimizer)``: the engine is the model from then on, the ZeRO optimizer wrapper the
    optimizer. Gradient accumulation stays the runtime's: DeepSpeed's ``gradient_accumulation_steps``
    is the runtime's accumulation steps at the current world size and ``train_micro_batch_size_per_gpu``
    its micro-batch (the runtime calls :meth:`plan` before :meth:`setup`), and the accumulation
    boundary is set explicitly per micro-batch (``engine.set_gradient_accumulation_boundary(last)``
    in :meth:`no_sync`), so DeepSpeed reduces (ZeRO-1) or finishes the reduce-scatter (ZeRO-2/3) on the
    last micro-batch only. :meth:`backward` is ``engine.backward(loss, scale_wrt_gas=False)`` — the
    script already divides the loss by the number of micro-batches — and :meth:`optimizer_step` is
    ``engine.step()``, called once per optimizer step (DeepSpeed's documented "set the boundary, step
    once" style). Scripts must use ``rt.backward``/``rt.optimizer_step`` with this strategy: a bare
    ``loss.backward()`` bypasses the engine's gradient partitioning.

Precision
    ``32``: fp32 everywhere. ``bf16-mixed``: DeepSpeed's ``bf16`` section — the module is cast to bf16,
    the optimizer keeps fp32 master weights and fp32 optimizer state (gradients accumulate in
    DeepSpeed's default dtype for the stage unless the config's ``data_types`` says otherwise).
    ``16-mixed``: the ``fp16`` section with DeepSpeed's dynamic loss scaler, whose state is checkpointed;
    DeepSpeed refuses fp16 on a CPU without fp16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported``),
    so :meth:`setup` raises :class:`StrategyError` there. The engine casts the module to bf16/fp16;
    :meth:`autocast` is still ``torch.autocast`` to that dtype (base class), so floating-point inputs
    and buffers the script creates in fp32 meet the low-precision weights without a dtype error.

Checkpoint: world-size independent, under the normal manifest/commit rules
    :meth:`state` is a ``Stateful`` whose state dict holds, **per parameter name**, the full fp32
    master weight and every per-element optimizer state (``exp_avg``, ``exp_avg_sq`` for Adam), gathered
    with DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get_full_fp32_param`` /
    ``safe_get_full_optimizer_state``; collectives over the engine's data-parallel group), plus the
    optimizer's scalar state per param group (``step``), the engine's step counters and the fp16 loss
    scaler. Nothing in it depends on the world size or the ZeRO stage, so it goes into the DCP app
    state like any other strategy's (replicated tensors are written once: DCP de-duplicates them) and
    loads at any world size and stage, with no conversion step — hence ``reshard_native = True``. On
    load every rank takes its own partition back with ``safe_set_full_fp32_param`` /
    ``safe_set_full_optimizer_state`` and the module's (low-precision) weights are rewritten from the
    same full values (ZeRO-3: inside ``deepspeed.zero.GatheredParameters``). A fresh engine has no
    optimizer state until its first step, so the load creates it first (zeros of the keys a probe
    step of the same optimizer class creates, then overwritten).

    **Memory cost:** a save materialises the *full* fp32 parameters and optimizer states on every rank
    (for Adam 3 x 4 bytes x parameters, e.g. 12 GB per rank for a 1B model), and the checkpoint
    manager's staging buffers hold one more copy of it; a load does the same. ZeRO's per-rank memory
    saving therefore does not hold during a checkpoint: this design trades it for checkpoints that
    need no conversion. Models whose full fp32 state does not fit in one host's memory need DeepSpeed's
    own sharded engine checkpoints + ``ds_to_universal``, which this strategy does not do.

Limits
    Every parameter must be trainable (``requires_grad``); DeepSpeed ``optimizer``/``scheduler`` config
    sections are refused (build the optimizer in the script; create LR schedulers on the returned
    optimizer); no ZeRO offload, pipeline or tensor parallelism, MoE; stage 0 is ``ddp``.

CPU (torch 2.13, gloo)
    DeepSpeed picks its CPU accelerator when CUDA is absent (``DS_ACCELERATOR`` overrides it) and uses
    gloo when oneCCL is not installed. Creating its communication backend JIT-builds a shared-memory
    all-reduce op (``deepspeed_shm_comm``, used only by inference all-reduce) with a C++ compiler and
    ninja; a build lock left by a killed process makes every later start wait forever on it. Setup marks
    that op incompatible before ``deepspeed.initialize`` so no compiler is involved and gloo does every
    collective. Verified with ZeRO-1/2/3 at 1 and 2 processes (tests/strategies).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
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
            leave out, set to ``"auto"`` or to the same value.
    """

    name = "deepspeed"
    reshard_native = True

    def __init__(self, *, precision: Any = "32", stage: int | str | None = None,
                 config: dict[str, Any] | str | os.PathLike[str] | None = None) -> None:
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
        self.engine: Any = None
        self._probe: _OptimizerProbe | None = None
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
        return (f"{BATCH_RULE}; the checkpoint holds full fp32 parameters and optimizer states per parameter "
                f"name, which DeepSpeed re-partitions on load at any world size and ZeRO stage (no conversion)")

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
        self._probe = _OptimizerProbe(optimizer)
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
        """See base class: full fp32 parameters + optimizer states per parameter name (see the module
        docstring for the format and its memory cost). ``optimizer`` None: parameters only."""
        return DeepSpeedState(self._engine(model), self._probe if optimizer is not None else None)

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
                "ds_micro_batch": self.micro_batch}


@contextlib.contextmanager
def _boundary(engine: Any, last: bool) -> Iterator[None]:
    engine.set_gradient_accumulation_boundary(last)
    yield


def _as_int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


# ---- the world-size independent state -------------------------------------------------------------

class _OptimizerProbe:
    """Which optimizer state keys are per element (shaped like the parameter) and which are scalars.

    Learned from one step of a throwaway optimizer of the same class and hyperparameters over a
    2-element parameter, because a fresh engine has no optimizer state yet (torch optimizers create it
    lazily at the first step) and a restore needs the keys before then.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        accepted = inspect.signature(type(optimizer).__init__).parameters
        p = torch.zeros(2, requires_grad=True)
        probe = type(optimizer)([p], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        p.grad = torch.zeros_like(p)
        probe.step()
        state = probe.state[p]
        self.element_keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape)
        self.scalars = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in state.items()
                        if k not in self.element_keys}


class DeepSpeedState(Stateful):
    """The ``app`` entry of a checkpoint for a DeepSpeed engine; the same keys at every world size.

    ``state_dict()`` and ``load_state_dict()`` are collectives over the engine's data-parallel group
    (call on every rank, in the training thread).
    """

    def __init__(self, engine: Any, probe: _OptimizerProbe | None) -> None:
        self.engine = engine
        self.probe = probe

    # the ZeRO wrapper (``engine.optimizer``) and the torch optimizer it steps over flat partitions
    @property
    def _zero(self) -> Any:
        return self.engine.optimizer

    @property
    def _torch_opt(self) -> torch.optim.Optimizer:
        return self.engine.optimizer.optimizer

    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.engine.module.named_parameters())

    def _flat_partitions(self) -> list[tuple[int, torch.Tensor]]:
        """``(param group index, flat fp32 partition)`` for every tensor the torch optimizer steps.

        ZeRO-1/2 keep them in the torch optimizer's param groups; ZeRO-3 empties those groups between
        steps and keeps its sub-groups in ``fp32_partitioned_groups_flat``.
        """
        sub_groups = getattr(self._zero, "fp32_partitioned_groups_flat", None)
        if sub_groups is not None:
            return [(int(self._zero.sub_group_to_group_id[i]), t) for i, t in enumerate(sub_groups)]
        return [(i, p) for i, g in enumerate(self._torch_opt.param_groups) for p in g["params"]]

    def _optimizer_initialised(self) -> bool:
        state = self._torch_opt.state
        return all(t in state and state[t] for _, t in self._flat_partitions())

    def state_dict(self) -> dict[str, Any]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        params: dict[str, torch.Tensor] = {}
        for name, p in self._named_params():
            full = safe_get_full_fp32_param(p)
            if full is None:
                raise StrategyError(f"deepspeed: no fp32 master weight for parameter {name!r} (not managed by the "
                                    f"ZeRO optimizer). Fix: every parameter must be trainable and in the optimizer")
            params[name] = full.detach().cpu()
        out: dict[str, Any] = {"params": params, "buffers": self._buffers(), "engine": self._counters()}
        if self.probe is None:
            return out
        initialised = self._optimizer_initialised()
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self._named_params():
            optim[name] = {k: (safe_get_full_optimizer_state(p, k).detach().cpu() if initialised
                               else torch.zeros(params[name].shape, dtype=torch.float32))
                           for k in self.probe.element_keys}
        out["optim"] = optim
        out["optim_scalars"] = self._scalars(initialised)
        scaler = getattr(self._zero, "loss_scaler", None)
        if self.engine.fp16_enabled() and scaler is not None:
            out["loss_scaler"] = {k: getattr(scaler, k) for k in _SCALER_FIELDS if hasattr(scaler, k)}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        params = state_dict["params"]
        missing = sorted({n for n, _ in self._named_params()} - set(params))
        if missing:
            raise StrategyError(f"deepspeed checkpoint lacks parameters {missing[:5]} of this model. Fix: restore "
                                f"a checkpoint of the same model")
        if self.probe is not None:
            self._ensure_optimizer_state(state_dict["optim_scalars"])
        for name, p in self._named_params():
            full = params[name].to(torch.float32)
            self._set_module_weight(p, full)
            safe_set_full_fp32_param(p, full)
            if self.probe is not None:
                for k in self.probe.element_keys:
                    safe_set_full_optimizer_state(p, state_dict["optim"][name][k].to(torch.float32), k)
        with torch.no_grad():
            for name, b in self.engine.module.named_buffers():
                if name in state_dict["buffers"]:
                    b.copy_(state_dict["buffers"][name])
        for k, v in state_dict["engine"].items():
            setattr(self.engine, k, int(v))
        scaler = getattr(self._zero, "loss_scaler", None)
        for k, v in (state_dict.get("loss_scaler") or {}).items():
            if scaler is not None and hasattr(scaler, k):
                setattr(scaler, k, v)

    # -- pieces -----------------------------------------------------------------------------------
    def _buffers(self) -> dict[str, torch.Tensor]:
        out = {}
        for mod_name, m in self.engine.module.named_modules():
            for b_name, b in m.named_buffers(recurse=False):
                if b_name not in m._non_persistent_buffers_set:
                    out[f"{mod_name}.{b_name}" if mod_name else b_name] = b.detach().cpu()
        return out

    def _counters(self) -> dict[str, int]:
        return {k: int(getattr(self.engine, k)) for k in ("global_steps", "global_samples", "skipped_steps")
                if hasattr(self.engine, k)}

    def _scalars(self, initialised: bool) -> dict[str, dict[str, Any]]:
        """Per param group: the optimizer's non-element state (Adam's ``step``), from its first partition."""
        assert self.probe is not None
        out: dict[str, dict[str, Any]] = {}
        for i in range(len(self._torch_opt.param_groups)):
            if not initialised:  # a template (restore) or a save before the first step: step 0
                out[str(i)] = {k: (torch.zeros_like(v) if torch.is_tensor(v) else v)
                               for k, v in self.probe.scalars.items()}
        for i, flat in self._flat_partitions():
            if initialised and str(i) not in out:
                out[str(i)] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                               for k, v in self._torch_opt.state[flat].items() if k not in self.probe.element_keys}
        return out

    def _ensure_optimizer_state(self, scalars: dict[str, dict[str, Any]]) -> None:
        """Give every flat partition the optimizer state a first step would create, with the saved
        scalars (``step``), and link ZeRO-1/2's per-parameter fragments to it."""
        assert self.probe is not None
        state = self._torch_opt.state
        for i, flat in self._flat_partitions():
            st = state[flat]
            for k in self.probe.element_keys:
                if k not in st:
                    st[k] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            for k, v in scalars.get(str(i), {}).items():
                st[k] = v.clone() if torch.is_tensor(v) else v
        # ZeRO-1/2 (and the bf16 optimizer) address optimizer states per parameter through fragments
        # linked lazily at the first step; link them now so safe_set_full_optimizer_state can write.
        # A later step re-links to the same tensors.
        link = getattr(self._zero, "_lazy_init_hp_params_optimizer_state", None)
        if callable(link):
            if hasattr(self._zero, "_hp_optimizer_states_linked"):
                self._zero._hp_optimizer_states_linked = False
            link()

    def _set_module_weight(self, p: nn.Parameter, full: torch.Tensor) -> None:
        """The module's (possibly bf16/fp16) copy of ``p`` := ``full``, as an optimizer step would."""
        if hasattr(p, "ds_id"):  # ZeRO-3: p is a partition; gather, write, re-partition
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if dist.get_rank() == 0:
                    with torch.no_grad():
                        p.data.copy_(full.to(p.device, p.dtype))
            return
        with torch.no_grad():
            p.data.copy_(full.to(p.device, p.dtype))


_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


register_strategy("deepspeed", DeepSpeedStrategy)
