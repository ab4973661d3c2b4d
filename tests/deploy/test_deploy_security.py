"""Secrets in the Kubernetes manifests: every service that serves or calls gRPC/REST reads the shared
service token from the Secret furlong-internal-token (never inlined), and the optional mtls
component mounts the Secret furlong-internal-tls into each of them, passes the TLS flags their
parsers accept, and probes them with a command that really passes a mutual-TLS health check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from k8s_render import (
    COMPONENT,
    K8S,
    OVERLAYS,
    containers,
    find,
    pod_template,
    render_dir,
    render_overlay,
    replicated_job,
    replicated_jobs,
    workloads,
)
from test_deploy_render import validate_object
from test_deploy_workloads import expanded_args, flag_value

from furlong import rpc

INTERNAL_SECRET = "furlong-internal-token"
TLS_SECRET = "furlong-internal-tls"
# the services that serve gRPC or the REST API, and call each other over gRPC
API_SERVICES = {
    "controller": ("Deployment", "furlong-controller"),
    "trainer": ("JobSet", "furlong-trainer"),  # its leader pod: rank 0
    "rollout": ("StatefulSet", "furlong-rollout"),
    "weight-broker": ("StatefulSet", "furlong-weight-broker"),
}
GRPC_NAMES = {
    "trainer": "furlong.v1.Trainer",
    "rollout": "furlong.v1.Rollout",
    "weight-broker": "furlong.v1.WeightBroker",
}
TLS_FLAGS = ("--tls-ca-file", "--tls-cert-file", "--tls-key-file")


def api_workload(objects: list[dict], kind: str, name: str) -> dict:
    """The workload whose pods serve the API (a JobSet's: its leader's)."""
    if kind == "JobSet":
        return replicated_job(objects, name, "leader")
    return find(objects, kind, name)


def secret_file(workload: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) that the file at path of the workload's first container comes from."""
    spec = pod_template(workload)["spec"]
    container = spec["containers"][0]
    file = Path(path)
    mounts = [m for m in container["volumeMounts"] if file.parent == Path(m["mountPath"])]
    assert len(mounts) == 1, f"{workload['metadata']['name']}: {path} is not in one mounted volume"
    assert mounts[0].get("readOnly") is True
    volume = next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])
    assert "secret" in volume, f"{workload['metadata']['name']}: {path} is not from a Secret"
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
    return volume["secret"]["secretName"], items.get(file.name, file.name)


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_api_service_reads_the_service_token_from_the_secret(overlay):
    objects = render_overlay(overlay)
    for component, (kind, name) in API_SERVICES.items():
        workload = api_workload(objects, kind, name)
        args = expanded_args(pod_template(workload)["spec"]["containers"][0])
        token_file = flag_value(args, "--auth-token-file")
        assert secret_file(workload, token_file) == (INTERNAL_SECRET, "token"), component
    for workload in workloads(objects):  # no other workload gets the service token
        if pod_template(workload)["metadata"]["labels"][COMPONENT] in API_SERVICES:
            continue
        volumes = pod_template(workload)["spec"].get("volumes", [])
        assert INTERNAL_SECRET not in {v.get("secret", {}).get("secretName") for v in volumes}
    assert not [o for o in objects if o["kind"] == "Secret"], "Secrets are created by the user"


def render_with_mtls(tmp_path: Path, overlay: str) -> list[dict]:
    """overlay plus the mtls component, through a kustomization written under tmp_path."""
    up = Path(os.path.relpath(K8S, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {up / 'overlays' / overlay}\ncomponents:\n  - {up / 'components' / 'mtls'}\n"
    )
    return render_dir(tmp_path)


@pytest.mark.integration
@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_mtls_component_mounts_certificates_and_passes_parsable_flags(overlay, tmp_path, monkeypatch):
    import torch

    # prod passes --device cuda: parse it as on a machine with CUDA devices
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    from furlong.controller.__main__ import load_config
    from furlong.controller.__main__ import parse_args as controller_args
    from furlong.rollout.config import RolloutServerConfig
    from furlong.trainer.__main__ import parse_args as trainer_args
    from furlong.weight_broker.config import BrokerConfig

    objects = render_with_mtls(tmp_path, overlay)
    for obj in objects:
        validate_object(obj)
    assert not [o for o in objects if o["kind"] == "Secret"]
    parsed = {}
    for component, (kind, name) in API_SERVICES.items():
        workload = api_workload(objects, kind, name)
        container = pod_template(workload)["spec"]["containers"][0]
        args = expanded_args(container)
        keys = [secret_file(workload, flag_value(args, flag)) for flag in TLS_FLAGS]
        assert keys == [(TLS_SECRET, "ca.crt"), (TLS_SECRET, "tls.crt"), (TLS_SECRET, "tls.key")]
        assert flag_value(args, "--tls-server-name") == "furlong-internal"
        parsed[component] = args
        if component in GRPC_NAMES:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = container[probe]["exec"]["command"]
                assert command[:3] == ["python3", "-m", "furlong.rpc.health_probe"], component
                assert flag_value(command, "--service") == GRPC_NAMES[component]
                assert flag_value(command, "--address") == f"127.0.0.1:{flag_value(args, '--port')}"
                for flag in (*TLS_FLAGS, "--tls-server-name"):
                    assert flag_value(command, flag) == flag_value(args, flag)
    expected = rpc.TlsFiles(*(flag_value(parsed["trainer"], f) for f in (*TLS_FLAGS, "--tls-server-name")))
    assert trainer_args(parsed["trainer"]).tls == expected
    assert RolloutServerConfig.from_args(parsed["rollout"]).tls == expected
    assert BrokerConfig.from_args(parsed["weight-broker"]).tls == expected
    token = tmp_path / "admin-token"
    token.write_text("admin-token-0123456789abcdef")
    controller_argv = [
        a if a != "/var/run/secrets/furlong/api-token/token" else str(token) for a in parsed["controller"]
    ]
    assert load_config(controller_args(controller_argv)).tls == expected


@pytest.mark.integration
def test_mtls_probe_command_passes_against_a_server_with_the_secret(tmp_path):
    """The trainer's exec probe, with the Secret's files replaced by certificates made here, passes
    against a mutual-TLS server for the shared name and fails against a plaintext one."""
    from pki import make_ca, make_cert

    (tmp_path / "render").mkdir()
    objects = render_with_mtls(tmp_path / "render", "dev")
    container = pod_template(replicated_job(objects, "furlong-trainer", "leader"))["spec"]["containers"][0]
    command = container["readinessProbe"]["exec"]["command"]
    ca = make_ca(tmp_path, "ca")
    cert = make_cert(ca, tmp_path, "service", dns=("furlong-internal",), ips=())
    files = {"ca.crt": ca.cert, "tls.crt": cert.cert, "tls.key": cert.key}
    tls = rpc.TlsFiles(str(ca.cert), str(cert.cert), str(cert.key), "furlong-internal").load()
    secure = rpc.start_server([], ["furlong.v1.Trainer"], tls=tls)
    plain = rpc.start_server([], ["furlong.v1.Trainer"])
    try:

        def run(port: int) -> subprocess.CompletedProcess:
            argv = [sys.executable if c == "python3" else c for c in command]
            argv = [str(files[Path(a).name]) if a.startswith("/var/run/secrets/") else a for a in argv]
            argv[argv.index("--address") + 1] = f"127.0.0.1:{port}"
            return subprocess.run(argv, capture_output=True, text=True, timeout=60)

        assert run(secure.port).returncode == 0, run(secure.port).stderr
        refused = run(plain.port)
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    finally:
        secure.stop(0)
        plain.stop(0)


@pytest.mark.unit
def test_mtls_component_is_optional():
    for overlay in OVERLAYS:
        text = (K8S / "overlays" / overlay / "kustomization.yaml").read_text()
        assert "components/mtls" not in text, f"{overlay} must not require the TLS Secret"
    for job in replicated_jobs(find(render_overlay("dev"), "JobSet", "furlong-trainer")):
        for container in containers(job):
            assert "--tls-ca-file" not in container["args"]
