"""The per-node supervisor: torch.distributed.elastic embedded in-process, driven by our own loop.

The loop runs on a dedicated thread ("supervisor") inside elastic's agent (see
:class:`~trainguard.agent.elastic.ElasticAdapter`, the only code touching elastic's internals). Each
tick it :meth:`~Supervisor.observe` s the workers and the node, asks the pure
:func:`trainguard.agent.decisions.decide` what to do, and :meth:`~Supervisor.execute` s it:

* a worker exit with the resize code (:data:`trainguard.contract.protocol.EXIT_RESIZE`) re-forms the
  world without consuming ``max_restarts``; a crash consumes one, after an exponential backoff;
* a node with a notice asks its API workers to checkpoint and exit (or SIGTERMs plain scripts with the
  configured grace), then *leaves* the rendezvous without closing it; a notice that arrives while the
  node waits in a rendezvous makes it leave at once (the join is interruptible);
* a node waiting to join makes API workers take a resize checkpoint before the world re-forms;
* an early warning makes API workers take one out-of-cycle checkpoint (the node stays);
* in-place re-formation (``workers.reform: in-process``, worker-API scripts): the workers that survive
  a membership change park alive; once all local workers are parked the agent re-forms the rendezvous
  (completing the round as soon as the planned membership has joined) and hands each its new rank
  over the control socket. A node that joins a running world first starts its workers in standby
  (they warm up: start, imports, model build) and only then enters the rendezvous, so the world pauses
  for it only once it is ready. Anything that fails there falls back to restarting the world;
* a member of the current world that vanishes while our workers run on (keep-alive expired, our
  workers not parked after a grace period) restarts the world: workers blocked in a collective or in
  their start-up with the lost node would otherwise wait for a process-group timeout.

Notices reach :meth:`Supervisor.request_drain` / :meth:`Supervisor.request_checkpoint` from the drain
coordinator (:mod:`trainguard.agent.drain`); the loop is the only code that moves the state machine.
Workers are started from the long-lived supervisor thread, which their parent-death signal
(:mod:`trainguard.runtime.shim`) is bound to; elastic installs SIGTERM/SIGINT handlers only from the
main thread, and ours must win (SIGTERM is a drain, not an abort).

Torch 2.13 pitfalls handled here (see docs/rendezvous.md):

* TCPStore sharing between agent and workers is disabled (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
  Root cause of the restart failures with sharing on: ``DynamicRendezvousHandler`` caches the
  bootstrap store address per handler and rebuilds it only on a rank 0 that has no server yet. After
  a membership change, non-zero ranks keep the address of a server that left with its node
  (``Gloo connectFullMesh ... Connection refused``); a long-lived rank 0 never republishes
  ``MASTER_ADDR``/``MASTER_PORT`` under the new round's key prefix, so a joining node waits for it
  forever (``DistStoreError: wait timeout``); and the workers' key prefix there includes each agent's
  own restart count, which differs between nodes after a scale-up. With sharing off, rank 0 picks a
  fresh port every round and the workers build their own store.
* The store of the c10d backend lives in the agent that hosts it; spot clusters run ``trainguard
  store`` elsewhere (``is_host: false``) or use an etcd backend.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

from trainguard.agent import rendezvous as rdzv
from trainguard.agent import exitcodes, torchlogs, workerenv
from trainguard.agent.census import STATUS_READERS, check_census, job_view, node_status, read_view, share_interval, share_status
from trainguard.agent.census import record as census_record
from trainguard.agent.config import TrainguardConfig
from trainguard.agent.configload import redacted
from trainguard.agent.control import ControlServer
from trainguard.agent.decisions import Act, Asked, Decision, Observation, park_reason
from trainguard.agent.elastic import ElasticAdapter, Poll, RendezvousClosedError, World
from trainguard.agent.exitcodes import ExitCode, exit_code
from trainguard.agent.hangwatch import HangWatch
from trainguard.agent.memtier import NodeSnapshots
from trainguard.agent.states import StateMachine
from trainguard.agent.stragglermon import StragglerMonitor
from trainguard.agent.supervisor_control import ControlOps
from trainguard.agent.supervisor_hangs import HangActions
from trainguard.agent.supervisor_join import WORKER_API_KEY, Joining
from trainguard.agent.supervisor_signals import DRAIN_KEY, LEAVING_KEY, RoundSignals
from trainguard.agent.supervisor_worlds import Worlds
from trainguard.contract import protocol as proto
from trainguard.contract.log import get_logger, rendered_format
from trainguard.contract.protocol import AgentState, WorkerStatus

log = get_logger("trainguard.agent.supervisor")
MEMBER_LOST_GRACE_S = 3.0
"""How long workers may run on after a member of their world is gone before the world restarts (API
workers usually notice first, in their next collective, and park)."""

# Set once, deliberately, for the whole agent process: see the module docstring.
os.environ.update(workerenv.AGENT_ENV)  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1


@dataclasses.dataclass(slots=True)
class DrainRequest:
    source: str
    kind: str
    deadline: float
    """Absolute wall-clock time (epoch seconds) by which this node must be gone."""
    reason: str = ""
    received_at: float = dataclasses.field(default_factory=time.time)


class Supervisor(ControlOps, RoundSignals, HangActions, Joining, Worlds):
    """Owns one node's supervision: config, control socket, state machine, the elastic agent thread."""

    def __init__(self, cfg: TrainguardConfig, *, listeners: list[Any] | None = None, handler: Any = None,
                 observer: Any = None,
                 adapter: Callable[[WorkerSpec, DefaultLogsSpecs, Supervisor], Any] | None = None) -> None:
        self.cfg = cfg
        # Metrics observe the supervisor and never steer it (AgentMetrics or None); see _observe().
        self.observer = observer
        self.on_emergency_commit: Callable[[], None] | None = None
        """Called (control thread) once a worker reports the emergency checkpoint committed."""
        self.on_manual_drain: Callable[[float | None, str], Any] | None = None
        """``trainguard drain`` -> the drain coordinator (the daemon wires the manual watcher here);
        None: the request drains directly."""
        self.on_start_waits: Callable[[], None] | None = None
        """Called once (supervisor thread) when this node's start first waits on others: in its first
        rendezvous, or, joining a running world, once its standby workers are spawned. Informing start-up
        work (the daemon's foreign-runs scan) runs from here, off the path to the node's first world."""
        self.sm = StateMachine(listeners)
        self._drain: DrainRequest | None = None
        self._checkpoint_reason: str | None = None
        self._emergency_committed = False
        self._emergency_error = ""
        self._emergency_step: int | None = None
        """The step of this node's committed emergency checkpoint (``trainguard drain --wait`` says it)."""
        """Why this node's emergency checkpoint failed (a worker's report, or the deadline passing
        first); non-empty makes the agent exit with :attr:`ExitCode.WORK_LOST`."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._outcome: AgentState | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._world: dict[str, Any] = {}
        self._waiting_for: str | None = None
        """What a starting agent waits for (``status`` says it)."""
        self._asked = Asked.NOTHING
        self._drain_published: int | None = None
        """The round this node published its leave in (the record is per round)."""
        self._asked_at = 0.0
        self._failures_in_a_row = 0
        self._parked: dict[int, proto.Parked] = {}
        self._current: World | None = None
        self._interval_shared_at = 0.0  # monotonic s of the next share_interval
        self._standby_start = False
        self._marked_api: tuple[int, int] | None = None  # (round, store generation) the worker-API mark was written for
        self._store_down_since: float | None = None
        self._store_failures = 0
        self._reconnect_at = 0.0
        self._member_check_at = 0.0
        self._member_lost_since: float | None = None
        self._joining: set[int] = set()
        """Local ranks sent a new world (:class:`~trainguard.contract.protocol.Reform`) that have not said
        :class:`~trainguard.contract.protocol.Joined` yet: between worlds, never inside a collective."""
        self._joining_since = 0.0
        self.reform_enabled = cfg.workers.reform == "in-process"
        self.straggler = (StragglerMonitor(cfg.straggler, job_id=cfg.agent.job_id, node=cfg.agent.node_name,
                                           min_nodes=cfg.rendezvous.min_nodes, interval_s=cfg.rendezvous.keep_alive_interval_s,
                                           request_drain=lambda why: self.drain_self("straggler", why),
                                           observer=observer) if cfg.straggler.enabled else None)
        """Straggler detection (:mod:`trainguard.agent.stragglermon`): fed by the workers' Pace reports."""
        self._run_started = time.monotonic()
        self.hangs: HangWatch | None = HangWatch(cfg.hang, node_name=cfg.agent.node_name) if cfg.hang.enabled else None
        """Hang detection (progress, not liveness): see :mod:`trainguard.agent.hangwatch`."""
        self._frozen_evicts: set[str] = set()
        """Nodes this agent already counted as evicted for being frozen (their removal is no second count)."""
        os.makedirs(cfg.agent.state_dir, mode=0o700, exist_ok=True)
        self.control_path = proto.control_socket_path(cfg.agent.state_dir, cfg.agent.job_id)
        # The control socket first: `trainguard status` / `drain` find an agent that still waits for its store.
        self.control = ControlServer(self.control_path, self._on_control)
        try:  # the previous agent's outcome (this socket is ours now)
            os.remove(exitcodes.record_path(self.control_path))
        except OSError:
            pass
        try:
            if handler is None and rdzv.store_to_reach(cfg.rendezvous) is not None:
                self._waiting_for = f"the rendezvous store at {cfg.rendezvous.endpoint}"
                rdzv.wait_for_store(cfg.rendezvous)
            self._waiting_for = None
            self.handler = handler if handler is not None else rdzv.build_handler(cfg.rendezvous, cfg.agent.job_id)
        except BaseException:
            self.control.close()
            raise
        # Tier 0: the agent owns its workers' snapshot memory (it outlives a worker); removed in _finish.
        self.snapshots = NodeSnapshots(cfg.checkpoint, cfg.agent.job_id, cfg.agent.node_name)
        self.memory_dir = self.snapshots.open()
        entrypoint, args = workerenv.worker_command(cfg.workers)
        spec = WorkerSpec(
            role=workerenv.ROLE,
            local_world_size=cfg.workers.nproc_per_node,
            rdzv_handler=self.handler,
            entrypoint=entrypoint,
            args=args,
            max_restarts=cfg.workers.max_restarts,
            monitor_interval=cfg.workers.monitor_interval_s,
            local_addr=cfg.rendezvous.local_addr or None,
        )
        log_dir = os.path.join(cfg.agent.log_dir, cfg.agent.job_id)
        os.makedirs(log_dir, exist_ok=True)
        logs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL, tee=Std.ALL if cfg.workers.tee else Std.NONE)
        if adapter is not None:
            self.adapter = adapter(spec, logs, self)
        else:
            self.adapter = ElasticAdapter(spec, logs, exit_barrier_timeout=cfg.workers.exit_barrier_timeout_s,
                                          worker_env=self.worker_env, abort_rendezvous=lambda: self._drain is not None)
            self.adapter.bound_store_calls(cfg.rendezvous.keep_alive_interval_s, cfg.rendezvous.keep_alive_max_attempts)

    # ---- inputs from other threads ------------------------------------------------------------
    def request_drain(self, source: str, kind: str, deadline: float, reason: str = "") -> bool:
        """A notice: this node must leave by ``deadline`` (epoch s). Idempotent; earliest deadline wins."""
        with self._lock:
            first = self._drain is None
            if first or deadline < self._drain.deadline:  # type: ignore[union-attr]
                self._drain = DrainRequest(source, kind, deadline, reason)
        if first:
            # Only the supervisor thread moves the state machine; it sees the request at its next tick.
            log.warning("drain_started", source=source, kind=kind, reason=reason,
                        deadline_in_s=round(deadline - time.time(), 1), node=self.cfg.agent.node_name)
        self._wake.set()
        return first

    def drain_self(self, source: str, reason: str) -> bool:
        """This node leaves the job by its own finding (``straggler`` eviction, ``health``): a planned
        drain with ``preemption.default_deadline_s``."""
        return self.request_drain(source, "drain", time.time() + self.cfg.preemption.default_deadline_s, reason)

    def checkpoint_supported(self) -> bool:
        """Whether a worker of this node uses the worker API (it can take an out-of-cycle checkpoint)."""
        return bool(self.control.api_workers())

    def request_checkpoint(self, reason: str) -> bool:
        """An early warning: one out-of-cycle checkpoint, the node stays. False while draining."""
        with self._lock:
            if self._drain is not None:
                return False
            self._checkpoint_reason = reason
        self._wake.set()
        return True

    @property
    def drain(self) -> DrainRequest | None:
        return self._drain

    def _observe(self, method: str, *args: Any) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, method)(*args)
        except Exception as e:  # an observer failure must never break supervision
            log.warning("observer_failed", method=method, error=str(e))

    def _resize_bound_s(self) -> float:
        """How long workers asked to resize may take: finish a step and save (each bounded by the
        process groups' timeout; the save's storage calls by ``checkpoint.retry_deadline_s``)."""
        return 2 * self.cfg.workers.pg_timeout_s + self.cfg.checkpoint.retry_deadline_s

    # ---- worker environment -------------------------------------------------------------------
    def worker_env(self) -> dict[str, str]:
        """Variables every worker gets besides torchrun's (:class:`~trainguard.contract.protocol.RuntimeEnv`)."""
        cfg = self.cfg
        env = proto.RuntimeEnv(
            job_id=cfg.agent.job_id, node=cfg.agent.node_name, agent_pid=os.getpid(),
            control_path=self.control_path, round=self.adapter.round,
            checkpoint=dataclasses.asdict(cfg.checkpoint), reform=self.reform_enabled,
            reform_timeout_s=cfg.workers.reform_timeout_s, standby=self._standby_start,
            pg_timeout_s=cfg.workers.pg_timeout_s, memory_dir=self.memory_dir,
            step_agreement=cfg.workers.step_agreement, step_agreement_period_s=cfg.workers.step_agreement_period_s,
            progress_interval_s=cfg.hang.heartbeat_interval_s if self.hangs is not None else 0.0,
            log_format=workerenv.worker_log_format(cfg.workers, cfg.agent.log_format, rendered_format()),
        ).to_env()
        env.update(workerenv.worker_defaults(cfg.workers, os.environ))
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        if self.observer is not None:
            env.update(self.observer.worker_env())
        env.update({k: str(v) for k, v in cfg.workers.env.items()})
        return env

    # ---- rendezvous-store records -------------------------------------------------------------
    def _member_lost(self, healthy: bool) -> bool:
        """A member of the current world is gone (checked every keep-alive interval) for longer than
        :data:`MEMBER_LOST_GRACE_S` while our workers run on (not while they are between worlds). This
        node counts too, in a world of one as in a larger one: a node whose keep-alive lapsed (a loaded or
        paused agent) was removed from its round and may already be replaced by a newer one; training on
        alone would split the job in two."""
        world = self._current
        now = time.monotonic()
        if world is None or not healthy or self._parked or not world.members:
            self._member_lost_since = None
            return False
        if now >= self._member_check_at:
            self._member_check_at = now + self.cfg.rendezvous.keep_alive_interval_s
            peek = None
            try:
                peek = self.adapter.peek()
                gone = peek.round != world.round or not set(world.members) <= set(peek.participants)
                self._store_ok()
            except Exception as e:
                self._store_failed("peek", e)
                gone = False
            if gone and self._member_lost_since is None and peek is not None:
                self._member_lost_since = now
                log.warning("member_lost", round=world.round, members=list(world.members),
                            seen_round=peek.round, missing=sorted(set(world.members) - set(peek.participants)),
                            grace_s=MEMBER_LOST_GRACE_S)
            elif not gone:
                self._member_lost_since = None
        if self._member_lost_since is None or now - self._member_lost_since <= MEMBER_LOST_GRACE_S:
            return False
        # Workers between worlds (finishing the old world's save, or in the new one's arrival count)
        # answer the call-off (member_gone -> ask_resize) once that save is done: killing them would
        # throw their state away. Bounded by the save's own storage deadline.
        return not (self._joining and now - self._joining_since < self.cfg.checkpoint.retry_deadline_s)

    def _on_world(self, world: World) -> None:
        self._current = world
        self._member_lost_since = None
        self._world = {"round": world.round, "group_rank": world.group_rank, "nodes": world.nodes,
                       "world_size": world.world_size,
                       "first_rank": world.global_ranks[0] if world.global_ranks else None}
        log.info("rendezvous_complete", node=self.cfg.agent.node_name, **world.log_fields())
        self._observe("set_world", world.world_size, world.nodes, world.round)
        rc = self.cfg.rendezvous  # a node alone in a job others on its store expect bigger: a mistyped job id?
        check_census(self.adapter.endpoint_store(), census_record(self.cfg.agent.job_id, rc.min_nodes, rc.max_nodes,
                                                                  world.nodes, self.cfg.agent.node_name,
                                                                  str(self.cfg.checkpoint.interval or ""),
                                                                  self.cfg.workers.nproc_per_node))
        self._interval_shared_at = 0.0
        if self.hangs is not None:
            try:
                self.hangs.start_world(self.adapter.side_store(world.round), self.adapter.node_id, world.members)
            except Exception as e:  # noqa: BLE001 - a static handler, a fake adapter: no hang detection
                log.info("hang_watch_unavailable", error=f"{type(e).__name__}: {e}"[:200])

    def _share_interval(self) -> None:
        """Every keep-alive interval: the job's effective checkpoint interval on every node, and the
        job-wide status (see :mod:`trainguard.agent.census`)."""
        now = time.monotonic()
        if self.observer is None or self._current is None or now < self._interval_shared_at:
            return
        self._interval_shared_at = now + self.cfg.rendezvous.keep_alive_interval_s
        store, world, job, node = self.adapter.endpoint_store(), self._current, self.cfg.agent.job_id, self.cfg.agent.node_name
        share_interval(store, job, node, decides=0 in world.global_ranks, metrics=self.observer)
        try:  # the job-wide picture `trainguard status` shows from any node
            me = node_status(node, world.group_rank, tuple(world.global_ranks), self.observer.view(),
                             self.observer.started_unix_s)
        except Exception as e:  # noqa: BLE001 - observing only
            log.info("census_unavailable", error=f"{type(e).__name__}: {e}"[:300])
            return
        reads_all = world.group_rank < STATUS_READERS  # O(N) for the job: the others read the view on demand
        records = share_status(store, job, me, reads_all=reads_all)
        if reads_all and records:
            self.control.status_extra["job"] = job_view(records)
        elif records:
            self.control.status_extra["job"] = lambda: read_view(store, job)

    def _workers_gone(self) -> None:
        for pid in self.adapter.worker_pids().values():
            self._observe("mark_worker_dead", pid)

    # ---- the loop (runs in the supervisor thread) ---------------------------------------------
    def observe(self) -> tuple[Observation, Poll]:
        """One look at the workers and this node (no side effects on the job)."""
        # Asked to stop (drain or resize), the first worker to exit makes elastic end its siblings: planned.
        with torchlogs.expected_stop(self._asked is not Asked.NOTHING):
            poll = self.adapter.poll()
        drain = self._drain
        if drain is not None and self.sm.state != AgentState.DRAINING:
            self.sm.to(AgentState.DRAINING, source=drain.source, kind=drain.kind)
        healthy = poll.status is WorkerStatus.HEALTHY
        with self._lock:
            parked = dict(self._parked)
        if healthy:
            self._mark_worker_api()
        waiting = 0
        if healthy and drain is None:
            try:
                waiting = self.adapter.nodes_waiting()
                self._store_ok()
            except Exception as e:
                self._store_failed("nodes_waiting", e)
        member_lost = self._member_lost(healthy) if drain is None else False
        obs = Observation(
            workers=poll.status,
            exit_codes=poll.exit_codes,
            remaining_restarts=self.adapter.remaining_restarts,
            nodes_waiting=waiting,
            draining=drain is not None,
            drain_deadline_passed=drain is not None and time.time() >= drain.deadline,
            asked=self._asked,
            api_workers=bool(self.control.api_workers()),
            peer_draining=(not healthy or member_lost) and self._peer_draining(),
            checkpoint_requested=self._checkpoint_reason is not None,
            nproc=self.cfg.workers.nproc_per_node,
            parked=len(parked) if healthy else 0,
            park_reason=park_reason(p.reason for p in parked.values()),
            member_lost=member_lost,
            member_gone=drain is None and self._member_lost_since is not None,
            reform_in_place=self.reform_enabled,
            world_nodes=self._current.nodes if self._current is not None else 1,
            resize_overdue=self._asked is Asked.RESIZE and time.monotonic() - self._asked_at > self._resize_bound_s(),
            emergency_committed=self._emergency_committed,
        )
        return obs, poll

    def execute(self, d: Decision, obs: Observation, poll: Poll) -> RunResult | None:
        """Carry out one decision; returns elastic's result when the loop ends."""
        log.info("decision", act=d.act.value, reason=d.reason, exit_codes=list(obs.exit_codes),
                 remaining_restarts=obs.remaining_restarts, nodes_waiting=obs.nodes_waiting)
        drain = self._drain
        if d.act is Act.ASK_DRAIN:
            assert drain is not None
            self._publish_drain()
            n = self.control.broadcast(proto.Stop(proto.StopReason.DRAIN, drain.deadline, drain.reason or drain.kind))
            log.info("drain_requested_from_workers", workers=n, deadline_in_s=round(drain.deadline - time.time(), 1))
            self._asked = Asked.DRAIN
        elif d.act is Act.ASK_RESIZE:
            n = self.control.broadcast(proto.Stop(proto.StopReason.RESIZE, None, d.reason))
            log.info("resize_requested_from_workers", workers=n, nodes_waiting=obs.nodes_waiting,
                     bound_s=round(self._resize_bound_s(), 1))
            if d.reason == "member_lost" and self.hangs is not None and not self._joining:
                # The member is gone (its keep-alive expired) and no socket of ours reset: a frozen or
                # partitioned node. Our workers may wait in a collective with it that never fails on
                # its own; abort it, so they park alive and re-form in place instead of being restarted.
                n = self.control.broadcast(proto.Abort("a member of this world is gone (keep-alive expired)"))
                log.warning("collectives_abort_requested", workers=n, reason=d.reason,
                            effect="our workers park (peer lost) and re-form in place without the lost member")
            self._asked = Asked.RESIZE
            self._asked_at = time.monotonic()
        elif d.act is Act.CHECKPOINT:
            with self._lock:
                reason, self._checkpoint_reason = self._checkpoint_reason, None
            n = self.control.broadcast(proto.CheckpointNow(reason or d.reason))
            if n:
                log.info("checkpoint_requested_from_workers", workers=n, reason=reason)
            else:
                log.warning("checkpoint_request_not_supported", reason=reason,
                            effect="the workers do not use the worker API; the node stays in the job")
        elif d.act is Act.TERMINATE:
            self._publish_drain()
            grace = self.cfg.preemption.term_grace_s
            if drain is not None:
                grace = max(1.0, min(grace, drain.deadline - time.time()))
            # The pids SIGTERMed (torch's own per-process line is dropped on a planned stop: torchlogs).
            log.warning("workers_terminating", reason=d.reason, grace_s=round(grace, 1),
                        pids=sorted(self.adapter.worker_pids().values()))
            if self._asked is Asked.DRAIN and not self._emergency_committed and not self._emergency_error:
                self._emergency_error = "the drain deadline passed before the emergency checkpoint was committed"
            with torchlogs.expected_stop(not obs.drain_deadline_passed):  # late: the line says what was cut
                self.adapter.terminate_workers(grace)
            return self._leave(d.reason)
        elif d.act is Act.LEAVE:
            return self._leave(d.reason)
        elif d.act is Act.SUCCEED:
            self.adapter.exit_barrier()
            self._outcome = AgentState.SUCCEEDED
            self.sm.to(AgentState.SUCCEEDED)
            return poll.result if poll.result is not None else RunResult(state=WorkerState.SUCCEEDED)
        elif d.act is Act.FAIL:
            self.adapter.stop_workers()
            self._outcome = AgentState.FAILED
            self.sm.to(AgentState.FAILED, reason=d.reason, exit_codes=list(obs.exit_codes))
            return RunResult(state=WorkerState.FAILED, failures=poll.failures)
        elif d.act is Act.RESTART:
            return self._restart(d, obs)
        elif d.act is Act.REFORM:
            return self._reform(d.reason)
        return None

    def _loop(self) -> RunResult:
        try:
            return self._run_loop()
        except RendezvousClosedError:
            return self._not_needed()

    def _leave(self, reason: str) -> RunResult:
        if self.sm.state != AgentState.DRAINING:
            self.sm.to(AgentState.DRAINING, reason=reason)
        # Leave first: the survivors re-form as soon as this node is out of the round, and our
        # workers have committed (or are being terminated) already.
        if self._drain is not None:  # a planned leave (also one before the world's first step): say so
            self._publish_drain()
        try:
            self.adapter.leave(timeout_s=self.cfg.rendezvous.close_timeout_s)
        except Exception as e:  # the store may be gone; leaving is best effort, stopping is not
            log.warning("rendezvous_leave_failed", error=str(e))
        with torchlogs.expected_stop():
            self.adapter.stop_workers()
        self._workers_gone()
        drain = self._drain
        self._outcome = AgentState.STOPPED
        if drain is not None:
            self._observe("drain_done", time.time() - drain.received_at)
        self.sm.to(AgentState.STOPPED, reason=reason,
                   seconds_since_notice=round(time.time() - drain.received_at, 3) if drain else None)
        # elastic's run() records one event per worker and needs a value for each global rank.
        return RunResult(state=WorkerState.SUCCEEDED, return_values={r: None for r in self.adapter.world().global_ranks})

    # ---- lifecycle (main thread) --------------------------------------------------------------
    def start(self) -> None:
        log.info("agent_starting", node=self.cfg.agent.node_name, pid=os.getpid(), config=redacted(self.cfg),
                 rendezvous_protocol=self.cfg.rendezvous.effective_protocol)

        def target() -> None:
            try:
                self.adapter.run(self._loop)
            except BaseException as e:  # surfaced to the main thread by wait()
                self._error = e
                log.error("supervisor_crashed", error=f"{type(e).__name__}: {e}")
            finally:
                self._wake.set()

        if self.hangs is not None:  # a stopped worker is acted on the moment its stop lasted hang.stopped_s
            self.hangs.watch_procs(self._wake.set)
            # peers probe this agent directly when its record is late; an unanswered probe of a peer wakes us
            self.hangs.serve_probes(self.cfg.rendezvous.local_addr or socket.getfqdn(), self._wake.set)
        self._thread = threading.Thread(target=target, name="supervisor", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the supervisor thread runs (the systemd watchdog pings only then)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def world(self) -> dict[str, Any]:
        """The current world as last formed (round, group rank, nodes, world size)."""
        return {k: v for k, v in self._world.items() if k != "first_rank"}

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the supervisor thread; returns the process exit code, or None on timeout."""
        assert self._thread is not None, "start() first"
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        return self._finish()

    def _finish(self) -> int:
        self.control.settle()  # the workers' last reports are handled before the outcome is read from them
        outcome = self._outcome
        if self._error is not None or outcome is None:
            if not self.sm.state.terminal:
                self.sm.to(AgentState.FAILED, error=repr(self._error))
            outcome = AgentState.FAILED
        if outcome in (AgentState.SUCCEEDED, AgentState.FAILED):
            # The job as a whole is over: close the rendezvous like torchrun does. A drained node
            # (STOPPED) never closes it: the survivors go on.
            try:
                self.adapter.close()
            except Exception as e:
                log.warning("rendezvous_close_failed", error=str(e))
        drain = self._drain
        code = exit_code(outcome, drain_kind=drain.kind if drain is not None else None,
                         emergency_failed=bool(self._emergency_error))
        # Before the socket goes: a `trainguard drain --wait` that sees it gone reads this.
        exitcodes.write_record(self.control_path, {
            "pid": os.getpid(), "job_id": self.cfg.agent.job_id, "node": self.cfg.agent.node_name,
            "outcome": outcome.value, "exit_code": int(code), "meaning": code.label,
            "emergency_step": self._emergency_step, "error": self._emergency_error or None, "t": time.time()})
        self.control.close()
        if self.hangs is not None:
            self.hangs.close()
        self.snapshots.remove(outcome.value)  # the job is over for this node: its snapshots with it
        fields: dict[str, Any] = {"error": self._emergency_error} if code is ExitCode.WORK_LOST else {}
        (log.error if code in (ExitCode.FAILED, ExitCode.WORK_LOST) else log.info)(
            "agent_exit", outcome=outcome.value, exit_code=int(code), meaning=code.label,
            uptime_s=round(time.monotonic() - self._run_started, 1), **fields)
        return int(code)


__all__ = ["DRAIN_KEY", "LEAVING_KEY", "MEMBER_LOST_GRACE_S", "WORKER_API_KEY", "DrainRequest", "Supervisor"]
