"""Manifest validation: which kustomizations are rendered, and that an empty check fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.ci.manifests import (
    ManifestError,
    kustomization_roots,
    render_command,
    validate_command,
    validate_tree,
)

pytestmark = pytest.mark.unit


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_roots_skip_components_and_plain_manifests(tmp_path):
    write(tmp_path / "base/kustomization.yaml", "resources: [deploy.yaml]\n")
    write(tmp_path / "base/deploy.yaml", "kind: Deployment\n")
    write(
        tmp_path / "overlays/nvidia/kustomization.yml",
        "kind: Kustomization\nresources: [../../base]\n",
    )
    write(tmp_path / "overlays/cpu/Kustomization", "resources: [../../base]\n")
    write(
        tmp_path / "components/gpu/kustomization.yaml",
        "apiVersion: kustomize.config.k8s.io/v1alpha1\nkind: Component\n",
    )
    assert kustomization_roots(tmp_path) == [
        tmp_path / "base",
        tmp_path / "overlays/cpu",
        tmp_path / "overlays/nvidia",
    ]


def test_nothing_to_validate_is_an_error(tmp_path):
    write(tmp_path / "README.md", "no manifests\n")
    with pytest.raises(ManifestError, match="nothing would be validated"):
        validate_tree(tmp_path, tmp_path / "out")
    with pytest.raises(ManifestError, match="not a directory"):
        validate_tree(tmp_path / "absent", tmp_path / "out")


def test_missing_tool_is_an_error(tmp_path, monkeypatch):
    write(tmp_path / "k8s/base/kustomization.yaml", "resources: []\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(ManifestError, match="kubectl is not installed"):
        validate_tree(tmp_path / "k8s", tmp_path / "out")


def test_commands_pin_the_kubernetes_version(tmp_path):
    assert render_command(tmp_path) == ["kubectl", "kustomize", str(tmp_path)]
    assert validate_command(tmp_path / "r.yaml", "1.32.0") == [
        "kubernetes-validate",
        "--strict",
        "-k",
        "1.32.0",
        str(tmp_path / "r.yaml"),
    ]
