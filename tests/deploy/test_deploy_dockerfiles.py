"""Structure of the services' Dockerfiles (no Docker engine here): pinned base images, non-root
users, health checks, entry points that run the service, no downloads outside the package indexes,
images that install exactly the Furlong distributions their service depends on (derived from the
pyproject.toml files, transitively, as tools/deps_check.py reads them), and build contexts
(<Dockerfile>.dockerignore) that keep what the COPY lines need and no other distribution."""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from k8s_render import OVERLAYS, ROOT, render_overlay, workloads

from tools.deps_check import FURLONG_PREFIX, load_distributions, requirement_extras, requirement_name

SERVICES = {  # directory -> module
    "controller": "furlong.controller",
    "trainer": "furlong.trainer",
    "rollout": "furlong.rollout",
    "weight-broker": "furlong.weight_broker",
    "dashboard": "furlong.dashboard",
}
ALLOWED_INDEX = "https://download.pytorch.org/whl/"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, keyword: str) -> str | None:
        values = [v for k, v in self.instructions if k == keyword]
        return values[-1] if values else None


def parse(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile; continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else ""
            stages.append(Stage(name=name, base=parts[0]))
        elif not stages:
            assert keyword == "ARG", f"{path}: {keyword} before the first FROM"
            arg, _, default = rest.partition("=")
            global_args[arg] = default
        else:
            stages[-1].instructions.append((keyword, rest.strip()))
    return global_args, stages


def resolve(image: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


def distribution_dirs() -> dict[str, str]:
    """Furlong distribution name -> its directory (libs/<x>, services/<x>)."""
    return {name: d.directory.relative_to(ROOT).as_posix() for name, d in load_distributions(ROOT).items()}


def furlong_closure(directory: str, dirs: dict[str, str]) -> set[str]:
    """`directory` and the directories of every Furlong distribution it depends on, transitively."""
    distributions = load_distributions(ROOT)
    by_dir = {d: name for name, d in dirs.items()}
    wanted, todo = set(), [by_dir[directory]]
    while todo:
        current = todo.pop()
        if dirs[current] in wanted:
            continue
        wanted.add(dirs[current])
        for name in distributions[current].declared():
            if name.startswith(FURLONG_PREFIX):
                assert name in dirs, f"{current} depends on {name}, which no pyproject.toml declares"
                todo.append(name)
    return wanted


def third_party_closure(directory: str, dirs: dict[str, str]) -> set[str]:
    """Canonical names of the third-party dependencies of `directory`'s Furlong closure."""
    distributions = {d.directory.relative_to(ROOT).as_posix(): d for d in load_distributions(ROOT).values()}
    names = set()
    for current in furlong_closure(directory, dirs):
        names |= {n for n in distributions[current].declared() if not n.startswith(FURLONG_PREFIX)}
    return names


def pip_installs(stage: Stage) -> list[list[str]]:
    """The arguments of each `pip install` in a stage's RUN commands, quotes removed."""
    found = []
    for keyword, value in stage.instructions:
        if keyword == "RUN":
            matches = re.finditer(r"pip install ([^&;]*)", value)
            found += [m.group(1).replace('"', "").split() for m in matches]
    return found


def installed_requests(stage: Stage) -> dict[str, set[str]]:
    """Repository directory -> extras, for each directory a stage's `pip install` commands install
    (constraint files aside): `/src/services/dashboard[nvidia]` -> {"services/dashboard": {"nvidia"}}."""
    installed: dict[str, set[str]] = {}
    for tokens in pip_installs(stage):
        for before, token in zip(["", *tokens], tokens):
            path = token.split("[", 1)[0]
            if before != "-c" and path.startswith("/src/") and (ROOT / path[len("/src/") :]).is_dir():
                installed.setdefault(path[len("/src/") :], set()).update(requirement_extras(token))
    return installed


def installed_sources(stage: Stage) -> set[str]:
    """The repository directories a stage's `pip install` commands install (constraint files aside)."""
    return set(installed_requests(stage))


def image_stages(stages: list[Stage]) -> list[Stage]:
    """Stages that are images someone runs: those with an ENTRYPOINT."""
    return [s for s in stages if s.last("ENTRYPOINT")]


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_base_images_are_pinned(service):
    global_args, stages = parse(ROOT / "services" / service / "Dockerfile")
    stage_names = {s.name for s in stages}
    for stage in stages:
        if stage.base in stage_names:
            continue
        image = resolve(stage.base, global_args)
        name, _, tag = image.rpartition(":")
        assert name and tag and "/" not in tag, f"{service}: {image} has no tag"
        assert tag != "latest" and not tag.startswith("latest"), image
        assert re.search(r"\d", tag), f"{service}: {image}: tag must name a version"


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_images_run_the_service_as_non_root_with_a_health_check(service):
    _, stages = parse(ROOT / "services" / service / "Dockerfile")
    runnable = image_stages(stages)
    assert runnable, service
    assert stages[-1] in runnable, f"{service}: the default (last) stage must be a service image"
    for stage in runnable:
        user = stage.last("USER")
        assert user is not None, f"{service}/{stage.name}: no USER"
        uid = user.split(":")[0]
        assert uid.isdigit() and int(uid) > 0, f"{service}/{stage.name}: USER {user} (numeric, non-root)"
        keywords = [k for k, _ in stage.instructions]
        assert keywords.index("USER") < keywords.index("ENTRYPOINT")
        health = stage.last("HEALTHCHECK")
        assert health and " CMD " in f" {health} " and "NONE" not in health.upper().split()
        entry = json.loads(stage.last("ENTRYPOINT"))
        assert entry[0] in ("python", "python3") and entry[1:] == ["-m", SERVICES[service]]
        health_cmd = json.loads(health[health.index("CMD") + 3 :].strip())
        assert health_cmd[0] == entry[0]
        probe = health_cmd[-1]
        assert ("check_health" in probe) or ("/healthz" in probe), probe


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_no_downloads_beyond_package_indexes(service):
    dockerfile = ROOT / "services" / service / "Dockerfile"
    _, stages = parse(dockerfile)
    for stage in stages:
        for keyword, value in stage.instructions:
            assert keyword != "ADD", f"{service}: use COPY, not ADD"
            if keyword != "RUN":
                continue
            assert not re.search(r"\b(curl|wget|git\s+clone)\b", value), value
            for url in re.findall(r"https?://[^\s\"']+", value):
                assert url.startswith(ALLOWED_INDEX), f"{service}: {url}"
            if "pip install" in value:
                for match in re.finditer(r"pip install ([^&;]*)", value):
                    options = match.group(1)
                    assert "--extra-index-url" not in options and "--trusted-host" not in options


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_images_install_exactly_the_furlong_distributions_their_service_needs(service):
    wanted = furlong_closure(f"services/{service}", distribution_dirs())
    _, stages = parse(ROOT / "services" / service / "Dockerfile")
    installing = [stage for stage in stages if installed_sources(stage)]
    assert installing, f"{service}: no stage installs the service"
    for stage in installing:
        assert installed_sources(stage) == wanted, f"{service}/{stage.name}"
        copied = {v.split()[0] for k, v in stage.instructions if k == "COPY" and not v.startswith("--from")}
        assert wanted <= copied, f"{service}/{stage.name}: installs {sorted(wanted - copied)} without COPY"


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_requested_extras_exist(service):
    distributions = {d.directory.relative_to(ROOT).as_posix(): d for d in load_distributions(ROOT).values()}
    _, stages = parse(ROOT / "services" / service / "Dockerfile")
    for stage in stages:
        for directory, extras in installed_requests(stage).items():
            assert extras <= set(distributions[directory].optional), f"{service}/{stage.name}: {directory}"


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_stages_installing_without_dependencies_install_the_rest_by_name(service):
    """A stage that installs the Furlong distributions with --no-deps (on a base image that brings
    its own torch) names every other third-party dependency of the service's closure, or leaves it
    to the base image explicitly (the packages it drops from the constraints)."""
    _, stages = parse(ROOT / "services" / service / "Dockerfile")
    for stage in stages:
        installs = pip_installs(stage)
        if not any("--no-deps" in tokens for tokens in installs):
            continue
        named = {requirement_name(t) for tokens in installs for t in tokens if not t.startswith(("-", "/"))}
        run = " ".join(v for k, v in stage.instructions if k == "RUN")
        left = re.search(r"grep -v -E '\^\(([^)]*)\)=='", run)
        from_base = {requirement_name(n) for n in left.group(1).split("|")} if left else set()
        needed = third_party_closure(f"services/{service}", distribution_dirs())
        assert needed - from_base <= named, f"{service}/{stage.name}: {sorted(needed - from_base - named)}"
        assert not named & from_base, f"{service}/{stage.name}"


@pytest.mark.unit
def test_the_derived_distribution_sets():
    """What the declared dependencies say each image needs; the controller has the trainer's, rollout's
    and broker's clients, and only it and the broker install the broker service."""
    dirs = distribution_dirs()
    for service in ("trainer", "rollout"):
        assert {"libs/transfer", "libs/ledger"} <= furlong_closure(f"services/{service}", dirs)
    assert furlong_closure("services/controller", dirs) == {
        "libs/core",
        "libs/service-main",
        "libs/proto",
        "libs/ledger",
        "libs/transfer",
        "services/trainer",
        "services/rollout",
        "services/weight-broker",
        "services/controller",
    }
    assert furlong_closure("services/dashboard", dirs) == {
        "libs/core",
        "libs/service-main",
        "services/dashboard",
    }
    for service in SERVICES:
        needs_broker = "services/weight-broker" in furlong_closure(f"services/{service}", dirs)
        assert needs_broker == (service in ("weight-broker", "controller")), service


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_build_context_keeps_what_copy_needs(service):
    dockerfile = ROOT / "services" / service / "Dockerfile"
    ignore = (dockerfile.parent / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*", "the context starts empty and names what it needs"
    included = [p[1:] for p in patterns if p.startswith("!")]
    _, stages = parse(dockerfile)
    sources = []
    for stage in stages:
        for keyword, value in stage.instructions:
            if keyword == "COPY" and not value.startswith("--from"):
                sources += value.split()[:-1]
    assert "requirements.txt" in sources
    distribution_roots = set(distribution_dirs().values())
    wanted = furlong_closure(f"services/{service}", distribution_dirs())
    assert {inc for inc in included if inc in distribution_roots} == wanted, f"{service}: context"
    for source in sources:
        assert (ROOT / source).exists(), f"{service}: COPY {source} does not exist"
        assert any(
            source == inc or source.startswith(inc + "/") or fnmatch.fnmatch(source, inc) for inc in included
        ), f"{service}: {source} is excluded from the build context"


@pytest.mark.unit
def test_gpu_variants_are_build_arguments():
    for service in ("trainer", "rollout"):
        text = (ROOT / "services" / service / "Dockerfile").read_text()
        assert "ARG TORCH_VARIANT=cpu" in text
        assert "rocm" in text and "cu1" in text
        assert "https://download.pytorch.org/whl/$TORCH_VARIANT" in text
    _, stages = parse(ROOT / "services" / "rollout" / "Dockerfile")
    sglang = next(s for s in stages if s.name == "sglang")
    global_args, _ = parse(ROOT / "services" / "rollout" / "Dockerfile")
    assert resolve(sglang.base, global_args).startswith("lmsysorg/sglang:v")


@pytest.mark.unit
def test_sglang_image_is_the_release_the_adapter_follows():
    from furlong.rollout.engine_launch import SGLANG_RELEASE

    global_args, stages = parse(ROOT / "services" / "rollout" / "Dockerfile")
    sglang = next(s for s in stages if s.name == "sglang")
    assert resolve(sglang.base, global_args) == f"lmsysorg/sglang:{SGLANG_RELEASE}"
    assert SGLANG_RELEASE in (ROOT / "docs" / "rollout.md").read_text()


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifest_images_are_built_by_a_dockerfile(overlay):
    for workload in workloads(render_overlay(overlay)):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            image = container["image"]
            if not image.startswith("furlong/"):
                continue
            service, _, tag = image[len("furlong/") :].partition(":")
            assert service in SERVICES, image
            dockerfile = ROOT / "services" / service / "Dockerfile"
            assert dockerfile.is_file(), image
            if tag.endswith("-sglang"):
                assert any(s.name == "sglang" for s in parse(dockerfile)[1]), image
            if tag.endswith(("-cuda", "-rocm")):
                assert "ARG TORCH_VARIANT" in dockerfile.read_text(), image
