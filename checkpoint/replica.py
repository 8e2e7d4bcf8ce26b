"""Tier 1: each rank's newest in-memory snapshot, copied to a buddy rank on another node in the background.

After every snapshot the worker runtime calls :meth:`Replicator.replicate`: a background thread sends
this rank's newest snapshot (header + data, straight from its mapped slot: :meth:`MemoryTier.newest_view`) to its *buddy* — the
same local rank on its node's buddy node (:func:`node_buddies`: a rotation of the nodes, so every node
sends one copy and receives one) — and receives the snapshot of the rank whose buddy it is straight
into its own agent's folder (``replica-<rank>-<k>.snap``: at most one replica per source
rank, double-buffered, commit word last after the checksum, so a transfer cut short never replaces a good
replica; :meth:`MemoryTier.receive_replica`, :meth:`MemoryTier.commit_replica`). Neither side copies a
snapshot in memory: the transient memory of a transfer is one header block. When a whole node is lost, the ranks that
replace its ranks in a world of the same size receive those replicas from the buddies at restore
(:meth:`~trainguard.checkpoint.manager.CheckpointManager.restore`).

Transport: point-to-point ``isend``/``irecv`` over a dedicated gloo group (its own, so the transfers
never interleave with the training loop's collectives or the checkpoint persist thread's). Every rank
replicates at the same steps and waits for its previous transfer before it writes the next snapshot
(:meth:`Replicator.wait`): the transfers stay matched across ranks, a snapshot slot is never rewritten
while it is being sent, and the replica lags the snapshot by at most one snapshot interval. A transfer
that fails (a peer gone) stops replication for this world (``memory_replica_failed``); the snapshots
themselves go on. Buddies: :func:`node_buddies` (in another failure domain when the nodes name theirs,
``checkpoint.memory_failure_domain``; else the next node).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint.memory import HEADER_BYTES, MemoryTier
from trainguard.contract.log import get_logger

log = get_logger("trainguard.checkpoint.replica")

WAIT_S = 30.0
"""How long the next snapshot waits for the previous transfer. Past it (a buddy that stopped
replicating, e.g. its snapshots were refused, or a peer gone) this rank stops replicating for the
world (``memory_replica_failed``) instead of stalling training; its buddies then time out the same way."""


def node_buddies(domains: list[str]) -> tuple[list[int], bool]:
    """The buddy node of every node, given each node's failure domain (``""``: unknown), and whether
    every buddy is in another domain. A rotation (every node sends to one node and receives from one),
    over the nodes grouped by domain, by the size of the largest domain: when no domain holds more than
    half the nodes, no node's buddy shares its domain. Without domains: the next node."""
    n = len(domains)
    if n < 2:
        return list(range(n)), False
    if not any(domains):
        return [(i + 1) % n for i in range(n)], False
    order = sorted(range(n), key=lambda i: (domains[i], i))
    largest = max(domains.count(d) for d in set(domains))
    shift = largest if largest <= n // 2 else max(1, n // 2)
    out = [0] * n
    for pos, node in enumerate(order):
        out[node] = order[(pos + shift) % n]
    return out, all(domains[i] != domains[out[i]] for i in range(n))


def buddies(rank: int, world_size: int, local_world_size: int,
            domains: list[str] | None = None) -> tuple[int, int] | None:
    """``(rank this one sends to, rank it receives from)``: the same local rank on its node's buddy node
    and on the node whose buddy it is (:func:`node_buddies` over ``domains``, one per node; None: the
    next and the previous node); None when the world has one node."""
    step = max(1, local_world_size)
    if world_size <= step or world_size % step:
        return None
    nodes = world_size // step
    plan, _ = node_buddies(list(domains) if domains is not None else [""] * nodes)
    node, local = divmod(rank, step)
    return plan[node] * step + local, plan.index(node) * step + local


class Replicator:
    """Background copies of this rank's snapshots to its buddy (see the module docstring)."""

    def __init__(self, tier: MemoryTier, group: Any, *, rank: int, world_size: int, local_world_size: int,
                 domains: list[str] | None = None) -> None:
        self.tier = tier
        self.group = group
        self.rank = rank
        self.pair = buddies(rank, world_size, local_world_size, domains)
        self._thread: threading.Thread | None = None
        self.failed: str | None = None
        self.last_seconds = 0.0
        self.last_step: int | None = None
        """The step of the newest replica this rank received (None before the first)."""

    @classmethod
    def create(cls, tier: MemoryTier | None, group: Any, *, rank: int, world_size: int, local_world_size: int,
               domain: str) -> Replicator | None:
        """Agree on the buddies (a collective over ``group``: every rank passes its node's failure domain,
        ``checkpoint.memory_failure_domain``, and whether it has tier 0) and return this rank's replicator,
        or None on every rank alike (one node, or some rank without tier 0). Call on every rank of the
        world, in the same order as its other group calls."""
        table: list[Any] = [None] * world_size
        dist.all_gather_object(table, (domain, tier is not None), group=group)
        step = max(1, local_world_size)
        domains = [str(table[i][0]) for i in range(0, world_size, step)] if world_size % step == 0 else None
        if rank == 0 and domains is not None and any(domains):
            plan, separated = node_buddies(domains)
            (log.info if separated else log.warning)(
                "memory_replica_buddies", domains=domains, buddies=plan, separated=separated,
                **({} if separated else {"effect": "some node's buddy shares its failure domain: more than half "
                                                   "of the nodes are in one domain"}))
        if not all(has for _, has in table):  # a rank without tier 0 would leave its buddies' transfers hanging
            if rank == 0:
                log.warning("memory_replica_off", ranks_without_tier0=[i for i, (_, has) in enumerate(table) if not has],
                            effect="no replicas in this world")
            return None
        assert tier is not None
        rep = cls(tier, group, rank=rank, world_size=world_size, local_world_size=local_world_size, domains=domains)
        return rep if rep.enabled else None

    @property
    def enabled(self) -> bool:
        return self.pair is not None and self.failed is None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the transfer in flight (True when none is left)."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                return False
            self._thread = None
        return True

    def settle(self) -> None:
        """Before a snapshot: wait (at most :data:`WAIT_S`) for the transfer that may read the slot about
        to be written; a transfer still running then stops replication for this world."""
        if self._thread is not None and not self.wait(WAIT_S):
            self.failed = f"the transfer of the previous snapshot did not finish within {WAIT_S:g}s"
            self._thread = None  # left behind: a daemon thread blocked in gloo until the group's timeout
            log.warning("memory_replica_failed", rank=self.rank, error=self.failed,
                        effect="no more replicas in this world; the snapshots go on")

    def replicate(self) -> None:
        """Send this rank's newest snapshot to the buddy and receive the predecessor's, in the background.
        Call on every rank after each snapshot (after :meth:`settle`)."""
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="trainguard-replica", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """One exchange, without a copy of either snapshot: sent from the mapped slot, received straight
        into the replica slot that does not hold the newest good replica (commit word zeroed until the
        data and its checksum check out: a transfer cut short leaves that slot invalid, the other stands)."""
        assert self.pair is not None
        dst, src = self.pair
        t0 = time.monotonic()
        got = into = target = None
        bufs: list[torch.Tensor] = []
        try:
            got = self.tier.newest_view()
            n_out = torch.tensor([len(got[1]) if got is not None else -1], dtype=torch.int64)
            n_in = torch.zeros(1, dtype=torch.int64)
            works = [dist.isend(n_out, dst=dst, group=self.group), dist.irecv(n_in, src=src, group=self.group)]
            for w in works:
                w.wait()
            works = []
            if got is not None:  # a rank with no snapshot to send says so (-1): its buddy skips the receive
                bufs += [torch.frombuffer(bytearray(got[0]), dtype=torch.uint8), torch.frombuffer(got[1], dtype=torch.uint8)]
                works += [dist.isend(bufs[-2], dst=dst, group=self.group), dist.isend(bufs[-1], dst=dst, group=self.group)]
            header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
            if int(n_in.item()) >= 0:
                target, into = self.tier.receive_replica(src, int(n_in.item()))
                bufs.append(torch.frombuffer(into, dtype=torch.uint8))
                works += [dist.irecv(header, src=src, group=self.group), dist.irecv(bufs[-1], src=src, group=self.group)]
            for w in works:
                w.wait()
            works.clear()
            w = None  # noqa: F841 - the last work's reference to its buffer goes too
            bufs.clear()  # the views into the mapped slots go before the slots may be unmapped
            if target is not None and into is not None:
                into.release()
                into = None
                h = self.tier.commit_replica(target, header.numpy().tobytes(), src)
                target = None
                self.last_step = h.step
            self.last_seconds = time.monotonic() - t0
        except Exception as e:  # noqa: BLE001 - a failed transfer must not kill training
            self.failed = f"{type(e).__name__}: {e}"[:500]
            log.warning("memory_replica_failed", rank=self.rank, buddy=dst, source=src, error=self.failed,
                        effect="no more replicas in this world; the snapshots go on")
        finally:
            bufs.clear()
            for view in (into, got[1] if got is not None else None):
                if view is not None:
                    with contextlib.suppress(BufferError):  # a transfer left behind may still hold it
                        view.release()
            if target is not None:
                with contextlib.suppress(BufferError):
                    target.close()


__all__ = ["Replicator", "buddies"]
