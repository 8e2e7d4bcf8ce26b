"""Worker-side metrics: what a training process reports to its agent.

Called by the trainguard worker runtime (tier-2 scripts) in the training loop. Every observation is
an ``mmap`` write into this process's file in ``PROMETHEUS_MULTIPROC_DIR`` (see
:mod:`trainguard.metrics.channel` for why); the agent merges the files when it is scraped.

Counting rules (so sums over nodes mean something):

* ``trainguard_steps_total`` is counted by local rank 0 only: it is the job's step count as seen
  on this node. Across nodes use ``max``, not ``sum``.
* samples and tokens are counted by every rank, each passing *its own* share of the step, so the
  node total is the node's share and ``sum`` over nodes is the job's total.
* the step-time histogram gets one observation per rank per step (the node's distribution).

Threading: the metric objects are per process and guarded by prometheus_client's lock; call from
the training thread (or any thread). Per step cost is a handful of microseconds.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

from trainguard.contract.log import get_logger
from trainguard.metrics import names
from trainguard.metrics.channel import ENV_VAR

log = get_logger("trainguard.metrics.worker")

GPU_PEAK_INTERVAL_S = 5.0
"""Seconds between reads of ``torch.cuda.max_memory_allocated`` by :meth:`WorkerMetrics.sample_gpu_peak`."""


class MetricsChannelError(RuntimeError):
    """The worker cannot reach its agent through the multiprocess channel."""


def multiprocess_active() -> bool:
    """Whether prometheus_client in *this* process writes to ``PROMETHEUS_MULTIPROC_DIR`` files.

    False when the variable was not in the environment when ``prometheus_client`` was first
    imported: setting it later has no effect.
    """
    from prometheus_client import values

    return getattr(values.ValueClass, "__name__", "") == "MmapedValue"


@dataclass(slots=True)
class _Families:
    steps: Any
    samples: Any
    tokens: Any
    step_time: Any
    step: Any
    last_step_ts: Any
    ckpt_stage: Any
    ckpt_persist: Any
    ckpt_blocked: Any
    ckpt_bytes: Any
    ckpt_saves: Any
    ckpt_failures: Any
    ckpt_step: Any
    ckpt_ts: Any
    gpu_peak: Any
    train_s: Any
    restores: Any
    restored_step: Any
    restore_skipped: Any
    restore_corrupt: Any
    tier_restores: Any
    memory_snapshot: Any
    memory_bytes: Any
    replica_lag: Any
    memory_interval: Any
    auto: dict[str, Any]


AUTO_GAUGES: dict[str, tuple[str, str]] = {
    "interval_s": ("checkpoint_auto_interval_seconds",
                   "Periodic checkpoint interval chosen by checkpoint.interval=auto (Young/Daly), seconds of training."),
    "optimum_s": ("checkpoint_auto_optimum_seconds",
                  "Young/Daly optimum for the measured inputs, before bounds and hysteresis."),
    "save_cost_s": ("checkpoint_auto_save_cost_seconds",
                    "Measured training time one periodic save costs (blocked + slowdown while persisting)."),
    "persist_s": ("checkpoint_auto_persist_seconds", "Measured time to persist and commit a save (average)."),
    "restore_s": ("checkpoint_auto_restore_seconds", "Measured time to restore a checkpoint (average)."),
    "mtbf_s": ("checkpoint_auto_mtbf_seconds",
               "Estimated mean time between failures that roll the job back to its newest durable checkpoint "
               "(unannounced failures / rollback probability), at its current world size."),
    "rollback_probability": ("checkpoint_auto_rollback_ratio",
                             "Estimated probability (0..1) that a membership loss takes the job's state with it, a "
                             "rollback to storage (1 when the world cannot survive the loss of a node; else from the "
                             "losses seen, survived or not)."),
    "unannounced_failures": ("checkpoint_auto_unannounced_failures",
                             "Rollbacks of the job so far (unannounced failures that restored from storage)."),
    "survived_losses": ("checkpoint_auto_survived_losses",
                        "Membership losses (announced or not) the job's state survived in memory: no rollback."),
}
"""Inputs and outputs of the checkpoint interval controller, by :meth:`WorkerMetrics.observe_interval` key."""


_families: _Families | None = None


def _make_families() -> _Families:
    """Create the metric objects once per process.

    Two objects for the same series in one process would each cache the value and overwrite each
    other's writes to the shared file, so they are module-level singletons. ``registry=None``: in
    multiprocess mode only the files matter, and the global registry is left alone.
    """
    global _families
    if _families is not None:
        return _families
    from prometheus_client import Counter, Gauge, Histogram

    p = names.PREFIX
    _families = _Families(
        steps=Counter(p + "steps", "Training steps completed by the job, as seen on this node (counted by local rank 0).",
                      registry=None),
        samples=Counter(p + "samples", "Training samples processed by this node's ranks.", registry=None),
        tokens=Counter(p + "tokens", "Training tokens processed by this node's ranks.", registry=None),
        step_time=Histogram(p + "step_duration_seconds", "Wall time of one training step, per rank.",
                            buckets=names.STEP_BUCKETS_S, registry=None),
        step=Gauge(p + "step", "Last completed training step of the live workers on this node.",
                   multiprocess_mode="livemax", registry=None),
        last_step_ts=Gauge(p + "last_step_timestamp_seconds", "Unix time of the last completed step on this node.",
                           multiprocess_mode="max", registry=None),
        ckpt_stage=Histogram(p + "checkpoint_stage_duration_seconds",
                             "Time to stage checkpoint state to host memory, per rank.", ["kind"],
                             buckets=names.CHECKPOINT_BUCKETS_S, registry=None),
        ckpt_persist=Histogram(p + "checkpoint_persist_duration_seconds",
                               "Time to persist a staged checkpoint to storage, per rank.", ["kind"],
                               buckets=names.CHECKPOINT_BUCKETS_S, registry=None),
        ckpt_blocked=Counter(p + "checkpoint_blocked_seconds", "Training time blocked by checkpoints, summed over ranks.",
                             ["kind"], registry=None),
        ckpt_bytes=Counter(p + "checkpoint_written_bytes", "Checkpoint bytes written by this node's ranks.", ["kind"],
                           registry=None),
        ckpt_saves=Counter(p + "checkpoint_saves", "Checkpoint saves completed by this node's ranks.", ["kind"],
                           registry=None),
        ckpt_failures=Counter(p + "checkpoint_failures", "Checkpoint saves that failed on this node's ranks.", ["kind"],
                              registry=None),
        ckpt_step=Gauge(p + "checkpoint_last_committed_step", "Step of the newest committed checkpoint.",
                        multiprocess_mode="max", registry=None),
        ckpt_ts=Gauge(p + "checkpoint_last_commit_timestamp_seconds", "Unix time of the newest committed checkpoint.",
                      multiprocess_mode="max", registry=None),
        gpu_peak=Gauge(p + "gpu_allocator_peak_bytes", "torch.cuda.max_memory_allocated of the live workers, per GPU.",
                       ["gpu"], multiprocess_mode="livemax", registry=None),
        train_s=Counter(p + "training_seconds",
                        "Wall time of completed training steps, as seen on this node (counted by local rank 0).",
                        registry=None),
        restores=Counter(p + "checkpoint_restores", "Checkpoint restores by this node's workers (counted by local rank 0), "
                         "by the kind of the checkpoint restored (other: nothing to restore, a start from step 0).", ["kind"], registry=None),
        restored_step=Gauge(p + "checkpoint_restored_step", "Step the live workers restored from.",
                            multiprocess_mode="livemax", registry=None),
        restore_skipped=Gauge(p + "checkpoint_restore_skipped_step",
                              "Newest committed step the live workers' restore skipped (proven corrupt, or unreadable "
                              "with checkpoint.on_unreadable=fallback); 0 when it restored the newest.",
                              multiprocess_mode="livemax", registry=None),
        restore_corrupt=Gauge(p + "checkpoint_restore_corrupt_steps",
                              "Committed steps the live workers' restore found proven corrupt (skipped and quarantined).",
                              multiprocess_mode="livemax", registry=None),
        tier_restores=Counter(p + "checkpoint_tier_restores", "Restores by this node's workers (counted by local rank "
                              "0), by the tier the state came from (memory, peer, storage, none).", ["tier"],
                              registry=None),
        memory_snapshot=Histogram(p + "checkpoint_memory_snapshot_duration_seconds",
                                  "Time to copy the checkpoint state into the node's shared memory (tier 0), per rank.",
                                  buckets=names.MEMORY_BUCKETS_S, registry=None),
        memory_bytes=Gauge(p + "checkpoint_memory_bytes",
                           "Host memory held by the in-memory snapshots (tier 0) of this node's live workers, "
                           "and the buddy replicas they hold (tier 1).",
                           multiprocess_mode="livesum", registry=None),
        replica_lag=Gauge(p + "checkpoint_memory_replica_lag_steps",
                          "Steps between this node's newest snapshot and the newest buddy replica it received (tier 1).",
                          multiprocess_mode="livemax", registry=None),
        memory_interval=Gauge(p + "checkpoint_memory_interval_steps",
                              "Steps between two in-memory snapshots (tier 0), as the world agreed it: "
                              "checkpoint.memory_interval_steps, stretched under checkpoint.memory_max_overhead.",
                              multiprocess_mode="livemax", registry=None),
        # Written by global rank 0 only (the rank whose controller decides); livemax: gone with it.
        auto={k: Gauge(p + name, doc, multiprocess_mode="livemax", registry=None) for k, (name, doc) in AUTO_GAUGES.items()},
    )
    return _families


class WorkerMetrics:
    """One per worker process; the worker runtime owns it.

    ``rank``/``local_rank`` come from the elastic environment. ``strict=True`` raises
    :class:`MetricsChannelError` when the channel is not in effect; the default disables the
    object (every method a no-op) with one warning, because metrics must never stop training.
    """

    def __init__(self, rank: int, local_rank: int, *, strict: bool = False, device: Any = None,
                 gpu: str | None = None) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.device = device
        """The worker's ``torch.device`` (``rt.device``): the allocator peak is read there, never on
        the current device. None: the current device."""
        self.gpu = gpu
        """Label of this worker's GPU series (its UUID, see ``trainguard.runtime.device.gpu_label``);
        None: the local rank."""
        self._f: _Families | None = None
        self._kinds_warned: set[str] = set()
        self._next_gpu_peak = 0.0  # monotonic s; inf once CUDA turned out to be absent
        # Kept by observe_step(defer=True) until flush(): step times (for the histogram), the last
        # step's unix time (0: none pending).
        self._step_ts = 0.0
        self._times: list[float] = []
        if not multiprocess_active():
            reason = (f"{ENV_VAR} was not set when prometheus_client was first imported in this process, so "
                      "worker metrics would never reach the agent")
            fix = (f"start workers through the trainguard agent (it sets {ENV_VAR} via "
                   "trainguard.metrics.worker_env), or export it before Python starts")
            if strict:
                raise MetricsChannelError(f"{reason}. Fix: {fix}")
            log.warning("worker_metrics_disabled", rank=rank, reason=reason, fix=fix)
            return
        self._f = _make_families()
        if local_rank == 0:
            # Declared at set-up, before the first step: the agent then counts this node's time by steps
            # (start-up is not productive), see trainguard.metrics.goodput.
            self._f.train_s.inc(0)
            for kind in names.CHECKPOINT_KINDS:
                self._f.restores.labels(kind=kind)
            for tier in names.CHECKPOINT_TIERS:
                self._f.tier_restores.labels(tier=tier)
            # Declare the checkpoint series at 0 so increase()/rate() see the first event (a series
            # born at 1 has no increase). One rank per node is enough: the agent sums the files,
            # and every extra declared series costs each scrape ~17 keys per histogram per process.
            for kind in names.CHECKPOINT_KINDS:
                for fam in (self._f.ckpt_stage, self._f.ckpt_persist, self._f.ckpt_blocked, self._f.ckpt_bytes,
                            self._f.ckpt_saves, self._f.ckpt_failures):
                    fam.labels(kind=kind)

    @property
    def enabled(self) -> bool:
        """False when the channel is not in effect and every method is a no-op."""
        return self._f is not None

    def observe_step(self, step: int, samples: int, tokens: int, step_time_s: float | None, *,
                     defer: bool = False) -> None:
        """Record one completed step: its number, this rank's samples and tokens, its time (s; None:
        recorded separately by :meth:`observe_step_time`, e.g. once the GPU's events complete).

        ``defer``: write the counters and the step gauge at once (what the agent's goodput ledger
        samples, and what a scrape reads side by side: a ledger window that saw steps run but no
        report would book their time as waste for good, and a scrape must see one global batch of
        samples per step) and keep the step-time histogram and the step's unix time in this process until the
        next :meth:`flush` (or a step recorded without ``defer``). The worker runtime defers between
        its step agreements (``workers.step_agreement_period_s``): five file writes a step, not eight."""
        f = self._f
        if f is None:
            return
        if self.local_rank == 0:
            f.steps.inc()
        if samples:
            f.samples.inc(samples)
        if tokens:
            f.tokens.inc(tokens)
        f.step.set(step)
        self._step_ts = time.time()
        if step_time_s is not None:
            self._step_time(f, step_time_s)
        if not defer:
            self.flush()

    def observe_step_time(self, step_time_s: float, *, defer: bool = False) -> None:
        """Record the time (s) of one step measured after the fact (CUDA events); ``defer`` as in
        :meth:`observe_step` (its training seconds are written at once, its histogram observation
        waits for the next :meth:`flush`)."""
        if self._f is not None:
            self._step_time(self._f, step_time_s)
            if not defer:
                self.flush()

    def _step_time(self, f: _Families, seconds: float) -> None:
        """The node's productive training seconds (local rank 0), now; the step-time histogram at the flush."""
        if self.local_rank == 0:
            f.train_s.inc(max(0.0, seconds))
        self._times.append(seconds)

    def flush(self) -> None:
        """Write what deferred :meth:`observe_step` calls kept: the step-time histogram, the last
        step's unix time."""
        f = self._f
        if f is None:
            return
        for seconds in self._times:
            f.step_time.observe(seconds)
        self._times.clear()
        if self._step_ts:
            f.last_step_ts.set(self._step_ts)
            self._step_ts = 0.0

    def _kind(self, kind: str) -> str:
        k = names.normalize_label(kind)
        if k in names.CHECKPOINT_KINDS:
            return k
        if k not in self._kinds_warned:
            self._kinds_warned.add(k)
            log.warning("checkpoint_kind_unknown", kind=kind, known=list(names.CHECKPOINT_KINDS),
                        fix="pass one of the known kinds; reported as 'other'")
        return "other"

    def observe_checkpoint(self, kind: str, stage_s: float | None, persist_s: float | None, blocked_s: float,
                           nbytes: int, step: int, ok: bool) -> None:
        """Record one checkpoint save by this rank.

        ``stage_s``: staging to host memory (s), ``persist_s``: writing to storage (s), either ``None``
        when that phase did not run; ``blocked_s``: how long training waited (s); ``nbytes``: bytes
        this rank wrote; ``ok=True`` means step ``step`` is committed (call it after the commit
        barrier), ``ok=False`` counts a failure.
        """
        f = self._f
        if f is None:
            return
        k = self._kind(kind)
        if blocked_s:
            f.ckpt_blocked.labels(kind=k).inc(blocked_s)
        if stage_s is not None:
            f.ckpt_stage.labels(kind=k).observe(stage_s)
        if not ok:
            f.ckpt_failures.labels(kind=k).inc()
            return
        if persist_s is not None:
            f.ckpt_persist.labels(kind=k).observe(persist_s)
        if nbytes:
            f.ckpt_bytes.labels(kind=k).inc(nbytes)
        f.ckpt_saves.labels(kind=k).inc()
        f.ckpt_step.set(step)
        f.ckpt_ts.set(time.time())

    def observe_checkpoint_async(self, done: Any, kind: str, stage_s: float | None, blocked_s: float, step: int) -> None:
        """Record a save of step ``step`` whose persist and commit run in the background.

        ``done``: its ``concurrent.futures.Future`` (result: committed; exception: failed). The save
        is recorded when ``done`` finishes, from the thread that finishes it, with ``persist_s``
        measured from this call; ``stage_s`` and ``blocked_s`` are the foreground part, already over.
        No bytes are recorded (the checkpoint manager does not say how many this rank wrote).
        """
        if self._f is None:
            return
        t0 = time.monotonic()

        def finished(f: Any) -> None:
            ok = not f.cancelled() and f.exception() is None
            self.observe_checkpoint(kind, stage_s, time.monotonic() - t0, blocked_s, 0, step, ok)

        done.add_done_callback(finished)

    def observe_restore(self, step: int, kind: str, *, skipped: int | None = None, corrupt: int = 0) -> None:
        """The workers restored checkpoint ``step`` of ``kind``, or start from step 0 with nothing to
        restore (``kind="other"``): the agent turns work trained past it on this node into
        ``recompute`` waste. ``skipped``: the newest committed step the restore passed over (the steps
        from ``step`` to it are recomputed too, even where this node's agent never saw them trained);
        ``corrupt``: how many steps it found proven corrupt. Counted by local rank 0."""
        f = self._f
        if f is None or self.local_rank != 0:
            return
        f.restore_skipped.set(skipped or 0)
        f.restore_corrupt.set(corrupt)
        f.restored_step.set(step)
        f.restores.labels(kind=self._kind(kind)).inc()

    def observe_restore_tier(self, tier: str) -> None:
        """The workers restored from ``tier`` (a :class:`~trainguard.contract.protocol.CheckpointTier` value).
        Counted by local rank 0."""
        f = self._f
        if f is None or self.local_rank != 0:
            return
        f.tier_restores.labels(tier=tier if tier in names.CHECKPOINT_TIERS else "none").inc()

    def observe_memory(self, seconds: float | None, nbytes: int, replica_lag: int | None = None,
                       interval: int | None = None) -> None:
        """One in-memory snapshot took ``seconds`` (None: none was taken); this rank's snapshots (and the
        replicas it holds) take ``nbytes`` of host memory; the newest replica it received is
        ``replica_lag`` steps behind (None: no tier 1); snapshots are ``interval`` steps apart."""
        f = self._f
        if f is None:
            return
        if seconds is not None:
            f.memory_snapshot.observe(seconds)
        f.memory_bytes.set(nbytes)
        if replica_lag is not None:
            f.replica_lag.set(replica_lag)
        if interval is not None:
            f.memory_interval.set(interval)

    def observe_interval(self, values: dict[str, float | None]) -> None:
        """The checkpoint interval controller's output and inputs (keys of :data:`AUTO_GAUGES`; None
        values are skipped). Call from the rank whose controller decides."""
        f = self._f
        if f is None:
            return
        for key, v in values.items():
            g = f.auto.get(key)
            if g is not None and v is not None:
                g.set(float(v))

    def sample_gpu_peak(self, now: float) -> None:
        """Report this worker's allocator peak (``torch.cuda.max_memory_allocated`` of its current
        device, :attr:`device`, labelled :attr:`gpu`) at most every :data:`GPU_PEAK_INTERVAL_S` of ``now``
        (monotonic seconds). Cheap enough to call every step. Without CUDA (or torch), or while this
        process has not initialised CUDA, nothing is read and the series stays absent: never faked."""
        if self._f is None or now < self._next_gpu_peak:
            return
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            self._next_gpu_peak = math.inf
            return
        self._next_gpu_peak = now + GPU_PEAK_INTERVAL_S
        if torch.cuda.is_initialized():  # else this process has not used its GPU (yet): nothing to report
            self.observe_gpu_peak(int(torch.cuda.max_memory_allocated(self.device)))

    def observe_gpu_peak(self, nbytes: int, gpu: int | str | None = None) -> None:
        """Record the allocator peak (``torch.cuda.max_memory_allocated``, bytes) of GPU ``gpu``
        (default: :attr:`gpu`, else this worker's local rank)."""
        f = self._f
        if f is None:
            return
        label = gpu if gpu is not None else (self.gpu if self.gpu is not None else self.local_rank)
        f.gpu_peak.labels(gpu=str(label)).set(nbytes)
