"""NetworkPolicies select the pods they mean: evaluated over the rendered pod templates with
Kubernetes' ingress semantics (a pod selected by any policy accepts only what some rule allows)."""

from __future__ import annotations

import pytest
from k8s_render import (
    COMPONENT,
    OVERLAYS,
    find,
    pod_template,
    pods_selected,
    render_overlay,
    selector_matches,
    workloads,
)

NAMESPACE = {"kubernetes.io/metadata.name": "furlong"}
MONITORING_NS = {"kubernetes.io/metadata.name": "monitoring"}
ELSEWHERE_NS = {"kubernetes.io/metadata.name": "default"}


def labels_of(objects: list[dict], component: str) -> dict[str, str]:
    matches = [
        pod_template(w)["metadata"]["labels"]
        for w in workloads(objects)
        if pod_template(w)["metadata"]["labels"].get(COMPONENT) == component
    ]
    # the trainer JobSet's leader and worker pods differ only in their role label
    assert len(matches) == 1 or (component == "trainer" and len(matches) == 2), component
    return matches[0]


def _peer_matches(peer: dict, src_labels: dict, src_ns: dict) -> bool:
    if "ipBlock" in peer:
        return False  # no policy here uses ipBlock; treat as not matching pod traffic
    ns_selector = peer.get("namespaceSelector")
    if ns_selector is None:
        if src_ns != NAMESPACE:
            return False
    elif not selector_matches(ns_selector, src_ns):
        return False
    pod_selector = peer.get("podSelector")
    return pod_selector is None or selector_matches(pod_selector, src_labels)


def ingress_allowed(objects: list[dict], target: dict, src_labels: dict, src_ns: dict, port: int) -> bool:
    policies = [
        p
        for p in objects
        if p["kind"] == "NetworkPolicy"
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selector_matches(p["spec"]["podSelector"], target)
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("port") == port for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, src_labels, src_ns) for peer in peers):
                return True
    return False


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_policies_select_the_intended_workloads(overlay):
    objects = render_overlay(overlay)
    every = {w["metadata"]["name"] for w in workloads(objects)}
    expected = {
        "furlong-default-deny": every,
        "furlong-controller-api": {"furlong-controller"},
        "furlong-internal": {"furlong-trainer", "furlong-rollout", "furlong-weight-broker"},
        "furlong-redis": {"furlong-redis"},
        "furlong-allow-prometheus": {
            "furlong-trainer",
            "furlong-rollout",
            "furlong-weight-broker",
            "furlong-dashboard",
        },
    }
    policies = {p["metadata"]["name"]: p for p in objects if p["kind"] == "NetworkPolicy"}
    assert set(policies) == set(expected)
    for name, workload_names in expected.items():
        assert pods_selected(policies[name]["spec"]["podSelector"], objects) == workload_names, name
    internal_peers = policies["furlong-internal"]["spec"]["ingress"][0]["from"][0]["podSelector"]
    assert pods_selected(internal_peers, objects) == {
        "furlong-controller",
        "furlong-trainer",
        "furlong-rollout",
        "furlong-weight-broker",
    }
    redis_peers = policies["furlong-redis"]["spec"]["ingress"][0]["from"][0]["podSelector"]
    assert pods_selected(redis_peers, objects) == {"furlong-controller", "furlong-trainer", "furlong-rollout"}


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ingress_matrix(overlay):
    objects = render_overlay(overlay)
    lab = {
        c: labels_of(objects, c)
        for c in ("controller", "trainer", "rollout", "weight-broker", "redis", "dashboard")
    }
    outsider = {"app": "something-else"}
    prometheus = {"app.kubernetes.io/name": "prometheus"}

    def allowed(src, src_ns, target, port):
        return ingress_allowed(objects, lab[target], src, src_ns, port)

    # The REST API is the one entry point from outside Furlong.
    assert allowed(outsider, ELSEWHERE_NS, "controller", 8080)
    assert allowed(outsider, NAMESPACE, "controller", 8080)
    assert not allowed(outsider, ELSEWHERE_NS, "controller", 9999)
    for target, port in (
        ("trainer", 50051),
        ("rollout", 50051),
        ("weight-broker", 50051),
        ("redis", 6379),
        ("dashboard", 9400),
        ("trainer", 9090),
    ):
        assert not allowed(outsider, ELSEWHERE_NS, target, port), (target, port)
        assert not allowed(outsider, NAMESPACE, target, port), (target, port)
    # Redis only from the services that use it.
    for src in ("controller", "trainer", "rollout"):
        assert allowed(lab[src], NAMESPACE, "redis", 6379), src
    for src in ("dashboard", "weight-broker"):
        assert not allowed(lab[src], NAMESPACE, "redis", 6379), src
    job = [w for w in workloads(objects) if w["kind"] == "Job"]
    for w in job:
        assert not allowed(pod_template(w)["metadata"]["labels"], NAMESPACE, "redis", 6379)
    # gRPC between the services, and NIXL/UCX on ports chosen at run time.
    assert allowed(lab["controller"], NAMESPACE, "rollout", 50051)
    assert allowed(lab["trainer"], NAMESPACE, "weight-broker", 50051)
    assert allowed(lab["rollout"], NAMESPACE, "trainer", 43127)
    assert not allowed(lab["dashboard"], NAMESPACE, "trainer", 50051)
    assert not allowed(lab["redis"], NAMESPACE, "trainer", 43127)
    # Prometheus scrapes the metrics ports only, from its own namespace.
    for target, port in (
        ("trainer", 9090),
        ("rollout", 9090),
        ("weight-broker", 9090),
        ("dashboard", 9400),
        ("controller", 8080),
    ):
        assert allowed(prometheus, MONITORING_NS, target, port), target
    assert not allowed(prometheus, MONITORING_NS, "trainer", 50051)
    assert not allowed(prometheus, MONITORING_NS, "redis", 6379)
    assert not allowed(prometheus, ELSEWHERE_NS, "trainer", 9090)


@pytest.mark.integration
def test_policy_ports_are_the_containers_ports():
    objects = render_overlay("dev")
    ports = {}
    for w in workloads(objects):
        for c in pod_template(w)["spec"]["containers"]:
            for p in c.get("ports", []):
                ports.setdefault(w["metadata"]["name"], {})[p["name"]] = p["containerPort"]
    api = find(objects, "NetworkPolicy", "furlong-controller-api")
    assert [p["port"] for p in api["spec"]["ingress"][0]["ports"]] == [ports["furlong-controller"]["http"]]
    redis = find(objects, "NetworkPolicy", "furlong-redis")
    assert [p["port"] for p in redis["spec"]["ingress"][0]["ports"]] == [ports["furlong-redis"]["redis"]]
    scrape = find(objects, "NetworkPolicy", "furlong-allow-prometheus")
    metric_ports = {
        ports[n]["metrics"]
        for n in ("furlong-trainer", "furlong-rollout", "furlong-weight-broker", "furlong-dashboard")
    }
    assert {p["port"] for p in scrape["spec"]["ingress"][0]["ports"]} == metric_ports
