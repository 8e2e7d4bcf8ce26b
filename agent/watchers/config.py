"""Preemption section of the agent config (YAML ``preemption``, env ``TRAINGUARD_PREEMPTION_*``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.agent.configbase import require

SOURCES = ("auto", "aws", "gcp", "azure", "signal", "none")


@dataclass(kw_only=True, slots=True)
class PreemptionConfig:
    sources: list[str] = field(default_factory=lambda: ["auto", "signal"])
    """Notice sources to watch: ``auto`` (probe which cloud this node is on), ``aws``, ``gcp``,
    ``azure``, ``signal`` (SIGTERM/SIGINT, plus SIGUSR1 when ``sigusr1`` is on), ``none``."""

    poll_interval_s: float = 2.0
    """Seconds between metadata polls (GCP uses ``wait_for_change`` long-polls instead)."""

    request_timeout_s: float = 2.0
    """Timeout of one metadata HTTP request; a slow answer is logged and the watcher goes on."""

    aws_endpoint: str = "http://169.254.169.254"
    """AWS IMDS base URL (tests point it at a local emulator)."""

    gcp_endpoint: str = "http://metadata.google.internal"
    """GCP metadata server base URL."""

    azure_endpoint: str = "http://169.254.169.254"
    """Azure IMDS base URL (Scheduled Events live under ``/metadata/scheduledevents``)."""

    aws_rebalance: bool = True
    """Also treat the AWS rebalance recommendation as an (early, lower-priority) notice."""

    azure_acknowledge: bool = True
    """Acknowledge (StartRequests) the Azure Preempt event once the checkpoint is committed."""

    sigusr1: bool = False
    """Treat SIGUSR1 as a notice (SLURM ``--signal=USR1@N``)."""

    signal_deadline_s: float = 30.0
    """Deadline assumed for SIGTERM/SIGINT/SIGUSR1 notices (systemd ``TimeoutStopSec`` minus margin)."""

    default_deadline_s: float = 30.0
    """Deadline assumed when a source gives none (GCP preemption is 30 s)."""

    term_grace_s: float = 25.0
    """For scripts without the worker API: seconds between SIGTERM and SIGKILL to workers on a notice
    (torchrun's fixed gap is 30 s)."""

    def __post_init__(self) -> None:
        bad = [s for s in self.sources if s not in SOURCES]
        require(not bad, "sources", f"unknown source(s) {bad}", f"choose from {list(SOURCES)}")
        require(self.poll_interval_s > 0, "poll_interval_s", f"must be > 0, got {self.poll_interval_s}", "e.g. 2")
        require(self.request_timeout_s > 0, "request_timeout_s", f"must be > 0, got {self.request_timeout_s}", "e.g. 2")
        require(self.term_grace_s >= 0, "term_grace_s", f"must be >= 0, got {self.term_grace_s}", "e.g. 25")
        require(self.signal_deadline_s > 0, "signal_deadline_s", f"must be > 0, got {self.signal_deadline_s}", "e.g. 30")
