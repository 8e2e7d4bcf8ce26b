"""The per-node supervisor: torch.distributed.elastic embedded in-process, driven by our own loop.

:class:`TrainguardElasticAgent` is a ``LocalElasticAgent`` whose run loop (``_invoke_run``) asks the
pure :func:`trainguard.agent.decisions.decide` what to do on each observation and executes it, so:

* a worker exit with the resize code (:data:`trainguard.runtime.protocol.EXIT_RESIZE`) re-forms the world without
  consuming ``max_restarts``; a crash consumes one, after an exponential backoff;
* a node with a notice asks its API workers to checkpoint and exit (or SIGTERMs plain scripts with the
  configured grace), then *leaves* the rendezvous without closing it;
* a node waiting to join makes API workers take a resize checkpoint before the world re-forms.

The elastic loop runs in a dedicated thread ("supervisor"): elastic's process context installs
SIGTERM/SIGINT handlers only when started from the main thread, and ours must win (SIGTERM is a
drain, not an abort). Workers are started from that long-lived thread, which their parent-death
signal (:mod:`trainguard.runtime.shim`) is bound to.

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
  store`` elsewhere (``is_host: false``) or use ``etcd-v2``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

from trainguard.agent import rendezvous as rdzv
from trainguard.agent import workerenv
from trainguard.agent.config import TrainguardConfig
from trainguard.agent.configload import redacted
from trainguard.agent.control import ControlServer
from trainguard.agent.decisions import Act, Observation, decide
from trainguard.runtime.log import get_logger
from trainguard.agent.states import StateMachine
from trainguard.runtime import protocol as proto
from trainguard.runtime.protocol import AgentState, WorkerStatus

log = get_logger("trainguard.agent.supervisor")
DRAIN_KEY = "trainguard/draining"

# Set once, deliberately, for the whole agent process: see the module docstring.
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"


@dataclasses.dataclass(slots=True)
class DrainRequest:
    source: str
    kind: str
    deadline: float
    """Absolute wall-clock time (epoch seconds) by which this node must be gone."""
    reason: str = ""
    received_at: float = dataclasses.field(default_factory=time.time)


def worker_command(cfg: TrainguardConfig) -> tuple[str, tuple[str, ...]]:
    """(entrypoint, args) for elastic: the orphan-safety shim, then the user's program."""
    w = cfg.workers
    if not w.entrypoint:
        raise ValueError("workers.entrypoint is empty: set YAML key `workers.entrypoint` or env var "
                         "TRAINGUARD_WORKERS_ENTRYPOINT (or pass the script to `trainguard run`)")
    shim = ["-m", "trainguard.runtime.shim"]
    if w.no_python:
        return sys.executable, (*shim, "--no-python", "--", w.entrypoint, *w.args)
    program = ["-u", "-m", w.entrypoint] if w.module else ["-u", w.entrypoint]
    return sys.executable, (*shim, "--", *program, *w.args)


class TrainguardElasticAgent(LocalElasticAgent):
    """``LocalElasticAgent`` with trainguard's run loop and worker environment. See module docstring."""

    def __init__(self, spec: WorkerSpec, logs_specs: DefaultLogsSpecs, sup: Supervisor, exit_barrier_timeout: float) -> None:
        super().__init__(spec, logs_specs=logs_specs, start_method="spawn", exit_barrier_timeout=exit_barrier_timeout)
        self._sup = sup

    # LocalElasticAgent._start_workers hands the per-rank env dicts to this hook right before it
    # starts the processes: the one place where trainguard adds its worker variables.
    def _setup_local_watchdog(self, envs: dict[int, dict[str, str]]) -> None:  # noqa: D401 - see base class
        extra = self._sup.worker_env(self._worker_group)
        for env in envs.values():
            env.update(extra)
        super()._setup_local_watchdog(envs)

    def remaining_restarts(self) -> int:
        return self._remaining_restarts

    def terminate_workers(self, grace_s: float) -> None:
        """SIGTERM every worker, SIGKILL after ``grace_s``."""
        if self._pcontext is not None:
            self._pcontext.close(signal.SIGTERM, max(1, int(round(grace_s))))

    def _invoke_run(self, role: str = "default") -> RunResult:  # See base class.
        return self._sup._loop(self)


class Supervisor:
    """Owns one node's supervision: config, control socket, state machine, the elastic agent thread."""

    def __init__(self, cfg: TrainguardConfig, *, listeners: list[Any] | None = None, handler: Any = None,
                 observer: Any = None) -> None:
        self.cfg = cfg
        # Metrics observe the supervisor and never steer it (AgentMetrics or None); see _observe().
        self.observer = observer
        # Called (control thread) once a worker reports the emergency checkpoint committed; the daemon
        # acknowledges the notice there (Azure StartRequests lets the node go early).
        self.on_emergency_commit: Any = None
        self.sm = StateMachine(listeners)
        self._drain: DrainRequest | None = None
        self._drain_lock = threading.Lock()
        self._wake = threading.Event()
        self._outcome: AgentState | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._world: dict[str, Any] = {}
        self._run_started = time.monotonic()
        self.handler = handler if handler is not None else rdzv.build_handler(cfg.rendezvous, cfg.agent.job_id)
        os.makedirs(cfg.agent.state_dir, mode=0o700, exist_ok=True)
        self.control_path = proto.control_socket_path(cfg.agent.state_dir, cfg.agent.job_id)
        self.control = ControlServer(self.control_path, self._on_control)
        entrypoint, args = worker_command(cfg)
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
        self.agent = TrainguardElasticAgent(spec, logs, self, cfg.workers.exit_barrier_timeout_s)

    # ---- inputs from other threads ------------------------------------------------------------
    def request_drain(self, source: str, kind: str, deadline: float, reason: str = "") -> bool:
        """A notice: this node must leave by ``deadline`` (epoch s). Idempotent; earliest deadline wins."""
        with self._drain_lock:
            first = self._drain is None
            if first or deadline < self._drain.deadline:  # type: ignore[union-attr]
                self._drain = DrainRequest(source, kind, deadline, reason)
        if first:
            # Only the supervisor thread moves the state machine; it sees the request at its next tick.
            log.warning("drain_started", source=source, kind=kind, reason=reason,
                        deadline_in_s=round(deadline - time.time(), 1), node=self.cfg.agent.node_name)
        self._wake.set()
        return first

    @property
    def drain(self) -> DrainRequest | None:
        return self._drain

    def _on_control(self, msg: proto.Message) -> proto.Reply | None:
        if isinstance(msg, proto.DrainRequest):
            deadline_s = msg.deadline_s or self.cfg.preemption.default_deadline_s
            first = self.request_drain("manual", "drain", time.time() + deadline_s, msg.reason)
            if first:
                self._observe("notice", "manual")
            return proto.Reply(ok=True, data={"already_draining": not first})
        if isinstance(msg, proto.StatusRequest):
            return proto.Reply(ok=True, data=self.status())
        if isinstance(msg, proto.Committed):
            log.info("checkpoint_committed_by_worker", step=msg.step, kind=msg.kind.value, rank=msg.rank, saved=msg.saved)
            if msg.kind is proto.CheckpointKind.EMERGENCY and msg.saved and self.on_emergency_commit is not None:
                try:
                    self.on_emergency_commit()
                except Exception as e:
                    log.warning("emergency_commit_hook_failed", error=str(e))
            return None
        if isinstance(msg, proto.Hello):
            return None
        return proto.Reply(ok=False, error=f"op {msg.OP!r} is not a request to the agent")

    def status(self) -> dict[str, Any]:
        d = self._drain
        return {
            "state": self.sm.state.value,
            "node": self.cfg.agent.node_name,
            "job_id": self.cfg.agent.job_id,
            **self._world,
            "remaining_restarts": self.agent.remaining_restarts(),
            "draining": d is not None,
            "drain_deadline": d.deadline if d else None,
        }

    def _observe(self, method: str, *args: Any) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, method)(*args)
        except Exception as e:  # an observer failure must never break supervision
            log.warning("observer_failed", method=method, error=str(e))

    # ---- worker environment -------------------------------------------------------------------
    def worker_env(self, wg: WorkerGroup) -> dict[str, str]:
        """Variables every worker gets besides torchrun's (the worker runtime reads ``TRAINGUARD_RT_*``)."""
        cfg = self.cfg
        env = proto.RuntimeEnv(
            job_id=cfg.agent.job_id, node=cfg.agent.node_name, agent_pid=os.getpid(),
            control_path=self.control_path, round=rdzv.current_round(self.handler),
            checkpoint=dataclasses.asdict(cfg.checkpoint), pg_timeout_s=cfg.workers.pg_timeout_s,
        ).to_env()
        env.update(workerenv.torchrun_defaults(cfg.workers, os.environ))
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        if self.observer is not None:
            env.update(self.observer.worker_env())
        env.update({k: str(v) for k, v in cfg.workers.env.items()})
        return env

    # ---- the loop (runs in the supervisor thread) ---------------------------------------------
    def _publish_drain(self, wg: WorkerGroup) -> None:
        try:
            if wg.store is not None:
                wg.store.add(DRAIN_KEY, 1)
        except Exception as e:  # the store may be gone with its host; the drain goes on regardless
            log.warning("drain_publish_failed", error=str(e))

    def _peer_draining(self, wg: WorkerGroup) -> bool:
        try:
            return wg.store is not None and wg.store.check([DRAIN_KEY])
        except Exception:
            return False

    def _on_world(self, wg: WorkerGroup) -> None:
        self._world = {
            "round": rdzv.current_round(self.handler),
            "group_rank": wg.group_rank,
            "nodes": wg.group_world_size,
            "world_size": (wg.group_world_size or 0) * wg.spec.local_world_size,
        }
        log.info("rendezvous_complete", node=self.cfg.agent.node_name, **self._world,
                 global_ranks=[w.global_rank for w in wg.workers])
        self._observe("set_world", self._world["world_size"], self._world["nodes"], self._world["round"])

    def _workers_gone(self, wg: WorkerGroup) -> None:
        for w in wg.workers:
            if w.id is not None:
                self._observe("mark_worker_dead", int(w.id))

    def _loop(self, agent: TrainguardElasticAgent) -> RunResult:
        wg = agent.get_worker_group()
        spec = wg.spec
        asked = ""
        failures_in_a_row = 0
        self.sm.to(AgentState.RENDEZVOUS)
        if self._drain is not None:
            return self._leave(agent, wg, "drained_before_start")
        agent._initialize_workers(wg)
        self._on_world(wg)
        self.sm.to(AgentState.DRAINING if self._drain else AgentState.RUNNING)
        while True:
            self._wake.wait(spec.monitor_interval)
            self._wake.clear()
            result = agent._monitor_workers(wg)
            state = result.state
            drain = self._drain
            if drain is not None and self.sm.state != AgentState.DRAINING:
                self.sm.to(AgentState.DRAINING, source=drain.source, kind=drain.kind)
            if state == WorkerState.HEALTHY:
                obs_workers, codes = WorkerStatus.HEALTHY, ()
            elif state in (WorkerState.SUCCEEDED, WorkerState.FAILED):
                failed = [f.exitcode for f in result.failures.values()]
                codes = tuple(failed + [0] * (spec.local_world_size - len(failed)))
                obs_workers = WorkerStatus.EXITED
            else:
                obs_workers, codes = WorkerStatus.UNKNOWN, ()
            waiting = 0
            if obs_workers is WorkerStatus.HEALTHY and drain is None:
                try:
                    waiting = self.handler.num_nodes_waiting()
                except Exception as e:
                    log.warning("rendezvous_poll_failed", error=str(e))
            obs = Observation(
                workers=obs_workers,
                exit_codes=codes,
                remaining_restarts=agent.remaining_restarts(),
                nodes_waiting=waiting,
                draining=drain is not None,
                drain_deadline_passed=drain is not None and time.time() >= drain.deadline,
                asked=asked,
                api_workers=bool(self.control.api_workers()),
                peer_draining=obs_workers is not WorkerStatus.HEALTHY and self._peer_draining(wg),
            )
            d = decide(obs)
            if d.act is Act.WAIT:
                continue
            log.info("decision", act=d.act.value, reason=d.reason, exit_codes=list(codes),
                     remaining_restarts=obs.remaining_restarts, nodes_waiting=waiting)
            if d.act is Act.ASK_DRAIN:
                assert drain is not None
                self._publish_drain(wg)
                n = self.control.broadcast(proto.Stop(proto.StopReason.DRAIN, drain.deadline, drain.reason or drain.kind))
                log.info("drain_requested_from_workers", workers=n, deadline_in_s=round(drain.deadline - time.time(), 1))
                asked = "drain"
            elif d.act is Act.ASK_RESIZE:
                n = self.control.broadcast(proto.Stop(proto.StopReason.RESIZE, None, d.reason))
                log.info("resize_requested_from_workers", workers=n, nodes_waiting=waiting)
                asked = "resize"
            elif d.act is Act.TERMINATE:
                self._publish_drain(wg)
                grace = self.cfg.preemption.term_grace_s
                if drain is not None:
                    grace = max(1.0, min(grace, drain.deadline - time.time()))
                log.warning("workers_terminating", reason=d.reason, grace_s=round(grace, 1))
                agent.terminate_workers(grace)
                return self._leave(agent, wg, d.reason)
            elif d.act is Act.LEAVE:
                return self._leave(agent, wg, d.reason)
            elif d.act is Act.SUCCEED:
                agent._exit_barrier()
                self._outcome = AgentState.SUCCEEDED
                self.sm.to(AgentState.SUCCEEDED)
                return result
            elif d.act is Act.FAIL:
                agent._stop_workers(wg)
                self._outcome = AgentState.FAILED
                self.sm.to(AgentState.FAILED, reason=d.reason, exit_codes=list(codes))
                return RunResult(state=WorkerState.FAILED, failures=result.failures)
            elif d.act is Act.RESTART:
                self.control.forget_workers()
                self._workers_gone(wg)
                if d.consume_restart:  # a planned resize is no restart (metrics: its downtime is "resize")
                    self._observe("restart", d.reason)
                    agent._remaining_restarts -= 1
                    failures_in_a_row += 1
                    backoff = min(self.cfg.workers.restart_backoff_max_s,
                                  self.cfg.workers.restart_backoff_s * 2 ** (failures_in_a_row - 1))
                    self.sm.to(AgentState.RESTARTING, reason=d.reason, exit_codes=list(codes),
                               remaining_restarts=agent._remaining_restarts, backoff_s=backoff)
                    self._wake.wait(backoff)
                else:
                    failures_in_a_row = 0
                    self.sm.to(AgentState.RESIZING, reason=d.reason)
                if self._drain is not None:
                    return self._leave(agent, wg, "drained_during_restart")
                self.sm.to(AgentState.RENDEZVOUS)
                agent._restart_workers(wg)
                self._on_world(wg)
                asked = ""
                self.sm.to(AgentState.DRAINING if self._drain else AgentState.RUNNING)

    def _leave(self, agent: TrainguardElasticAgent, wg: WorkerGroup, reason: str) -> RunResult:
        if self.sm.state != AgentState.DRAINING:
            self.sm.to(AgentState.DRAINING, reason=reason)
        agent._stop_workers(wg)
        self._workers_gone(wg)
        try:
            rdzv.leave_rendezvous(self.handler, timeout_s=self.cfg.rendezvous.close_timeout_s)
        except Exception as e:  # the store may be gone; leaving is best effort, stopping is not
            log.warning("rendezvous_leave_failed", error=str(e))
        drain = self._drain
        self._outcome = AgentState.STOPPED
        if drain is not None:
            self._observe("drain_done", time.time() - drain.received_at)
        self.sm.to(AgentState.STOPPED, reason=reason,
                   seconds_since_notice=round(time.time() - drain.received_at, 3) if drain else None)
        # elastic's run() records one event per worker and needs a value for each global rank.
        return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in wg.workers})

    # ---- lifecycle (main thread) --------------------------------------------------------------
    def start(self) -> None:
        log.info("agent_starting", node=self.cfg.agent.node_name, pid=os.getpid(), config=redacted(self.cfg))

        def target() -> None:
            try:
                self.agent.run()
            except BaseException as e:  # surfaced to the main thread by wait()
                self._error = e
                log.error("supervisor_crashed", error=f"{type(e).__name__}: {e}")
            finally:
                self._wake.set()

        self._thread = threading.Thread(target=target, name="supervisor", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the supervisor thread; returns the process exit code, or None on timeout."""
        assert self._thread is not None, "start() first"
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        return self._finish()

    def _finish(self) -> int:
        outcome = self._outcome
        if self._error is not None or outcome is None:
            if not self.sm.state.terminal:
                self.sm.to(AgentState.FAILED, error=repr(self._error))
            outcome = AgentState.FAILED
        if outcome in (AgentState.SUCCEEDED, AgentState.FAILED):
            # The job as a whole is over: close the rendezvous like torchrun does. A drained node
            # (STOPPED) never closes it: the survivors go on.
            try:
                self.handler.shutdown()
            except Exception as e:
                log.warning("rendezvous_close_failed", error=str(e))
        self.control.close()
        code = 0 if outcome in (AgentState.SUCCEEDED, AgentState.STOPPED) else 1
        log.info("agent_exit", outcome=outcome.value, exit_code=code,
                 uptime_s=round(time.monotonic() - self._run_started, 1))
        return code

    def leave_now(self) -> None:
        """Last resort from the main thread when the supervisor thread is stuck in a rendezvous wait."""
        try:
            rdzv.leave_rendezvous(self.handler, timeout_s=5)
        except Exception as e:
            log.warning("rendezvous_leave_failed", error=str(e))
