"""Structure of .github/workflows: the files parse, and the gates, pass-throughs and step orders
that the CI logic relies on are really wired that way."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tools.ci import cli, directives, gateway
from tools.ci.outcome import JOBS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
EXPECTED_FILES = {
    "test-cpu.yml",
    "test-gpu.yml",
    "test-rocm.yml",
    "_gpu-suite.yml",
    "manifests.yml",
    "rerun-command.yml",
    "rerun-test.yml",
}
TOOLS_CI = re.compile(r"python3? -m tools\.ci ([a-z-]+)")


def load(name: str) -> dict:
    doc = yaml.safe_load((WORKFLOWS / name).read_text())
    if True in doc:  # YAML 1.1 reads the key `on` as the boolean True
        doc["on"] = doc.pop(True)
    return doc


def steps(doc: dict, job: str) -> list[dict]:
    return doc["jobs"][job]["steps"]


def index(step_list: list[dict], predicate) -> int:
    found = [i for i, s in enumerate(step_list) if predicate(s)]
    assert len(found) == 1, f"expected one matching step, found {len(found)}"
    return found[0]


def runs(text: str):
    return lambda step: text in step.get("run", "")


def all_docs() -> dict[str, dict]:
    return {p.name: load(p.name) for p in sorted(WORKFLOWS.glob("*.yml"))}


def test_every_workflow_parses_with_triggers_permissions_and_jobs():
    docs = all_docs()
    assert set(docs) == EXPECTED_FILES
    for name, doc in docs.items():
        assert doc["on"], name
        assert isinstance(doc.get("permissions"), dict), f"{name} must declare permissions"
        for job_name, job in doc["jobs"].items():
            assert ("runs-on" in job) != ("uses" in job), f"{name}:{job_name}"
            needs = job.get("needs", [])
            for need in [needs] if isinstance(needs, str) else needs:
                assert need in doc["jobs"], f"{name}:{job_name} needs unknown {need}"
            if "uses" in job:
                assert (ROOT / job["uses"]).is_file(), job["uses"]


def test_no_expression_is_expanded_inside_a_script():
    """Untrusted text (comment bodies, PR bodies, inputs) reaches scripts only through env."""
    for name, doc in all_docs().items():
        for job_name, job in doc["jobs"].items():
            for step in job.get("steps", []):
                assert "${{" not in step.get("run", ""), f"{name}:{job_name}:{step.get('name')}"


def test_every_tools_ci_command_exists():
    known = cli.command_names()
    used = set()
    for doc in all_docs().values():
        for job in doc["jobs"].values():
            for step in job.get("steps", []):
                used.update(TOOLS_CI.findall(step.get("run", "")))
    assert used and used <= known, used - known


def test_cpu_workflow_installs_redis_then_runs_the_readme_test_command():
    doc = load("test-cpu.yml")
    assert doc["jobs"]["test"]["runs-on"] == "ubuntu-latest"
    s = steps(doc, "test")
    checkout = index(s, lambda st: st.get("uses", "").startswith("actions/checkout@"))
    redis = index(s, runs("apt-get install -y -qq redis-server"))
    setup = index(s, runs("make setup"))
    test = index(s, lambda st: st.get("run", "").strip() == "make test")
    assert checkout < redis < setup < test
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme


@pytest.mark.parametrize(("name", "vendor"), [("test-gpu.yml", "nvidia"), ("test-rocm.yml", "amd")])
def test_gpu_workflows_resolve_first_then_gate_and_pass_booleans(name, vendor):
    doc = load(name)
    assert "pull_request" in doc["on"] and "workflow_dispatch" in doc["on"]
    assert set(doc["on"]["workflow_dispatch"]["inputs"]) == {f"{k}_ref" for k in directives.UPSTREAMS}
    resolve, suite = doc["jobs"]["resolve"], doc["jobs"]["suite"]
    assert resolve["runs-on"] == "ubuntu-latest"  # decided before any GPU runner is claimed
    assert "github.event.pull_request.head.repo.full_name == github.repository" in resolve["if"]
    step = resolve["steps"][index(resolve["steps"], runs("tools.ci resolve"))]
    assert step["id"] == "resolve"
    assert step["env"]["PR_BODY"] == "${{ github.event.pull_request.body }}"
    for key in directives.UPSTREAMS:
        assert step["env"][f"INPUT_{key.upper()}_REF"] == f"${{{{ inputs.{key}_ref }}}}"
    assert suite["needs"] == "resolve"
    assert suite["if"] == "needs.resolve.result == 'success'"
    assert suite["uses"] == "./.github/workflows/_gpu-suite.yml"
    assert json.loads(suite["with"]["runs_on"]) == ["self-hosted", "gpu", vendor]
    check_resolver_outputs(resolve)
    check_suite_call(suite["with"])


def check_resolver_outputs(resolve_job: dict) -> None:
    expected = set(directives.outputs({}))
    assert set(resolve_job["outputs"]) == expected
    for key, value in resolve_job["outputs"].items():
        assert value == f"${{{{ steps.resolve.outputs.{key} }}}}"


def check_suite_call(with_: dict) -> None:
    """Every boolean input of the suite gets a real boolean made from the resolver's string."""
    inputs = load("_gpu-suite.yml")["on"]["workflow_call"]["inputs"]
    assert set(with_) <= set(inputs), set(with_) - set(inputs)
    for name, spec in inputs.items():
        if spec.get("required"):
            assert name in with_, f"required suite input {name} not passed"
        if spec["type"] == "boolean":
            assert with_[name] == f"${{{{ needs.resolve.outputs.{name} == 'true' }}}}"
    for key in directives.UPSTREAMS:
        assert with_[f"{key}_sha"] == f"${{{{ needs.resolve.outputs.{key}_sha }}}}"


def test_gpu_suite_inputs_are_typed_and_steps_ordered():
    doc = load("_gpu-suite.yml")
    inputs = doc["on"]["workflow_call"]["inputs"]
    for key in directives.UPSTREAMS:
        assert inputs[f"override_{key}"]["type"] == "boolean"
        assert inputs[f"{key}_sha"]["type"] == "string"
    assert doc["jobs"]["suite"]["runs-on"] == "${{ fromJSON(inputs.runs_on) }}"
    s = steps(doc, "suite")
    for step in s:  # booleans are used as booleans, never compared with strings
        assert "'true'" not in str(step.get("if", "")) and "== true" not in str(step.get("if", ""))
    checkout = index(s, lambda st: st.get("uses", "").startswith("actions/checkout@"))
    check = index(s, runs("tools.ci check-suite-inputs"))
    fetch = index(s, runs("NVIDIA/Megatron-LM.git"))
    probe = index(s, runs("tools.ci platform-patch"))
    venv = index(s, runs("python3 -m venv --system-site-packages"))
    sglang = index(s, runs("sglang @ git+https://github.com/sgl-project/sglang.git@"))
    megatron = index(s, runs('--no-deps "$RUNNER_TEMP/megatron-lm"'))
    baseline = index(s, runs("tools.ci check-baseline"))
    tests = index(s, runs("-m pytest"))
    assert checkout < check < fetch < probe < venv < sglang < megatron < baseline < tests
    installs = [i for i, st in enumerate(s) if "pip install" in st.get("run", "")]
    assert installs and min(installs) > probe  # the probe fails before any install
    assert s[fetch]["if"] == s[probe]["if"] == s[megatron]["if"] == "inputs.override_megatron"
    assert s[sglang]["if"] == "inputs.override_sglang"
    for i in installs:
        if i != venv:
            assert "--no-deps" in s[i]["run"]  # overrides never pull other dependencies
    assert "--override megatron-core" in s[baseline]["run"] and "--override sglang" in s[baseline]["run"]
    makefile = (ROOT / "Makefile").read_text()
    dists = re.search(r"^DISTS := (.+)$", makefile, re.M).group(1).split()
    assert re.findall(r"-e (\S+)", s[venv]["run"]) == dists


def test_rerun_gateway_accepts_only_pr_comments_and_dispatches_from_default_branch():
    doc = load("rerun-command.yml")
    assert doc["on"] == {"issue_comment": {"types": ["created"]}}
    assert doc["permissions"]["actions"] == "write"
    job = doc["jobs"]["gateway"]
    assert "github.event.issue.pull_request" in job["if"]
    assert "startsWith(github.event.comment.body, '/rerun-test')" in job["if"]
    checkout = job["steps"][index(job["steps"], lambda st: "actions/checkout" in st.get("uses", ""))]
    assert "ref" not in checkout.get("with", {})  # the default branch, never the PR's code
    step = job["steps"][index(job["steps"], runs("tools.ci gateway"))]
    assert step["env"]["COMMENT_BODY"] == "${{ github.event.comment.body }}"
    assert step["env"]["DEFAULT_BRANCH"] == "${{ github.event.repository.default_branch }}"
    dispatched = load(gateway.RERUN_WORKFLOW)["on"]
    assert list(dispatched) == ["workflow_dispatch"]
    required = {k for k, v in dispatched["workflow_dispatch"]["inputs"].items() if v.get("required")}
    assert required == {"pr_number", "head_sha", "test_path", "requested_by"}


def test_rerun_run_owns_one_comment_and_always_finalizes_it():
    doc = load("rerun-test.yml")
    jobs = doc["jobs"]
    assert list(jobs) == [*JOBS, "finalize"]
    assert jobs["resolve"]["needs"] == "announce"
    assert set(jobs["test"]["needs"]) == {"announce", "resolve"}
    assert jobs["test"]["if"] == "needs.resolve.result == 'success'"
    assert jobs["test"]["permissions"] == {"contents": "read"}
    assert jobs["test"]["with"]["ref"] == "${{ inputs.head_sha }}"
    assert jobs["test"]["with"]["test_path"] == "${{ inputs.test_path }}"
    check_resolver_outputs(jobs["resolve"])
    check_suite_call(jobs["test"]["with"])

    announce_step = jobs["announce"]["steps"][index(jobs["announce"]["steps"], runs("tools.ci announce"))]
    assert announce_step["id"] == "announce"
    assert jobs["announce"]["outputs"] == {
        "comment_id": "${{ steps.announce.outputs.comment_id }}",
        "started_at": "${{ steps.announce.outputs.started_at }}",
    }
    fin = jobs["finalize"]
    assert fin["needs"] == list(JOBS) and fin["if"] == "always()"
    env = fin["steps"][index(fin["steps"], runs("tools.ci finalize"))]["env"]
    assert env["COMMENT_ID"] == "${{ needs.announce.outputs.comment_id }}"  # passed, not searched
    assert env["STARTED_AT"] == "${{ needs.announce.outputs.started_at }}"
    assert {k: v for k, v in env.items() if k.startswith("RESULT_")} == {
        f"RESULT_{job.upper()}": f"${{{{ needs.{job}.result }}}}" for job in JOBS
    }
    assert env["RUN_URL"] == (
        "${{ github.server_url }}/${{ github.repository }}/actions/runs/${{ github.run_id }}"
    )
    scripts = [st.get("run", "") for job in jobs.values() for st in job.get("steps", [])]
    assert sum("tools.ci announce" in s for s in scripts) == 1  # only one job may create
    assert not any("gh " in s or "/comments" in s for s in scripts)  # nothing searches comments
    for name in ("announce", "resolve", "finalize"):
        checkout = jobs[name]["steps"][0]
        assert checkout["uses"].startswith("actions/checkout@")
        assert checkout["with"] == {"persist-credentials": False}  # default-branch code only
