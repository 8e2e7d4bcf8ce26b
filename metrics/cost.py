"""Cost: the node's price per hour and what the goodput partition costs.

Pure arithmetic over a :class:`~trainguard.metrics.goodput.GoodputSnapshot`; prices come from
``cost.*`` in the agent config, or from an instance-type price table file when the config prices
are 0. The price applies to paid time as the agent measures it (from agent start): boot time
before the agent starts is not counted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import yaml

from trainguard.contract.configbase import ConfigError
from trainguard.metrics.config import CostConfig
from trainguard.metrics.goodput import GoodputSnapshot


@dataclass(frozen=True, slots=True)
class Price:
    """The price that applies to this node and where it came from."""

    per_hour: float
    capacity: str
    source: str
    """``config``, ``table:<file>`` or ``unset`` (no price anywhere: cost metrics read 0)."""


def load_price_table(path: str) -> dict[str, dict[str, float]]:
    """Read ``instance_type -> {spot: x, on_demand: y}`` from a YAML or JSON file.

    Raises :class:`ConfigError` naming ``cost.price_table_file`` when the file is missing or
    malformed.
    """
    key = "cost.price_table_file"
    if not os.path.isfile(path):
        raise ConfigError(key, f"file not found: {path!r}", "point it at an existing YAML/JSON price table or leave it empty",
                          value=path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(key, f"cannot parse {path!r}: {e}", "write a mapping of instance type to "
                          "{spot: <price>, on_demand: <price>}", value=path) from e
    if not isinstance(data, dict):
        raise ConfigError(key, f"{path!r} must hold a mapping, got {type(data).__name__}",
                          "write a mapping of instance type to {spot: <price>, on_demand: <price>}", value=path)
    table: dict[str, dict[str, float]] = {}
    for itype, prices in data.items():
        if not isinstance(prices, dict):
            raise ConfigError(key, f"entry {itype!r} in {path!r} must be a mapping",
                              "use {spot: <price>, on_demand: <price>}", value=path)
        row: dict[str, float] = {}
        for cap in ("spot", "on_demand"):
            if cap in prices:
                v = prices[cap]
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or not math.isfinite(v):
                    raise ConfigError(key, f"{itype}.{cap} in {path!r} must be a number >= 0, got {v!r}",
                                      "give the price per hour as a number", value=path)
                row[cap] = float(v)
        table[str(itype)] = row
    return table


def resolve_price(cfg: CostConfig) -> Price:
    """The price per hour of this node: the config price for ``cfg.capacity`` if > 0, else the
    table entry for ``cfg.instance_type``, else 0 (``source="unset"``)."""
    direct = cfg.spot_price_per_hour if cfg.capacity == "spot" else cfg.on_demand_price_per_hour
    if direct > 0:
        return Price(direct, cfg.capacity, "config")
    if cfg.price_table_file:
        table = load_price_table(cfg.price_table_file)
        row = table.get(cfg.instance_type)
        if row is None:
            raise ConfigError("cost.instance_type", f"{cfg.instance_type!r} is not in {cfg.price_table_file!r} "
                              f"(has {sorted(table)[:10]})", "set the node's instance type as spelled in the table, "
                              "or add it to the table", value=cfg.instance_type)
        if cfg.capacity not in row:
            raise ConfigError("cost.price_table_file", f"no {cfg.capacity!r} price for {cfg.instance_type!r} in "
                              f"{cfg.price_table_file!r}", f"add {cfg.capacity}: <price> to that entry",
                              value=cfg.price_table_file)
        return Price(row[cfg.capacity], cfg.capacity, f"table:{cfg.price_table_file}")
    return Price(0.0, cfg.capacity, "unset")


def cost_of(seconds: float, price_per_hour: float) -> float:
    """Cost of ``seconds`` at ``price_per_hour``."""
    return seconds / 3600.0 * price_per_hour


@dataclass(frozen=True, slots=True)
class CostSnapshot:
    """Money view of a goodput snapshot, in the configured currency."""

    total: float
    wasted: dict[str, float] = field(default_factory=dict)
    per_million_tokens: float | None = None
    """``None`` when no token was processed (the series is then absent, never infinite)."""
    per_thousand_samples: float | None = None


def cost_snapshot(g: GoodputSnapshot, price_per_hour: float, *, tokens: float = 0.0, samples: float = 0.0) -> CostSnapshot:
    """Cost so far, wasted cost by reason, and unit costs over this node's tokens/samples."""
    total = cost_of(g.paid_s, price_per_hour)
    return CostSnapshot(
        total=total,
        wasted={r: cost_of(s, price_per_hour) for r, s in g.wasted_s.items()},
        per_million_tokens=total / tokens * 1e6 if tokens > 0 else None,
        per_thousand_samples=total / samples * 1e3 if samples > 0 else None,
    )
