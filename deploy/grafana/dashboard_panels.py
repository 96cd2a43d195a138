"""The pieces every pbsd dashboard is built from: a panel of PromQL queries, a row, a dashboard's
layout (two panels a row), and the PromQL of a histogram's mean and quantiles
(``deploy/grafana/dashboards.py`` assembles the dashboards)."""

from __future__ import annotations

DATASOURCE = {"type": "prometheus", "uid": "pbsd-prometheus"}


def _target(expr: str, legend: str, ref: str, *, fmt: str | None = None) -> dict:
    target = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}
    if fmt:
        target["format"] = fmt
    return target


def panel(
    title: str,
    description: str,
    queries: list[tuple[str, str]],
    *,
    unit: str = "short",
    kind: str = "timeseries",
    fmt: str | None = None,
    min_: float | None = None,
    max_: float | None = None,
    thresholds: list[tuple[str, float | None]] | None = None,
) -> dict:
    defaults: dict = {"unit": unit}
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    if thresholds:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": color, "value": value} for color, value in thresholds],
        }
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"}}
        if kind == "timeseries"
        else {},
        "targets": [
            _target(expr, legend, chr(ord("A") + i), fmt=fmt) for i, (expr, legend) in enumerate(queries)
        ],
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def dashboard(uid: str, title: str, description: str, items: list[dict]) -> dict:
    """Lay panels out two per row (rows span the width) and number them."""
    x = y = 0
    for i, item in enumerate(items, start=1):
        item["id"] = i
        if item["type"] == "row":
            if x:
                x, y = 0, y + 8
            item["gridPos"] = {"x": 0, "y": y, "w": 24, "h": 1}
            y += 1
            continue
        item["gridPos"] = {"x": x, "y": y, "w": 12, "h": 8}
        x = 12 if x == 0 else 0
        if x == 0:
            y += 8
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["pbsd"],
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "utc",
        "panels": items,
        "templating": {"list": []},
        "annotations": {"list": []},
    }


def mean(histogram: str, window: str = "5m", by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum(rate({histogram}_sum[{window}])){group} / sum(rate({histogram}_count[{window}])){group}"


def quantile(q: float, histogram: str, window: str = "5m", by: str = "") -> str:
    extra = f", {by}" if by else ""
    return f"histogram_quantile({q}, sum(rate({histogram}_bucket[{window}])) by (le{extra}))"
