"""The agent process: wires config, logging, watchers, metrics and sd_notify around the supervisor.

Main thread: starts everything, then waits on the supervisor thread while watchers (signals run
here) turn notices into drain requests. Data flows one way: watchers -> notices -> supervisor
(drain) -> workers; metrics only observe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from trainguard.agent.config import TrainguardConfig
from trainguard.runtime.log import get_logger
from trainguard.agent.states import AgentState
from trainguard.agent.supervisor import Supervisor

log = get_logger("trainguard.agent.daemon")


def _start_metrics(cfg: TrainguardConfig) -> tuple[Any, Any]:
    """The agent's metrics and exporter, or (None, None) when ``metrics.enabled`` is false."""
    if not cfg.metrics.enabled:
        return None, None
    import os

    from trainguard.metrics import AgentMetrics

    metrics = AgentMetrics(cfg.metrics, cfg.cost, cfg.agent.node_name,
                           run_dir=os.path.join(cfg.agent.state_dir, cfg.agent.job_id))
    if cfg.checkpoint.url:
        policy, _ = cfg.checkpoint.interval_policy()  # auto: the workers export the interval they chose
        metrics.set_checkpoint_policy(policy.seconds, policy.steps)
    exporter = metrics.serve()
    log.info("metrics_serving", url=getattr(exporter, "url", None))
    return metrics, exporter


def _start_watchers(cfg: TrainguardConfig, sup: Supervisor) -> list[Any]:
    try:
        from trainguard.agent.watchers import build_watchers
    except ImportError:
        log.warning("watchers_unavailable")
        return []

    notices: list[Any] = []

    def acknowledge_notices() -> None:
        from trainguard.agent.watchers import acknowledge

        if not cfg.preemption.azure_acknowledge:
            return
        while notices:
            n = notices.pop()
            if acknowledge(watchers, n):
                log.info("notice_acknowledged", source=n.source, event_id=getattr(n, "event_id", None))

    sup.on_emergency_commit = acknowledge_notices

    def on_notice(notice: Any) -> None:
        notices.append(notice)
        log.warning("preemption_notice", source=notice.source, kind=notice.kind,
                    deadline_in_s=round(notice.deadline - time.time(), 1))
        sup._observe("notice", notice.source)
        sup.request_drain(notice.source, notice.kind, notice.deadline, reason=f"{notice.source}:{notice.kind}")

    watchers = build_watchers(cfg.preemption)
    for w in watchers:
        w.start(on_notice)
    return watchers


def run_agent(cfg: TrainguardConfig, env: Mapping[str, str], *, extra_listeners: list[Callable[..., Any]] | None = None) -> int:
    """Run one node's agent until the job ends or this node leaves. Returns the process exit code."""
    from trainguard.agent.sdnotify import Notifier, WatchdogThread, watchdog_interval

    notifier = Notifier.from_env(env)
    ready_sent = False

    def tell_systemd(old: Any, new: Any, details: dict[str, Any]) -> None:
        nonlocal ready_sent
        size = sup._world.get("world_size")  # sup exists: transitions start after it is built
        text = f"{new.value}" + (f", world size {size}" if size else "")
        if new == AgentState.RENDEZVOUS and not ready_sent:
            ready_sent = True
            notifier.ready(status=text)  # READY once the first rendezvous attempt has started
        else:
            notifier.status(text)

    metrics, exporter = _start_metrics(cfg)
    listeners = list(extra_listeners or [])
    listeners.append(tell_systemd)
    if metrics is not None:
        listeners.append(lambda old, new, details: metrics.set_state(new))
    sup = Supervisor(cfg, listeners=listeners, observer=metrics)
    services: list[Any] = [s for s in (metrics, exporter) if s is not None]
    interval = watchdog_interval(env)
    if interval:
        # Pings only while the supervisor thread lives: a wedged agent is restarted by systemd.
        services.append(WatchdogThread(notifier, interval, healthy=lambda: sup._thread is not None and sup._thread.is_alive()).start())
    try:
        services += _start_watchers(cfg, sup)
        sup.start()
        while True:
            code = sup.wait(timeout=0.5)
            if code is not None:
                return code
            drain = sup.drain
            # A drain that arrives while the supervisor thread blocks in a rendezvous wait: leave from
            # here once the deadline is near, so the node never overstays its notice.
            if drain is not None and sup.sm.state == AgentState.RENDEZVOUS and time.time() > drain.deadline - 2:
                log.warning("drain_during_rendezvous", action="leaving from the main thread")
                sup.leave_now()
                return 0
    finally:
        notifier.stopping()
        if metrics is not None:
            drain = sup.drain
            metrics.await_final_scrape(deadline=drain.deadline if drain is not None else None)
        for s in reversed(services):
            try:
                (getattr(s, "stop", None) or s.close)()
            except Exception as e:
                log.warning("service_stop_failed", service=type(s).__name__, error=str(e))
