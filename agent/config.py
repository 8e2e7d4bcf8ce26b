"""The agent's typed configuration: sections owned by each component, composed here.

Precedence: defaults < YAML file < ``TRAINGUARD_*`` environment < CLI flags. Every key has one
env var, derived mechanically (``rendezvous.min_nodes`` -> ``TRAINGUARD_RENDEZVOUS_MIN_NODES``; see
:func:`trainguard.runtime.configbase.env_var_for`). The loader lives in
:mod:`trainguard.agent.configload`; this module only declares.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from trainguard.runtime.configbase import require
from trainguard.agent.watchers.config import PreemptionConfig
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.metrics.config import CostConfig, MetricsConfig

RDZV_BACKENDS = ("c10d", "etcd-v2", "static")
LOG_FORMATS = ("auto", "json", "console")


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    job_id: str = "trainguard"
    """Run id shared by every node of one job: the rendezvous id (torchrun ``--rdzv-id``) and the
    checkpoint run folder. Nodes with different ids never meet."""

    node_name: str = field(default_factory=socket.gethostname)
    """Name of this node in logs and metrics (defaults to the hostname)."""

    state_dir: str = "/var/lib/trainguard"
    """Agent-private runtime state: the control socket, the workers' metrics directory."""

    log_dir: str = "/var/log/trainguard"
    """Per-rank worker logs go to ``<log_dir>/<job_id>/attempt_<n>/<rank>/``."""

    log_format: str = "auto"
    """``auto`` (JSON unless stderr is a TTY), ``json`` or ``console``."""

    log_level: str = "info"
    """``debug``, ``info``, ``warning`` or ``error``."""

    def __post_init__(self) -> None:
        require(bool(self.job_id) and "/" not in self.job_id, "job_id", f"must be a non-empty name without '/', got {self.job_id!r}",
                "use a short name such as 'gpt-small-run1'")
        require(self.log_format in LOG_FORMATS, "log_format", f"must be one of {list(LOG_FORMATS)}, got {self.log_format!r}",
                "use 'auto' unless you need to force one")
        require(self.log_level in {"debug", "info", "warning", "error"}, "log_level",
                f"must be debug/info/warning/error, got {self.log_level!r}", "use 'info'")


@dataclass(kw_only=True, slots=True)
class RendezvousConfig:
    backend: str = "c10d"
    """``c10d`` (TCPStore at ``endpoint``), ``etcd-v2`` (etcd with ``--enable-v2=true``) or ``static``."""

    endpoint: str = "127.0.0.1:29400"
    """``host:port`` of the rendezvous store (c10d) or of etcd (etcd-v2)."""

    min_nodes: int = 1
    """Fewest nodes the job runs with; below it the survivors wait for nodes to join."""

    max_nodes: int = 1
    """Most nodes the job runs with; extra nodes wait as spares."""

    is_host: bool | None = None
    """c10d only: whether this agent hosts the store. ``None`` = host if the endpoint is a local address
    (torchrun's rule). Spot clusters should run ``trainguard store`` on an on-demand node and set
    ``false`` on every agent, since the store dies with the node that hosts it (pytorch#67742)."""

    local_addr: str = ""
    """Address other nodes use to reach this one (defaults to the hostname's FQDN)."""

    join_timeout_s: float = 600.0
    """How long a node waits for the rendezvous to form before it fails."""

    last_call_timeout_s: float = 2.0
    """Once ``min_nodes`` have joined, how long to wait for more before the round closes. Small values
    make re-formation after a drain fast; a late node then joins through a scale-up."""

    close_timeout_s: float = 30.0
    """Deadline of the close operation when the job ends."""

    keep_alive_interval_s: int = 2
    """Heartbeat period (whole seconds, a torch limit). A node silent for interval x attempts is dead."""

    keep_alive_max_attempts: int = 3
    """Missed heartbeats before a node is declared dead. interval x attempts < 4 s risks splitting a
    job into two worlds under load."""

    def __post_init__(self) -> None:
        require(self.backend in RDZV_BACKENDS, "backend", f"must be one of {list(RDZV_BACKENDS)}, got {self.backend!r}",
                "use 'c10d' (with `trainguard store` for spot clusters) or 'etcd-v2'")
        require(self.min_nodes >= 1, "min_nodes", f"must be >= 1, got {self.min_nodes}", "set min_nodes to at least 1")
        require(self.max_nodes >= self.min_nodes, "max_nodes",
                f"max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})",
                "raise max_nodes or lower min_nodes (torchrun: --nnodes MIN:MAX)")
        host, _, port = self.endpoint.rpartition(":")
        require(bool(host) and port.isdigit() and 0 < int(port) < 65536, "endpoint",
                f"must be host:port, got {self.endpoint!r}", "e.g. '10.0.0.5:29400'")
        require(self.keep_alive_interval_s >= 1, "keep_alive_interval_s", f"must be >= 1, got {self.keep_alive_interval_s}",
                "use whole seconds, e.g. 2")
        require(self.keep_alive_max_attempts >= 2, "keep_alive_max_attempts",
                f"must be >= 2, got {self.keep_alive_max_attempts}", "use 3: one lost heartbeat must not evict a node")
        require(self.join_timeout_s > 0, "join_timeout_s", f"must be > 0, got {self.join_timeout_s}", "e.g. 600")
        require(self.last_call_timeout_s >= 0, "last_call_timeout_s", f"must be >= 0, got {self.last_call_timeout_s}", "e.g. 2")
        require(self.backend != "static" or self.min_nodes == self.max_nodes, "backend",
                "the static backend cannot change size", "use c10d or etcd-v2 for an elastic job, or set min_nodes == max_nodes")


@dataclass(kw_only=True, slots=True)
class WorkersConfig:
    entrypoint: str = ""
    """The training script (``train.py``) or, with ``module: true``, a module name. Required."""

    args: list[str] = field(default_factory=list)
    """Arguments passed to the script."""

    module: bool = False
    """Run ``entrypoint`` as ``python -m <module>`` (torchrun ``-m``)."""

    no_python: bool = False
    """Run ``entrypoint`` as an executable instead of a Python script (torchrun ``--no-python``)."""

    nproc_per_node: int = 1
    """Worker processes on this node (one per GPU)."""

    max_restarts: int = 3
    """Restarts after worker *failures* before the job fails. Planned resizes (drain, scale-up) never
    consume one."""

    monitor_interval_s: float = 0.5
    """How often the agent polls its workers."""

    restart_backoff_s: float = 1.0
    """Wait before the first restart after a failure; doubles each time, up to ``restart_backoff_max_s``."""

    restart_backoff_max_s: float = 30.0
    """Cap of the restart backoff."""

    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the workers."""

    tee: bool = True
    """Copy worker stdout/stderr to the agent's stderr (prefixed with the rank) as well as the log files."""

    exit_barrier_timeout_s: float = 300.0
    """On success, how long to wait for the other nodes' workers to finish."""

    reform: str = "in-process"
    """How the world changes size for worker-API scripts: ``in-process`` (the workers that stay keep
    their processes and state; a joiner warms up before the world pauses for it; a failure falls back
    to ``restart``) or ``restart`` (every change restarts the workers, which restore from storage).
    Scripts without the worker API always restart."""

    reform_timeout_s: float = 120.0
    """How long a parked worker waits for its new world (and a joiner's workers for theirs) before it
    gives up and the agent restarts the world."""

    def __post_init__(self) -> None:
        require(self.nproc_per_node >= 1, "nproc_per_node", f"must be >= 1, got {self.nproc_per_node}",
                "set it to the number of GPUs (or CPU workers) on this node")
        require(self.max_restarts >= 0, "max_restarts", f"must be >= 0, got {self.max_restarts}", "use 0 to never restart")
        require(self.monitor_interval_s > 0, "monitor_interval_s", f"must be > 0, got {self.monitor_interval_s}", "e.g. 0.5")
        require(self.restart_backoff_s >= 0, "restart_backoff_s", f"must be >= 0, got {self.restart_backoff_s}", "e.g. 1")
        require(self.restart_backoff_max_s >= self.restart_backoff_s, "restart_backoff_max_s",
                f"must be >= restart_backoff_s ({self.restart_backoff_s}), got {self.restart_backoff_max_s}", "e.g. 30")
        require(not (self.module and self.no_python), "module", "module and no_python are mutually exclusive",
                "choose one way to start the entrypoint")
        require(self.reform in ("in-process", "restart"), "reform", f"must be in-process or restart, got {self.reform!r}",
                "use 'in-process' (default) or 'restart'")
        require(0 < self.reform_timeout_s <= 3600, "reform_timeout_s",
                f"must be within (0, 3600] seconds, got {self.reform_timeout_s}", "e.g. 120")


@dataclass(kw_only=True, slots=True)
class TrainguardConfig:
    agent: AgentConfig = field(default_factory=AgentConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cost: CostConfig = field(default_factory=CostConfig)


SECTIONS: dict[str, type] = {
    "agent": AgentConfig,
    "rendezvous": RendezvousConfig,
    "workers": WorkersConfig,
    "checkpoint": CheckpointConfig,
    "preemption": PreemptionConfig,
    "metrics": MetricsConfig,
    "cost": CostConfig,
}
