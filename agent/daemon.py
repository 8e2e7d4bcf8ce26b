"""The agent process: wires config, logging, watchers, the drain coordinator, metrics and sd_notify
around the supervisor. It only wires; every decision lives elsewhere.

Data flows one way: watchers (and ``trainguard drain`` through the manual watcher) -> notices ->
:class:`~trainguard.agent.drain.DrainCoordinator` (policy) -> supervisor (drain / out-of-cycle
checkpoint) -> workers. Metrics only observe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from trainguard.agent.config import TrainguardConfig
from trainguard.agent.drain import DrainCoordinator
from trainguard.agent.supervisor import Supervisor
from trainguard.agent.watchers.config import PreemptionConfig
from trainguard.agent.lead import DrainCosts, auto_drain_lead
from trainguard.contract.log import get_logger
from trainguard.contract.protocol import AgentState

log = get_logger("trainguard.agent.daemon")


def _start_metrics(cfg: TrainguardConfig) -> tuple[Any, Any]:
    """The agent's metrics and exporter, or (None, None) when ``metrics.enabled`` is false."""
    if not cfg.metrics.enabled:
        return None, None
    import os

    from trainguard.metrics import AgentMetrics

    metrics = AgentMetrics(cfg.metrics, cfg.cost, cfg.agent.node_name, job_id=cfg.agent.job_id,
                           run_dir=os.path.join(cfg.agent.state_dir, cfg.agent.job_id))
    if cfg.checkpoint.url:
        policy, _ = cfg.checkpoint.interval_policy()  # auto: the workers export the interval they chose
        metrics.set_checkpoint_policy(policy.seconds, policy.steps)
    from trainguard.agent.preflight import store_in_agent

    metrics.set_store_in_agent(store_in_agent(cfg.rendezvous))
    exporter = metrics.serve()
    log.info("metrics_serving", url=getattr(exporter, "url", None))
    return metrics, exporter


def warn_foreign_runs(cfg: TrainguardConfig, metrics: Any = None) -> dict[str, int]:
    """A job that finds no committed checkpoint of its own while other runs have some under the same
    ``checkpoint.url`` is most likely a mistyped ``agent.job_id`` (it would train from step 0 into a
    new run folder and bill for it): one loud ``checkpoint_other_runs`` error line, from a thread once the
    node's start waits on others (:class:`_Background`). Returns
    those other runs (``{run: newest step}``); never raises (the workers report storage errors).
    When the job has committed steps, the newest seeds ``metrics``' last-commit series (the same scan)."""
    if not cfg.checkpoint.url:
        return {}
    try:
        from trainguard.checkpoint.discovery import newest_commits
        from trainguard.checkpoint.storage import Storage

        storage = Storage(cfg.checkpoint.url, cfg.checkpoint.storage_options, retry_attempts=1, retry_deadline_s=10.0)
        newest = newest_commits(storage)
    except Exception as e:  # noqa: BLE001 - a start-up hint only
        log.info("checkpoint_other_runs_unchecked", url=cfg.checkpoint.url, error=f"{type(e).__name__}: {e}"[:300])
        return {}
    job = cfg.agent.job_id
    if job in newest and metrics is not None:
        metrics.set_stored_commit(newest[job].step, newest[job].created_unix_s)
    runs = {run: m.step for run, m in newest.items()}
    if job in runs or not runs:
        return {}
    others = dict(sorted(runs.items(), key=lambda kv: -kv[1])[:10])
    log.error("checkpoint_other_runs", job_id=job, url=cfg.checkpoint.url, other_runs=others,
              effect=f"job {job!r} has no checkpoint of its own: it starts from step 0 in a new run folder "
                     f"{cfg.checkpoint.url.rstrip('/')}/{job}",
              fix="if this node belongs to one of those runs, stop it and fix agent.job_id "
                  "(TRAINGUARD_AGENT_JOB_ID, --rdzv-id) on this node; a new job may ignore this line")
    return others


class _Background:
    """Runs ``fn`` once on a daemon thread of its own, from :meth:`start` (idempotent).

    Why: the foreign-runs scan of :func:`warn_foreign_runs` imports the storage stack and lists
    ``checkpoint.url`` (0.4 s of one core on this machine, several times that under load). It ran before the
    supervisor started, so a node joining a running world began its warm-up (its workers' start, imports and
    model build) that much later, and the world waited for it as long. The supervisor starts it once the
    node's start waits on others (:attr:`Supervisor.on_start_waits`): in the first rendezvous, or beside a
    joiner's warming workers."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._fn = fn
        self._name = name
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._fn()
        except Exception as e:  # noqa: BLE001 - an informing task must never end the agent
            log.warning("background_task_failed", task=self._name, error=f"{type(e).__name__}: {e}"[:300])

    def stop(self, timeout_s: float = 1.0) -> None:
        """Wait briefly for a task that started (an agent that exits must not wait long on an informing scan
        of a slow storage: the thread is a daemon and ends with the process); idempotent."""
        with self._lock:
            t = self._thread
        if t is not None:
            t.join(timeout_s)


def _start_notices(cfg: TrainguardConfig, sup: Supervisor, metrics: Any) -> list[Any]:
    """Watchers -> coordinator -> supervisor. Returns what must be stopped at exit."""
    from trainguard.agent.watchers import acknowledge, build_watchers, manual_watcher, start_all

    watchers = build_watchers(cfg.preemption)
    costs = DrainCosts()
    sup.control.observers.append(costs.observe)  # the workers' reports: their steps and checkpoints
    coordinator = DrainCoordinator(
        sup, on_early_warning=cfg.preemption.on_early_warning,
        drain_lead_s=drain_lead(cfg.preemption, costs, metrics, cfg.workers.step_agreement_period_s),
        train_through=cfg.preemption.train_through_notice, observer=metrics,
        acknowledge=(lambda n: acknowledge(watchers, n)) if cfg.preemption.azure_acknowledge else None)
    sup.on_emergency_commit = coordinator.on_emergency_commit
    manual = manual_watcher(watchers)
    sup.on_manual_drain = lambda deadline_s, reason: manual.trigger(deadline_s, reason)
    start_all(watchers, coordinator.on_notice)
    return [_Stopper(lambda: _stop_watchers(watchers)), _Stopper(coordinator.close)]


def drain_lead(pre: PreemptionConfig, costs: DrainCosts, metrics: Any,
               agreement_s: float = 0.0) -> float | Callable[[], tuple[float, str]]:
    """``preemption.drain_lead_s``: the number, or for ``auto`` a provider that sizes the lead at each
    notice (:func:`~trainguard.agent.lead.auto_drain_lead`) from the step and checkpoint times the node's
    workers reported (``costs``, the agent's own :class:`~trainguard.agent.lead.DrainCosts`) and exports
    it (``trainguard_drain_lead_seconds``; ``metrics`` only observe). ``agreement_s``: the workers'
    ``step_agreement_period_s`` (a stop waits for their next agreement)."""
    fixed = pre.fixed_drain_lead_s
    if fixed is not None:
        if metrics is not None:
            metrics.set_drain_lead(fixed)
        return fixed

    def lead() -> tuple[float, str]:
        measured = costs.costs(agreement_s)
        out = auto_drain_lead(measured, min_s=pre.drain_lead_min_s,
                              factor=pre.drain_lead_factor, unmeasured_s=pre.drain_lead_unmeasured_s)
        if metrics is not None:
            metrics.set_drain_lead(out[0])
        log.info("drain_lead", seconds=round(out[0], 2), basis=out[1], step_s=measured.step_s,
                 checkpoint_s=measured.checkpoint_s)
        return out

    return lead


def _stop_watchers(watchers: list[Any]) -> None:
    from trainguard.agent.watchers import stop_all

    stop_all(watchers)


class _Stopper:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.stop = fn


def run_agent(cfg: TrainguardConfig, env: Mapping[str, str], *, extra_listeners: list[Callable[..., Any]] | None = None) -> int:
    """Run one node's agent until the job ends or this node leaves. Returns the process exit code."""
    from trainguard.agent.sdnotify import Notifier, WatchdogThread, watchdog_interval

    notifier = Notifier.from_env(env)
    ready_sent = False

    def tell_systemd(old: Any, new: Any, details: dict[str, Any]) -> None:
        nonlocal ready_sent
        size = sup.world.get("world_size")  # sup exists: transitions start after it is built
        text = f"{new.value}" + (f", world size {size}" if size else "")
        if new == AgentState.RENDEZVOUS and not ready_sent:
            ready_sent = True
            notifier.ready(status=text)  # READY once the first rendezvous attempt has started
        else:
            notifier.status(text)

    from trainguard.agent.health import HealthMonitor, open_probe

    probe = open_probe(cfg.health)  # the pre-flight: a fatal GPU stops the start before any rendezvous
    metrics, exporter = _start_metrics(cfg)
    hints = _Background(lambda: warn_foreign_runs(cfg, metrics), "foreign-runs-check")
    listeners = list(extra_listeners or [])
    listeners.append(tell_systemd)
    if metrics is not None:
        listeners.append(lambda old, new, details: metrics.set_state(new))
    sup = Supervisor(cfg, listeners=listeners, observer=metrics)
    sup.on_start_waits = hints.start
    if exporter is not None:  # `trainguard status` finds the exporter through the control socket
        sup.control.status_extra["metrics_url"] = getattr(exporter, "url", None)
    services: list[Any] = [s for s in (metrics, exporter) if s is not None]
    services.append(hints)
    if probe is not None:  # a fatal GPU while training drains the node through the normal path
        health = HealthMonitor(probe, cfg.health, lambda why: sup.drain_self("health", why),
                               metrics.straggler if metrics is not None else None)
        health.poll()
        services.append(health.start())
    interval = watchdog_interval(env)
    if interval:
        # Pings only while the supervisor thread lives: a wedged agent is restarted by systemd.
        services.append(WatchdogThread(notifier, interval, healthy=lambda: sup.alive).start())
    try:
        services += _start_notices(cfg, sup, metrics)
        sup.start()
        while True:
            code = sup.wait(timeout=0.5)
            if code is not None:
                return code
    finally:
        notifier.stopping()
        if metrics is not None:
            # The deadline is asked again while waiting: a second Ctrl-C moves it to now.
            metrics.await_final_scrape(deadline=lambda: sup.drain.deadline if sup.drain is not None else None)
        for s in reversed(services):
            try:
                (getattr(s, "stop", None) or s.close)()
            except Exception as e:
                log.warning("service_stop_failed", service=type(s).__name__, error=str(e))


__all__ = ["run_agent", "warn_foreign_runs"]
