"""The one adapter over torch.distributed.elastic internals (STYLE §11).

Every private name of torch elastic that trainguard relies on is used here and in this module's one
part, :mod:`trainguard.agent.elastic_join` (the rendezvous join), and nowhere else, so a torch upgrade
touches these two files and tests fake :class:`ElasticAdapter`, not torch. The values handed to the
supervisor (:class:`World`, :class:`Plan`, :class:`Peek`, :class:`Poll`) live in
:mod:`trainguard.agent.elastic_types` and are re-exported here. Verified against
torch 2.13's ``agent/server/api.py``, ``local_elastic_agent.py`` and ``rendezvous/dynamic_rendezvous.py``.

What it offers the supervisor (:mod:`trainguard.agent.supervisor`), all called from the supervisor
thread:

* :meth:`ElasticAdapter.run` — run elastic's agent with our loop as its body (``_invoke_run``);
* :meth:`~ElasticAdapter.start` / :meth:`~ElasticAdapter.restart` — rendezvous, then start the
  local workers (``_initialize_workers`` / ``_restart_workers``);
* :meth:`~ElasticAdapter.poll` — one look at the workers (``_monitor_workers``);
* :meth:`~ElasticAdapter.stop_workers`, :meth:`~ElasticAdapter.terminate_workers`,
  :meth:`~ElasticAdapter.exit_barrier` (ours, not torch's: it waits only for the members still in the
  round, :mod:`trainguard.agent.exitbarrier`), :meth:`~ElasticAdapter.consume_restart`;
* :meth:`~ElasticAdapter.leave` — the planned leave: the handler's exit operation without closing
  the rendezvous (``DynamicRendezvousHandler.shutdown()`` would close it for every node);
* :meth:`~ElasticAdapter.members`, :meth:`~ElasticAdapter.node_id`, :attr:`~ElasticAdapter.round`;
* in-place re-formation: :meth:`~ElasticAdapter.reform` (a rendezvous and new ranks for the workers
  that keep running), :meth:`~ElasticAdapter.start_standby` (a joiner's workers, started before
  their world exists so that they warm up), :meth:`~ElasticAdapter.peek` and
  :meth:`~ElasticAdapter.round_store` (what a node sees of a running world before it joins).

Tee'd worker output is written in whole lines (:func:`install_whole_line_tail`, over torch's
``tail_log.tail_logfile``): torch writes a half-written line at once, and its rest behind a second header.

Two changes to how the dynamic rendezvous joins (see :func:`next_round`), installed on the handler:

* **Interruptible.** A drain that arrives while the node waits in a rendezvous makes the join
  operation leave the participant set (or wait list) at its next poll and raise
  :class:`RendezvousAborted`: the node leaves at once, on the supervisor thread.
* **Planned membership.** When the agents re-form a world for a planned change (:class:`Plan`: its
  members and the ones announced as leaving), the round completes as soon as every member that is
  not leaving and every newcomer has joined, instead of waiting out ``last_call_timeout`` for nodes
  known not to come. After an unplanned loss (``Plan.lost``) the members expected are those whose
  keep-alive the rendezvous still holds: the round completes once the lost node's heartbeat expired
  and every live member joined, not ``last_call_timeout`` later. Should a member fail to come,
  torch's own rule (``last_call_timeout`` after
  ``min_nodes``) still closes the round. The state is polled every :data:`POLL_INTERVAL_S` instead of
  torch's fixed 1 s.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import signal
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing import tail_log as _tail_log
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

from trainguard.agent import prestart, prestart_handler, storecall
from trainguard.agent.elastic_join import _Executor, evict_nodes, fresh_reads, next_round, planned_complete  # noqa: F401 (re-exported)
from trainguard.agent.elastic_types import POLL_INTERVAL_S, Peek, Plan, Poll, RendezvousAborted, World
from trainguard.agent.exitbarrier import (EXITED_KEY, FINISHED_KEY, REJOINING_KEY, ExitOutcome, LingerOutcome,
                                          RoundView, listens_here, wait_for_exits, wait_for_members)
from trainguard.agent.keyed_rendezvous import KeyedRendezvousHandler
from trainguard.agent.linetail import tail_whole_lines
from trainguard.contract.log import get_logger
from trainguard.contract.protocol import WorkerStatus

log = get_logger("trainguard.agent.elastic")

# ---- elastic's agent with our loop ---------------------------------------------------------------

class _Agent(LocalElasticAgent):
    """``LocalElasticAgent`` whose run loop is the supervisor's and whose workers get our env."""

    def __init__(self, spec: WorkerSpec, logs: DefaultLogsSpecs, exit_barrier_timeout: float,
                 body: Callable[[], RunResult], env: Callable[[], dict[str, str]]) -> None:
        super().__init__(spec, logs_specs=logs, start_method="spawn", exit_barrier_timeout=exit_barrier_timeout)
        self._body = body
        self._env = env

    # LocalElasticAgent._start_workers hands the per-rank env dicts to this hook right before it
    # starts the processes: the one place where trainguard adds its worker variables.
    def _setup_local_watchdog(self, envs: dict[int, dict[str, str]]) -> None:  # See base class.
        extra = self._env()
        for env in envs.values():
            env.update(extra)
        super()._setup_local_watchdog(envs)

    def _invoke_run(self, role: str = "default") -> RunResult:  # See base class.
        return self._body()

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:  # See base class.
        try:
            return super()._start_workers(worker_group)
        finally:  # the prestarted interpreters are for this node's first workers only
            prestart.close("the first workers started")


class _LockedStore:
    """``set`` / ``check`` / ``get`` of a store, each under ``lock`` (see :meth:`ElasticAdapter.side_store`)."""

    def __init__(self, store: Any, lock: Any) -> None:
        self._store, self._lock = store, lock

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return bool(self._store.check(keys))

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._store.get(key)


TORCH_TAIL_LOGFILE = _tail_log.tail_logfile
"""torch's own ``tail_logfile``, as this module found it (what :func:`install_whole_line_tail` replaces)."""

FIRST_CONNECT_S = 60.0
"""How long :meth:`ElasticAdapter.bound_store_calls` may take to open its connection to the c10d endpoint
(torch's c10d backend's default ``read_timeout``); each call on it is bounded afterwards."""


def install_whole_line_tail() -> None:
    """Tee'd worker output reaches the agent's in whole lines (:mod:`trainguard.agent.linetail`):
    torch's ``TailLog`` calls its module's ``tail_logfile``, which this replaces. Idempotent."""
    if _tail_log.tail_logfile is not tail_whole_lines:
        _tail_log.tail_logfile = tail_whole_lines


class ElasticAdapter:
    """The supervisor's handle on torch elastic. Not thread-safe: the supervisor thread owns it, except
    :meth:`leave` on a handler no other thread uses any more."""

    def __init__(self, spec: WorkerSpec, logs: DefaultLogsSpecs, *, exit_barrier_timeout: float,
                 worker_env: Callable[[], dict[str, str]], abort_rendezvous: Callable[[], bool]) -> None:
        self.handler: RendezvousHandler = spec.rdzv_handler
        self._abort = abort_rendezvous
        self._plan: Plan | None = None
        self.evicted: list[str] = []
        """Rendezvous ids the last round removed on evidence (:attr:`Plan.evict`)."""
        self._body: Callable[[], RunResult] | None = None
        self._joined: tuple[int, frozenset[str]] | None = None
        """The round this node last joined and its members' rendezvous ids (what the exit barrier is about)."""
        self._left: frozenset[str] = frozenset()
        """Members the exit barrier saw leave the round without finishing (a store host waits for them)."""
        self._rejoin_marked = False
        """This node's rejoin mark is up (:meth:`leave` with ``rejoin``) until it joins again or leaves for good."""
        self._store_round = -1
        self._reconnects = 0  # see store_generation
        self._guard: storecall.ClientGuard | None = None
        """c10d with :meth:`bound_store_calls`: the handler client's guard."""
        install_whole_line_tail()
        prestart_handler.install()
        self._agent = _Agent(spec, logs, exit_barrier_timeout, self._run_body, worker_env)
        self.keyed = isinstance(self.handler, KeyedRendezvousHandler)
        """``rendezvous.protocol: keyed``: trainguard's own handler, interruptible and planned by itself."""
        if self.keyed:
            self.handler.next_rendezvous = self._next_keyed  # type: ignore[method-assign]
        elif hasattr(self.handler, "_op_executor"):  # the dynamic handler (c10d, etcd-v2, etcd): interruptible
            self.handler.next_rendezvous = self._next_rendezvous  # type: ignore[method-assign]
            fresh_reads(self.handler)

    # -- running -----------------------------------------------------------------------------------
    def run(self, body: Callable[[], RunResult]) -> RunResult:
        """Run elastic's agent (its event records and shutdown handling) with ``body`` as the loop."""
        self._body = body
        return self._agent.run()

    def _run_body(self) -> RunResult:
        assert self._body is not None
        return self._body()

    def _next_rendezvous(self) -> RendezvousInfo:
        plan, self._plan = self._plan, None
        return self._in_round(next_round(self.handler, self._abort, plan, self.evicted))

    def _next_keyed(self) -> RendezvousInfo:
        plan, self._plan = self._plan, None
        self.evicted.clear()
        return self._in_round(self.handler.next_round(self._abort, plan, self.evicted))  # type: ignore[attr-defined]

    def _in_round(self, info: RendezvousInfo) -> RendezvousInfo:
        """What either protocol's next round leaves this adapter: the round it is in and its members."""
        self._store_round = self.round  # the round whose prefix info.store (the group's store) carries
        self._joined = (self.round, frozenset(self.members()))
        if self._rejoin_marked:  # back in a round: nobody needs to wait for this node on its mark any more
            self._mark_rejoining(False)
        return info

    @property
    def group(self) -> WorkerGroup:
        return self._agent.get_worker_group()

    def world(self) -> World:
        wg = self.group
        return World(round=self.round, group_rank=wg.group_rank or 0, nodes=wg.group_world_size or 0,
                     world_size=wg.workers[0].world_size if wg.workers else 0,
                     global_ranks=tuple(w.global_rank for w in wg.workers),
                     master_addr=str(wg.master_addr or ""), master_port=int(wg.master_port or 0),
                     members=tuple(self.members()))

    def start(self, plan: Plan | None = None) -> World:
        """Rendezvous, then start the local workers. Raises :class:`RendezvousAborted` when a drain
        interrupts the rendezvous."""
        self._plan = plan
        self._agent._initialize_workers(self.group)
        return self.world()

    def restart(self, plan: Plan | None = None) -> World:
        """Stop the local workers, rendezvous, start them again."""
        self._plan = plan
        self._agent._restart_workers(self.group)
        return self.world()

    def reform(self, plan: Plan | None = None) -> World:
        """Rendezvous and assign new ranks while the local workers keep running (in-place
        re-formation; the workers are told their new ranks by the supervisor). Raises
        :class:`RendezvousAborted` when a drain interrupts the rendezvous."""
        wg = self.group
        pids = {w.local_rank: w.id for w in wg.workers}
        self._plan = plan
        self._agent._rendezvous(wg)  # next_round + elastic's rank assignment over the round's store
        for w in wg.workers:
            w.id = pids.get(w.local_rank)
        wg.state = WorkerState.HEALTHY
        return self.world()

    def start_standby(self) -> None:
        """Start the local workers before this node has a world (placeholder ranks of -1): they warm
        up (start, imports, model build) and wait for their first :meth:`reform`."""
        wg = self.group
        n = wg.spec.local_world_size
        wg.workers = [Worker(local_rank=i, global_rank=-1, role_rank=-1, world_size=-1, role_world_size=-1)
                      for i in range(n)]
        wg.store = dist.HashStore()  # elastic's start asserts a store; standby workers never use it
        wg.group_rank, wg.group_world_size = -1, -1
        wg.master_addr, wg.master_port = "127.0.0.1", 0
        for local_rank, pid in self._agent._start_workers(wg).items():
            wg.workers[local_rank].id = pid
        wg.state = WorkerState.HEALTHY

    def peek(self) -> Peek:
        """Sync and read the shared rendezvous state without joining. Keyed: the newest round and its
        members (two small reads while that round is this node's), the announcements since it."""
        if self.keyed:
            return self.handler.peek()  # type: ignore[attr-defined]
        holder = self.handler._state_holder
        with self.handler._heartbeat_lock:  # the keep-alive timer thread syncs the same holder
            holder.sync()
            st = holder.state
            me = self.handler._this_node
            return Peek(round=st.round, complete=st.complete, participants=tuple(str(n) for n in st.participants),
                        waiting=len(st.wait_list), this_node_participates=me in st.participants, closed=bool(st.closed))

    def endpoint_store(self) -> Any:
        """The rendezvous store itself, not prefixed by the job (``c10d``: the ``TCPStore`` at the
        endpoint, shared by every job that uses it); None for other backends. The backend is the state
        holder's (torch's handler keeps only its name)."""
        if self.keyed:
            return self.handler.endpoint_store  # type: ignore[attr-defined]
        backend = getattr(getattr(self.handler, "_state_holder", None), "_backend", None)
        if not isinstance(backend, C10dRendezvousBackend):
            return None
        if self._guard is not None:
            return storecall.BoundedStore(self._guard)
        return getattr(self.handler, "_store", None)

    def round_store(self, round_: int) -> Any:
        """The store under round ``round_``'s prefix (the one the round's agents use)."""
        if self.keyed:
            return self.handler.round_store(round_)  # type: ignore[attr-defined]
        prefix = f"torch.rendezvous.{self.handler._settings.run_id}.{round_}"
        if self._guard is not None:
            return storecall.BoundedStore(self._guard, lambda c: dist.PrefixStore(prefix, c))
        return dist.PrefixStore(prefix, self.handler._store)

    def side_store(self, round_: int) -> Any:
        """A store under round ``round_``'s prefix for a thread other than the supervisor's (the hang
        watch). A ``TCPStore`` client is not safe to share between threads that do not hold the
        handler's lock (two requests in flight on one connection: one thread waited for an answer the
        other had read, and the supervisor hung); for c10d this is a connection of its own, with a short
        timeout; for other backends the round store, each call under the handler's lock."""
        if self.keyed:
            return self.handler.side_store(round_)  # type: ignore[attr-defined]
        settings = self.handler._settings
        old = getattr(self.handler, "_store", None)
        host, port = getattr(old, "host", ""), int(getattr(old, "port", 0) or 0)
        prefix = f"torch.rendezvous.{settings.run_id}.{round_}"
        if self._guard is not None:  # c10d: a client of its own, bounded and renewed like the handler's
            slot = [self._connect(timedelta(seconds=5))]
            retired: list[Any] = []

            def renew() -> None:
                retired[:] = [*retired[-3:], slot[0]]
                slot[0] = self._connect(timedelta(seconds=5))
            guard = storecall.ClientGuard(lambda: slot[0], renew, bound_s=self._bound_s, interval_s=self._bound_s / 3,
                                          name="side")
            return storecall.BoundedStore(guard, lambda c: dist.PrefixStore(prefix, c))
        if isinstance(getattr(self.handler, "_backend", None), C10dRendezvousBackend) and host and port:
            client = dist.TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=5))
            return dist.PrefixStore(prefix, client)
        return _LockedStore(self.round_store(round_), self.handler._heartbeat_lock)

    def poll(self) -> Poll:
        result = self._agent._monitor_workers(self.group)
        n = self.group.spec.local_world_size
        if result.state == WorkerState.HEALTHY:
            return Poll(WorkerStatus.HEALTHY, result=result)
        if result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED):
            failed = [f.exitcode for f in result.failures.values()]
            return Poll(WorkerStatus.EXITED, tuple(failed + [0] * (n - len(failed))), dict(result.failures), result)
        return Poll(WorkerStatus.UNKNOWN, result=result)

    def worker_pids(self) -> dict[int, int]:
        """Local rank -> pid of the running workers."""
        return {w.local_rank: int(w.id) for w in self.group.workers if w.id is not None}

    def stop_workers(self) -> None:
        self._agent._stop_workers(self.group)

    def terminate_workers(self, grace_s: float) -> None:
        """SIGTERM every worker, SIGKILL after ``grace_s``."""
        pc = self._agent._pcontext
        if pc is not None:
            pc.close(signal.SIGTERM, max(1, int(round(grace_s))))

    def exit_barrier(self) -> ExitOutcome | None:
        """This node's workers finished: wait until every other member still in the round finished or left
        it, or the round is over, within ``workers.exit_barrier_timeout_s``
        (:func:`~trainguard.agent.exitbarrier.wait_for_members`; torch's own barrier waits for every
        member, also one that left). A handler without shared state (static): torch's barrier."""
        holder = getattr(self.handler, "_state_holder", None)
        if (holder is None and not self.keyed) or self._joined is None:
            self._agent._exit_barrier()
            return None
        round_, members = self._joined
        me = self.node_id
        store = _LockedStore(self.round_store(round_), self._lock())
        self._agent._in_exit_barrier = True  # torch's health check reads it: the agent is alive, not stuck
        try:
            out = wait_for_members(
                me, round_, members, mark_finished=lambda: store.set(FINISHED_KEY + me, b"1"), read=self._round_view,
                finished=lambda nodes: frozenset(n for n in nodes if store.check([FINISHED_KEY + n])),
                timeout_s=float(self._agent._exit_barrier_timeout), unreachable_limit_s=self._keep_alive_window_s(),
                hosts_store=self.hosts_store())
            self._left = frozenset(out.left)
            return out
        finally:
            self._agent._in_exit_barrier = False

    def _lock(self) -> Any:
        """The lock the handler's client is used under: torch's keep-alive thread shares it; the keyed handler's
        client is the supervisor thread's alone (its heartbeat thread has a client of its own)."""
        return contextlib.nullcontext() if self.keyed else self.handler._heartbeat_lock

    def _round_view(self) -> RoundView:
        """Sync and read the shared rendezvous state (sanitized: expired keep-alives are gone). Keyed: the
        handler's read (:meth:`~trainguard.agent.keyed_rendezvous.KeyedRendezvousHandler.round_view`)."""
        if self.keyed:
            return self.handler.round_view()  # type: ignore[attr-defined]
        holder = self.handler._state_holder
        with self.handler._heartbeat_lock:
            holder.sync()
            st = holder.state
            return RoundView(round=st.round, closed=bool(st.closed),
                             participants=frozenset(str(n) for n in st.participants),
                             known=frozenset(str(n) for n in st.last_heartbeats))

    def _keep_alive_window_s(self) -> float:
        if self.keyed:
            return float(self.handler.keep_alive_window_s)  # type: ignore[attr-defined]
        settings = self.handler._settings
        return settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt

    def hosts_store(self) -> bool:
        """Whether this agent's process hosts the c10d rendezvous store (listens on its port). The port is
        the handler client's (the endpoint store may be a bounded wrapper: :meth:`bound_store_calls`)."""
        if self.endpoint_store() is None:
            return False
        port = int(getattr(getattr(self.handler, "_store", None), "port", 0) or 0)
        return bool(port) and listens_here(port)

    @property
    def remaining_restarts(self) -> int:
        return self._agent._remaining_restarts

    def consume_restart(self) -> int:
        """Count one restart against ``max_restarts``; returns what is left."""
        self._agent._remaining_restarts -= 1
        return self._agent._remaining_restarts

    # -- rendezvous --------------------------------------------------------------------------------
    def bound_store_calls(self, keep_alive_interval_s: float, keep_alive_max_attempts: int) -> bool:
        """c10d: every rendezvous-store call of this agent gives up after interval x attempts (issue 37,
        :mod:`trainguard.agent.storecall`): the backend's state calls on a connection of their own that
        reconnects, the supervisor's and the hang watch's calls through a :class:`~trainguard.agent.storecall.ClientGuard`
        that renews the client after a call gave up. False (nothing changed) for other backends."""
        handler = self.handler
        holder = getattr(handler, "_state_holder", None)
        backend = getattr(holder, "_backend", None)
        old = getattr(handler, "_store", None)
        host, port = getattr(old, "host", ""), int(getattr(old, "port", 0) or 0)
        if type(backend) is not C10dRendezvousBackend or not host or not port:
            return False
        self._bound_s = bound = storecall.call_bound_s(keep_alive_interval_s, keep_alive_max_attempts)
        self._endpoint = (host, port)
        self._retired: list[Any] = []  # replaced clients; the first may be the store server this agent hosts
        self._guard = storecall.ClientGuard(lambda: handler._store, self._renew_handler_client, bound_s=bound,
                                            interval_s=keep_alive_interval_s, name="handler")
        # The first connection may take as long as torch's own (its backend's read_timeout, 60 s): the handler
        # reached the store a moment ago, and a busy store must not end the agent at its start (a 3 s connect
        # did, at load 15: DistNetworkError out of Supervisor.start). Then each call is bounded.
        client = dist.TCPStore(host, port, is_master=False, multi_tenant=True,
                               timeout=timedelta(seconds=max(bound, FIRST_CONNECT_S)))
        client.set_timeout(timedelta(seconds=bound))
        with handler._heartbeat_lock:
            holder._backend = storecall.BoundedC10dBackend(
                client, handler._settings.run_id, host=host, port=port, bound_s=bound,
                interval_s=keep_alive_interval_s, on_reconnected=self._renew_handler_client)
        return True

    def _connect(self, timeout: timedelta) -> Any:
        """A new client to the c10d endpoint, the connect bounded (its own timeout does not bound it)."""
        host, port = self._endpoint
        bound = self._bound_s
        new = storecall.call_with_deadline(lambda: dist.TCPStore(
            host, port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=bound)), bound, "connect")
        new.set_timeout(timeout)
        return new

    def _renew_handler_client(self) -> None:
        """Replace the handler's client (torch's rank assignment, the round store) with a new connection."""
        self._reconnects += 1  # (the store may have restarted: what this node wrote there may be gone)
        handler = self.handler
        new = self._connect(getattr(handler._store, "timeout", None) or timedelta(seconds=60))
        self._retired.append(handler._store)
        del self._retired[1:-4]
        handler._store = new
        if self.group.store is not None:
            self.group.store = dist.PrefixStore(f"torch.rendezvous.{handler._settings.run_id}.{self._store_round}", new)

    def reconnect_store(self) -> bool:
        """Reconnect to a c10d rendezvous store that restarted (``trainguard store`` under systemd).

        A ``TCPStore`` client never reconnects by itself: every call after the server restarted fails
        with a broken pipe, so without this the agent could neither see a joiner nor re-form. A new
        client to the same endpoint replaces the handler's; the restarted store is empty, so this node
        publishes its last view of the rendezvous state there unless a peer did first (the write is a
        compare-and-set against the empty key: one copy wins, the others read it). The current round's
        store (worker-API mark, drain keys) is rebuilt on the new client; keys written under it before
        the restart are gone. Returns False (nothing changed) for other backends, or while the endpoint
        does not answer yet. (A store hosted by an agent dies with that agent: nothing to reconnect to.)
        Keyed: the handler reconnects, writes its heartbeat and republishes its round
        (:meth:`~trainguard.agent.keyed_rendezvous.KeyedRendezvousHandler.reconnect`); etcd keeps its keys."""
        handler = self.handler
        if self.keyed:  # new connections, its heartbeat, its round republished (create-once: the first member wins)
            if not handler.reconnect():  # type: ignore[attr-defined]
                return False
            if self.group.store is not None:
                self.group.store = handler.round_store(self.round)  # type: ignore[attr-defined]
            return True
        holder = getattr(handler, "_state_holder", None)
        backend = getattr(holder, "_backend", None)
        if not isinstance(backend, C10dRendezvousBackend) or getattr(handler, "_store", None) is None:
            return False
        old = handler._store
        host = getattr(old, "host", "")
        port = int(getattr(old, "port", 0) or 0)
        if not host or not port:
            return False
        timeout = getattr(old, "timeout", None) or timedelta(seconds=60)
        run_id = handler._settings.run_id
        try:
            if isinstance(backend, storecall.BoundedC10dBackend):  # keep the bound on the new connection
                new = self._connect(timeout)
                fresh: C10dRendezvousBackend = storecall.call_with_deadline(lambda: storecall.BoundedC10dBackend(
                    new, run_id, host=host, port=port, bound_s=backend.bound_s, interval_s=backend.interval_s,
                    on_reconnected=backend.on_reconnected), backend.bound_s, "connect")
            else:
                new = dist.TCPStore(host, port, is_master=False, multi_tenant=True, timeout=min(timeout, timedelta(seconds=5)))
                new.set_timeout(timeout)
                fresh = C10dRendezvousBackend(new, run_id)
        except Exception:  # noqa: BLE001 - not back yet: the caller tries again later
            return False
        with handler._heartbeat_lock:  # the keep-alive timer thread syncs the same holder
            # Every node's heartbeat is as stale as the outage is long (none could write): refresh them
            # all, or the first sync would drop the whole round as dead. A node that died meanwhile
            # sends no more keep-alives and is dropped after the usual keep-alive timeout.
            state = copy.deepcopy(holder.state)
            now = datetime.now(timezone.utc)
            for node in state.last_heartbeats:
                state.last_heartbeats[node] = now
            result = fresh.set_state(pickle.dumps(state), None)
            if result and result[2]:
                holder._state = state
            holder._backend = fresh
            holder._token = result[1] if result else None
            holder._dirty = False
            holder._last_sync_time = -1.0
            handler._store = new
            holder.sync()
        if self.group.store is not None:  # the running world's round store, as _next_rendezvous built it
            self.group.store = dist.PrefixStore(f"torch.rendezvous.{run_id}.{self.round}", new)
        self._reconnects += 1
        log.warning("rendezvous_store_reconnected", endpoint=f"{host}:{port}", round=self.round,
                    published=bool(result and result[2]),
                    effect="this node's view of the round was republished to the restarted store" if result and result[2]
                    else "a peer republished the round first")
        return True

    @property
    def store(self) -> Any:
        """The current round's store (keys under the round's prefix), or None before the first round."""
        if (self._guard is not None or self.keyed) and self.group.store is not None:  # (bounded: see round_store)
            return self.round_store(self._store_round)
        return self.group.store

    @property
    def store_generation(self) -> int:
        """Counts this node's reconnections to the rendezvous store (its own and, keyed, its handler's restores):
        keys it wrote before one (a restarted store holds none) are written again (the worker-API mark)."""
        return self._reconnects + (self.handler.restores if self.keyed else 0)  # type: ignore[attr-defined]

    @property
    def round(self) -> int:
        """The rendezvous round this node last joined; -1 if unknown."""
        if self.keyed:
            return int(self.handler.round)  # type: ignore[attr-defined]
        state = getattr(getattr(self.handler, "_state_holder", None), "state", None)
        return int(getattr(state, "round", -1))

    @property
    def node_id(self) -> str:
        """This node's identity in the rendezvous (``addr_pid_localid``)."""
        if self.keyed:
            return str(self.handler.node)  # type: ignore[attr-defined]
        return str(getattr(self.handler, "_this_node", ""))

    def members(self) -> list[str]:
        """The node ids of the current round's participants, by group rank (from the last sync)."""
        if self.keyed:
            return self.handler.members()  # type: ignore[attr-defined]
        state = getattr(getattr(self.handler, "_state_holder", None), "state", None)
        parts = getattr(state, "participants", {}) or {}
        return [str(n) for n, _ in sorted(parts.items(), key=lambda kv: kv[1])]

    def nodes_waiting(self) -> int:
        return self.handler.num_nodes_waiting()

    def leave(self, timeout_s: float, rejoin: bool = False) -> bool:
        """Leave the participant set without closing the rendezvous; whether it was done.

        When the last participant of a completed round has left, the round advances and the
        survivors, already waiting in their own join, form the next one at once. ``rejoin``: this node
        comes back (warm) and says so in the store first, so that an agent hosting the store does not
        take it away meanwhile should the job end (:data:`~trainguard.agent.exitbarrier.REJOINING_KEY`).
        """
        if self.keyed:  # one announcement and a dead heartbeat
            if rejoin or self._rejoin_marked:
                self._mark_rejoining(rejoin)
            started = time.monotonic()
            self.handler.leave()  # type: ignore[attr-defined]
            log.info("rendezvous_left", seconds=round(time.monotonic() - started, 3))
            return True
        executor = getattr(self.handler, "_op_executor", None)
        if executor is None:  # static rendezvous: nothing to leave
            return False
        if rejoin or self._rejoin_marked:  # a node that leaves for good takes an earlier mark down
            self._mark_rejoining(rejoin)
        stop = getattr(self.handler, "_stop_heartbeats", None)
        if stop is not None:
            stop()
        started = time.monotonic()
        executor.run(_RendezvousExitOp(), time.monotonic() + timeout_s)
        log.info("rendezvous_left", seconds=round(time.monotonic() - started, 3))
        return True

    def close(self) -> LingerOutcome | None:
        """Close the rendezvous for every node (the job as a whole is over), and say this node needs the
        store no more (:data:`~trainguard.agent.exitbarrier.EXITED_KEY`). An agent that hosts the c10d
        store then lingers until the other nodes the rendezvous knows, and the members its exit barrier
        saw leave, have exited too (they learn from the store that the job is over:
        :func:`~trainguard.agent.exitbarrier.wait_for_exits`), within ``workers.exit_barrier_timeout_s``."""
        self.handler.shutdown()
        if (getattr(self.handler, "_state_holder", None) is None and not self.keyed) \
                or getattr(self.handler, "_store", None) is None:
            return None
        me = self.node_id
        store = self._exit_store()
        try:
            store.set(EXITED_KEY + me, b"1")
        except Exception as e:  # noqa: BLE001 - the store may be gone; this node's keep-alive stopped anyway
            log.info("exit_mark_failed", error=f"{type(e).__name__}: {e}"[:200])
        if not self.hosts_store():
            return None
        return wait_for_exits(me, read=self._round_view,
                              exited=lambda nodes: frozenset(n for n in nodes if store.check([EXITED_KEY + n])),
                              rejoining=lambda nodes: frozenset(n for n in nodes if store.check([REJOINING_KEY + n])
                                                                and store.get(REJOINING_KEY + n) == b"1"),
                              timeout_s=float(self._agent._exit_barrier_timeout),
                              unreachable_limit_s=self._keep_alive_window_s(), left=self._left)

    def _mark_rejoining(self, on: bool) -> None:
        """Up (``b"1"``) while this node is out of the rendezvous state between leaving to rejoin and its
        next round; down (``b"0"``) once it is back, or leaves for good. Best effort."""
        try:
            self._exit_store().set(REJOINING_KEY + self.node_id, b"1" if on else b"0")
        except Exception as e:  # noqa: BLE001 - the leave or the join that follows says whether the store answers
            log.info("rejoin_mark_failed", error=f"{type(e).__name__}: {e}"[:200])
        self._rejoin_marked = on

    def _exit_store(self) -> _LockedStore:
        """The job's store for the end of the job (exited and rejoining marks), not tied to a round."""
        return _LockedStore(dist.PrefixStore(f"trainguard.exit.{self.handler.get_run_id()}", self.handler._store),
                            self._lock())


__all__ = ["POLL_INTERVAL_S", "RendezvousClosedError", "evict_nodes", "ElasticAdapter", "Peek", "Plan", "Poll", "RendezvousAborted",
           "World", "fresh_reads", "next_round",
           "planned_complete"]
