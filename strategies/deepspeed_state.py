"""The checkpoint state of a DeepSpeed engine: every rank saves and loads only the ZeRO partitions it owns.

Format (the ``app`` entry of a checkpoint; the same keys at every world size and ZeRO stage)
    ``fp32.<param>``               the fp32 master weight, flattened: a 1-D tensor of the parameter's
                                   numel of which this rank holds its ZeRO range (see
                                   :mod:`~trainguard.strategies.flat_shards`)
    ``optim.<param>.<key>``        each per-element optimizer state (Adam: ``exp_avg``, ``exp_avg_sq``),
                                   expressed the same way
    ``optim_scalars.<group>.<key>``  per param group, the optimizer's non-element state (Adam's
                                   ``step``), replicated
    ``buffers``, ``engine``        persistent module buffers and the engine's step counters, replicated
    ``loss_scaler``                the fp16 dynamic loss scaler's fields (``16-mixed`` only)
    ``shapes``                     ``{param: shape}``, for offline converters (the tensors are flat)

    DCP writes each rank's ranges once; a load at any world size or stage reads, per parameter, exactly
    the saved ranges that overlap the range the loading rank owns, straight into its live partitions.
    After the read, :meth:`DeepSpeedState.load_state_dict` puts the step counters back and rewrites
    the module's (possibly bf16/fp16) weights from the fp32 masters (ZeRO-1/2: what DeepSpeed's
    ``update_lp_params`` does, all-gathering the partitions in buckets; ZeRO-3: each rank's parameter
    partitions, then the persistent parameters' all-gather).

Memory (per rank, Adam, P parameters, W ranks)
    ``state_dict()`` returns views of the live partitions: no copy. The checkpoint manager stages one
    copy of them (12 x P / W bytes, reused across saves) and DCP writes them. A load reads into the
    live partitions in place; the transient is one saved range at a time. A fresh engine has no
    optimizer state before its first step, so the load first allocates it (8 x P / W bytes, what the
    first step would allocate anyway). ``bench/deepspeed_memory.py`` measures it.

:class:`ZeroPartitions` is the one place that reads DeepSpeed's partition internals (ZeRO-1/2's
``param._hp_mapping`` fragments, ZeRO-3's flat fp32 sub-groups); DeepSpeed 0.19.8.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.strategies.base import StrategyError
from trainguard.strategies.flat_shards import PieceTable, local_shard, sharded

_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
GATHER_BUCKET = 1 << 22
"""Elements per all-gather when a load rewrites ZeRO-1/2's module weights (16 MiB of fp32 output)."""


class OptimizerProbe:
    """Which optimizer state keys are per element (shaped like the parameter) and which are scalars.

    Learned from one step of a throwaway optimizer of the same class and hyperparameters over a
    2-element parameter, because a fresh engine has no optimizer state yet (optimizers create it
    lazily at the first step) and a restore needs the keys before then. :attr:`scalars` holds the
    values a never-stepped state has (tensors zeroed, numbers 0).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        accepted = inspect.signature(type(optimizer).__init__).parameters
        p = torch.zeros(2, requires_grad=True)
        probe = type(optimizer)([p], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        p.grad = torch.zeros_like(p)
        probe.step()
        state = probe.state[p]
        self.element_keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape)
        self.scalars = {k: _zero(v) for k, v in state.items() if k not in self.element_keys}


def _zero(v: Any) -> Any:
    if torch.is_tensor(v):
        return torch.zeros_like(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return type(v)(0)
    return v


class ZeroPartitions:
    """What this rank owns of each parameter, as views of DeepSpeed's partitions (no copies).

    ZeRO-1/2 (and DeepSpeed's bf16 optimizer): the fp32 master and optimizer states of a param group
    are flat tensors split into one contiguous slice per rank; ``param._hp_mapping`` says which range of
    the flattened parameter falls into this rank's slice (None: none). ZeRO-3: each parameter is split
    into ``ceil(numel / W)`` pieces, rank ``r`` holding ``[r * piece, (r + 1) * piece)`` (the last piece
    padded), kept in flat fp32 sub-groups (``safe_get_local_fp32_param``).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.params = list(engine.module.named_parameters())
        self.stage3 = any(hasattr(p, "ds_id") for _, p in self.params)
        self._table: PieceTable | None = None

    @property
    def zero(self) -> Any:
        """The ZeRO optimizer wrapper (``engine.optimizer``)."""
        return self.engine.optimizer

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch (or DeepSpeed CPU) optimizer the ZeRO wrapper steps over flat partitions."""
        return self.engine.optimizer.optimizer

    def numel(self, p: nn.Parameter) -> int:
        return int(p.ds_numel) if self.stage3 else p.numel()

    def local_range(self, p: nn.Parameter) -> tuple[int, int] | None:
        """``(start, numel)`` of this rank's range of the flattened ``p``, or None."""
        if self.stage3:
            piece = int(p.partition_numel())
            start = self.zero._get_param_partition_rank(p) * piece
            numel = min(piece, int(p.ds_numel) - start)
            return (start, numel) if numel > 0 else None
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            return None
        return int(mapping.lp_fragment_address.start), int(mapping.lp_fragment_address.numel)

    def table(self) -> PieceTable:
        """Every rank's ranges (gathered once: partitions never move during an engine's life)."""
        if self._table is None:
            self._table = PieceTable.gather({n: self.numel(p) for n, p in self.params},
                                            {n: self.local_range(p) for n, p in self.params})
        return self._table

    def view(self, p: nn.Parameter, key: str | None) -> torch.Tensor | None:
        """This rank's range of ``p``'s fp32 master (``key`` None) or of its optimizer state ``key``."""
        rng = self.local_range(p)
        if rng is None:
            return None
        if self.stage3:
            from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

            full = safe_get_local_fp32_param(p) if key is None else safe_get_local_optimizer_state(p, key)
            return full.detach().narrow(0, 0, rng[1])
        mapping = p._hp_mapping
        return (mapping.hp_fragment if key is None else mapping.get_optim_state_fragment(key)).detach()

    def flat_partitions(self) -> list[tuple[int, torch.Tensor]]:
        """``(param group index, flat fp32 partition)`` for every tensor the optimizer steps.

        ZeRO-1/2 keep them in the optimizer's param groups; ZeRO-3 empties those groups between steps
        and keeps its sub-groups in ``fp32_partitioned_groups_flat``.
        """
        sub_groups = getattr(self.zero, "fp32_partitioned_groups_flat", None)
        if sub_groups is not None:
            return [(int(self.zero.sub_group_to_group_id[i]), t) for i, t in enumerate(sub_groups)]
        return [(i, p) for i, g in enumerate(self.torch_optimizer.param_groups) for p in g["params"]]

    def optimizer_initialised(self) -> bool:
        state = self.torch_optimizer.state
        return all(t in state and state[t] for _, t in self.flat_partitions())

    def ensure_optimizer_state(self, probe: OptimizerProbe) -> None:
        """Give every flat partition the state a first step would create (zeros; scalars at 0) unless it
        has one, and link ZeRO-1/2's per-parameter fragments to it (DeepSpeed links them lazily at the
        first step; a later step keeps the same tensors)."""
        state = self.torch_optimizer.state
        created = False
        for _, flat in self.flat_partitions():
            st = state[flat]
            for k in probe.element_keys:
                if k not in st:
                    st[k] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                    created = True
            for k, v in probe.scalars.items():
                if k not in st:
                    st[k] = v.clone() if torch.is_tensor(v) else v
        link = getattr(self.zero, "_lazy_init_hp_params_optimizer_state", None)
        if callable(link) and (created or not getattr(self.zero, "_hp_optimizer_states_linked", True)):
            self.zero._hp_optimizer_states_linked = False
            link()

    def refresh_module_weights(self) -> None:
        """Rewrite the module's (bf16/fp16/fp32) weights from the fp32 masters, as a step does (a
        collective: ZeRO-1/2 all-gather the partitions, ZeRO-3 the persistent parameters)."""
        z = self.zero
        if not self.stage3:
            self._refresh_flat_partitions()
            return
        z.checkpoint_event_prologue()  # release any gathered parameter before its partition changes
        for sg, fp32 in enumerate(z.fp32_partitioned_groups_flat):
            lp = z.fp16_partitioned_groups_flat[sg]
            if lp is None:
                raise StrategyError("deepspeed: ZeRO-3 parameter partitions are swapped out (NVMe offload), which "
                                    "trainguard's checkpoint does not support. Fix: offload_param.device 'cpu' or none")
            if fp32.numel() > 0:
                with torch.no_grad():
                    lp.data.copy_(fp32.data)
            for part, q in zip(z.fp16_partitioned_groups[sg], z.unflatten(lp, z.fp16_partitioned_groups[sg])):
                part.data = q.data
        z.checkpoint_event_epilogue()


    def _refresh_flat_partitions(self) -> None:
        """ZeRO-1/2 (and the bf16 optimizer): what DeepSpeed's ``update_lp_params`` does — each rank
        copies its fp32 partition into its slice of the module's flat weights, then the slices are
        all-gathered — but in buckets of :data:`GATHER_BUCKET` elements: gloo's single-tensor
        all-gather stages the whole flat output (the full model) in a temporary, which a load must not
        add to the host's peak."""
        z = self.zero
        if hasattr(z, "parallel_partitioned_bit16_groups"):
            lp_groups, fp32_parts = z.parallel_partitioned_bit16_groups, z.single_partition_of_fp32_groups
        else:  # DeepSpeed's BF16_Optimizer (ZeRO-1 with bf16)
            lp_groups, fp32_parts = z.bf16_partitioned_groups, z.fp32_groups_flat_partition
        for i, (slices, fp32) in enumerate(zip(lp_groups, fp32_parts)):
            group = z.real_dp_process_group[i]
            me, world = dist.get_rank(group=group), dist.get_world_size(group=group)
            with torch.no_grad():
                slices[me].data.copy_(fp32.data)
            if world == 1:
                continue
            numel = slices[me].numel()
            if any(s.numel() != numel for s in slices):
                raise StrategyError(f"deepspeed: unequal ZeRO partitions in param group {i} "
                                    f"({[s.numel() for s in slices]}); this DeepSpeed version is not supported")
            step = max(1, GATHER_BUCKET // world)
            for off in range(0, numel, step):
                n = min(step, numel - off)
                dist.all_gather([s.detach().narrow(0, off, n) for s in slices], slices[me].detach().narrow(0, off, n),
                                group=group)


class DeepSpeedState(Stateful):
    """The ``app`` entry of a checkpoint for a DeepSpeed engine (see the module docstring).

    ``state_dict()`` (the first time: gathers the range table) and ``load_state_dict()`` are collectives
    over the world: call them on every rank, in the training thread. ``probe`` None: parameters only.
    """

    def __init__(self, parts: ZeroPartitions, probe: OptimizerProbe | None) -> None:
        self.parts = parts
        self.engine = parts.engine
        self.probe = probe

    def state_dict(self) -> dict[str, Any]:
        parts, rank = self.parts, _rank()
        table = parts.table()
        if self.probe is not None:
            # A save before the first step, or the template of a restore into a fresh engine: the state a
            # first step creates (the step itself then uses it; zeros and step 0 are what it would make).
            parts.ensure_optimizer_state(self.probe)
        fp32: dict[str, Any] = {}
        optim: dict[str, dict[str, Any]] = {}
        for name, p in parts.params:
            fp32[name] = sharded(table, name, parts.view(p, None), rank)
            if self.probe is not None:
                optim[name] = {k: sharded(table, name, parts.view(p, k), rank) for k in self.probe.element_keys}
        out: dict[str, Any] = {"fp32": fp32, "buffers": self._buffers(), "engine": self._counters(),
                               "shapes": {n: list(p.ds_shape if parts.stage3 else p.shape) for n, p in parts.params}}
        if self.probe is None:
            return out
        out["optim"] = optim
        out["optim_scalars"] = self._scalars()
        scaler = getattr(parts.zero, "loss_scaler", None)
        if self.engine.fp16_enabled() and scaler is not None:
            out["loss_scaler"] = {k: getattr(scaler, k) for k in _SCALER_FIELDS if hasattr(scaler, k)}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = self.parts
        missing = sorted({n for n, _ in parts.params} - set(state_dict["fp32"]))
        if missing:
            raise StrategyError(f"deepspeed checkpoint lacks parameters {missing[:5]} of this model. Fix: restore "
                                f"a checkpoint of the same model")
        for name, p in parts.params:  # DCP read into the live views; a foreign dict is copied in
            self._copy_in(state_dict["fp32"][name], parts.view(p, None))
            if self.probe is not None:
                for k in self.probe.element_keys:
                    self._copy_in(state_dict["optim"][name][k], parts.view(p, k))
        if self.probe is not None:
            state = parts.torch_optimizer.state
            for i, flat in parts.flat_partitions():
                for k, v in state_dict["optim_scalars"].get(str(i), {}).items():
                    state[flat][k] = v.clone() if torch.is_tensor(v) else v
        parts.refresh_module_weights()
        with torch.no_grad():
            for name, b in self.engine.module.named_buffers():
                if name in state_dict["buffers"]:
                    b.copy_(state_dict["buffers"][name])
        for k, v in state_dict["engine"].items():
            setattr(self.engine, k, int(v))
        scaler = getattr(parts.zero, "loss_scaler", None)
        for k, v in (state_dict.get("loss_scaler") or {}).items():
            if scaler is not None and hasattr(scaler, k):
                setattr(scaler, k, v)

    @staticmethod
    def _copy_in(src: Any, dst: torch.Tensor | None) -> None:
        """Nothing when DCP already read into ``dst`` (the shard *is* the view); else copy."""
        got = local_shard(src)
        if dst is None or got is None or got.data_ptr() == dst.data_ptr():
            return
        with torch.no_grad():
            dst.copy_(got)

    # -- pieces -----------------------------------------------------------------------------------
    def _buffers(self) -> dict[str, torch.Tensor]:
        out = {}
        for mod_name, m in self.engine.module.named_modules():
            for b_name, b in m.named_buffers(recurse=False):
                if b_name not in m._non_persistent_buffers_set:
                    out[f"{mod_name}.{b_name}" if mod_name else b_name] = b.detach()
        return out

    def _counters(self) -> dict[str, int]:
        return {k: int(getattr(self.engine, k)) for k in ("global_steps", "global_samples", "skipped_steps")
                if hasattr(self.engine, k)}

    def _scalars(self) -> dict[str, dict[str, Any]]:
        """Per param group: the non-element optimizer state (Adam's ``step``) of its first partition."""
        assert self.probe is not None
        state = self.parts.torch_optimizer.state
        out: dict[str, dict[str, Any]] = {}
        for i, flat in self.parts.flat_partitions():
            if str(i) not in out:
                out[str(i)] = {k: (v.detach().clone() if torch.is_tensor(v) else v)
                               for k, v in state[flat].items() if k not in self.probe.element_keys}
        return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


__all__ = ["DeepSpeedState", "OptimizerProbe", "ZeroPartitions"]
