"""Grafana's dashboards evaluated without Grafana: every panel's PromQL, with Grafana's own
variables replaced as Grafana would for the chosen time range, through Prometheus' HTTP API.

Grafana has no Debian package and no registry can be reached here, so this is how the stack test
proves each provisioned panel would draw something: the query Grafana sends, asked of the real
Prometheus of the stack over the range of a finished run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["PanelQuery", "grafana_expr", "panel_queries", "query_range"]


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    expr: str


def panel_queries(dashboards: Path) -> list[PanelQuery]:
    """Every target of every panel (rows included, for their collapsed panels) of every dashboard."""
    out = []
    for path in sorted(dashboards.glob("*.json")):
        board = json.loads(path.read_text())
        panels = list(board["panels"])
        panels += [p for row in board["panels"] for p in row.get("panels", [])]
        for panel in panels:
            for target in panel.get("targets", []):
                out.append(PanelQuery(path.stem, panel["title"], target["expr"]))
    return out


def grafana_expr(expr: str, range_s: int, step_s: int) -> str:
    """Grafana's global variables as Grafana substitutes them for a time range of ``range_s``
    seconds drawn at ``step_s`` seconds a point."""
    values = {
        "__range_s": str(range_s),
        "__range_ms": str(range_s * 1000),
        "__range": f"{range_s}s",
        "__rate_interval": f"{max(4 * step_s, step_s + 15)}s",  # scrape interval 10s: 4x it at least
        "__interval_ms": str(step_s * 1000),
        "__interval": f"{step_s}s",
    }
    names = "|".join(sorted(values, key=len, reverse=True))
    return re.sub(r"\$\{?(" + names + r")\}?", lambda m: values[m.group(1)], expr)


def query_range(prometheus: str, expr: str, start: float, end: float, step_s: int) -> list[dict]:
    """The series ``expr`` yields over [start, end]; raises on a query Prometheus refuses."""
    reply = httpx.get(
        f"{prometheus}/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": step_s},
        timeout=60,
    ).json()
    if reply.get("status") != "success":
        raise ValueError(f"{expr}: {reply.get('errorType')}: {reply.get('error')}")
    return [s for s in reply["data"]["result"] if s.get("values")]
