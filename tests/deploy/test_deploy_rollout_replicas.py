"""Rollout replicas on Kubernetes: the StatefulSet furlong-rollout governed by a headless Service,
each pod's --replica-id read from its ordinal, and the controller's --rollout list naming exactly
the StatefulSet's pods, in every overlay, with the mtls component, and in the replica-count patches
docs/deploy.md shows (its "Scaling rollout" section)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from k8s_render import K8S, OVERLAYS, ROOT, find, pod_template, pods_selected, render_dir, render_overlay
from test_deploy_render import validate_object
from test_deploy_security import render_with_mtls
from test_deploy_workloads import FAKE_FIELDS, POD_INDEX, expanded_args, flag_value, flag_values

ROLLOUT = "furlong-rollout"
ROLLOUT_PORT = 50051
DOC = ROOT / "docs" / "deploy.md"
SECRET_FILE = re.compile(r"^/var/run/secrets/furlong/(api-token|internal-token)/token$")


@pytest.fixture
def cuda(monkeypatch):
    """prod and amd pass --device cuda: parse it as on a machine with CUDA devices."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def expected_addresses(objects: list[dict]) -> list[str]:
    """furlong-rollout-<k>.<headless service>:50051 for every ordinal k of the StatefulSet."""
    sts = find(objects, "StatefulSet", ROLLOUT)
    service = sts["spec"]["serviceName"]
    return [f"{ROLLOUT}-{k}.{service}:{ROLLOUT_PORT}" for k in range(sts["spec"]["replicas"])]


def check_replicas(objects: list[dict], tmp_path: Path) -> int:
    """Assert how rollout replicas are wired in rendered objects; the number of replicas."""
    from furlong.controller.__main__ import load_config
    from furlong.controller.__main__ import parse_args as controller_args
    from furlong.rollout.config import MAX_REPLICA_ID, RolloutServerConfig

    sts = find(objects, "StatefulSet", ROLLOUT)
    replicas = sts["spec"]["replicas"]
    assert 1 <= replicas <= MAX_REPLICA_ID + 1
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    validate_object(sts)

    # The headless Service: one DNS name per pod, and it selects the rollout pods alone.
    service = find(objects, "Service", sts["spec"]["serviceName"])
    validate_object(service)
    assert service["spec"]["clusterIP"] == "None"
    assert pods_selected({"matchLabels": service["spec"]["selector"]}, objects) == {ROLLOUT}
    assert {"name": "grpc", "port": ROLLOUT_PORT, "targetPort": "grpc"} in service["spec"]["ports"]
    container = pod_template(sts)["spec"]["containers"][0]
    assert {"name": "grpc", "containerPort": ROLLOUT_PORT} in container["ports"]

    # Each pod's replica id is its ordinal, from the downward API.
    env = {e["name"]: e for e in container["env"]}
    assert env["FURLONG_REPLICA_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": POD_INDEX}}
    assert flag_value(container["args"], "--replica-id") == "$(FURLONG_REPLICA_ID)"
    for k in range(replicas):
        args = expanded_args(container, {**FAKE_FIELDS, POD_INDEX: str(k)})
        config = RolloutServerConfig.from_args(args)
        assert (config.replica_id, config.port) == (k, ROLLOUT_PORT)

    # The controller calls exactly those pods, one --rollout each.
    controller = pod_template(find(objects, "Deployment", "furlong-controller"))["spec"]["containers"][0]
    args = expanded_args(controller)
    assert flag_values(args, "--rollout") == expected_addresses(objects)
    token = tmp_path / "token"
    token.write_text("token-0123456789abcdef")
    parsed = controller_args([str(token) if SECRET_FILE.match(a) else a for a in args])
    config = load_config(parsed)
    assert list(config.rollouts) == expected_addresses(objects)
    assert len(config.rollouts) == replicas
    return replicas


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_controller_calls_every_rollout_replica_of_the_overlay(overlay, tmp_path, cuda):
    objects = render_overlay(overlay)
    assert check_replicas(objects, tmp_path) == 2
    assert not [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == ROLLOUT]


@pytest.mark.integration
def test_rollout_replicas_with_the_mtls_component(tmp_path, cuda):
    (tmp_path / "render").mkdir()
    objects = render_with_mtls(tmp_path / "render", "prod")
    assert check_replicas(objects, tmp_path) == 2
    rollout = pod_template(find(objects, "StatefulSet", ROLLOUT))["spec"]["containers"][0]
    assert flag_value(rollout["args"], "--tls-server-name") == "furlong-internal"


def scaling_patches() -> list[str]:
    """The yaml blocks of docs/deploy.md's "Scaling rollout" section (each a `patches:` list)."""
    text = DOC.read_text()
    section = text[text.index("## Scaling rollout\n") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert blocks and all(b.startswith("patches:\n") for b in blocks)
    return blocks


@pytest.mark.integration
def test_scaling_examples_of_the_guide_keep_the_controller_in_step(tmp_path, cuda):
    """Every patch the guide shows for rollout renders on top of prod, and the ones that change the
    replica count change the controller's --rollout list with it."""
    counts = []
    for i, block in enumerate(scaling_patches()):
        overlay = tmp_path / f"example-{i}"
        overlay.mkdir()
        up = Path(os.path.relpath(K8S / "overlays" / "prod", overlay))
        (overlay / "kustomization.yaml").write_text(
            f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {up}\n{block}"
        )
        counts.append(check_replicas(render_dir(overlay), tmp_path))
    assert counts == [2, 4, 1]  # more per replica, four replicas, one replica
