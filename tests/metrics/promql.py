"""Pull the PromQL out of the shipped dashboard and alert rules (never hand-copied into tests)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

PKG = resources.files("trainguard.metrics")
DASHBOARD = Path(str(PKG / "dashboards" / "trainguard.json"))
RULES = Path(str(PKG / "rules" / "trainguard-alerts.yml"))

# Values Grafana would substitute; `.*` selects every job/node the way the "All" option does.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "${job_id}": ".*", "$job_id": ".*",
                "${node}": ".*", "$node": ".*"}


@dataclass(frozen=True, slots=True)
class Expr:
    where: str
    expr: str


def _substitute(expr: str, **values: str) -> str:
    """``expr`` with Grafana's variables replaced (``values``: e.g. ``job_id="a"`` instead of ``.*``)."""
    subst = {**GRAFANA_VARS, **{f"${k}": v for k, v in values.items()}, **{f"${{{k}}}": v for k, v in values.items()}}
    for k in sorted(subst, key=len, reverse=True):
        expr = expr.replace(k, subst[k])
    assert "$" not in expr, f"unhandled Grafana variable in {expr!r}"
    return expr


def dashboard_exprs() -> list[Expr]:
    """Every panel target and every templating query (``label_values(X, l)`` -> ``X``)."""
    dash = json.loads(DASHBOARD.read_text())
    out: list[Expr] = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append(Expr(f"panel {p['title']!r} {t.get('refId')}", _substitute(t["expr"])))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
        assert m, f"templating query {q!r} is not label_values(<selector>, <label>)"
        out.append(Expr(f"variable {var['name']}", _substitute(m.group(1))))
    return out


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


_CMP = (">=", "<=", "==", "!=", ">", "<")


def split_comparison(expr: str) -> tuple[str, str, str]:
    """``lhs op rhs`` at parenthesis depth 0 (the rule-file convention); raises ``ValueError``
    unless there is exactly one top-level comparison and no top-level ``and``/``or``/``unless``."""
    depth, i, found = 0, 0, []
    quote = ""
    while i < len(expr):
        ch = expr[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0:
            for op in _CMP:
                if expr.startswith(op, i):
                    found.append((i, op))
                    i += len(op) - 1
                    break
        i += 1
    top = re.sub(r"\([^()]*\)", "", expr)
    while re.search(r"\([^()]*\)", top):
        top = re.sub(r"\([^()]*\)", "", top)
    if re.search(r"\b(and|or|unless)\b", top):
        raise ValueError(f"top-level set operator in {expr!r}")
    if len(found) != 1:
        raise ValueError(f"expected one top-level comparison in {expr!r}, found {[op for _, op in found]}")
    pos, op = found[0]
    rhs = expr[pos + len(op):].strip()
    if rhs.startswith("bool "):
        rhs = rhs[5:]
    return expr[:pos].strip(), op, rhs


def referenced_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\btrainguard_[a-z0-9_]+", expr))
