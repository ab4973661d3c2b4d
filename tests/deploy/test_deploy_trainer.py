"""The trainer JobSet: torchrun's command line (parsed by torchrun's own parser and the trainer's),
the c10d rendezvous it names (the leader pod's DNS name, a headless Service, the port), which pod
holds rank 0, the checkpoint volume, GPUs requested and used, restart behaviour, and strict
validation that rejects a broken JobSet."""

from __future__ import annotations

import copy
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from k8s_render import (
    COMPONENT,
    K8S,
    OVERLAYS,
    find,
    pod_template,
    render_dir,
    render_overlay,
    replicated_jobs,
    selector_matches,
    workloads,
)
from test_deploy_render import validate_object
from test_deploy_workloads import FAKE_FIELDS, expanded_args, flag_value, launcher_args

JOBSET = "furlong-trainer"
GPU_KEYS = ("nvidia.com/gpu", "amd.com/gpu")
JOB_INDEX_FIELD = "metadata.labels['jobset.sigs.k8s.io/job-index']"


def trainer_jobs(objects: list[dict]) -> dict[str, dict]:
    return {job["replicatedJob"]: job for job in replicated_jobs(find(objects, "JobSet", JOBSET))}


def container_of(job: dict) -> dict:
    containers = pod_template(job)["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def fields_of(job_index: int) -> dict[str, str]:
    return {**FAKE_FIELDS, JOB_INDEX_FIELD: str(job_index)}


def torchrun_config(container: dict, fields: dict[str, str], monkeypatch):
    """(torchrun's LaunchConfig, the module it starts, that module's args) from torchrun's own
    parser, as the agent would make them of the container's command line."""
    from torch.distributed.run import config_from_args, get_args_parser

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # else torchrun sets it in this process
    args = get_args_parser().parse_args(launcher_args(container, fields) + ["-m", "furlong.trainer"])
    assert args.module and args.training_script == "furlong.trainer"
    config, _cmd, _cmd_args = config_from_args(args)
    return config


def total_pods(objects: list[dict]) -> int:
    return sum(j["replicas"] * j["job"]["parallelism"] for j in trainer_jobs(objects).values())


def gpus_of(container: dict) -> int:
    limits = container["resources"]["limits"]
    found = [int(limits[k]) for k in GPU_KEYS if k in limits]
    assert len(found) <= 1
    return found[0] if found else 0


def pod_dns_name(jobset: dict, replicated_job: str, job_index: int, pod_index: int = 0) -> str:
    """The name JobSet gives a pod: <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>."""
    subdomain = jobset["spec"]["network"]["subdomain"]
    return f"{jobset['metadata']['name']}-{replicated_job}-{job_index}-{pod_index}.{subdomain}"


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_torchrun_command_is_accepted_by_torchrun_and_the_trainer(overlay, monkeypatch):
    import torch

    from furlong.trainer.__main__ import parse_args as trainer_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPU overlays pass --device cuda
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    objects = render_overlay(overlay)
    jobset = find(objects, "JobSet", JOBSET)
    jobs = trainer_jobs(objects)
    assert set(jobs) == {"leader", "workers"}
    assert jobs["leader"]["replicas"] == 1
    leader_name = pod_dns_name(jobset, "leader", 0)
    nodes = total_pods(objects)
    assert nodes >= 2
    for role, job in jobs.items():
        container = container_of(job)
        for job_index in range(job["replicas"]):
            fields = fields_of(job_index)
            config = torchrun_config(container, fields, monkeypatch)
            where = f"{overlay}: {role} {job_index}"
            assert (config.min_nodes, config.max_nodes) == (nodes, nodes), where
            assert config.nproc_per_node == max(1, gpus_of(container)), where
            assert config.rdzv_backend == "c10d", where
            assert config.rdzv_endpoint == f"{leader_name}:29400", where
            assert config.rdzv_configs["is_host"] == ("true" if role == "leader" else "false"), where
            assert config.local_addr == pod_dns_name(jobset, role, job_index), where
            assert config.max_restarts == 0, where
            trainer = trainer_args(expanded_args(container, fields))
            assert trainer.device == ("cuda" if gpus_of(container) else "cpu"), where
            assert trainer.checkpoint_dir == "/var/lib/furlong/checkpoints", where
            assert trainer.consumer_name == "furlong-trainer", where


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rendezvous_endpoint_and_rank_zero_service_resolve(overlay):
    objects = render_overlay(overlay)
    jobset = find(objects, "JobSet", JOBSET)
    jobs = trainer_jobs(objects)
    network = jobset["spec"]["network"]
    assert network["enableDNSHostnames"] is True and network["publishNotReadyAddresses"] is True
    ranks = find(objects, "Service", network["subdomain"])
    assert ranks["spec"]["clusterIP"] == "None"
    assert ranks["spec"]["publishNotReadyAddresses"] is True  # agents resolve each other unready
    labels = {role: pod_template(job)["metadata"]["labels"] for role, job in jobs.items()}
    assert all(selector_matches({"matchLabels": ranks["spec"]["selector"]}, lab) for lab in labels.values())
    endpoint = flag_value(launcher_args(container_of(jobs["leader"])), "--rdzv-endpoint")
    host, port = endpoint.rsplit(":", 1)
    assert host == pod_dns_name(jobset, "leader", 0)
    assert int(port) in [p["port"] for p in ranks["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in container_of(jobs["leader"])["ports"]]
    # furlong-trainer, the address the controller calls, reaches the leader pod alone
    service = find(objects, "Service", "furlong-trainer")
    assert service["spec"].get("clusterIP") != "None"
    selector = {"matchLabels": service["spec"]["selector"]}
    assert selector_matches(selector, labels["leader"])
    assert not selector_matches(selector, labels["workers"])
    leader_ports = {p["name"]: p["containerPort"] for p in container_of(jobs["leader"])["ports"]}
    for port in service["spec"]["ports"]:
        assert leader_ports[port["targetPort"]] == port["port"]
    controller = find(objects, "Deployment", "furlong-controller")
    controller_args = expanded_args(pod_template(controller)["spec"]["containers"][0])
    assert flag_value(controller_args, "--trainer") == "furlong-trainer:50051"


@pytest.mark.unit
def test_the_leader_pod_holds_rank_zero():
    """torchrun numbers the nodes in the sorted order of their agents' descriptors, whose first
    field is --local-addr: the leader's name sorts before every worker's, for up to 100 workers."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    objects = render_overlay("prod")
    jobs = trainer_jobs(objects)
    addresses = {"leader": flag_value(launcher_args(container_of(jobs["leader"])), "--local-addr")}
    for index in range(100):
        worker_args = launcher_args(container_of(jobs["workers"]), fields_of(index))
        addresses[f"worker {index}"] = flag_value(worker_args, "--local-addr")
    assert len(set(addresses.values())) == len(addresses)
    # pids and local ids as in any order the agents might have
    nodes = {_NodeDesc(addr, 1000 - i, i): who for i, (who, addr) in enumerate(addresses.items())}
    assert nodes[sorted(nodes)[0]] == "leader"


@pytest.mark.integration
def test_torchrun_gives_rank_zero_to_the_agent_whose_address_sorts_first(tmp_path):
    """The manifest's launcher options, run: two agents on this machine meet in a c10d rendezvous
    hosted by the one with is_host=true; ranks follow the sorted --local-addr, whichever agent hosts
    the store (the worker's address here sorts first)."""
    objects = render_overlay("dev")
    jobs = trainer_jobs(objects)
    script = tmp_path / "rank.py"
    script.write_text("import os\nprint('RANK', os.environ['RANK'], os.environ['GROUP_RANK'], flush=True)\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    replaced = {
        "--nnodes": "2",
        "--nproc-per-node": "1",
        "--rdzv-endpoint": f"127.0.0.1:{port}",
    }
    addresses = {"leader": "localhost", "workers": "127.0.0.1"}  # "127.0.0.1" < "localhost"
    procs = {}
    for role in ("workers", "leader"):
        args = launcher_args(container_of(jobs[role]))
        conf = flag_value(args, "--rdzv-conf")
        for flag, value in {**replaced, "--local-addr": addresses[role]}.items():
            args[args.index(flag) + 1] = value
        args[args.index("--rdzv-conf") + 1] = conf.replace("join_timeout=900", "join_timeout=60")
        procs[role] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *args, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    outputs = {}
    try:
        for role, proc in procs.items():
            outputs[role] = proc.communicate(timeout=120)[0]
            assert proc.returncode == 0, f"{role}: {outputs[role]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    rank_lines = {
        role: [line for line in out.splitlines() if line.startswith("RANK ")] for role, out in outputs.items()
    }
    assert rank_lines == {"workers": ["RANK 0 0"], "leader": ["RANK 1 1"]}


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_leader_and_workers_run_the_same_trainer(overlay):
    """The two pod templates may differ only where a role must: rendezvous role and address,
    ports and probes (rank 0 serves), the role label, mTLS on the leader."""
    jobs = trainer_jobs(render_overlay(overlay))
    leader, worker = (container_of(jobs[r]) for r in ("leader", "workers"))
    assert leader["image"] == worker["image"] and leader["command"] == worker["command"]
    assert leader["resources"] == worker["resources"]
    assert expanded_args(leader) == expanded_args(worker)
    launch = [launcher_args(c) for c in (leader, worker)]
    for args in launch:
        del args[args.index("--rdzv-conf") : args.index("--rdzv-conf") + 2]
        del args[args.index("--local-addr") : args.index("--local-addr") + 2]
    assert launch[0] == launch[1]
    specs = [pod_template(jobs[r])["spec"] for r in ("leader", "workers")]
    for key in ("volumes", "securityContext", "tolerations", "serviceAccountName"):
        assert specs[0].get(key) == specs[1].get(key), key
    assert leader["volumeMounts"] == worker["volumeMounts"]


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_trainer_pod_mounts_the_checkpoint_volume(overlay):
    objects = render_overlay(overlay)
    claim = find(objects, "PersistentVolumeClaim", "furlong-trainer-checkpoints")
    modes = claim["spec"]["accessModes"]
    assert modes == (["ReadWriteOnce"] if overlay == "dev" else ["ReadWriteMany"])  # pods on several nodes
    for role, job in trainer_jobs(objects).items():
        spec = pod_template(job)["spec"]
        container = container_of(job)
        args = expanded_args(container)
        for flag in ("--checkpoint-dir", "--policy-dir"):
            path = Path(flag_value(args, flag))
            mounts = [m for m in container["volumeMounts"] if Path(m["mountPath"]) in path.parents]
            assert len(mounts) == 1, f"{role}: {flag} {path}"
            assert not mounts[0].get("readOnly", False), f"{role}: {flag} must be writable"
            volume = next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])
            assert volume["persistentVolumeClaim"]["claimName"] == "furlong-trainer-checkpoints"
            assert not volume["persistentVolumeClaim"].get("readOnly", False)


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_failed_pod_restarts_the_whole_trainer(overlay):
    jobset = find(render_overlay(overlay), "JobSet", JOBSET)
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    assert jobset["spec"]["failurePolicy"].get("restartStrategy", "Recreate") == "Recreate"
    for job in replicated_jobs(jobset):
        assert job["job"]["backoffLimit"] == 0  # a failed pod fails its Job, and JobSet recreates all
        assert job["job"]["completionMode"] == "Indexed"  # JobSet's pod hostnames need it
        assert job["job"]["parallelism"] == job["job"]["completions"] == 1
        assert pod_template(job)["spec"]["restartPolicy"] == "Never"


@pytest.mark.integration
@pytest.mark.parametrize(
    "overlay,gpu_key", [("dev", None), ("prod", "nvidia.com/gpu"), ("amd", "amd.com/gpu")]
)
def test_processes_use_the_gpus_their_pods_request(overlay, gpu_key):
    """Every GPU a trainer or rollout pod requests has a process on it: the trainer starts one rank
    per GPU (--nproc-per-node; --device cuda is cuda:LOCAL_RANK), rollout runs its engines on cuda."""
    objects = render_overlay(overlay)
    checked = set()
    for workload in workloads(objects):
        component = pod_template(workload)["metadata"]["labels"][COMPONENT]
        if component not in ("trainer", "rollout"):
            continue
        container = pod_template(workload)["spec"]["containers"][0]
        resources = container["resources"]
        gpus = gpus_of(container)
        if gpu_key is None:
            assert gpus == 0
        else:
            assert gpus >= 1 and resources["requests"][gpu_key] == resources["limits"][gpu_key]
        assert flag_value(expanded_args(container), "--device") == ("cuda" if gpus else "cpu")
        if component == "trainer":
            ranks = int(flag_value(launcher_args(container), "--nproc-per-node"))
            assert ranks == max(1, gpus)
        checked.add((component, workload.get("replicatedJob")))
    assert checked == {("trainer", "leader"), ("trainer", "workers"), ("rollout", None)}


@pytest.mark.unit
def test_the_example_run_asks_for_the_dev_trainers_world_size():
    from furlong.controller.run_spec import parse_run_spec

    spec = parse_run_spec(json.loads((K8S / "components" / "cpu-dev" / "addition-run.json").read_text()))
    objects = render_overlay("dev")
    leader = container_of(trainer_jobs(objects)["leader"])
    per_node = int(flag_value(launcher_args(leader), "--nproc-per-node"))
    assert spec.trainer.parallel.world_size == total_pods(objects) * per_node
    assert spec.trainer.parallel.strategy == "ddp"  # resumable from checkpoints


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_disruption_budget_covers_every_trainer_pod(overlay):
    objects = render_overlay(overlay)
    budget = find(objects, "PodDisruptionBudget", "furlong-trainer")
    assert budget["spec"]["minAvailable"] == total_pods(objects)


def broken(jobset: dict, change) -> dict:
    obj = copy.deepcopy(jobset)
    change(obj)
    return obj


def _set(path: list, value):
    def change(obj):
        node = obj
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def _delete(path: list):
    def change(obj):
        node = obj
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return change


@pytest.mark.unit
def test_strict_validation_rejects_a_broken_jobset():
    jobset = find(render_overlay("prod"), "JobSet", JOBSET)
    validate_object(jobset)  # the shipped one passes
    job = ["spec", "replicatedJobs", 1]
    pod = [*job, "template", "spec", "template", "spec"]
    schema_errors = {
        "unknown spec field": _set(["spec", "replicatedJob"], []),
        "unknown replicated-job field": _set([*job, "replica"], 2),
        "replicas not an integer": _set([*job, "replicas"], "two"),
        "unknown failure-policy field": _set(["spec", "failurePolicy", "maxRestart"], 3),
        "restart strategy outside the enum": _set(["spec", "failurePolicy", "restartStrategy"], "Sometimes"),
        "unknown network field": _set(["spec", "network", "subdomian"], "x"),
        "replicated job without a template": _delete([*job, "template"]),
        "wrong apiVersion": _set(["apiVersion"], "jobset.x-k8s.io/v1alpha1"),
    }
    for what, change in schema_errors.items():
        with pytest.raises(jsonschema.ValidationError):
            validate_object(broken(jobset, change))
            pytest.fail(f"accepted a JobSet with {what}")
    template_errors = {
        "unknown container field": _set([*pod, "containers", 0, "imagePullPolicyy"], "IfNotPresent"),
        "unknown Job field": _set([*job, "template", "spec", "paralelism"], 1),
        "container without a name": _delete([*pod, "containers", 0, "name"]),
    }
    for what, change in template_errors.items():
        with pytest.raises(kubernetes_validate.ValidationError):
            validate_object(broken(jobset, change))
            pytest.fail(f"accepted a JobSet with {what}")


@pytest.mark.integration
def test_the_gpu_components_fail_to_build_when_the_trainer_template_moves(tmp_path):
    """The JobSet is patched by path; the patches' `test` operations stop a build whose
    base/trainer.yaml no longer has what they patch where they patch it."""
    shutil.copytree(K8S, tmp_path / "k8s")
    trainer = tmp_path / "k8s" / "base" / "trainer.yaml"
    text = trainer.read_text()
    swapped = text.replace("- name: FURLONG_RANKS_PER_NODE", "- name: FURLONG_RANKS_PER_POD")
    assert swapped != text
    trainer.write_text(swapped)
    render_dir(tmp_path / "k8s" / "overlays" / "dev")  # cpu-dev does not patch the env
    for overlay in ("prod", "amd"):
        with pytest.raises(AssertionError, match="testing value"):
            render_dir(tmp_path / "k8s" / "overlays" / overlay)


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_the_trainer_pods_reach_each_other(overlay):
    """The rendezvous port on the leader, and the ports NCCL/gloo pick at run time both ways."""
    from test_deploy_network import NAMESPACE, ingress_allowed

    objects = render_overlay(overlay)
    labels = {role: pod_template(job)["metadata"]["labels"] for role, job in trainer_jobs(objects).items()}
    assert ingress_allowed(objects, labels["leader"], labels["workers"], NAMESPACE, 29400)
    for src, dst in (("workers", "leader"), ("leader", "workers")):
        assert ingress_allowed(objects, labels[dst], labels[src], NAMESPACE, 43127), f"{src} -> {dst}"
    dashboard = next(
        pod_template(w)["metadata"]["labels"]
        for w in workloads(objects)
        if pod_template(w)["metadata"]["labels"][COMPONENT] == "dashboard"
    )
    assert not ingress_allowed(objects, labels["leader"], dashboard, NAMESPACE, 29400)


CRD_TOOL = K8S.parents[1] / "tools" / "k8s_crd_schema.py"
TINY_CRD = """\
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.example.com}
spec:
  group: example.com
  names: {kind: Widget, singular: widget, plural: widgets, listKind: WidgetList}
  scope: Namespaced
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            apiVersion: {type: string}
            kind: {type: string}
            metadata: {type: object}
            spec:
              type: object
              description: dropped
              properties:
                size: {type: integer, format: int32, default: 1}
                free:
                  type: object
                  x-kubernetes-preserve-unknown-fields: true
                  properties: {a: {type: string}}
                parts:
                  type: array
                  items:
                    type: object
                    required: [name]
                    properties:
                      name: {type: string}
                      template: {type: object, properties: {x: {type: string}}}
"""


def run_crd_tool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    crd = tmp_path / "crd.yaml"
    crd.write_text(TINY_CRD)
    command = [sys.executable, str(CRD_TOOL), str(crd), "--source", "example 1.0, crd.yaml", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.mark.unit
def test_crd_schema_tool_rejects_unknown_fields_and_opens_the_paths_asked(tmp_path):
    result = run_crd_tool(tmp_path, "--version", "v1", "--opaque", "spec.parts.template")
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    good = {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": "w"},
        "spec": {"size": 2, "free": {"anything": 1}, "parts": [{"name": "p", "template": {"y": 1}}]},
    }
    validator.validate(good)  # preserve-unknown-fields and the opaque template take any field
    assert schema["x-source"] == "example 1.0, crd.yaml"
    assert "description" not in schema["properties"]["spec"]
    for bad in (
        {**good, "apiVersion": "example.com/v2"},
        {**good, "spec": {**good["spec"], "sise": 2}},
        {**good, "spec": {**good["spec"], "parts": [{"name": "p", "extra": 1}]}},
        {**good, "spec": {**good["spec"], "parts": [{"template": {}}]}},
        {k: v for k, v in good.items() if k != "spec"},
    ):
        assert not validator.is_valid(bad), bad
    missing = run_crd_tool(tmp_path, "--version", "v2")
    assert missing.returncode != 0 and "v2" in missing.stderr
    wrong_path = run_crd_tool(tmp_path, "--version", "v1", "--opaque", "spec.parts.nothing")
    assert wrong_path.returncode != 0 and "nothing" in wrong_path.stderr
