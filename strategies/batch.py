"""Global batch arithmetic: how one global batch is split over the ranks of the current world.

Pure functions (no ``torch.distributed``), used by the strategies (:meth:`Strategy.plan`) and by the
worker runtime's sample cursor (:mod:`trainguard.runtime.cursor`):

* :func:`plan` — global batch, world size, micro-batch per rank -> (accumulation steps, samples per
  rank), or a ``ValueError`` that names the setting and the fix.
* :func:`split` — this rank's part of a global batch, as micro-batches.

The global batch stays constant at every world size: ``global_batch = world_size x accumulation_steps
x micro_batch``, so a resize changes only the accumulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _valid_world_sizes(global_batch: int, micro_batch: int, limit: int = 64) -> list[int]:
    return [w for w in range(1, limit + 1) if global_batch % (w * micro_batch) == 0]


def plan(global_batch: int, world_size: int, micro_batch_per_rank: int) -> tuple[int, int]:
    """``(accum_steps, per_rank_samples)`` that keep ``global_batch`` constant at ``world_size``.

    ``global_batch = world_size * per_rank_samples`` and ``per_rank_samples = accum_steps *
    micro_batch_per_rank``. Raises ``ValueError`` naming the settings and listing the world sizes
    that would work when it cannot divide.
    """
    for name, v in (("global_batch_size", global_batch), ("world_size", world_size),
                    ("micro_batch_size", micro_batch_per_rank)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"`{name}` must be a positive integer, got {v!r}")
    ok = _valid_world_sizes(global_batch, micro_batch_per_rank)
    per_rank, rem = divmod(global_batch, world_size)
    if rem:
        raise ValueError(
            f"global batch size `global_batch_size`={global_batch} cannot be split evenly over world size "
            f"{world_size} ({global_batch} % {world_size} = {rem}). Fix: choose `global_batch_size` divisible by "
            f"every world size the job may run at (e.g. a multiple of lcm(min_nodes..max_nodes) x nproc_per_node), "
            f"or limit the nodes; with micro_batch_size={micro_batch_per_rank} the valid world sizes are {ok}")
    accum, rem2 = divmod(per_rank, micro_batch_per_rank)
    if rem2:
        raise ValueError(
            f"at world size {world_size} each rank takes {per_rank} samples per step (`global_batch_size`="
            f"{global_batch} / {world_size}), which is not a multiple of `micro_batch_size`="
            f"{micro_batch_per_rank}. Fix: choose a `micro_batch_size` dividing {per_rank} "
            f"(e.g. {math.gcd(per_rank, micro_batch_per_rank)}) or a `global_batch_size` divisible by "
            f"{world_size * micro_batch_per_rank}; valid world sizes now are {ok}")
    return accum, per_rank


def split(ids: Sequence[int], rank: int, world_size: int, micro_batch: int) -> list[list[int]]:
    """This rank's share of one global batch, as ``accum_steps`` micro-batches of ``micro_batch`` ids.

    Rank ``r`` takes the contiguous slice ``[r * per_rank, (r + 1) * per_rank)`` (the batch is already
    a random draw, so contiguous slices are as good as strided ones and keep ranks' concatenation
    equal to the global batch).
    """
    accum, per_rank = plan(len(ids), world_size, micro_batch)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    mine = [int(i) for i in ids[rank * per_rank:(rank + 1) * per_rank]]
    return [mine[k * micro_batch:(k + 1) * micro_batch] for k in range(accum)]
