"""Staging: copy the state to be saved into reusable host buffers, so training can go on.

Training blocks only for this copy; the background persist thread then writes the buffers. The
buffers hold one copy of the state, are allocated on first use and reused by every later save
(rebuilt only when the state's structure, shapes or dtypes change, e.g. when optimizer state
appears after the first step). With CUDA tensors they are pinned and the copy is non-blocking,
followed by one synchronize. Called from the training thread only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._state_dict_utils import (
    CompanionMismatch,
    _copy_state_dict,
    _create_cpu_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class Stager:
    """Copies a state dict into reusable CPU buffers (one copy of the state, allocated once).

    Buffers are rebuilt only when the state's structure, shapes or dtypes change (e.g. optimizer
    state appearing after the first step). With CUDA tensors the buffers are pinned and the copy is
    non-blocking, followed by one synchronize.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self.staging_bytes = 0
        self.rebuilds = 0

    @staticmethod
    def _materialise(state: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}

    @torch.no_grad()
    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        sd = self._materialise(state)
        cuda = _has_cuda_tensor(sd)
        if self._buffers is None or not _same_layout(sd, self._buffers):
            self._buffers = None  # free the old buffers before allocating new ones
            self._buffers = _create_cpu_state_dict(sd, pin_memory=cuda)
            self.staging_bytes = _tensor_bytes(self._buffers)
            self.rebuilds += 1
        try:
            out = _copy_state_dict(sd, self._buffers, non_blocking=cuda, type_check=False)
        except CompanionMismatch:
            self._buffers = _create_cpu_state_dict(sd, pin_memory=cuda)
            self.staging_bytes = _tensor_bytes(self._buffers)
            self.rebuilds += 1
            out = _copy_state_dict(sd, self._buffers, non_blocking=cuda, type_check=False)
        if cuda:
            torch.cuda.synchronize()
        return out


def _same_layout(a: Any, b: Any) -> bool:
    """Same structure, and tensors of the same shape and dtype (no copying).

    torch's ``_check_state_dict_similarity`` is not used: it walks with a companion object and so
    also *copies* every tensor, which doubled the staging time.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor):
        return isinstance(b, DTensor) and _same_layout(a._local_tensor, b._local_tensor)
    if _is_sharded_tensor(a):
        return _is_sharded_tensor(b) and _same_layout(_shard_layout(a), _shard_layout(b))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and not isinstance(b, DTensor) and a.shape == b.shape
                and a.dtype == b.dtype)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_layout(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    return not isinstance(b, (torch.Tensor, dict, list, tuple))


def _is_sharded_tensor(obj: Any) -> bool:
    """A ``ShardedTensor`` (e.g. a DeepSpeed ZeRO range): it supports no tensor op, only its local shards."""
    return isinstance(obj, torch.Tensor) and callable(getattr(type(obj), "local_shards", None))


def _shard_layout(obj: Any) -> list[Any]:
    return [(list(s.metadata.shard_offsets), s.tensor) for s in obj.local_shards()]


def _walk_tensors(obj: Any) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out: list[torch.Tensor] = []
    if isinstance(obj, DTensor):
        out.append(obj._local_tensor)
    elif _is_sharded_tensor(obj):
        out.extend(s.tensor for s in obj.local_shards())
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out.extend(_walk_tensors(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(_walk_tensors(v))
    return out


def _tensor_bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _walk_tensors(obj))


def _has_cuda_tensor(obj: Any) -> bool:
    return any(t.is_cuda for t in _walk_tensors(obj))


__all__ = ["Stager"]
