"""Stateful helpers for what goes into a checkpoint: model + optimizer, and trainer state.

Both implement ``torch.distributed.checkpoint.stateful.Stateful``; put them in the app-state dict
given to :meth:`CheckpointManager.save` / :meth:`~CheckpointManager.restore`::

    state = {"model": ModelOptimizerState(model, optimizer), "trainer": TrainerState(seed=1234)}

RNG across world sizes
    :class:`TrainerState` stores *every* rank's RNG states (gathered over the checkpoint process
    group at save time, a few KB per rank) in one opaque value, so the checkpoint reads the same at
    any world size. On restore at ``W'`` ranks, rank ``r`` restores rank ``r``'s states if the saving
    world had a rank ``r``; otherwise (``r >= W``) it reseeds python ``random``, numpy and torch
    deterministically from ``(seed, step, r)`` (see :func:`reseed_value`), and ``rng_restored`` is
    False. At ``W' == W`` restore is bit-identical.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict import _init_optim_state  # what get_state_dict does for a fresh optimizer
from torch.distributed.checkpoint.stateful import Stateful


_ENVELOPE = "__trainguard_trainer_blob__"


class ModelOptimizerState(Stateful):
    """Model (and optimizer) state through ``get_state_dict`` / ``set_state_dict``.

    Works for plain modules, DDP and FSDP2 (``fully_shard``) at any world size: DDP's ``module.``
    prefix is dropped and FSDP2 parameters are DTensors that DCP reshards on load.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 options: StateDictOptions | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            model_sd, _ = get_state_dict(self.model, [], options=self.options)
            return {"model": model_sd}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def local_state_dict(self) -> dict[str, Any]:
        """The module's and the optimizer's own ``state_dict()`` (no FQN conversion, no collective): what
        an in-memory snapshot keeps (:mod:`trainguard.checkpoint.memory`), loaded back only by the same
        rank of a world of the same size, into the same objects. A tenth of ``get_state_dict``'s cost.
        The optimizer state is created first if it does not exist yet (as ``get_state_dict`` does), so a
        fresh process has the layout of a snapshot taken after its first step."""
        if self.optimizer is None:
            return {"model": self.model.state_dict(), **self.local_extras()}
        _init_optim_state(self.optimizer)
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(), **self.local_extras()}

    def local_extras(self) -> dict[str, Any]:
        """Entries :meth:`local_state_dict` adds beside the model and the optimizer (none here; a
        subclass's, e.g. a loss scaler's state). Read at every in-memory snapshot, also when the
        snapshot replays the model and optimizer part (:mod:`trainguard.checkpoint.localplan`)."""
        return {}

    def load_local_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`local_state_dict`."""
        self.model.load_state_dict(state_dict["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state_dict["optim"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is None:
            set_state_dict(self.model, [], model_state_dict=state_dict["model"], optim_state_dict={},
                           options=self.options)
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"], options=self.options)


def capture_rng(raw: bool = False) -> dict[str, Any]:
    """This process's RNG states: python ``random``, numpy global, torch CPU, and CUDA if available.
    ``raw``: the torch states and numpy's key as bytes (pickled ten times faster than a tensor, several
    than an array: every in-memory snapshot takes them); :func:`restore_rng` takes either."""
    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                           "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    if raw:
        out["torch"] = out["torch"].numpy().tobytes()
        kind, key, *rest = out["numpy"]
        out["numpy"] = (kind, key.tobytes(), *rest)  # an array pickles several times slower
        if "cuda" in out:
            out["cuda"] = [t.numpy().tobytes() for t in out["cuda"]]
    return out


def _rng_tensor(v: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(v), dtype=torch.uint8) if isinstance(v, bytes) else v


def restore_rng(states: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng` (CUDA states only when this process has as many devices)."""
    random.setstate(states["python"])
    kind, key, *rest = states["numpy"]
    np.random.set_state((kind, np.frombuffer(key, dtype=np.uint32) if isinstance(key, bytes) else key, *rest))
    torch.set_rng_state(_rng_tensor(states["torch"]))
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all([_rng_tensor(v) for v in cuda])


def reseed_value(seed: int, step: int, rank: int) -> int:
    """The deterministic 63-bit seed used for a rank that has no saved RNG state."""
    digest = hashlib.sha256(f"trainguard-rng/{seed}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed python, numpy and torch (all devices) from :func:`reseed_value`."""
    v = reseed_value(seed, step, rank)
    random.seed(v)
    np.random.seed(v % (2**32))
    torch.manual_seed(v)


class TrainerState(Stateful):
    """Step, global data cursor, RNG states (per rank) and config fingerprint.

    ``cursor`` is any picklable dict (e.g. the global sample cursor: epoch, permutation seed, samples
    consumed); it is global, identical on every rank. ``process_group`` is the group over which RNG
    states are gathered at save time; :class:`~trainguard.checkpoint.manager.CheckpointManager` binds
    its checkpoint group through :meth:`bind_checkpoint_group`. ``state_dict()`` is a collective
    when a group of size > 1 is bound (or the default group exists): call it on every rank.
    """

    def __init__(self, *, step: int = 0, cursor: dict[str, Any] | None = None, seed: int = 0,
                 config_fingerprint: str = "", process_group: Any = None) -> None:
        self.step = step
        self.cursor: dict[str, Any] = dict(cursor or {})
        self.seed = seed
        self.config_fingerprint = config_fingerprint
        self.process_group = process_group
        self.extras: dict[str, Any] = {}
        """Small picklable values other components carry across restarts (e.g. the checkpoint interval
        controller's measurements under ``"interval"``); saved with the cursor, see :meth:`state_dict`."""
        self.rng_restored: bool | None = None
        """After a restore: True when this rank's own RNG states were restored, False when reseeded."""
        self.saved_world_size: int | None = None

    def bind_checkpoint_group(self, process_group: Any) -> None:
        """Use ``process_group`` for the RNG gather (called by the checkpoint manager)."""
        self.process_group = process_group

    def _rank_world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        return 0, 1

    def state_dict(self) -> dict[str, Any]:
        rank, world = self._rank_world()
        mine = capture_rng()
        if world > 1:
            table: list[Any] = [None] * world
            dist.all_gather_object(table, mine, group=self.process_group)
        else:
            table = [mine]
        # One opaque value (bytes) so that the key set is the same at every world size and DCP's
        # de-duplication of identical keys across ranks is harmless (every rank holds the same table).
        # The cursor and the extras share one value too, so checkpoints keep the same key set as
        # before extras existed (DCP refuses to load a key a checkpoint lacks): older ones still load.
        return {"step": self.step, "seed": self.seed, "config_fingerprint": self.config_fingerprint,
                "world_size": world, "cursor": pickle.dumps({_ENVELOPE: 1, "cursor": self.cursor, "extras": self.extras}),
                "rng": pickle.dumps(dict(enumerate(table)))}

    def local_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` with this rank's RNG states only, and no collective: what an in-memory
        snapshot (:mod:`trainguard.checkpoint.memory`) keeps, since it is restored by the same rank of a
        world of the same size."""
        rank, world = self._rank_world()
        return {"step": self.step, "seed": self.seed, "config_fingerprint": self.config_fingerprint,
                "world_size": world, "cursor": pickle.dumps({_ENVELOPE: 1, "cursor": self.cursor, "extras": self.extras}),
                "rng": pickle.dumps({rank: capture_rng(raw=True)})}

    def load_local_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`local_state_dict` (the same format as :meth:`state_dict`)."""
        self.load_state_dict(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.seed = int(state_dict["seed"])
        self.config_fingerprint = str(state_dict["config_fingerprint"])
        self.saved_world_size = int(state_dict["world_size"])
        blob = pickle.loads(state_dict["cursor"])
        if isinstance(blob, dict) and blob.get(_ENVELOPE) == 1:
            self.cursor, self.extras = dict(blob["cursor"]), dict(blob["extras"])
        else:  # written before extras existed: the blob is the cursor itself
            self.cursor, self.extras = blob, {}
        table: dict[int, Any] = pickle.loads(state_dict["rng"])
        rank, _ = self._rank_world()
        if rank in table:
            restore_rng(table[rank])
            self.rng_restored = True
        else:
            reseed(self.seed, self.step, rank)
            self.rng_restored = False
