"""In-place re-formation on the worker side: rebuild the process groups of a live worker for a new
world, and hand the training state to ranks that lack it, from a live peer instead of storage.

Why the world is built the torchelastic way (``env://``, rank 0 hosting a ``TCPStore`` at
``MASTER_ADDR:MASTER_PORT``): a re-formed world can mix live workers (re-formed here) with workers
the agent just started (a warmed-up joiner, or a restarted node), which initialise from the env that
torch elastic gave them. Both must build the same store, so both go through :func:`init_world` with
the address the rendezvous published for the round: :func:`arrive` at the store rank 0 hosts (as
``env://`` does), counted, then ``init_process_group`` on it under torch's ``default_pg`` prefix. The
count is what makes a join interruptible: a world that loses a member before it forms is called off
by the agent (:class:`JoinAborted`) instead of waiting out the process-group timeout.

Collective order (it must match between a re-formed worker and a freshly started one):
``init_process_group`` -> the runtime's flag group -> the strategy's wrapping (DDP's constructor
broadcasts from rank 0) -> the checkpoint manager's group -> :func:`sync_live_state`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from trainguard.contract.log import get_logger
from trainguard.runtime import device as dev

log = get_logger("trainguard.runtime.reform")

_PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
                         "Timed out waiting", "Connection refused", "NCCL communicator was aborted",
                         "ProcessGroupNCCL", "gloo/transport")


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because a peer went away (not a bug in the script)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _PEER_FAILURE_MARKERS)


class JoinAborted(RuntimeError):
    """A world this worker was joining was called off before every rank arrived: the agent saw a member
    of the round go (or this node drain), or the rank hosting the world's store vanished."""


ARRIVED_KEY = "trainguard/arrived"
"""Key of the arrival count in a world's store (outside the ``default_pg`` prefix torch uses)."""
FATE_KEY = "trainguard/fate"
"""Whether the world forms (:func:`arrive`): :data:`FATE_GO` or :data:`FATE_OFF`, set once."""
FATE_GO, FATE_OFF = "go", "off"
CONNECT_S = 1.0
"""Bound of one attempt to reach the world's store: how often a waiting worker looks at ``aborted``."""
POLL_S = 0.02
"""How often a rank waiting for the others' arrival asks the world's store."""
PROBE_S = 0.01
"""How often a rank waiting for the world's store to listen tries its port (see :func:`_listening`)."""


def _listening(addr: str, port: int) -> bool:
    """Whether the world's store accepts connections yet. Asked before a ``TCPStore`` client is made:
    torch's client meets a refused connection with an exponential backoff whose first sleep is
    0.25-0.75 s (``c10d::ExponentialBackoffWithJitter``, 500 ms +- 50 %), which a rank that comes
    before rank 0's store is up paid at every re-formation (half a second of a join's 0.6 s in the
    spot-trace replay). A plain connect that is refused costs microseconds."""
    try:
        socket.create_connection((addr, port), timeout=CONNECT_S).close()
        return True
    except OSError:
        return False


def arrive(*, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float,
           aborted: Callable[[], bool] = lambda: False, connect_s: float = CONNECT_S) -> dist.Store:
    """Reach the world's ``TCPStore`` (rank 0 hosts it, like torch elastic's ``env://``) and wait until
    all ``world_size`` ranks have arrived; only then may ``init_process_group`` start, whose own waits
    for a missing rank cannot be interrupted (they run out after ``timeout_s``).

    Between attempts and polls ``aborted()`` is asked: True raises :class:`JoinAborted`, so that a worker
    whose world lost a member before it formed goes back to its agent alive, with its state, instead of
    sitting out the process-group timeout. A store that stops answering (its host is gone) raises
    :class:`JoinAborted` too; ``timeout_s`` passing raises :class:`TimeoutError`.

    Whether the world forms is agreed once, in the store (:data:`FATE_KEY`, compare-and-set): the first
    rank to see every rank arrived sets ``go``, a rank called off before that sets ``off``. A rank called
    off after ``go`` joins all the same (its agent's request is served at the first step boundary), and
    the others see ``off`` at their next poll: no rank goes on to ``init_process_group`` for a world that
    one of its ranks has left (that rank's arrival still counted)."""
    deadline = time.monotonic() + (timeout_s if timeout_s > 0 else 1800.0)
    store: dist.Store | None = None

    def ask(call: Callable[[dist.Store], Any]) -> Any:
        """One call to the world's store; its host gone means this world will not form."""
        assert store is not None
        try:
            return call(store)
        except (RuntimeError, OSError) as e:
            raise JoinAborted(f"the world's store stopped answering: {e}"[:300]) from e

    def fate(want: str) -> str:
        """The world's agreed fate: ``want`` unless another rank decided first."""
        return ask(lambda st: st.compare_set(FATE_KEY, "", want)).decode()

    def check(what: str) -> None:
        if store is not None and ask(lambda st: st.check([FATE_KEY]) and st.get(FATE_KEY) == FATE_OFF.encode()):
            raise JoinAborted(f"another rank called the world off while {what}")
        if aborted() and (store is None or fate(FATE_OFF) == FATE_OFF):
            raise JoinAborted(f"the agent called the world off while {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the world's ranks did not all arrive within workers.pg_timeout_s={timeout_s:.0f}s "
                               f"while {what}")

    while store is None:
        check(f"connecting to the world's store at {master_addr}:{master_port}")
        if rank != 0 and not _listening(master_addr, master_port):
            time.sleep(PROBE_S)
            continue
        try:
            store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                                  timeout=timedelta(seconds=connect_s), wait_for_workers=False, multi_tenant=True)
        except (RuntimeError, OSError) as e:
            if rank == 0:  # the host binds its own port: that failing is no peer's absence
                raise
            log.debug("world_store_unreachable", error=str(e)[:200])
            time.sleep(POLL_S)

    def count(add: int) -> int:
        return ask(lambda st: st.add(ARRIVED_KEY, add))

    arrived = count(1)
    while arrived < world_size or fate(FATE_GO) != FATE_GO:
        check(f"waiting for {max(0, world_size - arrived)} of {world_size} ranks")
        time.sleep(POLL_S)
        arrived = count(0)
    store.set_timeout(timedelta(seconds=timeout_s) if timeout_s > 0 else dist.default_pg_timeout)
    return store


def init_world(*, rank: int, world_size: int, local_rank: int, local_world_size: int, master_addr: str,
               master_port: int, device: torch.device, group_rank: int = 0, nodes: int = 1,
               timeout_s: float = 0.0, aborted: Callable[[], bool] = lambda: False) -> None:
    """Initialise the default process group for a new world, the way torch elastic's env does, on
    ``device`` (made current first; ``device_id`` binds the group to it) with ``timeout_s``, after every
    rank has :func:`arrive`d (raises :class:`JoinAborted` when ``aborted()`` says so before that)."""
    os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
                       "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(group_rank),
                       "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size)})
    dev.bind(device)
    store = arrive(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                   timeout_s=timeout_s, aborted=aborted)
    # The prefix torch's env:// init puts on its store: the same keys as a world made that way.
    backend = dev.backend_for(device)
    # gloo's connections are ended by hand after a peer failure; NCCL communicators are aborted instead
    # (teardown_world), their sockets are left alone.
    with world_connections() if backend == "gloo" else contextlib.nullcontext():
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world_size, **dev.init_kwargs(device, timeout_s))


# ---- ending a broken world's connections -------------------------------------------------------
# Destroying a gloo group closes its TCP connections only when its last reference goes, and DDP's
# reducer keeps one for the life of the process (gloo's abort() and shutdown() leave the connections
# open). A survivor blocked in a collective step that waits on *this* rank (a ring step, not one with
# the dead peer) would then wait out the process-group timeout while this rank is parked. Shutting the
# connections down sends every peer an end of stream: its collective fails at once as a peer failure,
# and it parks too.
_WORLD_SOCKETS: dict[int, int] = {}
"""fd -> inode of the TCP connections the current world's groups opened (see :func:`world_connections`)."""


def _tcp_connections() -> dict[int, int]:
    """fd -> inode of this process's connected TCP sockets (Linux ``/proc``; elsewhere none)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            fd = int(name)
            st = os.fstat(fd)
        except (ValueError, OSError):
            continue
        if not stat.S_ISSOCK(st.st_mode):
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM and \
                        not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    out[fd] = st.st_ino
        except OSError:
            continue
    return out


@contextlib.contextmanager
def world_connections() -> Iterator[None]:
    """Record the TCP connections opened while a group of the current world is made (a gloo group
    connects to every peer in its constructor), for :func:`end_world_connections`."""
    before = _tcp_connections()
    try:
        yield
    finally:
        _WORLD_SOCKETS.update({fd: ino for fd, ino in _tcp_connections().items() if before.get(fd) != ino})


def end_world_connections() -> int:
    """Shut down (not close: the fds stay gloo's) every connection :func:`world_connections` recorded
    that is still the same socket; returns how many. For a world that lost a peer, before its groups
    are destroyed: the peers blocked on this rank fail their collective now."""
    ended = 0
    for fd, ino in list(_WORLD_SOCKETS.items()):
        try:
            if os.fstat(fd).st_ino != ino:
                continue
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
            ended += 1
        except OSError:
            continue
    _WORLD_SOCKETS.clear()
    return ended


def abort_collectives(device: torch.device) -> str:
    """Make the collectives this process is blocked in fail now, from another thread (the agent's
    :class:`~trainguard.contract.protocol.Abort`: a peer is hung or frozen, its sockets stay open and
    nothing fails by itself before the process-group timeout). gloo: shut the world's connections
    down (:func:`end_world_connections`); NCCL: abort the communicators. The training thread then
    fails the collective as a lost peer and parks. Returns what was done."""
    if dev.backend_for(device) == "nccl" and dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
        return "nccl_abort"
    return f"gloo_connections_ended={end_world_connections()}"


class Teardown(str, Enum):
    """How a world's process groups are ended (:func:`teardown_plan`)."""

    ABORT = "abort"
    """A peer is lost on NCCL: abort every communicator (preempts kernels that wait for the lost peer);
    the abort tears every group down and clears the default one, so nothing is destroyed after it."""
    SYNCHRONIZE_DESTROY = "synchronize_destroy"
    """A planned resize on NCCL: the device's queued kernels finish, then a graceful destroy (an abort
    would preempt healthy kernels, e.g. a D2H copy of a checkpoint)."""
    DESTROY = "destroy"
    """gloo: destroy (after a peer loss its connections were ended first, :func:`end_world_connections`)."""
    NONE = "none"
    """No world (already aborted earlier in the same park, or never formed)."""


def teardown_plan(*, backend: str, initialized: bool, peer_lost: bool) -> Teardown:
    """Pure: how to end the current world (see :class:`Teardown`)."""
    if not initialized:
        return Teardown.NONE
    if backend == "nccl":
        return Teardown.ABORT if peer_lost else Teardown.SYNCHRONIZE_DESTROY
    return Teardown.DESTROY


def teardown_world(device: torch.device, *, peer_lost: bool,
                   synchronize: Callable[[torch.device], None] = dev.synchronize) -> Teardown:
    """End every process group of this process (the default one and all sub-groups) as
    :func:`teardown_plan` says, then forget the world's sockets and DTensor's caches; returns what was
    done. Idempotent: a second call finds no world and only clears the caches again."""
    plan = teardown_plan(backend=dev.backend_for(device), initialized=dist.is_initialized(), peer_lost=peer_lost)
    if plan is Teardown.ABORT:
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as e:  # an abort that failed leaves the groups: destroy what is left
            log.warning("nccl_abort_failed", error=str(e)[:300])
    elif plan is Teardown.SYNCHRONIZE_DESTROY:
        synchronize(device)
    if plan is not Teardown.NONE and dist.is_initialized():
        dist.destroy_process_group()
    _WORLD_SOCKETS.clear()  # the next world records its own
    clear_dtensor_caches()
    return plan


def clear_dtensor_caches() -> None:
    """Forget DTensor's sharding-propagation and redistribution caches. A ``DeviceMesh`` compares and
    hashes without its rank, so a mesh of the next world with the shape of an earlier one hits entries
    made for the earlier one, and tensors created through them (FSDP2's ``to_empty`` of a re-sharded
    module) carried the old mesh: a survivor that became rank 1 of a world of 2 it had been rank 0 of
    described its shards at rank 0's offsets (every DCP save then failed its global-plan check)."""
    try:
        from torch.distributed.tensor import debug
    except ImportError:  # torch without DTensor: nothing cached
        return
    clear = getattr(debug, "_clear_sharding_prop_cache", None) or getattr(debug, "_clear_python_sharding_prop_cache", None)
    if clear is not None:
        clear()
    try:
        from torch.distributed.tensor._redistribute import _gen_transform_infos
    except ImportError:
        return
    if hasattr(_gen_transform_infos, "cache_clear"):
        _gen_transform_infos.cache_clear()


def to_host(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU (CPU tensors as they are), for pickling: a pickled CUDA
    tensor is restored on the *sender's* ``cuda:<i>`` in every receiver (a DDP joiner got its optimizer
    state on another rank's GPU). ``Optimizer.load_state_dict`` moves the state to its parameters' device."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu") if obj.is_cuda else obj
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [to_host(v) for v in obj]
        return tuple(out) if isinstance(obj, tuple) else out
    return obj


def sync_live_state(step: int | None, tensors: dict[str, torch.Tensor], *,
                    extra: dict[str, Any] | Callable[[], dict[str, Any]], load_extra: Any, group: Any = None,
                    tensor_group: Any = None) -> tuple[str, int | None]:
    """Agree on the newest live state and hand it to every rank that lacks it.

    ``step`` is the step this rank's in-memory state is at (None: a fresh process, nothing live).
    ``tensors`` are the replicated tensors (parameters, buffers, optimizer state), broadcast in place
    from the source; ``extra`` is small picklable state (step, data cursor, optimizer state layout),
    or a function that makes it (called on the source rank only), given to ``load_extra`` on the receivers. Flags and ``extra`` go over ``group`` (gloo, CPU); the
    tensors over ``tensor_group`` (None: the default group — NCCL for tensors on the GPU). Returns ``(outcome, source step)``: ``none`` (no rank
    holds live state: restore from storage), ``agreed`` (every rank is at the same step: nothing
    moved) or ``broadcast``.
    """
    mine = -1 if step is None else step
    rank = dist.get_rank(group)
    flags = torch.tensor([mine, -mine], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    newest, oldest = int(flags[0]), -int(flags[1])
    if newest < 0:
        return "none", None
    if newest == oldest:
        return "agreed", newest
    pick = torch.tensor([rank if mine == newest else dist.get_world_size(group)], dtype=torch.int64)
    dist.all_reduce(pick, op=dist.ReduceOp.MIN, group=group)
    src = int(pick[0])
    box = [(extra() if callable(extra) else extra) if rank == src else None]
    dist.broadcast_object_list(box, group=group, group_src=src)
    if rank != src:
        load_extra(box[0])
    for t in tensors.values():
        dist.broadcast(t, group=tensor_group, group_src=src)
    return "broadcast", newest


__all__ = ["Teardown", "abort_collectives", "clear_dtensor_caches", "end_world_connections", "init_world", "is_peer_failure", "sync_live_state", "teardown_plan", "teardown_world", "to_host",
           "world_connections"]
