"""Metrics and cost sections of the agent config (YAML ``metrics``/``cost``, env ``TRAINGUARD_METRICS_*``/``TRAINGUARD_COST_*``)."""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.agent.configbase import require


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    enabled: bool = True
    """Serve Prometheus ``/metrics`` and ``/healthz`` from the agent."""

    bind_address: str = "127.0.0.1"
    """Address the exporter binds. Anything but loopback is an explicit choice."""

    port: int = 9400
    """Exporter port (0 picks a free one; tests use that)."""

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}", "pick a free TCP port, e.g. 9400")


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
