"""Every overlay renders with `kubectl kustomize`, and every rendered object passes strict schema
validation: Kubernetes kinds with kubernetes-validate (1.30 and the newest bundled release),
custom resources (monitoring.coreos.com, jobset.x-k8s.io) with the vendored CRD schemas under
deploy/k8s/schemas/, and a JobSet's Job templates, which its schema leaves open, as batch/v1 Jobs
with kubernetes-validate."""

from __future__ import annotations

import copy
import shutil

import jsonschema
import kubernetes_validate
import pytest
from k8s_render import K8S, OVERLAYS, crd_schemas, find, pod_template, render_dir, render_overlay, workloads

OLDEST_SUPPORTED = "1.30.0"
NEWEST_BUNDLED = kubernetes_validate.latest_version()  # e.g. "1.37.0"
CRD_GROUPS = ("monitoring.coreos.com/", "jobset.x-k8s.io/")


def validate_object(obj: dict, versions=(OLDEST_SUPPORTED, NEWEST_BUNDLED)) -> None:
    """Raise if obj fails strict validation (unknown fields included) for any of the versions."""
    if obj["apiVersion"].startswith(CRD_GROUPS):
        schemas = crd_schemas()
        assert obj["kind"] in schemas, f"no vendored schema for {obj['kind']}"
        jsonschema.Draft202012Validator(schemas[obj["kind"]]).validate(obj)
        if obj["kind"] == "JobSet":
            for job in obj["spec"]["replicatedJobs"]:
                validate_object(job_of(obj, job), versions)
        return
    for version in versions:
        kubernetes_validate.validate(obj, version, strict=True)


def job_of(jobset: dict, replicated_job: dict) -> dict:
    """A replicated job's template as the batch/v1 Job JobSet makes of it."""
    template = replicated_job["template"]
    name = f"{jobset['metadata']['name']}-{replicated_job['name']}-0"
    metadata = {**template.get("metadata", {}), "name": name, "namespace": jobset["metadata"]["namespace"]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": template["spec"]}


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_objects_pass_strict_validation(overlay):
    objects = render_overlay(overlay)
    assert len(objects) > 20
    for obj in objects:
        try:
            validate_object(obj)
        except (
            jsonschema.ValidationError,
            kubernetes_validate.ValidationError,
            kubernetes_validate.SchemaNotFoundError,
        ) as exc:
            message = getattr(exc, "message", str(exc))
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {message}")


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_whole_stack_into_one_namespace(overlay):
    objects = render_overlay(overlay)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for expected in [
        ("Namespace", "furlong"),
        ("Deployment", "furlong-controller"),
        ("Service", "furlong-controller"),
        ("JobSet", "furlong-trainer"),
        ("Service", "furlong-trainer"),
        ("Service", "furlong-trainer-ranks"),
        ("PersistentVolumeClaim", "furlong-trainer-checkpoints"),
        ("StatefulSet", "furlong-weight-broker"),
        ("StatefulSet", "furlong-rollout"),
        ("Service", "furlong-rollout"),
        ("StatefulSet", "furlong-redis"),
        ("DaemonSet", "furlong-dashboard"),
        ("ServiceMonitor", "furlong-services"),
        ("PodMonitor", "furlong-dashboard"),
        ("PrometheusRule", "furlong-alerts"),
    ]:
        assert expected in kinds, f"{overlay} lacks {expected}"
    namespaced = [o for o in objects if o["kind"] != "Namespace"]
    assert {o["metadata"].get("namespace") for o in namespaced} == {"furlong"}
    # The monitoring settings are local configuration: never applied.
    assert ("ConfigMap", "furlong-monitoring-settings") not in kinds


@pytest.mark.integration
def test_headless_services_govern_their_statefulsets():
    objects = render_overlay("prod")
    for name in ("furlong-weight-broker", "furlong-redis", "furlong-rollout"):
        sts = find(objects, "StatefulSet", name)
        svc = find(objects, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None"


@pytest.mark.unit
def test_strict_validation_rejects_unknown_fields():
    objects = render_overlay("dev")
    deployment = copy.deepcopy(find(objects, "Deployment", "furlong-controller"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(deployment)
    monitor = copy.deepcopy(find(objects, "ServiceMonitor", "furlong-services"))
    monitor["spec"]["endpoints"][0]["scrapeIntervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate_object(monitor)
    rule = copy.deepcopy(find(objects, "PrometheusRule", "furlong-alerts"))
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    with pytest.raises(jsonschema.ValidationError):
        validate_object(rule)


@pytest.mark.unit
def test_vendored_crd_schemas_are_valid_json_schemas():
    schemas = crd_schemas()
    assert set(schemas) == {"ServiceMonitor", "PodMonitor", "PrometheusRule", "JobSet"}
    for kind, schema in schemas.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        expected = "jobset.x-k8s.io/v1alpha2" if kind == "JobSet" else "monitoring.coreos.com/v1"
        assert schema["properties"]["apiVersion"]["const"] == expected


@pytest.mark.integration
def test_rdma_component_renders_on_top_of_prod(tmp_path):
    """components/nvidia/rdma is optional, so no shipped overlay includes it: build one."""
    shutil.copytree(K8S, tmp_path / "k8s")
    overlay = tmp_path / "k8s" / "overlays" / "prod-rdma"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [../prod]\ncomponents: [../../components/nvidia/rdma]\n"
    )
    objects = render_dir(overlay)
    validate_object(find(objects, "JobSet", "furlong-trainer"))
    validate_object(find(objects, "StatefulSet", "furlong-rollout"))
    pods = [
        pod_template(w)
        for w in workloads(objects)
        if w["metadata"]["name"] in ("furlong-trainer", "furlong-rollout")
    ]
    assert len(pods) == 3  # trainer leader and workers, rollout (one template for its replicas)
    gpus = {"furlong-rollout": 1, "furlong-trainer": 4}
    for workload in workloads(objects):
        name = workload["metadata"]["name"]
        if name not in gpus:
            continue
        container = pod_template(workload)["spec"]["containers"][0]
        assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus[name]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["UCX_TLS"] == "rc,tcp,cuda_copy"
