"""The Grafana dashboards under deploy/grafana/ are valid JSON, select their Prometheus through a
`${datasource}` variable, and query only metrics that docs/metrics.md lists (that the services export)."""

from __future__ import annotations

import json
import re

import pytest
from metrics_doc import ROOT, documented_metrics

DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "le",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w$.])([A-Za-z_:][A-Za-z0-9_:]*)\b(\s*\()?")


def metric_names(promql: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, labels and literals removed)."""
    text = _STRING.sub('""', promql)
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _GROUPING.sub("", text)
    return {
        m.group(1) for m in _IDENT.finditer(text) if not m.group(2) and m.group(1).lower() not in PROMQL_WORDS
    }


def walk(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from walk(panel.get("panels", []))


def expressions(dashboard: dict) -> list[str]:
    out = [
        t["expr"] for p in walk(dashboard.get("panels", [])) for t in p.get("targets", []) if t.get("expr")
    ]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_]\w*\s*\)\s*", query)
            out.append(match.group(1) if match else query)
    return out


def exported_series() -> set[str]:
    names = set()
    for metric in documented_metrics().values():
        names.update(metric.series_names())
    return names


@pytest.mark.unit
def test_promql_metric_name_extraction():
    assert metric_names(
        'histogram_quantile(0.95, sum by (le, phase) (rate(a_bucket{x=~"$v"}[$__rate_interval])))'
    ) == {"a_bucket"}
    assert metric_names("max by (run_id) (b) - on (run_id) c * 1024") == {"b", "c"}
    assert metric_names('sum(rate(d_total[5m])) / ignoring(lane) e{lane="nixl"} > bool 0') == {"d_total", "e"}


@pytest.mark.unit
def test_there_are_dashboards_for_the_loop_weight_sync_and_the_gpu_fleet():
    assert {p.stem for p in DASHBOARDS} >= {"rl-loop", "weight-sync", "gpu-fleet"}


@pytest.mark.unit
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_uses_datasource_variable_and_only_exported_metrics(path):
    dashboard = json.loads(path.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in walk(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            source = target.get("datasource") or panel.get("datasource")
            assert source and source.get("uid") == "${datasource}", (panel.get("title"), source)
    exprs = expressions(dashboard)
    assert exprs
    allowed = exported_series()
    unknown = {name: expr for expr in exprs for name in metric_names(expr) if name not in allowed}
    assert not unknown, f"{path.name} queries metrics no service exports: {unknown}"
