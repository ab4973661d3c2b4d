"""Manifest validation: render every kustomization under deploy/k8s and validate it offline.

A kustomization root is a directory holding `kustomization.yaml` (or `.yml`, or `Kustomization`)
whose kind is not `Component` (components are rendered through the overlays that use them). Each
root is rendered with `kubectl kustomize` and the result validated with `kubernetes-validate
--strict` against a fixed Kubernetes version, which catches unknown fields offline. Finding no root
at all is an error: an empty check must not pass.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
DEFAULT_KUBE_VERSION = "1.32.0"
TOOL_TIMEOUT_S = 120


class ManifestError(RuntimeError):
    """Rendering or validation failed, or there was nothing to validate."""


@dataclass(frozen=True)
class Failure:
    root: Path
    step: str  # "render" or "validate"
    output: str


def _kind(kustomization: Path) -> str:
    for line in kustomization.read_text().splitlines():
        if line.startswith("kind:"):
            return line.split(":", 1)[1].strip().strip("'\"")
    return "Kustomization"


def kustomization_roots(root: Path) -> list[Path]:
    """Directories under `root` with a kustomization that is not a Component, sorted."""
    if not root.is_dir():
        raise ManifestError(f"{root} is not a directory")
    roots = set()
    for name in KUSTOMIZATION_FILES:
        for found in root.rglob(name):
            if found.is_file() and _kind(found) != "Component":
                roots.add(found.parent)
    return sorted(roots)


def render_command(kustomization_root: Path) -> list[str]:
    return ["kubectl", "kustomize", str(kustomization_root)]


def validate_command(rendered: Path, kube_version: str) -> list[str]:
    return ["kubernetes-validate", "--strict", "-k", kube_version, str(rendered)]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    log.info("running %s", " ".join(command))
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise ManifestError(f"{command[0]} is not installed (see docs/ci.md)") from None


def validate_tree(root: Path, out_dir: Path, kube_version: str = DEFAULT_KUBE_VERSION) -> list[Path]:
    """Render and validate every kustomization root; return the rendered files.

    Raises ManifestError listing every failure (all roots are tried before raising).
    """
    roots = kustomization_roots(root)
    if not roots:
        raise ManifestError(f"no kustomization under {root}: nothing would be validated")
    out_dir.mkdir(parents=True, exist_ok=True)
    failures: list[Failure] = []
    rendered_files: list[Path] = []
    for index, kroot in enumerate(roots):
        rendered = _run(render_command(kroot))
        if rendered.returncode != 0:
            failures.append(Failure(kroot, "render", rendered.stderr.strip()))
            continue
        label = kroot.relative_to(root).as_posix().replace("/", "_").replace(".", "root")
        target = out_dir / f"{index:02d}-{label}.yaml"
        target.write_text(rendered.stdout)
        rendered_files.append(target)
        checked = _run(validate_command(target, kube_version))
        if checked.returncode != 0:
            failures.append(Failure(kroot, "validate", (checked.stdout + checked.stderr).strip()))
    if failures:
        raise ManifestError("\n".join(f"{f.root} ({f.step}):\n{f.output}" for f in failures))
    return rendered_files
