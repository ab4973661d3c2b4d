"""Properties every rendered workload must have, in every overlay: probes, resource requests and
limits, non-root security contexts, pinned images, the API token read from a Secret, command-line
flags the services really accept, and addresses that resolve to Services of the stack."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from k8s_render import (
    COMPONENT,
    OVERLAYS,
    SERVICE_MODULES,
    containers,
    find,
    pod_template,
    render_overlay,
    replicated_job,
    replicated_jobs,
    selector_matches,
    workloads,
)

GRPC_SERVICES = {
    "trainer": "furlong.v1.Trainer",
    "rollout": "furlong.v1.Rollout",
    "weight-broker": "furlong.v1.WeightBroker",
}
HTTP_SERVICES = {"controller", "dashboard"}
TOKEN_SECRET = "furlong-api-token"


def parse_quantity(value) -> float:
    """A Kubernetes quantity (cpu or memory) as a float in base units."""
    text = str(value)
    suffixes = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in suffixes.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def all_containers(overlay: str):
    for workload in workloads(render_overlay(overlay)):
        for container in containers(workload):
            yield workload, container


def component_of(workload: dict) -> str:
    return pod_template(workload)["metadata"]["labels"][COMPONENT]


POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"  # a StatefulSet pod's ordinal
FAKE_FIELDS = {
    "metadata.name": "furlong-controller-5d8f9c7b6-x2x7q",
    "spec.nodeName": "node-1",
    "metadata.labels['jobset.sigs.k8s.io/job-index']": "0",
    POD_INDEX: "0",
}
TORCHRUN = ["python", "-m", "torch.distributed.run"]


def env_values(container: dict, fields: dict[str, str] = FAKE_FIELDS) -> dict[str, str]:
    """The container's environment as the kubelet makes it: field references read from `fields`,
    $(VAR) in a value expanded from the variables defined before it."""
    out: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            out[entry["name"]] = _expand(entry["value"], out, container)
        else:
            out[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def _expand(text: str, env: dict[str, str], container: dict) -> str:
    def sub(match: re.Match) -> str:
        assert match.group(1) in env, f"{container['name']}: $({match.group(1)}) is not in env"
        return env[match.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def all_args(container: dict, fields: dict[str, str] = FAKE_FIELDS) -> list[str]:
    """The container's args with $(VAR) references expanded as the kubelet would."""
    env = env_values(container, fields)
    return [_expand(a, env, container) for a in container.get("args", [])]


def launcher_args(container: dict, fields: dict[str, str] = FAKE_FIELDS) -> list[str]:
    """torchrun's own options of a container that runs `python -m torch.distributed.run` (up to
    the `-m MODULE` it starts)."""
    assert container.get("command") == TORCHRUN, f"{container['name']} does not run torchrun"
    args = all_args(container, fields)
    return args[: args.index("-m")]


def expanded_args(container: dict, fields: dict[str, str] = FAKE_FIELDS) -> list[str]:
    """The service's own command line, $(VAR) expanded: the container's args, or under torchrun
    what follows `-m MODULE`."""
    args = all_args(container, fields)
    if container.get("command") == TORCHRUN:
        return args[args.index("-m") + 2 :]
    return args


def flag_value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} must appear once in {args}"
    return args[args.index(flag) + 1]


def flag_values(args: list[str], flag: str) -> list[str]:
    """The values of a flag given any number of times, in order."""
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def declared_flags(module: str) -> tuple[set[str], set[str]]:
    """(all, required) long options of the service's real command line (`<module>.__main__.command()`,
    the start-up scaffold's shared flags included)."""
    parser = importlib.import_module(f"{module}.__main__").command().parser
    flags, required = set(), set()
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                flags.add(option)
                if action.required:
                    required.add(option)
    assert flags, f"no flags found for {module}"
    return flags, required


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_sets_requests_and_limits(overlay):
    for workload, container in all_containers(overlay):
        where = f"{overlay}: {workload['metadata']['name']}/{container['name']}"
        resources = container.get("resources", {})
        for resource in ("cpu", "memory"):
            request = resources.get("requests", {}).get(resource)
            limit = resources.get("limits", {}).get(resource)
            assert request is not None and limit is not None, f"{where}: {resource} request and limit"
            assert parse_quantity(limit) >= parse_quantity(request) > 0, f"{where}: {resource}"
        for extended in ("nvidia.com/gpu", "amd.com/gpu"):
            if extended in resources.get("limits", {}):
                assert resources["requests"].get(extended) == resources["limits"][extended], where


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_long_running_containers_have_probes_of_their_protocol(overlay):
    seen = set()
    for workload, container in all_containers(overlay):
        if workload["kind"] == "Job":
            continue
        component = component_of(workload)
        where = f"{overlay}: {workload['metadata']['name']}"
        if workload.get("replicatedJob") == "workers":
            # Trainer ranks other than 0 serve nothing: no port to probe. torchrun exits when a
            # rank fails, failing the pod, and JobSet restarts the group.
            assert "ports" not in container and not any(k.endswith("Probe") for k in container), where
            continue
        assert "readinessProbe" in container and "livenessProbe" in container, where
        probes = [container[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in container]
        if component in GRPC_SERVICES:
            grpc_port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
            assert int(flag_value(expanded_args(container), "--port")) == grpc_port, where
            for probe in probes:
                assert probe["grpc"] == {"port": grpc_port, "service": GRPC_SERVICES[component]}, where
        elif component in HTTP_SERVICES:
            for probe in probes:
                assert probe["httpGet"]["path"] in ("/healthz", "/readyz"), where
        else:
            assert component == "redis", where
            for probe in probes:
                assert probe["exec"]["command"] == ["redis-cli", "ping"], where
        seen.add(component)
    assert seen == set(GRPC_SERVICES) | HTTP_SERVICES | {"redis"}


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_non_root_with_minimal_privileges(overlay):
    for workload, container in all_containers(overlay):
        where = f"{overlay}: {workload['metadata']['name']}/{container['name']}"
        pod_sc = pod_template(workload)["spec"].get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True, where
        assert pod_sc.get("runAsUser", 0) > 0, where
        assert pod_sc.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        sc = container.get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False, where
        assert sc.get("readOnlyRootFilesystem") is True, where
        assert sc.get("privileged", False) is False, where
        assert sc.get("runAsUser", pod_sc["runAsUser"]) > 0, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}, where


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(overlay):
    for _workload, container in all_containers(overlay):
        image = container["image"]
        name, _, tag = image.rpartition(":")
        assert "@sha256:" in image or (name and "/" not in tag and tag), f"{image} has no tag"
        assert tag != "latest" and not image.endswith(":latest"), image
        assert container.get("imagePullPolicy") != "Always", image


@pytest.mark.integration
@pytest.mark.parametrize(
    "overlay,trainer_tag,rollout_tag,gpu",
    [
        ("dev", "0.1.0-cpu", "0.1.0-cpu", None),
        ("prod", "0.1.0-cuda", "0.1.0-sglang", "nvidia.com/gpu"),
        ("amd", "0.1.0-rocm", "0.1.0-rocm", "amd.com/gpu"),
    ],
)
def test_hardware_variant_images_and_devices(overlay, trainer_tag, rollout_tag, gpu):
    objects = render_overlay(overlay)
    pods = [
        (find(objects, "StatefulSet", "furlong-rollout"), rollout_tag, 1),  # per replica
        *((job, trainer_tag, 4) for job in replicated_jobs(find(objects, "JobSet", "furlong-trainer"))),
    ]
    assert len(pods) == 3
    for workload, tag, gpus in pods:
        spec = pod_template(workload)["spec"]
        container = spec["containers"][0]
        assert container["image"].endswith(f":{tag}")
        limits = container["resources"]["limits"]
        if gpu is None:
            assert not any(k.endswith("/gpu") for k in limits)
        else:
            assert limits[gpu] == gpus
        # NIXL/UCX staging: /dev/shm is a memory-backed emptyDir.
        shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in spec["volumes"] if v["name"] == shm["name"])
        assert volume["emptyDir"]["medium"] == "Memory"


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_token_is_referenced_from_a_secret_never_inlined(overlay):
    objects = render_overlay(overlay)
    assert not [o for o in objects if o["kind"] == "Secret"], "the token Secret is created by the user"
    controller = find(objects, "Deployment", "furlong-controller")
    spec = pod_template(controller)["spec"]
    container = spec["containers"][0]
    token_file = Path(flag_value(expanded_args(container), "--token-file"))
    mount = next(m for m in container["volumeMounts"] if token_file.parent == Path(m["mountPath"]))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == TOKEN_SECRET
    assert {"key": "token", "path": token_file.name} in volume["secret"]["items"]
    for workload, c in all_containers(overlay):
        assert "--token" not in c.get("args", []), "a token must not be passed on the command line"
        for entry in c.get("env", []):
            if re.search(r"TOKEN|SECRET|PASSWORD", entry["name"]):
                assert "value" not in entry, f"{entry['name']} inlined in {workload['metadata']['name']}"


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_flags_exist_and_required_ones_are_given(overlay):
    checked = set()
    for workload, container in all_containers(overlay):
        component = component_of(workload)
        if component not in SERVICE_MODULES or workload["kind"] == "Job":
            continue
        flags, required = declared_flags(SERVICE_MODULES[component])
        args = expanded_args(container)
        given = {a for a in args if a.startswith("--")}
        assert given <= flags, f"{component}: unknown flags {given - flags}"
        assert required <= given, f"{component}: missing required flags {required - given}"
        assert flag_value(args, "--host") == "0.0.0.0", f"{component} must listen on the pod IP"
        checked.add(component)
    assert checked == set(SERVICE_MODULES)


@pytest.mark.integration
def test_service_parsers_accept_the_manifest_args(monkeypatch):
    """The real argparse/config code of each service accepts what the manifests pass (the GPU
    overlay's `--device cuda` checked as on a machine with CUDA devices)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    from furlong.controller.__main__ import parse_args as controller_args
    from furlong.rollout.config import RolloutServerConfig
    from furlong.trainer.__main__ import parse_args as trainer_args
    from furlong.weight_broker.config import BrokerConfig

    objects = render_overlay("prod")

    def args_of(kind: str, name: str) -> list[str]:
        return expanded_args(pod_template(find(objects, kind, name))["spec"]["containers"][0])

    leader = pod_template(replicated_job(objects, "furlong-trainer", "leader"))["spec"]["containers"][0]
    trainer = trainer_args(expanded_args(leader))
    assert (trainer.host, trainer.port, trainer.metrics_port) == ("0.0.0.0", 50051, 9090)
    assert trainer.consumer_name == "furlong-trainer"  # fixed: stable across restarts
    assert trainer.num_threads == 8
    assert (trainer.device, trainer.checkpoint_dir) == ("cuda", "/var/lib/furlong/checkpoints")
    rollout = RolloutServerConfig.from_args(args_of("StatefulSet", "furlong-rollout"))
    assert (rollout.port, rollout.metrics_port, rollout.num_threads) == (50051, 9090, 8)
    assert (rollout.device, rollout.replica_id) == ("cuda", 0)
    broker = BrokerConfig.from_args(args_of("StatefulSet", "furlong-weight-broker"))
    assert (broker.host, broker.port, broker.metrics_port) == ("0.0.0.0", 50051, 9090)
    controller = controller_args(args_of("Deployment", "furlong-controller"))
    assert (controller.host, controller.port) == ("0.0.0.0", 8080)
    assert len(controller.rollout) == find(objects, "StatefulSet", "furlong-rollout")["spec"]["replicas"]


def resolve_address(objects: list[dict], address: str) -> tuple[dict, int]:
    """(Service, port) that a host:port of the stack names: `<service>` or the StatefulSet pod
    form `<statefulset>-<ordinal>.<service>`."""
    host, port = address.rsplit(":", 1)
    parts = host.split(".")
    service = find(objects, "Service", parts[-1])
    if len(parts) == 2:
        sts_name, ordinal = parts[0].rsplit("-", 1)
        sts = find(objects, "StatefulSet", sts_name)
        assert sts["spec"]["serviceName"] == service["metadata"]["name"], address
        assert int(ordinal) < sts["spec"]["replicas"], address
    else:
        assert len(parts) == 1, f"{address}: expected <service> or <pod>.<service>"
    assert int(port) in [p["port"] for p in service["spec"]["ports"]], address
    return service, int(port)


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_addresses_in_args_resolve_to_services_of_the_stack(overlay):
    objects = render_overlay(overlay)
    expected_target = {
        "--redis-url": "redis",
        "--broker": "weight-broker",
        "--trainer": "trainer",
        "--rollout": "rollout",
    }
    checked = 0
    for _workload, container in all_containers(overlay):
        args = expanded_args(container)
        for flag, component in expected_target.items():
            values = flag_values(args, flag)
            assert flag == "--rollout" or len(values) <= 1, f"{flag} given {len(values)} times"
            for value in values:
                if flag == "--redis-url":
                    assert value.startswith("redis://") and value.endswith("/0")
                    value = value[len("redis://") : -len("/0")]
                service, _ = resolve_address(objects, value)
                assert service["spec"]["selector"][COMPONENT] == component
                checked += 1
    # controller: 3 + one --rollout per rollout replica, trainer leader and workers: 2 each, rollout: 2
    replicas = find(objects, "StatefulSet", "furlong-rollout")["spec"]["replicas"]
    assert checked == 3 + replicas + 2 + 2 + 2


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stateful_pieces_have_budgets_accounts_and_storage(overlay):
    objects = render_overlay(overlay)
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
    for workload in workloads(objects):
        spec = pod_template(workload)["spec"]
        labels = pod_template(workload)["metadata"]["labels"]
        assert spec["serviceAccountName"] in accounts
        assert spec["automountServiceAccountToken"] is False
        if workload["kind"] in ("Deployment", "StatefulSet", "JobSet"):
            matching = [b for b in budgets if selector_matches(b["spec"]["selector"], labels)]
            assert len(matching) == 1, f"{workload['metadata']['name']}: {len(matching)} budgets"
            if workload["metadata"]["name"] == "furlong-rollout":
                # replicas: one may go at a time (its share of a step goes to another replica)
                assert matching[0]["spec"]["maxUnavailable"] == 1 < workload["spec"]["replicas"]
            elif workload["kind"] == "StatefulSet":  # holds run state: no voluntary eviction
                assert matching[0]["spec"]["maxUnavailable"] == 0
            if workload["kind"] == "JobSet":  # the same, as the integer minAvailable pods of a JobSet take
                jobs = replicated_jobs(find(objects, "JobSet", workload["metadata"]["name"]))
                assert matching[0]["spec"]["minAvailable"] == sum(
                    j["replicas"] * j["job"]["parallelism"] for j in jobs
                )
                assert "maxUnavailable" not in matching[0]["spec"]
    redis = find(objects, "StatefulSet", "furlong-redis")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag_value(args, "--appendonly") == "yes"
    assert flag_value(args, "--dir") == "/data"
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    dashboard = find(objects, "DaemonSet", "furlong-dashboard")
    assert pod_template(dashboard)["spec"]["hostPID"] is True  # process attribution (documented)
