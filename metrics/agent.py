"""Agent-side metrics: the node's registry, fed by the agent and by its workers.

:class:`AgentMetrics` is created once by the agent at start. It owns

* a private registry of agent metrics (state, world size, rendezvous, restarts, notices, drains),
* the worker channel directory (wiped at start; see :mod:`trainguard.metrics.channel`),
* a :class:`~trainguard.metrics.goodput.GoodputLedger` and the node's price,
* an NVML :class:`~trainguard.metrics.gpu.GpuSampler`,
* a sampler thread (``metrics.sample_interval_s``) that reads worker progress for the throughput
  gauges and the ledger,

and exposes all of it, plus the merged worker metrics, through :attr:`AgentMetrics.registry`, each
series labelled ``node`` and ``job_id`` (``agent.job_id``: two training jobs scraped by one Prometheus
job stay apart in ``by (job_id)``; Prometheus's own ``job`` label is the scrape job). Cost, goodput and GPU families are computed at scrape time, so they are
exact at the moment Prometheus asks (:mod:`~trainguard.metrics.exposition`).

Metrics observe the agent; they never steer it. No method raises on bad *observations*
(unknown label values are normalised and bounded); only construction raises, on bad config.

Threading: every public method may be called from any agent thread; the ledger is guarded by one
lock, prometheus_client metrics by their own.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from trainguard.contract.configbase import ConfigError
from trainguard.contract.log import get_logger
from trainguard.metrics import channel, exposition, names
from trainguard.metrics.config import CostConfig, MetricsConfig
from trainguard.metrics.cost import resolve_price
from trainguard.metrics.goodput import GoodputLedger, GoodputSnapshot
from trainguard.metrics.gpu import GpuSampler
from trainguard.metrics.hangs import HangMetrics
from trainguard.metrics.straggler import StragglerMetrics

log = get_logger("trainguard.metrics.agent")

P = names.PREFIX

FINAL_SCRAPE_MAX_WAIT_S = 5.0
"""Upper bound of :meth:`AgentMetrics.await_final_scrape` (whatever the observed scrape interval): an
agent that has said ``agent_exit`` must not look hung, nor hold its metrics port for long."""
PORT_BUSY_WAIT_S = FINAL_SCRAPE_MAX_WAIT_S + 2.0
"""How long :meth:`AgentMetrics.serve` retries a fixed ``metrics.port`` that is in use: the agent this
one replaces may still be serving its final scrape."""


def _state_name(state: Any) -> str:
    """Accept a plain string or an ``Enum`` member (its ``name``), lower-cased."""
    return str(getattr(state, "name", state)).lower()


class AgentMetrics(HangMetrics):
    """The node's metrics. See the module docstring.

    ``node``: the node's name (``node`` label on every series); ``job_id``: the training job's id
    (``job_id`` label on every series). ``run_dir``: the agent's local run
    directory; the worker channel lives in ``<run_dir>/prometheus_multiproc`` and is wiped here. Without
    it there is no worker channel (tier-1 scripts only get node-level metrics).
    ``clock`` (monotonic seconds) and ``wall_clock`` (unix seconds) are injectable for tests;
    ``nvml`` injects a fake NVML module; ``start_sampler=False`` leaves :meth:`sample` to the caller.
    """

    def __init__(self, config: MetricsConfig, cost_config: CostConfig, node: str, *, job_id: str = "",
                 run_dir: str | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 nvml: Any | None = None, start_sampler: bool = True) -> None:
        self.config = config
        self.cost_config = cost_config
        self.node = node
        self.job_id = job_id
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._channel_lock = channel.ReadWriteLock()  # reads of the channel dir vs. compaction
        self._closed = False
        self._exporter: Any = None
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

        self.price = resolve_price(cost_config)
        if self.price.source == "unset":
            log.info("cost_price_unset", capacity=cost_config.capacity,
                     effect="cost metrics read 0",
                     fix="set cost.spot_price_per_hour / cost.on_demand_price_per_hour "
                         "(env TRAINGUARD_COST_SPOT_PRICE_PER_HOUR / TRAINGUARD_COST_ON_DEMAND_PRICE_PER_HOUR) "
                         "or cost.instance_type + cost.price_table_file")

        self.multiproc_dir: str | None = None
        if run_dir is not None:
            self.multiproc_dir = channel.prepare_dir(channel.multiproc_dir(run_dir))

        self.ledger = GoodputLedger(clock)
        self._window: deque[tuple[float, float, float, float]] = deque()  # (t, samples, tokens, steps)
        self._rates: tuple[float, float] | None = None
        self._ckpt_policy: tuple[float, int] = (0.0, 0)  # (interval_s, interval_steps)
        self._restores_seen = 0.0
        self._interval_here = 0.0  # what this node's own policy / workers say (seconds; 0: off or unknown)
        self._interval_job: float | None = None  # the job's effective interval, from its global rank 0's node
        self._stored_commit: tuple[float, float] | None = None  # (step, unix s) found in the store at start
        self._state = "starting"

        self._gpu = GpuSampler(enabled=config.gpu, nvml=nvml)
        self._build_agent_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(exposition.NodeCollector(self))

        if start_sampler and self.multiproc_dir is not None:
            self._sampler = threading.Thread(target=self._sample_loop, name="trainguard-metrics-sampler", daemon=True)
            self._sampler.start()

    # -- agent metrics --------------------------------------------------------------------------
    def _build_agent_metrics(self) -> None:
        r = self._inner = CollectorRegistry(auto_describe=False)
        self._m_state = Gauge(P + "agent_state", "1 for the agent's current state, 0 for the others.", ["state"], registry=r)
        for s in names.AGENT_STATES:
            self._m_state.labels(state=s).set(1 if s == self._state else 0)
        self._states = names.BoundedLabels(names.AGENT_STATES)
        self._m_world = Gauge(P + "world_size", "Worker processes in the current world (all nodes).", registry=r)
        self._m_nodes = Gauge(P + "nodes", "Nodes in the current world.", registry=r)
        self._m_round = Gauge(P + "rendezvous_round", "Current rendezvous round number.", registry=r)
        self._m_rounds = Counter(P + "rendezvous_rounds", "Rendezvous rounds this agent completed.", registry=r)
        self._m_restarts = Counter(P + "restarts", "Worker-group restarts by reason.", ["reason"], registry=r)
        self._restart_reasons = names.BoundedLabels(names.RESTART_REASONS)
        for reason in names.RESTART_REASONS:
            self._m_restarts.labels(reason=reason)
        self._m_notices = Counter(P + "preemption_notices", "Preemption notices received, by source.", ["source"], registry=r)
        self._sources = names.BoundedLabels(names.NOTICE_SOURCES)
        for src in names.NOTICE_SOURCES:
            self._m_notices.labels(source=src)
        self._m_drain = Histogram(P + "drain_duration_seconds", "Time from a preemption notice to the drain being done.",
                                  buckets=names.DRAIN_BUCKETS_S, registry=r)
        self._m_drain_lead = Gauge(P + "drain_lead_seconds",
                                   "Seconds before a notice's deadline at which its node drains (preemption.drain_lead_s, "
                                   "as sized at the last notice).", registry=r)
        self._m_ckpt_interval = Gauge(P + "checkpoint_interval_seconds",
                                      "Configured (or estimated) time between periodic checkpoints.", registry=r)
        self._m_start = Gauge(P + "agent_start_time_seconds", "Unix time the agent started.", registry=r)
        self.started_unix_s = self._wall()
        self._m_start.set(self.started_unix_s)
        self._m_corrupt = Counter(P + "checkpoint_corrupt_steps",
                                  "Committed checkpoint steps this node's workers found proven corrupt at restore (size or "
                                  "CRC32 mismatch, missing file): skipped, rolled back past, moved to quarantine/.",
                                  registry=r)
        self._m_dead = Counter(P + "worker_exits", "Worker processes that exited (marked dead in the channel).", registry=r)
        self._m_store_in_agent = Gauge(P + "rendezvous_store_in_agent",
                                       "1 when this agent hosts the c10d store of a job that may span several nodes "
                                       "(the store, and the job, die with this node; pytorch#67742).", registry=r)
        self._init_hang_metrics(r)
        self._round_seen: int | None = None
        self.straggler = StragglerMetrics(r, self.evicted)
        """Straggler scores, evictions and re-admissions, GPU health (:mod:`trainguard.metrics.straggler`)."""

    # -- the owner's API ------------------------------------------------------------------------
    def set_state(self, state: Any) -> None:
        """The agent entered ``state`` (a string or an Enum member; compared lower-case)."""
        s = self._states(_state_name(state))
        try:  # the ledger splits time at the transition: it needs the workers' step time up to now
            self.sample()
        except Exception as e:  # observing must not stop the agent
            log.warning("metrics_sample_failed", error=repr(e))
        with self._lock:
            prev, self._state = self._state, s
            self.ledger.set_state(s)
        if prev != s:
            self._m_state.labels(state=prev).set(0)
        self._m_state.labels(state=s).set(1)

    def set_world(self, world_size: int, nodes: int, round: int) -> None:  # noqa: A002 - elastic's name
        """A rendezvous completed: ``world_size`` workers over ``nodes`` nodes, round ``round``."""
        self._m_world.set(world_size)
        self._m_nodes.set(nodes)
        self._m_round.set(round)
        if round != self._round_seen:
            self._round_seen = round
            self._m_rounds.inc()

    def set_store_in_agent(self, hosted: bool) -> None:
        """Whether this agent hosts the rendezvous store of a multi-node job (a start-up warning too)."""
        self._m_store_in_agent.set(1 if hosted else 0)

    def restart(self, reason: str) -> None:
        """The worker group is restarted after a failure (``reason``: e.g. ``worker_failure``).

        Counts the restart and attributes the downtime until training runs again to ``restart``.
        Planned resizes are not restarts: use :meth:`set_state` (``resizing``) for those.
        """
        self._m_restarts.labels(reason=self._restart_reasons(reason)).inc()
        with self._lock:
            self.ledger.set_cause("restart")

    def notice(self, source: str) -> None:
        """A preemption notice arrived from ``source`` (``aws``, ``gcp``, ``azure``, ``signal``,
        ``manual``); downtime until training runs again counts as ``drain``."""
        self._m_notices.labels(source=self._sources(source)).inc()
        with self._lock:
            self.ledger.set_cause("drain")

    def drain_done(self, seconds: float) -> None:
        """A drain finished ``seconds`` after its notice (checkpoint committed, workers out)."""
        self._m_drain.observe(seconds)

    def set_drain_lead(self, seconds: float) -> None:
        """The lead the agent sized at the last notice (``trainguard_drain_lead_seconds``; see
        :mod:`trainguard.agent.lead`: the agent measures it from its workers' reports, not from here)."""
        self._m_drain_lead.set(seconds)

    def lost_work(self, seconds: float, steps: int, reason: str = "recompute") -> float:
        """``seconds`` of recent training (``steps`` steps) were lost and will be recomputed.

        Use this when the caller measured the loss (e.g. a drain that missed its deadline), *or*
        :meth:`restored`, not both. Returns the seconds reclassified from productive to wasted.
        """
        with self._lock:
            return self.ledger.lost_work(seconds, steps, reason)

    def restored(self, step: int) -> tuple[float, int]:
        """Workers restart from checkpoint ``step``; work done past it (as sampled from the workers)
        becomes ``recompute`` waste. Returns ``(seconds, steps)`` reclassified. Workers on the worker
        API report their restores through the channel (``trainguard_checkpoint_restores_total``),
        which the sampler turns into this call: use it only for restores the channel does not see."""
        with self._lock:
            seconds, steps = self.ledger.restored(step)
        if steps:
            log.info("work_lost", restored_step=step, recomputed_steps=steps, recomputed_s=round(seconds, 3))
        return seconds, steps

    def set_checkpoint_interval(self, seconds: float) -> None:
        """Time between periodic checkpoints (``checkpoint.interval_s``, or ``interval_steps`` x the
        mean step time); the staleness alert fires at 3x this."""
        self._set_interval(seconds)

    def set_checkpoint_policy(self, interval_s: float = 0.0, interval_steps: int = 0) -> None:
        """The workers' periodic checkpoint settings (``checkpoint.interval_s`` / ``interval_steps``,
        0 = off). ``interval_s`` is exported at once; ``interval_steps`` is turned into seconds by the
        sampler: steps x the job's step time, from ``trainguard_steps_total`` over the sample periods
        of the last ``metrics.throughput_window_s`` in which steps ran (the estimate is kept while none
        run). With both, the shorter one. Both 0 (periodic checkpoints off) exports 0."""
        interval_s, interval_steps = max(0.0, float(interval_s)), max(0, int(interval_steps))
        with self._lock:
            self._ckpt_policy = (interval_s, interval_steps)
        self._set_interval(interval_s)

    def _set_interval(self, seconds: float) -> None:
        with self._lock:
            self._interval_here = seconds
            job = self._interval_job
        self._m_ckpt_interval.set(seconds if job is None else job)

    def view(self) -> dict[str, Any]:
        """This node's ``trainguard status`` view (:func:`trainguard.metrics.status.build_view`) from one
        collection of its own registry (no HTTP)."""
        from trainguard.metrics.status import build_view

        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for fam in self.registry.collect():
            for smp in fam.samples:
                samples.setdefault(smp.name, []).append((dict(smp.labels), float(smp.value)))
        return build_view(samples, now=self._wall())

    def checkpoint_interval_here(self) -> float:
        """The interval this node's own policy and workers give (seconds; 0: off, or not decided here:
        with ``interval: auto`` only the node of global rank 0 runs the controller)."""
        with self._lock:
            return self._interval_here

    def set_job_checkpoint_interval(self, seconds: float | None) -> None:
        """The job's effective interval, as the node of global rank 0 (whose workers decide when to save)
        exports it: ``trainguard_checkpoint_interval_seconds`` then shows it on this node too, whatever
        this node's own config says. None: this node decides (it hosts global rank 0)."""
        with self._lock:
            self._interval_job = seconds
            here = self._interval_here
        self._m_ckpt_interval.set(here if seconds is None else seconds)

    def _estimate_checkpoint_interval(self, steps_per_s: float) -> None:
        interval_s, interval_steps = self._ckpt_policy
        if interval_steps and steps_per_s > 0:
            est = interval_steps / steps_per_s
            self._set_interval(min(est, interval_s) if interval_s else est)

    def mark_worker_dead(self, pid: int) -> None:
        """Worker ``pid`` exited: drop its live gauges. Call for every exited worker process.

        Samples worker progress first, so the dead worker's last step still reaches the goodput
        ledger (a later :meth:`restored` needs it to size the rollback).
        """
        self._m_dead.inc()
        if self.multiproc_dir is not None:
            try:
                self.sample()
            except Exception as e:  # observing must not stop the agent from cleaning up
                log.warning("metrics_sample_failed", error=repr(e))
            with self._channel_lock.write():
                channel.mark_dead(pid, self.multiproc_dir)
                try:
                    channel.compact_dead(self.multiproc_dir, pid)
                except Exception as e:  # uncompacted files are still read correctly, only slower
                    log.warning("metrics_compaction_failed", pid=pid, error=repr(e))

    def worker_env(self) -> dict[str, str]:
        """Env vars for the workers this agent starts (empty without a ``run_dir``)."""
        return {} if self.multiproc_dir is None else {channel.ENV_VAR: self.multiproc_dir}

    def serve(self) -> Any:
        """Start the HTTP exporter on ``metrics.bind_address:port`` (daemon thread) and return it. A
        fixed port that is in use is retried for :data:`PORT_BUSY_WAIT_S` (a restart right after a
        drain finds the previous agent still answering its final scrape), then the error stands."""
        from trainguard.metrics.exporter import MetricsExporter

        t0 = time.monotonic()
        while self._exporter is None:
            try:
                self._exporter = MetricsExporter(self.registry, self.config.bind_address, self.config.port,
                                                 health=self.health)
            except ConfigError as e:
                busy = getattr(e.__cause__, "errno", None) == errno.EADDRINUSE and self.config.port != 0
                if not busy or time.monotonic() - t0 > PORT_BUSY_WAIT_S:
                    raise
                if t0 + 0.25 > time.monotonic():
                    log.warning("metrics_port_busy", port=self.config.port, retry_for_s=PORT_BUSY_WAIT_S,
                                effect="retrying: the agent this one replaces may still be exiting")
                time.sleep(0.25)
        return self._exporter

    def await_final_scrape(self, deadline: float | Callable[[], float | None] | None = None) -> bool:
        """Before the agent exits: give the scraper watching this node one more scrape, so the final
        values (drain duration, ``stopped`` state, final cost and waste) reach it; a drained node
        would otherwise vanish with them unscraped.

        Waits only while something scrapes periodically (see
        :meth:`~trainguard.metrics.exporter.MetricsExporter.scrape_interval_s`), for at most two
        scrape intervals or :data:`FINAL_SCRAPE_MAX_WAIT_S`, and never past ``deadline`` (unix
        seconds, e.g. the drain deadline) minus one second. ``deadline`` may be a function, asked
        again every quarter second: a second Ctrl-C moves the drain deadline to now and ends the wait.
        Returns whether a scrape was served. Never raises; logs ``metrics_final_scrape``.
        """
        ex = self._exporter

        def left(until: float) -> float:
            d = deadline() if callable(deadline) else deadline
            return min(until - time.monotonic(), float("inf") if d is None else d - 1.0 - self._wall())

        try:
            interval = ex.scrape_interval_s() if ex is not None else None
            if interval is None:
                return False
            t0 = time.monotonic()
            until = t0 + min(2 * interval, FINAL_SCRAPE_MAX_WAIT_S)
            if left(until) <= 0:
                return False
            log.info("metrics_final_scrape_wait", max_s=round(left(until), 1),
                     skip="press Ctrl-C again (or send SIGTERM) to exit at once")
            scraped, mark = False, ex.scrapes_begun()
            while not scraped and (slice_s := min(0.25, left(until))) > 0:
                scraped = ex.wait_for_next_scrape(slice_s, after=mark)
            log.info("metrics_final_scrape", scraped=scraped, waited_s=round(time.monotonic() - t0, 3),
                     scrape_interval_s=round(interval, 3))
            return scraped
        except Exception as e:  # never delay or break the exit over metrics
            log.warning("metrics_final_scrape_failed", error=repr(e))
            return False

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` reports: ``ok`` is False when the sampler thread died."""
        sampler_ok = self._sampler is None or self._sampler.is_alive() or self._closed
        return {"ok": sampler_ok, "node": self.node, "state": self._state,
                "gpu_metrics": self._gpu.available, "worker_channel": self.multiproc_dir is not None}

    def goodput(self) -> GoodputSnapshot:
        """The ledger's current partition of paid time."""
        with self._lock:
            return self.ledger.snapshot()

    def close(self) -> None:
        """Stop the sampler and the exporter, release NVML. Idempotent; safe on a half-built object."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        if self._exporter is not None:
            self._exporter.close()
        gpu = getattr(self, "_gpu", None)
        if gpu is not None:
            gpu.close()

    def __enter__(self) -> "AgentMetrics":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sampling -------------------------------------------------------------------------------
    def _worker_families(self, pattern: str | tuple[str, ...] = "*.db") -> list[Metric]:
        if self.multiproc_dir is None:
            return []
        with self._channel_lock.read():
            return channel.collect_files(self.multiproc_dir, pattern, exclude_pid=os.getpid())

    def sample(self, now: float | None = None) -> None:
        """Read worker progress once: feeds the throughput window and the goodput ledger.

        Called by the sampler thread every ``metrics.sample_interval_s``; tests call it directly.
        """
        if self.multiproc_dir is None:
            return
        # Counters and gauges only: histogram files are most of the bytes and not needed here.
        vals = exposition.values(self._worker_families(("counter_*.db", "gauge_*.db")))
        t = self._clock() if now is None else now
        samples = vals.get(P + "samples_total", 0.0)
        tokens = vals.get(P + "tokens_total", 0.0)
        steps = vals.get(P + "steps_total", 0.0)
        steps_per_s = 0.0
        restores = vals.get(P + "checkpoint_restores_total", 0.0)
        lost: tuple[int, float, int] | None = None
        with self._lock:
            # A restore first: the rolled-back work is sized before the restored workers' own steps count.
            if restores > self._restores_seen and P + "checkpoint_restored_step" in vals:
                k = int(vals[P + "checkpoint_restored_step"])
                skipped = int(vals.get(P + "checkpoint_restore_skipped_step", 0))
                seconds, n = self.ledger.restored(k, t, newest=skipped or None)
                corrupt = int(vals.get(P + "checkpoint_restore_corrupt_steps", 0))
                if corrupt:
                    self._m_corrupt.inc(corrupt)
                if n:
                    lost = (k, seconds, n)
            self._restores_seen = max(self._restores_seen, restores)
            self.ledger.progress(int(vals[P + "step"]) if P + "step" in vals else None, t,
                                 train_s=vals.get(P + "training_seconds_total"))
            if P + "checkpoint_last_committed_step" in vals:
                self.ledger.committed(int(vals[P + "checkpoint_last_committed_step"]), t)
            w = self._window
            if w and (samples < w[-1][1] or tokens < w[-1][2] or steps < w[-1][3]):
                w.clear()  # counter reset: nothing to difference against
            w.append((t, samples, tokens, steps))
            while len(w) > 2 and w[1][0] <= t - self.config.throughput_window_s:
                w.popleft()
            if len(w) >= 2 and w[-1][0] > w[0][0]:
                dt = w[-1][0] - w[0][0]
                self._rates = ((w[-1][1] - w[0][1]) / dt, (w[-1][2] - w[0][2]) / dt)
                # Step rate while steps run: sample periods without a step (a drain, a rendezvous,
                # workers loading a checkpoint) would make the checkpoint interval look longer.
                busy = [(b[0] - a[0], b[3] - a[3]) for a, b in zip(w, list(w)[1:]) if b[3] > a[3]]
                busy_s = sum(d for d, _ in busy)
                steps_per_s = sum(n for _, n in busy) / busy_s if busy_s > 0 else 0.0
        if lost is not None:
            log.info("work_lost", restored_step=lost[0], recomputed_steps=lost[2], recomputed_s=round(lost[1], 3))
        auto = vals.get(P + "checkpoint_auto_interval_seconds", 0.0)
        if auto > 0:  # checkpoint.interval=auto: the interval global rank 0's controller chose (this node runs it)
            self._set_interval(auto)
        else:
            self._estimate_checkpoint_interval(steps_per_s)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.config.sample_interval_s):
            try:
                self.sample()
            except Exception as e:  # a bad file or a race must not kill the sampler
                log.warning("metrics_sample_failed", error=repr(e))

    # -- exposition -----------------------------------------------------------------------------
    def _computed(self, worker: list[Metric]) -> Iterator[Metric]:
        with self._lock:
            g = self.ledger.snapshot()
            rates = self._rates
        return exposition.computed_families(worker, g, rates, price=self.price, currency=self.cost_config.currency,
                                            window_s=self.config.throughput_window_s, read_gpu=self._gpu.read)

    def set_stored_commit(self, step: int, unix_s: float) -> None:
        """The job's newest committed step in the checkpoint store (read at agent start) and when it was
        committed: ``trainguard_checkpoint_last_committed_step`` and ``..._last_commit_timestamp_seconds``
        show it (or a newer commit of the workers) from the first scrape, so that an agent restart does
        not blank them until the next commit (``TrainguardCheckpointStale`` and ``status`` need them)."""
        with self._lock:
            self._stored_commit = (float(step), float(unix_s))

    def _with_stored_commit(self, worker: list[Metric]) -> list[Metric]:
        with self._lock:
            stored = self._stored_commit
        return exposition.with_stored_commit(worker, stored)

    def collect(self) -> Iterator[Metric]:
        """All families of this node, before the ``node`` and ``job_id`` labels are added (see
        :class:`~trainguard.metrics.exposition.NodeCollector`)."""
        yield from self._inner.collect()
        worker = self._with_stored_commit(self._worker_families())
        yield from worker
        yield from self._computed(worker)


