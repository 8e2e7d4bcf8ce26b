"""Tier 0: in-memory snapshots of each worker's checkpoint state, in shared memory its agent owns.

Every ``checkpoint.memory_interval_steps`` steps each rank copies its checkpoint state (the state
dict the durable save stages: model and optimizer shards, trainer state) into a file under the node's
snapshot folder, which the *agent* creates on a tmpfs (``/dev/shm``) and removes when the job ends
(:mod:`trainguard.agent.memtier`). The worker only maps the files, so a worker killed with SIGKILL
leaves its last snapshot in memory; the restarted worker restores it instead of the last checkpoint in
storage.

Slots and the header (torn writes)
    Each rank has :data:`SLOTS` slot files, ``rank-<rank>-<k>.snap``, and writes each snapshot into
    the slot that does not hold its newest one. A slot is a 4 KiB header, then the data: every
    tensor's bytes back to back (:data:`ALIGN`-aligned), then a pickled *skeleton* (the state dict's
    structure with every tensor replaced by its index, and every non-tensor value as it is). The
    header's commit word is zeroed before the data is written and set to ``step + 1`` after the data
    and the other header fields (step, world size, rank, lengths, CRC32 of the data): a slot whose
    writer died half-way has commit 0 (or a commit that does not match its step), and a slot is valid
    only when its CRC32 matches. So a kill during a snapshot loses that snapshot, never the previous
    one in the other slot.

Completeness: agreement at restore time, no collective per snapshot
    A snapshot of step ``s`` is complete when *every* rank of the world holds a valid slot of ``s``
    written by the same world (each snapshot records a world id: rendezvous id and round).
    Ranks never agree on that while training (that would add a collective per step): at restore
    every rank reports the snapshots it can hand out (:meth:`MemoryTier.provides`: its own, and the
    replicas of a buddy's, tier 1, see :mod:`trainguard.checkpoint.replica`) and the newest step for
    which every rank's snapshot exists somewhere is chosen (:func:`~trainguard.checkpoint.nearest.choose_sources`), never a mix of
    steps; a rank that lacks its own receives the replica from the rank holding it. Two slots suffice: a rank cannot
    start snapshot ``s + 2`` before every rank finished snapshot ``s + 1`` (the gradient all-reduce of
    step ``s + 2`` needs every rank, and a rank snapshots ``s + 1`` before it starts step ``s + 2``),
    so when a rank dies mid-write the others still hold the step it holds.

Where tier 0 applies, and where it does not
    A rank reads its own rank's files on its own node, or receives a replica of its rank: the world
    must have the same size (torch elastic keeps the ranks of a restarted world of the same nodes in the
    same order). Replicated state (DDP, ``replicated=True``) is the exception: any rank's snapshot
    restores any rank at any world size (:data:`ANY_RANK`). Sharded state at another world size is
    resharded (:meth:`MemoryTier.reshard_candidates`, :meth:`MemoryTier.load_resharded`): when the
    nodes' memory holds a snapshot of every rank of the earlier world (own slots of any rank, replicas),
    every rank receives those whose shards overlap its new ones (:func:`shards_needed`) and takes each
    element of its new shards from one of them: each DTensor's snapshot records its global shape, mesh
    and placements, so any layout DTensor expresses reshards (FSDP2 over one mesh dimension, FSDP2 over
    tensor parallelism on a 2-D mesh: :mod:`trainguard.checkpoint.reshard`); the transient memory is
    those old shards (about ``old / new + 1`` of them per rank). ZeRO's ranges (ShardedTensors) record
    every rank's offsets and reshard the same way. Anything else (a pending reduction, a rank moved to
    another node and not replicated there, a layout that changed) makes the restore fall back to
    storage. A restore from storage invalidates every slot and replica of the node (:meth:`MemoryTier.invalidate_all`);
    a world re-formed in place invalidates this rank's slots (:meth:`MemoryTier.rebind`; the live state
    is newer) unless it reloads its state (sharded state re-formed through a checkpoint), so a snapshot
    of an abandoned branch of history is never restored later.

Feeding the durable save (tier 2)
    :meth:`MemoryTier.lend` hands the snapshot this process just took to the durable save of the same
    step (:mod:`~trainguard.checkpoint.lending`).

Threading: the training thread copies the tensors and the skeleton into the slot and returns; the
checksum (CRC32 over the data, which releases the GIL), the header and the commit word are written by
one background thread while the next step runs (:meth:`MemoryTier.settle` waits for it; every reader
of the slots and the next snapshot call it first). A worker killed before that commit leaves the slot
invalid and the previous snapshot in the other slot, as a kill during the copy does.
GPU tensors are copied asynchronously into the page-locked slot (:mod:`~trainguard.checkpoint.gpusnap`;
not verified on a GPU yet, see ``docs/gpu.md``).

Where each part lives: this module is the tier itself (snapshot, settle, guard, load, the node
folder); the slot file format and its sizing are :mod:`~trainguard.checkpoint.slots`; a state's
skeleton and the reads of a slot's data :mod:`~trainguard.checkpoint.skeleton`; lending to the durable
save :mod:`~trainguard.checkpoint.lending`; tier 1's replicas and hand-outs
:mod:`~trainguard.checkpoint.replicaslots`; parity :mod:`~trainguard.checkpoint.parityslots`;
resharding from snapshots :mod:`~trainguard.checkpoint.memreshard`. Every name callers imported from
here before the split is still importable from here.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch

from trainguard.checkpoint import pinned
from trainguard.checkpoint.gpusnap import GpuCopies
from trainguard.checkpoint.lending import Lending, SnapshotSource
from trainguard.checkpoint.localplan import LocalPlan
from trainguard.checkpoint.memreshard import ReshardReads, fill_resharded, shards_needed  # noqa: F401 - re-exported
from trainguard.checkpoint.nearest import choose_sources  # noqa: F401 - re-exported (restore planning)
from trainguard.checkpoint.parityslots import _PARITY_META, ParitySlots  # noqa: F401 - re-exported
from trainguard.checkpoint.replicaslots import ANY_RANK, ReplicaSlots  # noqa: F401 - ANY_RANK re-exported
from trainguard.checkpoint.skeleton import (  # noqa: F401 - the skeleton's names, re-exported here
    Leaf, _has_local, _Leaf, _leaves, _load_data, _materialise_one, _parse, _Shards, _Tuple, _world_of, blob_skeleton,
    fill, layout, materialise, relaxed, skeleton)
from trainguard.checkpoint.slots import (  # noqa: F401 - the slot format's names, re-exported here
    _COMMIT_OFFSET, _HEADER, ALIGN, HEADER_BYTES, SLOTS, Header, MemoryTierError, _align,
    _commit, _numel, _seal, _Slot, _write, checksum, checksum_threads, _zero_commit, check_fits, folder_bytes, host_available_bytes, node_bytes,
    parity_buffers, slot_bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotResult:
    """What one snapshot cost this rank."""

    step: int
    seconds: float
    nbytes: int
    """Bytes of state copied (tensors + skeleton)."""


class MemoryTier(ReplicaSlots, ParitySlots, ReshardReads, Lending):
    """This rank's tier-0 snapshots in ``directory`` (the node folder its agent created).

    Args:
        directory: the agent's node folder (must exist: the agent owns it).
        rank, world_size: this rank in the current world.
        local_world_size: workers on this node (the cap is per node).
        max_bytes: ``checkpoint.memory_max_bytes`` (0: no cap besides the folder's free space).
    """

    def __init__(self, directory: str, *, rank: int, world_size: int, local_world_size: int = 1,
                 max_bytes: int = 0, copies: int = 1, replicated: bool = False, cuda: Any = None) -> None:
        if not os.path.isdir(directory):
            raise MemoryTierError(f"the tier-0 snapshot folder {directory} does not exist (its agent creates it). "
                                  f"Fix: start the workers through the trainguard agent, or set "
                                  f"checkpoint.memory_interval_steps=0 (TRAINGUARD_CHECKPOINT_MEMORY_INTERVAL_STEPS)")
        self.directory = directory
        self.local_world_size = local_world_size
        self.waited_s = 0.0
        """Seconds the guarded optimizer's ``step()`` waited for snapshots' copies, in all (the part of a
        snapshot's cost :attr:`SnapshotResult.seconds` does not hold: it is paid at the next step)."""
        self._threads = checksum_threads(local_world_size)  # the slots' checksum (slots.checksum)
        self.max_bytes = max_bytes
        self.copies = copies
        """1: tier 0 only; 2: this rank also holds a buddy's replica (counted against the cap)."""
        self.replicated = replicated
        """Every rank holds the whole state (DDP): a snapshot of any rank restores any rank of a world of
        any size (:data:`ANY_RANK`)."""
        self._slots: list[_Slot] = []
        self._newest: int | None = None  # index of the slot holding this rank's newest snapshot
        self._views: list[torch.Tensor] | None = None
        self._sig: Any = None
        self._tensor_bytes = 0
        self._replica_sizes: dict[str, int] = {}
        self.background_commit = True
        """Checksum and commit each snapshot in a background thread (the training thread only copies)."""
        self.fault_hook: Callable[[int], None] | None = None
        """Tests: called with the step once a snapshot's data is written, before its commit (a hook that
        kills the process leaves the slot torn, as a SIGKILL mid-snapshot does)."""
        self._pool: ThreadPoolExecutor | None = None
        self._committing: Future[None] | None = None
        self._guarded: Any = None  # the optimizer whose parameters and state are copied in the background
        self._gpu = GpuCopies(cuda)  # GPU tensors: asynchronous copies into pinned memory (gpusnap)
        self._copied: threading.Event | None = None
        """Set once the newest snapshot has read every tensor (its checksum and commit may still run):
        what the guarded optimizer's next step waits for."""
        self.pin_error: str | None = None
        """Why a slot could not be page-locked for GPU copies (they are then slower), or None."""
        self._guard_hook: Any = None
        self._split: tuple[Any, set[int]] | None = None
        self._last: tuple[int, int, list[torch.Tensor], list[torch.Tensor]] | None = None
        """The newest snapshot taken by this process: step, slot, the tensors it copied, their views."""
        self._holds: dict[int, SnapshotSource] = {}  # slot -> the durable save reading it
        self.replay_state = True
        """Replay a plain model + optimizer entry's state dict from its objects (:mod:`.localplan`)."""
        self._plans: dict[str, LocalPlan | Literal[False]] = {}  # entry -> its plan, False: none can be built
        self._parity: tuple[Any, list[int], int] | None = None
        """Tier 1 as XOR parity (:meth:`set_parity`): the exchange's group, its members' global ranks, this
        rank's index among them. With it this rank keeps one own slot, not two."""
        self._parity_lock = threading.Lock()  # the own slot's write vs. :meth:`abandon`
        self.parity_failed: str | None = None
        """Why the parity exchange stopped for this world (no snapshot is taken after it), or None."""
        self.parity_step: int | None = None
        """The step of the newest parity block this rank committed."""
        self.parity_seconds = 0.0
        """How long the newest exchange, agreement and own write took (in the background; the next
        ``optimizer.step()`` waits for what is left of it)."""
        self.parity_restore = False
        """The job keeps parity (``checkpoint.memory_replica_parity``): a restore first rebuilds what a lost
        node held (:meth:`~trainguard.checkpoint.manager.CheckpointManager.restore`). The same on every rank."""
        self._attach(rank, world_size)

    @property
    def nbytes(self) -> int:
        """Host memory this rank's slot files take (bytes)."""
        return sum(s.size for s in self._slots)

    @property
    def replica_bytes(self) -> int:
        """Host memory of the replica files this rank wrote for its buddy's source rank, or of its parity
        blocks (bytes)."""
        return sum(self._replica_sizes.values())

    def _attach(self, rank: int, world_size: int, parity: tuple[Any, list[int], int] | None = None) -> None:
        self.close()
        self._last = None
        self.rank, self.world_size = rank, world_size
        self._parity, self.parity_failed, self.parity_step = parity, None, None
        own = 1 if parity is not None else SLOTS
        self._slots = [_Slot(os.path.join(self.directory, f"rank-{rank:05d}-{k}.snap")) for k in range(own)]
        self._sig, self._newest, self._on_cpu = None, None, True
        self._plans = {}

    def rebind(self, rank: int, world_size: int, *, keep: bool = False) -> None:
        """A new world formed in place: write and read as ``rank`` of ``world_size`` from now on. What
        this rank's old files and the new rank's files hold is invalidated: snapshots of the old world
        are older than the live state this process continues with. ``keep``: the new world reloads its
        state (sharded state re-formed through a checkpoint): the old world's snapshots stay candidates
        for that restore (a restore from storage invalidates them all)."""
        if not keep:
            self.invalidate()
        self._attach(rank, world_size)
        if not keep:
            self.invalidate()

    def invalidate(self) -> None:
        """Make this rank's slots read as empty (after a restore from storage: what they hold belongs to
        a branch of history the job left)."""
        self.settle()
        for s in self._slots:
            s.invalidate()
        self._newest, self._last = None, None

    def discard_from(self, step: int) -> int:
        """Make this rank's own snapshots of ``step`` and later read as empty (after the background commit
        of the newest one ended): their data may come from an update that ran on half-reduced gradients,
        or from replicas that disagree. Returns how many were discarded."""
        self.settle()
        gone = 0
        for i, s in enumerate(self._slots):
            h = s.header()
            if h is not None and h.complete and h.step >= step:
                s.invalidate()
                gone += 1
                if i == self._newest:
                    self._newest, self._last = None, None
        return gone

    def invalidate_all(self) -> None:
        """:meth:`invalidate`, and every other snapshot and replica in the node folder too: after a restore
        from storage they all belong to a branch of history the job left, and a snapshot set that failed
        to load must not be chosen again by the next restart."""
        self.invalidate()
        for name in os.listdir(self.directory):
            if name.endswith(".snap"):
                _Slot(os.path.join(self.directory, name)).invalidate()

    def snapshot(self, step: int, state: dict[str, Any], *, world: str = "",
                 extra: dict[str, Any] | None = None) -> SnapshotResult:
        """Copy ``state`` (as the durable save would stage it) into the slot not holding the newest
        snapshot, and commit that slot as ``step``. ``world`` names the world writing it (the same on
        every rank, e.g. rendezvous id and round): a restore never combines snapshots of different
        worlds. ``extra``: small picklable values restored with it (e.g. the committed step the state
        descends from). Raises :class:`MemoryTierError` when it does not fit."""
        t0 = time.monotonic()
        self.settle()
        self._last = None
        tensors: list[torch.Tensor] = []
        shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
        skel = self._skeleton(state, tensors, shapes)
        meta = pickle.dumps({"skeleton": skel, "world": world, "replicated": self.replicated,
                             "extra": dict(extra or {})}, protocol=pickle.HIGHEST_PROTOCOL)
        if self.parity_failed is not None:
            raise MemoryTierError(f"no more snapshots in this world: the parity exchange failed ({self.parity_failed})")
        idx = 0 if self._newest is None else (self._newest + 1) % len(self._slots)
        self._wait_hold(idx)  # a durable save still copying from this slot (two snapshots ago)
        target = self._slots[idx]
        sig = tuple(shapes)
        if sig != self._sig:
            tensor_bytes = sum(_align(t.numel() * t.element_size()) for t in tensors)
        else:
            tensor_bytes = self._tensor_bytes
        if sig != self._sig or target.size < HEADER_BYTES + tensor_bytes + len(meta):
            per_slot = max(slot_bytes(tensor_bytes, len(meta)), target.size if sig == self._sig else 0)
            st = os.statvfs(self.directory)
            avail = None if self.max_bytes else host_available_bytes()
            if avail is not None:
                avail += folder_bytes(self.directory)
            check_fits(per_slot, local_world_size=self.local_world_size, max_bytes=self.max_bytes,
                       available_bytes=avail,
                       free_bytes=st.f_bavail * st.f_frsize + self.nbytes + self.replica_bytes,
                       directory=self.directory, copies=self.copies,
                       buffers=parity_buffers(len(self._parity[1])) if self._parity is not None else None)
            if self._sig is not None and sig != self._sig:
                self.invalidate()  # the other slot holds another layout: never restored into this state
            if self._parity is None or sig != self._sig:
                target.invalidate()  # (parity: the one own slot grows in place, its snapshot still good)
            target.ensure(per_slot)
            self._sig, self._tensor_bytes = sig, tensor_bytes
            self._on_cpu = not any(t.is_cuda for t in tensors)
            self._split = None
        target.ensure(target.size)
        views = target.views(sig)
        last = (step, idx, tensors, views)
        now, later = self._deferred(sig, tensors) if self.background_commit else ((), ())
        if self._parity is not None:
            self._snapshot_parity(step, target, views, tensors, set(later), meta, tensor_bytes, world)
            return SnapshotResult(step=step, seconds=time.monotonic() - t0, nbytes=tensor_bytes + len(meta))
        if later:  # the guarded optimizer's parameters and state: copied by the background thread
            late_views, late_tensors = [views[i] for i in later], [tensors[i] for i in later]
            views, tensors = [views[i] for i in now], [tensors[i] for i in now]
        else:
            late_views, late_tensors = [], []
        gpu_done = None
        if not self._on_cpu:  # GPU tensors: asynchronous copies into the pinned slot (gpusnap)
            self.pin_error = target.pin()
            _zero_commit(target.mm)
            gpu_done = self._gpu.start(tensors, views, self._guarded_ptrs(sig) if self._guarded is not None else set())
            views, tensors = [v for v, t in zip(views, tensors) if not t.is_cuda], [t for t in tensors if not t.is_cuda]
        _write(target.mm, views, tensors, tensor_bytes=tensor_bytes, meta=meta)
        if self.fault_hook is not None and gpu_done is None:
            self.fault_hook(step)
        self._newest, self._last = idx, last
        self._copied = threading.Event()
        commit = functools.partial(_copy_and_commit, target.mm, late_views, late_tensors, step=step,
                                   world_size=self.world_size, rank=self.rank, tensor_bytes=tensor_bytes,
                                   meta_bytes=len(meta), threads=self._threads, copied=self._copied, gpu_done=gpu_done,
                                   device=self._gpu.device, fault_hook=self.fault_hook if gpu_done is not None else None)
        self._background(commit)
        return SnapshotResult(step=step, seconds=time.monotonic() - t0, nbytes=tensor_bytes + len(meta))

    def _background(self, job: Callable[[], Any]) -> None:
        """Run a snapshot's background half on the commit thread (:meth:`settle` waits for it), or now
        when :attr:`background_commit` is off."""
        if self.background_commit:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tg-snapshot-commit")
            self._committing = self._pool.submit(job)
        else:
            job()


    def _skeleton(self, state: dict[str, Any], tensors: list[torch.Tensor], shapes: list[Any]) -> dict[str, Any]:
        """``skeleton(materialise(state), tensors, shapes)``, a model + optimizer entry replayed from its
        :class:`~trainguard.checkpoint.localplan.LocalPlan` while the plan holds (built after its first
        full pass; an entry no plan can describe is not tried again)."""
        out: dict[str, Any] = {}
        for k, v in state.items():
            plan = self._plans.get(k)
            part = plan.replay(v, tensors, shapes, skeleton) if plan else None
            if part is None:
                base = len(tensors)
                sd = _materialise_one(v)
                part = skeleton(sd, tensors, shapes)
                if self.replay_state and _has_local(v) and plan is not False:
                    self._plans[k] = LocalPlan.build(v, sd, part, tensors[base:], base) or False
            out[k] = part
        return out

    def guard(self, optimizer: Any) -> None:
        """Copy ``optimizer``'s parameters and state in the background too, beside the next forward and
        backward, which do not change them: a step pre-hook on ``optimizer`` waits for the copy (and the
        commit) before its next step changes them. Buffers (e.g. BatchNorm statistics, changed by the
        forward) and everything else are still copied before :meth:`snapshot` returns. Call again when
        the optimizer object changes; whoever changes parameters or optimizer state other than through
        ``optimizer.step()`` (a restore, a re-formation) calls :meth:`settle` first."""
        if optimizer is self._guarded or not isinstance(optimizer, torch.optim.Optimizer):
            return
        if self._guard_hook is not None:
            self._guard_hook.remove()
        self._guard_hook = optimizer.register_step_pre_hook(lambda *_: self._wait_copied())
        self._guarded, self._split = optimizer, None

    def _wait_copied(self) -> None:
        """The guarded optimizer's step pre-hook: wait until the newest snapshot has read every tensor
        (not for its checksum and commit, which read only the slot); :meth:`settle` where it cannot tell."""
        t0 = time.monotonic()
        try:
            copied = self._copied
            if copied is None:
                self.settle()
                return
            while not copied.wait(0.05):
                pending = self._committing
                if pending is None or pending.done():  # the job ended without setting it: its error, if any
                    self.settle()
                    return
        finally:
            self.waited_s += time.monotonic() - t0

    def _deferred(self, sig: Any, tensors: list[torch.Tensor]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Indices of ``tensors`` to copy now, and those the background thread may copy: CPU tensors that
        are the guarded optimizer's parameters or state (by storage). Cached per layout."""
        if self._guarded is None:
            return (), ()
        ptrs = self._guarded_ptrs(sig)
        later = tuple(i for i, t in enumerate(tensors) if not t.is_cuda and t.data_ptr() in ptrs)
        return tuple(i for i in range(len(tensors)) if i not in set(later)), later

    def _guarded_ptrs(self, sig: Any) -> set[int]:
        """The guarded optimizer's parameter and state storages (:func:`pinned.optimizer_storages`),
        cached per layout."""
        if self._split is None or self._split[0] != sig:
            self._split = (sig, pinned.optimizer_storages(self._guarded))
        return self._split[1]


    def settle(self) -> None:
        """Wait until the newest snapshot is committed (its deferred copies, checksum and commit word are
        written in the background): every reader of the slots, and the next snapshot, call it first."""
        pending, self._committing = self._committing, None
        if pending is not None:
            pending.result()

    def _valid(self) -> list[tuple[int, Header, bytes]]:
        self.settle()
        out = []
        for i, s in enumerate(self._slots):
            got = s.read_valid(self.world_size, self.rank)
            if got is not None:
                out.append((i, *got))
        return out

    def available(self, state: dict[str, Any]) -> list[tuple[int, str]]:
        """The ``(step, world)`` snapshots this rank holds complete and checksum-verified, of this world
        size, whose layout fits ``state`` (newest first)."""
        want = layout(skeleton(materialise(state), []))
        steps = []
        for _, h, data in self._valid():
            try:
                meta = pickle.loads(data[h.tensor_bytes:])
            except Exception:  # noqa: BLE001 - a slot we cannot read is not a candidate
                continue
            if layout(meta["skeleton"]) == want:
                steps.append((h.step, str(meta.get("world", ""))))
        return sorted(steps, reverse=True)

    def load(self, step: int, state: dict[str, Any], *, world: str = "") -> dict[str, Any]:
        """Load the snapshot of ``step`` written by ``world`` into ``state`` in place (as ``dcp.load``:
        tensors copied into the current state dicts, then ``load_state_dict``); return its ``extra``.
        Raises :class:`MemoryTierError` when this rank holds no valid snapshot of ``step``."""
        for i, h, data in self._valid():
            if h.step == step and _world_of(h, data) == world:
                extra = _load_data(h, data, state)
                self._newest, self._last = i, None
                return extra
        raise MemoryTierError(f"rank {self.rank} holds no valid in-memory snapshot of step {step} in {self.directory}")


    def _own_files(self) -> list[_Slot]:
        return self._node_files(("rank-",))

    def _node_files(self, prefixes: tuple[str, ...] = ("rank-", "replica-")) -> list[_Slot]:
        """The node folder's slots (every rank's own, and the replicas), by name."""
        return [_Slot(os.path.join(self.directory, n)) for n in sorted(os.listdir(self.directory))
                if n.startswith(prefixes) and n.endswith(".snap")]


    def close(self) -> None:
        """Unmap the slot files (they stay: the agent owns them)."""
        self.settle()
        self._wait_hold()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for s in self._slots:
            s.close()
        self._gpu.close()



def _copy_and_commit(mm: mmap.mmap, views: list[torch.Tensor], tensors: list[torch.Tensor], *,
                     copied: threading.Event | None = None, gpu_done: Any = None, device: Any = None,
                     fault_hook: Callable[[int], None] | None = None, **kw: Any) -> None:
    """The background half of a snapshot: the deferred copies (CPU tensors: the copy releases the GIL),
    the wait for the GPU copies (``gpu_done``, on ``device`` made current first), then - ``copied`` set:
    the guarded optimizer may step - :func:`_commit`."""
    try:
        if tensors:
            with torch.no_grad():
                torch._foreach_copy_(views, tensors)
        if gpu_done is not None:
            pinned.bind_thread(device)
            gpu_done.synchronize()
    finally:
        if copied is not None:
            copied.set()
    if fault_hook is not None:
        fault_hook(kw["step"])
    _commit(mm, **kw)



__all__ = ["HEADER_BYTES", "SLOTS", "Header", "MemoryTier", "MemoryTierError", "SnapshotResult", "SnapshotSource", "check_fits",
           "folder_bytes", "host_available_bytes",
           "choose_sources", "node_bytes", "slot_bytes"]
