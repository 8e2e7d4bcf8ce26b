"""Preemption section of the agent config (YAML ``preemption``, env ``TRAINGUARD_PREEMPTION_*``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainguard.agent.lead import FACTOR, MIN_S, UNMEASURED_S
from trainguard.contract.configbase import require

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

    azure_vm_name: str = ""
    """This VM's name as Azure Scheduled Events lists it in ``Resources``; empty: read it from IMDS
    ``/metadata/instance/compute/name``. Only events naming this VM count."""

    aws_token_ttl_s: int = 21600
    """Lifetime requested for the IMDSv2 session token (1..21600 s); refreshed before it expires."""

    gcp_wait_timeout_s: int = 60
    """``timeout_sec`` of one GCP ``wait_for_change`` long-poll (the watcher re-polls at once)."""

    probe_timeout_s: float = 1.0
    """Timeout of each ``auto`` cloud probe; off-cloud the probes fail fast (refused or timeout)."""

    sigusr1: bool = False
    """Treat SIGUSR1 as a notice (SLURM ``--signal=USR1@N``)."""

    signal_escalate: bool = True
    """A second SIGTERM/SIGINT escalates to a ``stop`` notice with no grace (deadline now); a third
    restores the previous handler and re-delivers the signal, so the agent can always be killed."""

    signal_deadline_s: float = 30.0
    """Deadline assumed for SIGTERM/SIGINT/SIGUSR1 notices (systemd ``TimeoutStopSec`` minus margin)."""

    default_deadline_s: float = 30.0
    """Deadline assumed when a source gives none (GCP preemption is 30 s)."""

    on_early_warning: str = "checkpoint"
    """What an early warning does (AWS rebalance recommendation, GCP live migration, Azure Freeze):
    ``checkpoint`` (one out-of-cycle checkpoint, the node stays in the job), ``drain`` (leave as on a
    spot interruption) or ``ignore``. Azure Reboot/Redeploy restart the VM: with ``checkpoint`` the node
    checkpoints at once and drains ``drain_lead_s`` before the event."""

    drain_lead_s: str = "auto"
    """Seconds before a scheduled event's start at which a delayed drain begins (Azure Reboot/Redeploy
    with ``on_early_warning: checkpoint``, and cloud terminations with ``train_through_notice``); events
    closer than this drain at once. ``auto`` (the default) sizes it at each notice from what this node's
    workers reported: ``drain_lead_factor`` x (a step, the 99th percentile of its steps, + its longest checkpoint
    stage + persist, any kind), at least ``drain_lead_min_s``; ``drain_lead_unmeasured_s`` before
    anything was measured. A number fixes it: keep it above the emergency checkpoint's time plus the leave."""

    drain_lead_min_s: float = MIN_S
    """``drain_lead_s: auto``: the shortest lead, seconds."""

    drain_lead_factor: float = FACTOR
    """``drain_lead_s: auto``: the lead as a multiple of the measured drain cost."""

    drain_lead_unmeasured_s: float = UNMEASURED_S
    """``drain_lead_s: auto``: the lead while this node has measured no step and no checkpoint yet."""

    train_through_notice: bool = True
    """Keep training after a cloud termination notice (AWS ``instance-action``, GCP ``preempted``, Azure
    ``Preempt``/``Terminate``) whose deadline is more than the drain lead away: one out-of-cycle
    checkpoint at once (insurance against an early reclaim), then the drain the lead before the
    deadline. AWS's 2-minute notice then trains about 100 s longer per removed node instead of idling
    them out. Off: drain at once. Signals and ``trainguard drain`` always drain at once, and so does a node
    whose workers do not use the worker API (no insurance checkpoint possible)."""

    term_grace_s: float = 25.0
    """For scripts without the worker API: seconds between SIGTERM and SIGKILL to workers on a notice
    (torchrun's fixed gap is 30 s)."""

    @property
    def fixed_drain_lead_s(self) -> float | None:
        """``drain_lead_s`` as seconds; None for ``auto``."""
        lead = str(self.drain_lead_s).strip().lower()
        return None if lead == "auto" else float(lead)

    def __post_init__(self) -> None:
        bad = [s for s in self.sources if s not in SOURCES]
        require(not bad, "sources", f"unknown source(s) {bad}", f"choose from {list(SOURCES)}")
        require(self.poll_interval_s > 0, "poll_interval_s", f"must be > 0, got {self.poll_interval_s}", "e.g. 2")
        require(self.request_timeout_s > 0, "request_timeout_s", f"must be > 0, got {self.request_timeout_s}", "e.g. 2")
        require(self.on_early_warning in ("checkpoint", "drain", "ignore"), "on_early_warning",
                f"must be checkpoint, drain or ignore, got {self.on_early_warning!r}",
                "use 'checkpoint' to keep the node in the job after an early warning")
        try:
            fixed = self.fixed_drain_lead_s
        except ValueError:
            fixed = math.nan
        require(fixed is None or 0 < fixed < 3600, "drain_lead_s",
                f"must be auto or seconds within (0, 3600), got {self.drain_lead_s!r}", "e.g. auto, or 20")
        require(0 < self.drain_lead_min_s < 3600, "drain_lead_min_s",
                f"must be within (0, 3600) seconds, got {self.drain_lead_min_s}", "e.g. 10")
        require(1 <= self.drain_lead_factor <= 100, "drain_lead_factor",
                f"must be within [1, 100], got {self.drain_lead_factor}", "e.g. 3")
        require(0 < self.drain_lead_unmeasured_s < 3600, "drain_lead_unmeasured_s",
                f"must be within (0, 3600) seconds, got {self.drain_lead_unmeasured_s}", "e.g. 30")
        require(self.term_grace_s >= 0, "term_grace_s", f"must be >= 0, got {self.term_grace_s}", "e.g. 25")
        require(bool(self.sources), "sources", "is empty", "list at least one source, or [none]")
        require("none" not in self.sources or len(set(self.sources)) == 1, "sources",
                f"`none` cannot be combined with other sources ({self.sources})", "use [none] alone")
        require(self.default_deadline_s > 0, "default_deadline_s", f"must be > 0, got {self.default_deadline_s}",
                "e.g. 30")
        require(1 <= self.aws_token_ttl_s <= 21600, "aws_token_ttl_s",
                f"must be within 1..21600 (IMDSv2 limit), got {self.aws_token_ttl_s}", "e.g. 21600")
        require(1 <= self.gcp_wait_timeout_s <= 3600, "gcp_wait_timeout_s",
                f"must be within 1..3600, got {self.gcp_wait_timeout_s}", "e.g. 60")
        require(self.probe_timeout_s > 0, "probe_timeout_s", f"must be > 0, got {self.probe_timeout_s}", "e.g. 1")
        require(self.signal_deadline_s > 0, "signal_deadline_s", f"must be > 0, got {self.signal_deadline_s}", "e.g. 30")
