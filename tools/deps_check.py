"""The dependency check `make lint` runs: every Furlong distribution declares exactly what it imports.

A distribution is a directory under libs/ or services/ with a pyproject.toml and its modules under
furlong/<x>/. For each one this checks
- third-party packages with deptry, configured in the distribution's own [tool.deptry]: an import
  not declared (DEP001, DEP003), a dependency never imported (DEP002);
- furlong-* distributions, which deptry cannot tell apart (they all share the `furlong` namespace,
  its known first party): every `furlong.<x>` import, lazy ones and `importlib.import_module` of a
  literal included, is mapped to the distribution whose directory holds furlong/<x>; that
  distribution must be declared, and every declared furlong-* distribution must be imported;
- that each third-party dependency is pinned in requirements.txt, which the Dockerfiles install
  with as constraints, and that each furlong/<x> is one that [tool.setuptools.packages.find] ships.

Usage: python tools/deps_check.py [--root DIR] [DIST_DIR ...] (default: every distribution under
DIR). Prints one line per problem, "<dist dir>: <what>", and exits 1 when there is any. Knows nothing
about images or entry points: tests/deploy and tests/deps build on `load_distributions`.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIST_GLOBS = ("libs/*/pyproject.toml", "services/*/pyproject.toml")
FURLONG_PREFIX = "furlong-"


def canonical_name(name: str) -> str:
    """PEP 503 normalised distribution name: `PyYAML` -> `pyyaml`, `nvidia_ml_py` -> `nvidia-ml-py`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """The canonical distribution name of a PEP 508 requirement string (extras, versions, markers dropped)."""
    return canonical_name(re.split(r"[\s<>=!~;\[(@]", spec.strip(), maxsplit=1)[0])


def requirement_extras(spec: str) -> set[str]:
    """The extras a requirement string asks for: `furlong-dashboard[nvidia]` -> {"nvidia"}."""
    match = re.match(r"[^\[;]*\[([^\]]*)\]", spec)
    return {e.strip() for e in match.group(1).split(",") if e.strip()} if match else set()


@dataclass(frozen=True)
class Distribution:
    directory: Path  # absolute
    name: str  # canonical
    dependencies: tuple[str, ...]  # requirement strings of [project].dependencies
    optional: dict[str, tuple[str, ...]] = field(default_factory=dict)  # extra -> requirement strings
    include: tuple[str, ...] = ()  # [tool.setuptools.packages.find].include patterns
    subpackages: frozenset[str] = frozenset()  # x for each furlong/<x>/ package in the directory

    def declared(self, extras: set[str] = frozenset()) -> set[str]:
        """Canonical names of the dependencies, with those of the given extras."""
        specs = [*self.dependencies, *(s for e in extras for s in self.optional.get(e, ()))]
        return {requirement_name(s) for s in specs}

    def declared_with_optional(self) -> set[str]:
        return self.declared(set(self.optional))


def load_distribution(directory: Path) -> Distribution:
    data = tomllib.loads((directory / "pyproject.toml").read_text())
    project = data["project"]
    find = data.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    namespace = directory / "furlong"
    subpackages = frozenset(
        p.name for p in (namespace.iterdir() if namespace.is_dir() else ()) if (p / "__init__.py").is_file()
    )
    return Distribution(
        directory=directory.resolve(),
        name=canonical_name(project["name"]),
        dependencies=tuple(project.get("dependencies", ())),
        optional={k: tuple(v) for k, v in project.get("optional-dependencies", {}).items()},
        include=tuple(find.get("include", ())),
        subpackages=subpackages,
    )


def load_distributions(root: Path = ROOT) -> dict[str, Distribution]:
    """Every Furlong distribution under `root`, by canonical name."""
    found = [load_distribution(p.parent) for pattern in DIST_GLOBS for p in sorted(root.glob(pattern))]
    return {d.name: d for d in found}


def furlong_closure(name: str, distributions: dict[str, Distribution]) -> list[Distribution]:
    """`name` and every furlong-* distribution it depends on, transitively (declared dependencies)."""
    seen: dict[str, Distribution] = {}
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        if current not in distributions:
            raise KeyError(f"{current} is depended on but no pyproject.toml under libs/ or services/ is it")
        seen[current] = distributions[current]
        todo += [d for d in distributions[current].declared() if d.startswith(FURLONG_PREFIX)]
    return list(seen.values())


def python_files(directory: Path) -> Iterator[Path]:
    for path in sorted((directory / "furlong").rglob("*.py")):
        if not any(part == "__pycache__" or part.endswith(".egg-info") for part in path.parts):
            yield path


def furlong_imports(path: Path) -> Iterator[tuple[str, int]]:
    """(x, line) for every import of furlong.<x>... in a file: import statements anywhere (module level,
    functions, TYPE_CHECKING blocks) and `importlib.import_module("furlong.x...")` with a literal."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "furlong":  # from furlong import rpc
                modules = [f"furlong.{alias.name}" for alias in node.names]
            else:
                modules = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == "import_module" and isinstance(node.args[0].value, str):
                modules = [node.args[0].value]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "furlong" and len(parts) > 1:
                yield parts[1], node.lineno


def furlong_issues(dist: Distribution, distributions: dict[str, Distribution]) -> list[str]:
    """Undeclared, self-declared and unused furlong-* dependencies; furlong.<x> no one provides."""
    providers: dict[str, str] = {}
    issues = []
    for other in distributions.values():
        for sub in other.subpackages:
            if sub in providers and providers[sub] != other.name:
                issues.append(f"furlong.{sub} is in both {providers[sub]} and {other.name}")
            providers[sub] = other.name
    for sub in sorted(dist.subpackages):
        if not any(fnmatch.fnmatchcase(f"furlong.{sub}", pattern) for pattern in dist.include):
            issues.append(f"furlong/{sub} is not shipped: no [tool.setuptools.packages.find] include has it")
    declared = {d for d in dist.declared_with_optional() if d.startswith(FURLONG_PREFIX)}
    if dist.name in declared:
        issues.append(f"declares itself ({dist.name}) as a dependency")
    used = set()
    for path in python_files(dist.directory):
        where = path.relative_to(dist.directory)
        for sub, line in furlong_imports(path):
            provider = providers.get(sub)
            if provider is None:
                issues.append(f"{where}:{line}: imports furlong.{sub}, which no Furlong distribution has")
            elif provider != dist.name:
                used.add(provider)
                if provider not in declared:
                    issues.append(f"{where}:{line}: imports furlong.{sub} but does not declare {provider}")
    for unused in sorted(declared - used - {dist.name}):
        issues.append(f"declares {unused} but imports nothing from it")
    return issues


def pinned_names(requirements: Path) -> set[str]:
    """Canonical names pinned with == in a requirements file."""
    pins = set()
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            pins.add(requirement_name(line))
    return pins


def pin_issues(dist: Distribution, pins: set[str]) -> list[str]:
    third_party = {d for d in dist.declared_with_optional() if not d.startswith(FURLONG_PREFIX)}
    return [f"depends on {name}, which requirements.txt does not pin" for name in sorted(third_party - pins)]


def deptry_command() -> list[str]:
    beside = Path(sys.executable).parent / "deptry"
    found = str(beside) if beside.is_file() else shutil.which("deptry")
    if found is None:
        raise RuntimeError("deptry is not installed: it is pinned in requirements.txt (make setup)")
    return [found]


def deptry_issues(dist: Distribution) -> list[str]:
    """deptry's findings in the distribution's directory, with its [tool.deptry] configuration."""
    result = subprocess.run(
        [*deptry_command(), "--no-ansi", "."], cwd=dist.directory, capture_output=True, text=True
    )
    if result.returncode == 0:
        return []
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if re.search(r"\bDEP\d{3}\b", ln)]
    return lines or [f"deptry failed (exit {result.returncode}): {(result.stdout + result.stderr).strip()}"]


def check(directories: list[Path], root: Path = ROOT) -> list[str]:
    """Every problem found in the distributions at `directories`, against all of `root`'s."""
    distributions = load_distributions(root)
    requirements = root / "requirements.txt"
    pins = pinned_names(requirements) if requirements.is_file() else set()
    problems = []
    for directory in directories:
        dist = load_distribution(directory)
        if distributions.get(dist.name, dist).directory != dist.directory:
            problems.append(f"{directory}: {dist.name} is also {distributions[dist.name].directory}")
            continue
        label = directory.resolve().relative_to(root.resolve()).as_posix()
        issues = [*deptry_issues(dist), *furlong_issues(dist, distributions)]
        if requirements.is_file():
            issues += pin_issues(dist, pins)
        problems += [f"{label}: {issue}" for issue in issues]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    parser.add_argument("dists", nargs="*", type=Path, help="distribution directories (default: all)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    directories = [d.resolve() for d in args.dists]
    directories = directories or [d.directory for d in load_distributions(root).values()]
    problems = check(directories, root)
    for problem in problems:
        print(problem)
    print(f"deps_check: {len(directories)} distributions, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
