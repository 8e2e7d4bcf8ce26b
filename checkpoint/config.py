"""Checkpoint section of the agent config (YAML key ``checkpoint``, env ``TRAINGUARD_CHECKPOINT_*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.checkpoint.interval import INTERVAL_SYNTAX, AutoSettings, IntervalPolicy, parse_interval, policy_from_config
from trainguard.contract.configbase import FieldError, require


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    url: str = ""
    """Where checkpoints go: a path, ``file://``, ``s3://bucket/prefix``, ``gs://bucket/prefix`` or
    ``memory://`` (tests). Kept as ``str``: ``pathlib.Path`` collapses the ``//`` in ``gs://``.
    Empty disables checkpoints (the agent then only forwards SIGTERM to workers)."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to fsspec (e.g. ``{"endpoint_url": ...}`` for s3fs). Credentials come from the standard
    provider chains; secrets here are redacted in logs."""

    interval: str = ""
    """When to take periodic (async) checkpoints: ``auto`` (tuned online from the measured save cost and
    the rate of unannounced failures, Young/Daly; see :mod:`trainguard.checkpoint.interval`), a number of
    steps (``50``), a duration of training (``90s``, ``5m``, ``1.5h``) or ``off``. Unset: ``auto``, unless
    the deprecated ``interval_steps`` / ``interval_s`` are set."""

    interval_min_s: float = 5.0
    """``auto``: shortest interval, seconds (the persist time of a save is a floor too)."""

    interval_max_s: float = 3600.0
    """``auto``: longest interval, seconds."""

    interval_prior_mtbf_s: float = 3600.0
    """``auto``: mean time between unannounced failures of the job assumed before any is seen, seconds
    (a one-failure prior: it fades as training time accumulates)."""

    interval_hysteresis: float = 0.2
    """``auto``: a new optimum replaces the interval in effect only when it differs by more than this
    fraction (or crosses a bound)."""

    interval_steps: int = 0
    """Deprecated: use ``interval: <steps>``. Periodic checkpoint every N steps (0 = off)."""

    interval_s: float = 0.0
    """Deprecated: use ``interval: <duration>``. Periodic checkpoint every T seconds of training (0 = off)."""

    keep_last: int = 3
    """Committed checkpoints to retain (>= 2: the newest may still be being restored from)."""

    quarantine_keep: int = 3
    """Proven-corrupt steps (a size or CRC32 that does not match the manifest, a missing file, a
    malformed manifest) are never deleted on their own: garbage collection moves them into
    ``<url>/<run_id>/quarantine/`` as evidence, where ``trainguard checkpoints ls --all`` lists them. The
    newest N quarantined steps are kept (0: all)."""

    async_save: bool = True
    """Persist in the background; training blocks only while state is staged to host memory."""

    when_busy: str = "defer"
    """A periodic save that comes due while the previous one still persists (on any rank): ``defer``
    (train on; take it at the first step boundary at which none persists: no stall when storage is
    slower than the interval) or ``wait`` (every rank waits for the previous save, then saves at the
    due step: a checkpoint at every interval step, at the cost of the stall)."""

    retry_attempts: int = 5
    """Attempts per storage operation on transient errors (exponential backoff)."""

    retry_deadline_s: float = 120.0
    """Total time budget for the retries of one storage operation."""

    verify: bool = True
    """Verify sizes and checksums from the manifest on restore."""

    restore_deadline_s: float = 300.0
    """How long a restore keeps retrying a committed step that is *unreadable now* (timeouts, HTTP
    5xx, throttling) before giving up on it. Keep it below the process-group timeout: the other ranks
    wait in a collective meanwhile."""

    on_unreadable: str = "fail"
    """What a restore does with a committed step that stays unreadable (past ``restore_deadline_s``,
    or at once on a permission error): ``fail`` (raise a clear error; nothing in storage changes) or
    ``fallback`` (restore the next older step; nothing is marked stale or deleted)."""

    memory_interval_steps: int = 1
    """Tier 0: snapshot every worker's checkpoint state into shared memory owned by the node's agent
    every N steps (0 = off; the default 1 is every step, stretched under ``memory_max_overhead``). A
    worker killed without notice is then restarted from the newest step every rank snapshotted, losing
    at most N steps, instead of from the last checkpoint in storage. Needs the trainguard agent (it owns
    the memory: a worker's death leaves it intact) and a ``url``; under plain torchrun nothing is
    snapshotted, nor where DDP re-forms in place (``memory_replicated_in_place``). Costs two copies of
    each rank's state in host memory (capped: ``memory_max_bytes``)."""

    memory_max_overhead: float = 0.03
    """Tier 0: the largest share of the step time snapshots may cost (e.g. ``0.03``: 3 %). Above it the
    snapshots are taken less often than every ``memory_interval_steps`` (which stays the floor): each
    rank measures what its snapshots block the training loop for and its step time, proposes the
    smallest interval that keeps within the share, and at each step agreement the world takes the
    largest proposal (every rank snapshots the same steps; each change is logged as
    ``memory_interval_changed``). A worker killed without notice then loses at most that many steps.
    The default, 3 %, takes a snapshot every step where that costs at most 3 % of the step. 0: every
    ``memory_interval_steps`` steps whatever it costs."""

    memory_replicated_in_place: bool = False
    """Tier 0 also where it is redundant with the live state: replicated state (DDP) re-forming in place
    (``workers.reform: in-process``). Off: such a job takes no snapshots (rank 0 logs
    ``memory_tier_redundant``): a lost worker or node is restored from a live peer, which holds every
    rank's state, so snapshots would only cost step time; they would help only where every worker dies at
    once or an in-place re-formation falls back to a restart (then the restore is from storage). On:
    snapshots every ``memory_interval_steps`` as for any other job."""

    memory_max_bytes: int = 0
    """Tier 0 (+ tier 1): the most host memory this node's snapshots may take, in bytes (all local
    workers, both buffers of each, and the buddy replicas with ``memory_replica``). 0: at most half of
    the memory the host has available (``MemAvailable`` in ``/proc/meminfo``, plus what the node's
    snapshots already hold), and the free space of ``memory_dir``. A state that does not fit is refused
    with an error naming this key (``memory_tier_refused``): that worker takes no snapshots, training
    goes on."""

    memory_replica: bool = False
    """Tier 1: also copy each rank's newest snapshot to a buddy rank on the next node, in the background
    (double-buffered; at most one replica per source rank). A world that lost a whole node then
    restores the lost ranks' state from the replicas (resharded when the world shrank: FSDP2,
    tensor-parallel and ZeRO shards). Doubles tier 0's memory. Replicated state (DDP) keeps no replicas
    (logged as ``memory_replica_redundant``): every node's own snapshots restore any rank."""

    memory_replica_parity: bool = False
    """Tier 1 as XOR parity instead of copies (with ``memory_replica``): the nodes form groups of up to 8;
    each rank keeps one own snapshot (not two) and two parity blocks of ``1 / (nodes - 1)`` of a snapshot,
    so tier 0 + tier 1 take ``1 + 2 / (nodes - 1)`` of the state (2.0 with 3 nodes; copies take 4). One
    lost node per group is rebuilt at restore from the survivors (``memory_parity_rebuilt``). Each
    snapshot's exchange runs beside the next forward and backward, and the next ``optimizer.step()``
    waits for what is left of it; the durable save stages from the training tensors, not from the
    snapshot. Ignored where ``memory_replica`` keeps no replicas (DDP)."""

    memory_failure_domain: str = ""
    """Tier 1: this node's failure domain (a rack, a zone, a power feed: what fails together). When the
    nodes name theirs, each node's buddy is chosen in another domain (possible while no domain holds
    more than half the nodes; else logged as ``memory_replica_buddies`` with ``separated: false``).
    Empty: the buddy is the next node."""

    memory_dir: str = "/dev/shm"
    """Tier 0: the memory-backed folder (tmpfs) the agent creates its node's snapshot folder in
    (``<memory_dir>/trainguard-<job_id>-<node>/``, removed when the job ends or the node leaves)."""

    def __post_init__(self) -> None:
        require(self.memory_replica or not self.memory_replica_parity, "memory_replica_parity",
                "needs memory_replica: true (parity is how tier 1 keeps its redundancy)",
                "set checkpoint.memory_replica: true (TRAINGUARD_CHECKPOINT_MEMORY_REPLICA=1), or drop memory_replica_parity")
        require(self.when_busy in ("defer", "wait"), "when_busy", f"must be defer or wait, got {self.when_busy!r}",
                "use defer (the default) unless every interval step must have its own checkpoint")
        require(self.memory_interval_steps >= 0, "memory_interval_steps", f"must be >= 0, got {self.memory_interval_steps}",
                "use 0 to turn in-memory snapshots off, 1 to snapshot every step")
        require(0 <= self.memory_max_overhead < 1, "memory_max_overhead",
                f"must be in [0, 1), got {self.memory_max_overhead}",
                "use 0 to snapshot every memory_interval_steps steps whatever it costs, or a share such as 0.03")
        require(self.memory_max_bytes >= 0, "memory_max_bytes", f"must be >= 0, got {self.memory_max_bytes}",
                "use 0 for no cap besides the free space of memory_dir, or a number of bytes")
        require(bool(self.memory_dir) and self.memory_dir.startswith("/"), "memory_dir",
                f"must be an absolute path, got {self.memory_dir!r}", "use a tmpfs folder such as /dev/shm")
        require(self.keep_last >= 2, "keep_last", f"must be >= 2, got {self.keep_last}",
                "keep at least 2 committed checkpoints, as the newest may be the one being restored")
        require(self.quarantine_keep >= 0, "quarantine_keep", f"must be >= 0, got {self.quarantine_keep}",
                "use 0 to keep every quarantined (proven-corrupt) step, or how many of the newest to keep")
        require(self.interval_steps >= 0, "interval_steps", f"must be >= 0, got {self.interval_steps}",
                "use 0 to disable step-based periodic checkpoints")
        require(self.interval_s >= 0, "interval_s", f"must be >= 0, got {self.interval_s}",
                "use 0 to disable time-based periodic checkpoints")
        require(self.interval_min_s > 0, "interval_min_s", f"must be > 0, got {self.interval_min_s}",
                "give the auto interval a positive floor in seconds, e.g. 5")
        require(self.interval_max_s >= self.interval_min_s, "interval_max_s",
                f"must be >= interval_min_s ({self.interval_min_s}), got {self.interval_max_s}", "e.g. 3600")
        require(self.interval_prior_mtbf_s > 0, "interval_prior_mtbf_s", f"must be > 0, got {self.interval_prior_mtbf_s}",
                "give a prior mean time between unannounced failures in seconds, e.g. 3600")
        require(0 <= self.interval_hysteresis < 1, "interval_hysteresis", f"must be in [0, 1), got {self.interval_hysteresis}",
                "use a fraction such as 0.2")
        if str(self.interval).strip():
            try:
                parse_interval(self.interval)
            except ValueError as e:
                raise FieldError("interval", str(e), f"use {INTERVAL_SYNTAX}") from None
            legacy = [k for k in ("interval_steps", "interval_s") if getattr(self, k)]
            require(not legacy, "interval", f"set together with the deprecated {', '.join(legacy)}",
                    f"keep only `interval` (e.g. interval: {self.interval}) and remove {', '.join(legacy)}")
        require(self.retry_attempts >= 1, "retry_attempts", f"must be >= 1, got {self.retry_attempts}",
                "use 1 for no retries")
        require(self.retry_deadline_s > 0, "retry_deadline_s", f"must be > 0, got {self.retry_deadline_s}",
                "give the retries of one storage operation a positive time budget in seconds")
        require(self.restore_deadline_s >= 0, "restore_deadline_s", f"must be >= 0, got {self.restore_deadline_s}",
                "give restore a time budget in seconds for retrying unreadable steps (0: no retries)")
        require(self.on_unreadable in ("fail", "fallback"), "on_unreadable",
                f"must be 'fail' or 'fallback', got {self.on_unreadable!r}",
                "use 'fail' to stop on an unreadable newest step, 'fallback' to restore an older one")
        if self.url:
            scheme = self.url.split("://", 1)[0] if "://" in self.url else "file"
            require(scheme in {"file", "s3", "gs", "gcs", "memory"}, "url",
                    f"unsupported scheme {scheme!r} in {self.url!r}",
                    "use a path, file://, s3://, gs:// or memory://")

    def interval_policy(self) -> tuple[IntervalPolicy, list[str]]:
        """The periodic checkpoint policy in effect and the deprecated keys it came from (if any)."""
        return policy_from_config(self.interval, self.interval_steps, self.interval_s)

    def auto_settings(self) -> AutoSettings:
        """The ``interval_*`` knobs of the auto controller."""
        return AutoSettings(min_s=self.interval_min_s, max_s=self.interval_max_s,
                            prior_mtbf_s=self.interval_prior_mtbf_s, hysteresis=self.interval_hysteresis)
