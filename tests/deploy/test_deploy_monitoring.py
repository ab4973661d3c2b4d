"""Monitoring wiring: Grafana ConfigMaps generated from deploy/grafana (and failing on drift),
dashboards and alert rules that only use metrics the services export, ServiceMonitors and
PodMonitors that find their targets, the configurable `release` label, and alerts that fire."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from k8s_render import (
    K8S,
    OVERLAYS,
    ROOT,
    exported_metric_names,
    find,
    load_yaml,
    pod_template,
    pods_selected,
    promql_metric_names,
    render_dir,
    render_overlay,
    selector_matches,
)

TOOL = ROOT / "tools" / "k8s_monitoring.py"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
RULES = ROOT / "deploy" / "prometheus" / "rules" / "furlong-alerts.yaml"
DCGM_NAMES = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE"}
DS = {"type": "prometheus", "uid": "${datasource}"}


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=60)


def walk_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


@pytest.mark.integration
def test_generated_files_match_their_sources():
    result = run_tool("--check", "--root", str(ROOT))
    assert result.returncode == 0, result.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
    "source,old",
    [
        ("deploy/grafana/dashboards/rl-loop.json", '"title": "Furlong / RL loop"'),
        ("deploy/prometheus/rules/furlong-alerts.yaml", "for: 2m"),
    ],
)
def test_drift_is_detected(tmp_path, source, old):
    for part in ("deploy/grafana", "deploy/prometheus", "deploy/k8s/components/monitoring"):
        shutil.copytree(ROOT / part, tmp_path / part)
    assert run_tool("--check", "--root", str(tmp_path)).returncode == 0
    path = tmp_path / source
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, old[:-1] + "0" + old[-1], 1))
    result = run_tool("--check", "--root", str(tmp_path))
    assert result.returncode == 1
    assert "out of date" in result.stderr
    assert run_tool("--root", str(tmp_path)).returncode == 0  # regenerating fixes it
    assert run_tool("--check", "--root", str(tmp_path)).returncode == 0


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_dashboard_ships_as_a_sidecar_configmap(overlay):
    objects = render_overlay(overlay)
    maps = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    shipped = {key: text for m in maps for key, text in m["data"].items()}
    assert set(shipped) == {p.name for p in DASHBOARDS}
    for path in DASHBOARDS:
        assert shipped[path.name] == path.read_text()


@pytest.mark.unit
def test_dashboards_cover_the_loop_weight_sync_and_gpus_with_a_datasource_variable():
    assert {p.stem for p in DASHBOARDS} >= {"rl-loop", "weight-sync", "gpu-fleet"}
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        uids.add(board["uid"])
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        panels = list(walk_panels(board["panels"]))
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), path.name
        graphs = [p for p in panels if p["type"] != "row"]
        assert len(graphs) >= 8, path.name
        for panel in graphs:
            assert panel["datasource"] == DS, (path.name, panel["title"])
            assert panel["targets"], (path.name, panel["title"])
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24
            for target in panel["targets"]:
                assert target["datasource"] == DS
        for var in variables.values():
            if var["type"] == "query":
                assert var["datasource"] == DS
    assert len(uids) == len(DASHBOARDS)


@pytest.mark.unit
def test_dashboards_only_query_exported_metrics():
    known = exported_metric_names()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        allowed = known | (DCGM_NAMES if path.stem == "gpu-fleet" else set())
        exprs = [t["expr"] for p in walk_panels(board["panels"]) for t in p.get("targets", [])]
        exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
        used = set()
        for expr in exprs:
            label_values = re.fullmatch(r"label_values\((.+),\s*\w+\)", expr)
            if label_values:  # Grafana's label_values(<selector>, <label>)
                expr = label_values.group(1)
            names = promql_metric_names(expr)
            assert names, f"{path.name}: no metric in {expr!r}"
            assert names <= allowed, f"{path.name}: unknown metrics {names - allowed} in {expr!r}"
            used |= names
        assert used, path.name


@pytest.mark.unit
def test_alert_rules_only_use_exported_metrics_and_cover_the_failure_modes():
    known = exported_metric_names() | {"up"}
    rules = [r for g in load_yaml(RULES)["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert {
        "FurlongServiceDown",
        "FurlongRolloutEnginesMissing",
        "FurlongWeightVersionLag",
        "FurlongEngineVersionLag",
        "FurlongWeightSyncStalled",
        "FurlongRewardNaN",
        "FurlongLossNaN",
    } <= names
    for rule in rules:
        used = promql_metric_names(rule["expr"])
        assert used and used <= known, f"{rule['alert']}: unknown {used - known}"
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]


@pytest.mark.integration
def test_promtool_accepts_the_rules_and_the_alerts_fire(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    check = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    shutil.copy(RULES, tmp_path / "rules.yaml")
    (tmp_path / "tests.yaml").write_text(
        textwrap.dedent("""\
        rule_files: [rules.yaml]
        evaluation_interval: 1m
        tests:
          - interval: 1m
            input_series:
              - series: 'furlong_controller_reward_mean{run_id="r1"}'
                values: '0.5 0.5 NaN NaN NaN'
              - series: 'furlong_trainer_policy_version{run_id="r1"}'
                values: '1+1x20'
              - series: 'furlong_broker_committed_version{run_id="r1"}'
                values: '1x20'
              - series: 'up{job="furlong-rollout", instance="10.0.0.1:9090"}'
                values: '1 1 0 0 0 0'
            alert_rule_test:
              - eval_time: 4m
                alertname: FurlongRewardNaN
                exp_alerts:
                  - exp_labels: {severity: critical, run_id: r1}
                    exp_annotations:
                      summary: "Run r1: the mean reward is NaN"
                      description: "The reward function returned NaN for the latest step; the run's
                        updates are meaningless."
              - eval_time: 1m
                alertname: FurlongRewardNaN
                exp_alerts: []
              - eval_time: 5m
                alertname: FurlongServiceDown
                exp_alerts:
                  - exp_labels: {severity: critical, job: furlong-rollout, instance: "10.0.0.1:9090"}
                    exp_annotations:
                      summary: "Furlong furlong-rollout is not answering scrapes"
                      description: "furlong-rollout at 10.0.0.1:9090 has been down for 2 minutes; a run
                        in progress will fail."
              - eval_time: 8m
                alertname: FurlongWeightVersionLag
                exp_alerts: []
              - eval_time: 16m
                alertname: FurlongWeightVersionLag
                exp_alerts:
                  - exp_labels: {severity: warning, run_id: r1}
                    exp_annotations:
                      summary: "Run r1: trained policy is 16 versions ahead of the committed one"
                      description: "The trainer keeps producing versions that the engines have not all
                        acknowledged."
        """)
    )
    result = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitors_find_their_targets_and_carry_the_release_label(overlay):
    objects = render_overlay(overlay)
    settings = load_yaml(K8S / "overlays" / overlay / "monitoring-settings.yaml")["data"]
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            assert obj["metadata"]["labels"]["release"] == settings["release"], obj["metadata"]["name"]
    services = [o for o in objects if o["kind"] == "Service"]
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        selected = [
            s
            for s in services
            if selector_matches(monitor["spec"]["selector"], s["metadata"].get("labels", {}))
        ]
        assert selected, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["endpoints"]:
            for svc in selected:
                assert endpoint["port"] in [p["name"] for p in svc["spec"]["ports"]]
    scraped = {
        s["metadata"]["name"]
        for o in objects
        if o["kind"] == "ServiceMonitor"
        for s in services
        if selector_matches(o["spec"]["selector"], s["metadata"]["labels"])
    }
    assert scraped == {"furlong-controller", "furlong-trainer", "furlong-rollout", "furlong-weight-broker"}
    for name in scraped:  # each has endpoints: the pods behind it (every rollout replica's included)
        service = find(objects, "Service", name)
        assert pods_selected({"matchLabels": service["spec"]["selector"]}, objects) == {name}, name
    pod_monitor = find(objects, "PodMonitor", "furlong-dashboard")
    assert pods_selected(pod_monitor["spec"]["selector"], objects) == {"furlong-dashboard"}
    dashboard = find(objects, "DaemonSet", "furlong-dashboard")
    port_names = [p["name"] for p in pod_template(dashboard)["spec"]["containers"][0]["ports"]]
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] in port_names


@pytest.mark.integration
def test_release_label_and_prometheus_namespace_are_configurable(tmp_path):
    shutil.copytree(K8S, tmp_path / "k8s")
    settings = tmp_path / "k8s" / "overlays" / "dev" / "monitoring-settings.yaml"
    settings.write_text(
        settings.read_text()
        .replace("release: kube-prometheus-stack", "release: observability")
        .replace("prometheus-namespace: monitoring", "prometheus-namespace: obs")
    )
    objects = render_dir(tmp_path / "k8s" / "overlays" / "dev")
    labelled = [o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert len(labelled) == 4
    assert {o["metadata"]["labels"]["release"] for o in labelled} == {"observability"}
    policy = find(objects, "NetworkPolicy", "furlong-allow-prometheus")
    ns_selector = policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]
    assert ns_selector == {"matchLabels": {"kubernetes.io/metadata.name": "obs"}}
