"""The elastic global sample cursor: exact data resumption at any world size.

The data position of a run is *global*, not per rank: a seeded permutation of ``range(N)`` per
epoch, plus how many samples of it have been consumed. Step ``k`` of the run always trains on the
same ``global_batch_size`` sample ids whatever the world size; only how those ids are split over
ranks (and into gradient-accumulation micro-batches) depends on the world size. So after a resize
the new world continues from the same cursor and no sample is skipped or repeated, and the
optimizer sees the same global batch (same loss scale, same LR schedule) at every size.

Pieces, all pure (no ``torch.distributed``); the batch arithmetic (``plan``, ``split``) lives in
:mod:`trainguard.strategies.batch`, shared with the strategies:

* :class:`GlobalSampleCursor` — the position (``epoch``, ``consumed``); ``state_dict()`` is a tiny
  JSON-able dict for the checkpoint.
* :class:`ElasticSampler` — a ``torch.utils.data.Sampler`` yielding this rank's ids from the cursor.

Epoch rollover (``drop_last``):

* ``drop_last=True`` (default): each epoch yields ``N // B`` global batches; the last ``N % B`` ids of
  the epoch's permutation are skipped (the same ids at every world size: they are decided by the
  global permutation, not by the split). With ``N % B == 0`` every id is used exactly once per epoch.
* ``drop_last=False`` ("wrap"): the stream of ids is the concatenation of the epoch permutations and
  global batches are consecutive chunks of it, so a batch may straddle two epochs; every id is used
  exactly once per epoch and no id is dropped.

Why the sampler does not advance the cursor: a ``DataLoader`` prefetches (``prefetch_factor`` x
``num_workers`` batches ahead). If fetching advanced the cursor, a checkpoint would record samples
that were fetched but never trained on, and a resume would skip them. The training loop calls
:meth:`GlobalSampleCursor.advance` once per *optimizer step*, after the step, so the checkpointed
cursor is exactly the data the saved weights have seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from trainguard.strategies.batch import plan, split

STATE_VERSION = 1


class GlobalSampleCursor:
    """Position in the global sample stream: ``epoch`` and ``consumed`` (ids used in that epoch).

    Not thread-safe (one training loop owns it). ``dataset_size`` (N), ``seed`` and
    ``global_batch_size`` (B) are fixed for a run and checked on :meth:`load_state_dict`.
    """

    def __init__(self, dataset_size: int, global_batch_size: int, seed: int = 0, *, drop_last: bool = True) -> None:
        for name, v in (("dataset_size", dataset_size), ("global_batch_size", global_batch_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {v!r}")
        if global_batch_size > dataset_size:
            raise ValueError(f"`global_batch_size`={global_batch_size} is larger than the dataset "
                             f"(`dataset_size`={dataset_size}). Fix: lower global_batch_size")
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0
        self._perm_cache: dict[int, np.ndarray] = {}

    # ----------------------------------------------------------------- stream
    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch ``epoch``: ``default_rng((seed, epoch)).permutation(N)`` (cached, 2 epochs)."""
        p = self._perm_cache.get(epoch)
        if p is None:
            p = np.random.default_rng((self.seed, epoch)).permutation(self.dataset_size)
            self._perm_cache = {e: v for e, v in self._perm_cache.items() if e >= epoch - 1}
            self._perm_cache[epoch] = p
        return p

    @property
    def batches_per_epoch(self) -> int:
        """Global batches whose first id lies in an epoch (wrap mode: the straddling batch counts)."""
        n, b = self.dataset_size, self.global_batch_size
        return n // b if self.drop_last else math.ceil(n / b)

    def _normalize(self, epoch: int, consumed: int) -> tuple[int, int]:
        """Move a position that has no batch left in its epoch to the next epoch's start."""
        n, b = self.dataset_size, self.global_batch_size
        if consumed >= n or (self.drop_last and consumed + b > n):
            return epoch + 1, 0
        return epoch, consumed

    def _batch_at(self, epoch: int, consumed: int) -> tuple[list[int], int, int]:
        """(ids, epoch_after, consumed_after) for the global batch starting at (epoch, consumed)."""
        n, b = self.dataset_size, self.global_batch_size
        epoch, consumed = self._normalize(epoch, consumed)
        perm = self.permutation(epoch)
        take = min(b, n - consumed)
        ids = perm[consumed:consumed + take].tolist()
        consumed += take
        if take < b:  # wrap: the rest comes from the head of the next epoch
            epoch, consumed = epoch + 1, b - take
            ids += self.permutation(epoch)[:consumed].tolist()
        epoch, consumed = self._normalize(epoch, consumed)
        return ids, epoch, consumed

    def peek_global_batch(self, ahead: int = 0) -> list[int]:
        """The ids of the global batch ``ahead`` steps after the current position (no side effect)."""
        e, c = self.epoch, self.consumed
        for _ in range(ahead):
            _, e, c = self._batch_at(e, c)
        return self._batch_at(e, c)[0]

    def next_global_batch(self) -> list[int]:
        """The next ``global_batch_size`` ids, and advance past them."""
        ids, self.epoch, self.consumed = self._batch_at(self.epoch, self.consumed)
        return ids

    def advance(self, batches: int = 1) -> None:
        """Mark ``batches`` global batches as trained on (call after each optimizer step)."""
        for _ in range(batches):
            _, self.epoch, self.consumed = self._batch_at(self.epoch, self.consumed)

    def remaining_in_epoch(self) -> int:
        """Global batches left that *start* in the current epoch."""
        n, b = self.dataset_size, self.global_batch_size
        left = n - self.consumed
        return left // b if self.drop_last else math.ceil(left / b)

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """A small JSON-able dict: position plus the run constants it is only valid for."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "dataset_size": self.dataset_size, "global_batch_size": self.global_batch_size,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any], *, allow_global_batch_change: bool = False) -> None:
        """Restore a position saved by :meth:`state_dict` (``ValueError`` if it belongs to another run).

        ``allow_global_batch_change``: resuming with another ``global_batch_size`` keeps the
        exactly-once property (the position counts samples, not steps) but changes the training
        dynamics; refused unless asked for.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data cursor state version {state.get('version')!r} is not {STATE_VERSION}")
        for key, mine in (("dataset_size", self.dataset_size), ("seed", self.seed), ("drop_last", self.drop_last)):
            if state.get(key) != mine:
                raise ValueError(
                    f"checkpointed data cursor has `{key}`={state.get(key)!r} but this run has {mine!r}; resuming "
                    f"would skip or repeat samples. Fix: run with the checkpoint's `{key}`, or start a new run")
        if state.get("global_batch_size") != self.global_batch_size and not allow_global_batch_change:
            raise ValueError(
                f"checkpointed data cursor has `global_batch_size`={state.get('global_batch_size')!r} but this run "
                f"has {self.global_batch_size}. The global batch is kept constant across resizes; Fix: use the "
                "checkpoint's global_batch_size (micro-batch and accumulation adapt to the world size)")
        epoch, consumed = state.get("epoch"), state.get("consumed")
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(consumed, int)
                and 0 <= consumed <= self.dataset_size):
            raise ValueError(f"corrupt data cursor state: epoch={epoch!r}, consumed={consumed!r}")
        self.epoch, self.consumed = self._normalize(epoch, consumed)


class ElasticSampler(Sampler[int]):
    """``torch.utils.data.Sampler`` yielding this rank's sample ids, one epoch per iteration.

    Use with ``DataLoader(dataset, batch_size=micro_batch_size, sampler=ElasticSampler(...))``: each
    optimizer step is ``accum_steps`` consecutive loader batches. Iteration starts at the cursor's
    position *when* ``iter()`` is called and never moves the cursor (see the module docstring:
    call ``cursor.advance()`` after each optimizer step). After a resize, build a new sampler with
    the new ``rank`` / ``world_size`` from the restored cursor.
    """

    def __init__(self, cursor: GlobalSampleCursor, rank: int, world_size: int, micro_batch_size: int) -> None:
        self.cursor = cursor
        self.rank = rank
        self.world_size = world_size
        self.micro_batch_size = micro_batch_size
        self.accum_steps, self.per_rank = plan(cursor.global_batch_size, world_size, micro_batch_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")

    def __len__(self) -> int:
        return self.cursor.remaining_in_epoch() * self.per_rank

    def steps(self) -> Iterator[list[list[int]]]:
        """Per optimizer step, this rank's micro-batches (the rest of the current epoch)."""
        c = self.cursor
        e, pos = c.epoch, c.consumed
        for _ in range(c.remaining_in_epoch()):
            ids, e, pos = c._batch_at(e, pos)
            yield split(ids, self.rank, self.world_size, self.micro_batch_size)

    def __iter__(self) -> Iterator[int]:
        for micro_batches in self.steps():
            for mb in micro_batches:
                yield from mb
