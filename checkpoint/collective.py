"""The checkpoint process group's collectives, and the rule that every error reaches every rank.

:class:`Group` wraps the (gloo) group the checkpoint manager uses: ``broadcast`` and ``all_gather`` of
picklable objects, point to point bytes (:meth:`Group.send_bytes` / :meth:`Group.recv_bytes`), and
:meth:`Group.on_rank0`, which runs a function on rank 0 only and hands every
rank its result *or the same exception* — so a storage failure on rank 0 never leaves the other ranks
waiting in a collective. With one rank (no ``torch.distributed``) nothing is collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    FencedError,
    StorageError,
)


def pack_error(e: BaseException) -> tuple[str, str, dict[str, Any]]:
    """A picklable form of a checkpoint error (type name, message, the fields its class needs)."""
    extra: dict[str, Any] = {}
    if isinstance(e, FencedError):
        extra = {"epoch": e.epoch, "newest_epoch": e.newest_epoch}
    elif isinstance(e, StorageError):
        extra = {"transient": e.transient}
    return type(e).__name__, str(e), extra


def unpack_error(kind: str, msg: str, extra: dict[str, Any]) -> CheckpointError:
    """Inverse of :func:`pack_error`."""
    if kind == "FencedError":
        return FencedError(msg, epoch=extra["epoch"], newest_epoch=extra["newest_epoch"])
    if kind == "StorageError":
        return StorageError(msg, transient=extra.get("transient", False))
    if kind == "CheckpointNotFound":
        return CheckpointNotFound(msg)
    if kind == "CheckpointCorrupt":
        return CheckpointCorrupt(msg)
    return CheckpointError(msg if kind == "CheckpointError" else f"{kind}: {msg}")


class Group:
    """Collectives over the checkpoint group ``pg`` of ``world_size`` ranks (this one is ``rank``)."""

    def __init__(self, pg: Any, rank: int, world_size: int) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.distributed = world_size > 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def send_bytes(self, payload: bytes, dst: int) -> None:
        """Send ``payload`` to rank ``dst``: its length, then (when not empty) it."""
        dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst=dst, group=self.pg)
        if payload:
            dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=dst, group=self.pg)

    def recv_bytes(self, src: int) -> bytes | None:
        """What :meth:`send_bytes` from rank ``src`` sent (None: an empty payload)."""
        n = torch.zeros(1, dtype=torch.int64)
        dist.recv(n, src=src, group=self.pg)
        if not int(n.item()):
            return None
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.recv(buf, src=src, group=self.pg)
        return buf.numpy().tobytes()

    def on_rank0(self, fn: Callable[[], Any], *, url: str = "") -> Any:
        """Run ``fn`` on rank 0 only; every rank gets its result, or raises the same error.

        Checkpoint errors keep their class; ``PermissionError`` becomes a :class:`StorageError` naming
        ``url`` and the fix; anything else a :class:`CheckpointError` with the original type and message.
        """
        res: Any = None
        if self.rank == 0:
            try:
                res = ("ok", fn())
            except CheckpointError as e:
                res = ("err", *pack_error(e))
            except PermissionError as e:
                res = ("err", "StorageError", f"permission denied: {e}. Fix: check that the credentials may list, "
                       f"read and write {url}", {"transient": False})
            except Exception as e:  # noqa: BLE001 - must reach the other ranks, not hang them
                res = ("err", "CheckpointError", f"{type(e).__name__}: {e}", {})
        res = self.broadcast(res)
        if res[0] == "ok":
            return res[1]
        raise unpack_error(res[1], res[2], res[3])


__all__ = ["Group", "pack_error", "unpack_error"]
