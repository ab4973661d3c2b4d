"""docs/deploy.md walks through files and objects that exist, and its example run spec is valid."""

from __future__ import annotations

import json
import re

import pytest
from k8s_render import K8S, OVERLAYS, ROOT, render_overlay

DOC = ROOT / "docs" / "deploy.md"
EXAMPLE_RUN = K8S / "components" / "cpu-dev" / "addition-run.json"


@pytest.mark.unit
def test_paths_named_in_the_guide_exist():
    text = DOC.read_text()
    paths = set(re.findall(r"\b((?:deploy|services|tools|examples|docs)/[\w./-]*[\w-])", text))
    assert len(paths) > 10
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/deploy.md names missing paths: {missing}"
    for overlay in OVERLAYS:
        assert f"deploy/k8s/overlays/{overlay}" in text or f"overlays/{overlay}" in text


@pytest.mark.unit
def test_example_run_spec_is_valid_and_reads_the_checkpoint_the_job_writes():
    from furlong.controller.run_spec import parse_run_spec

    spec = parse_run_spec(json.loads(EXAMPLE_RUN.read_text()))
    job_text = (K8S / "components" / "cpu-dev" / "example-checkpoint-job.yaml").read_text()
    assert f"--out, {spec.model}" in job_text
    assert spec.model.startswith("/models/")


@pytest.mark.integration
def test_objects_named_in_the_guide_are_rendered():
    text = DOC.read_text()
    rendered = render_overlay("dev")
    objects = {(o["kind"].lower(), o["metadata"]["name"]) for o in rendered}
    # the Jobs a JobSet makes: <jobset>-<replicated job>-<job index>
    for jobset in (o for o in rendered if o["kind"] == "JobSet"):
        for job in jobset["spec"]["replicatedJobs"]:
            for index in range(job.get("replicas", 1)):
                objects.add(("job", f"{jobset['metadata']['name']}-{job['name']}-{index}"))
    named = re.findall(r"\b(statefulset|deployment|job|jobset|svc|pvc|pdb)/(furlong-[\w-]+)", text)
    assert ("jobset", "furlong-trainer") in named
    for kind, name in named:
        kind = {"svc": "service", "pvc": "persistentvolumeclaim", "pdb": "poddisruptionbudget"}.get(
            kind, kind
        )
        assert (kind, name) in objects, f"{kind}/{name}"
    assert "furlong-api-token" in text
