"""Metrics and cost sections of the agent config (YAML ``metrics``/``cost``, env ``TRAINGUARD_METRICS_*``/``TRAINGUARD_COST_*``)."""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.contract.configbase import require


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    enabled: bool = True
    """Serve Prometheus ``/metrics`` and ``/healthz`` from the agent."""

    bind_address: str = "127.0.0.1"
    """Address the exporter binds. Anything but loopback is an explicit choice."""

    port: int = 9400
    """Exporter port (0 picks a free one; tests use that)."""

    sample_interval_s: float = 1.0
    """Seconds between the agent's reads of worker progress (step, samples, tokens) for the
    throughput gauges and the goodput ledger. Runs in the agent, never in the workers."""

    throughput_window_s: float = 30.0
    """Window (seconds) over which ``trainguard_samples_per_second``/``tokens_per_second`` are averaged."""

    gpu: bool = True
    """Read GPU memory and utilisation through NVML. Without GPUs (or NVML) the GPU series are
    absent and one log line says why."""

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}", "pick a free TCP port, e.g. 9400")
        require(bool(self.bind_address.strip()), "bind_address", "must not be empty",
                "use 127.0.0.1 (default), or the address Prometheus scrapes, e.g. 0.0.0.0")
        require(self.sample_interval_s > 0, "sample_interval_s", f"must be > 0, got {self.sample_interval_s}", "e.g. 1")
        require(self.throughput_window_s >= 2 * self.sample_interval_s, "throughput_window_s",
                f"must be >= 2 x sample_interval_s ({2 * self.sample_interval_s}), got {self.throughput_window_s}",
                "e.g. 30")


@dataclass(kw_only=True, slots=True)
class CostConfig:
    capacity: str = "spot"
    """``spot`` or ``on_demand``: which price applies to this node."""

    spot_price_per_hour: float = 0.0
    """Price of this node per hour on spot capacity, in ``currency``."""

    on_demand_price_per_hour: float = 0.0
    """Price of this node per hour on demand, in ``currency``."""

    instance_type: str = ""
    """Instance type, used to look prices up in ``price_table_file`` when the prices above are 0."""

    price_table_file: str = ""
    """Optional YAML/JSON file mapping instance type -> {spot: x, on_demand: y}."""

    currency: str = "USD"
    """Label only; all cost metrics are in this currency."""

    def __post_init__(self) -> None:
        require(self.capacity in {"spot", "on_demand"}, "capacity", f"must be 'spot' or 'on_demand', got {self.capacity!r}",
                "set it to the purchase option of this node")
        require(self.spot_price_per_hour >= 0, "spot_price_per_hour", f"must be >= 0, got {self.spot_price_per_hour}",
                "give the node's spot price per hour")
        require(self.on_demand_price_per_hour >= 0, "on_demand_price_per_hour",
                f"must be >= 0, got {self.on_demand_price_per_hour}", "give the node's on-demand price per hour")
        require(not self.price_table_file or bool(self.instance_type), "instance_type",
                f"is empty but price_table_file is set ({self.price_table_file!r})",
                "set the node's instance type as spelled in the price table")
        require(not self.price_table_file or self.price_table_file.endswith((".yaml", ".yml", ".json")),
                "price_table_file", f"must be a .yaml/.yml/.json file, got {self.price_table_file!r}",
                "convert the table to YAML or JSON")
