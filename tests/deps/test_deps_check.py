"""tools/deps_check.py, the dependency check `make lint` runs: clean on this repository, and failing,
naming what is wrong, on a copy with undeclared imports planted in it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.deps_check import ROOT, furlong_imports, load_distributions, requirement_extras, requirement_name

pytestmark = pytest.mark.unit

TOOL = ROOT / "tools" / "deps_check.py"
COPY_IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info")


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    """The check as `make lint` runs it: its own process."""
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """libs/, services/ and requirements.txt of this repository, to plant imports in."""
    for part in ("libs", "services"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=COPY_IGNORE)
    shutil.copy(ROOT / "requirements.txt", tmp_path / "requirements.txt")
    return tmp_path


def test_this_repository_declares_what_it_imports():
    result = run_check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""
    assert f"{len(load_distributions())} distributions, 0 problems" in result.stderr


def test_planted_undeclared_imports_fail_the_check_naming_both(repo_copy):
    core = repo_copy / "libs" / "core" / "furlong" / "core"
    # PyYAML is installed (the controller declares it) but furlong-core does not declare it.
    (core / "planted_yaml.py").write_text("import yaml\n\nLOAD = yaml.safe_load\n")
    # furlong-trainer is a Furlong distribution furlong-core does not (and must not) declare.
    (core / "planted_trainer.py").write_text(
        textwrap.dedent(
            """\
            def request_type():
                from furlong.trainer.api import TrainStepRequest

                return TrainStepRequest
            """
        )
    )
    result = run_check("--root", str(repo_copy), str(repo_copy / "libs" / "core"))
    assert result.returncode == 1, result.stdout + result.stderr
    problems = result.stdout.splitlines()
    yaml_lines = [p for p in problems if "planted_yaml.py" in p]
    assert len(yaml_lines) == 1 and "'yaml'" in yaml_lines[0] and "DEP003" in yaml_lines[0], problems
    assert yaml_lines[0].startswith("libs/core: furlong/core/planted_yaml.py:1:")
    planted = "libs/core: furlong/core/planted_trainer.py:2: imports furlong.trainer"
    assert problems.count(f"{planted} but does not declare furlong-trainer") == 1, problems
    assert len(problems) == 2, problems
    assert "1 distributions, 2 problems" in result.stderr


def test_the_unplanted_copy_passes(repo_copy):
    """The copy itself is clean: the failure above is the planted imports', not the copying's."""
    result = run_check("--root", str(repo_copy), str(repo_copy / "libs" / "core"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_declared_but_unused_and_unpinned_dependencies_fail(repo_copy):
    pyproject = repo_copy / "services" / "dashboard" / "pyproject.toml"
    text = pyproject.read_text()
    declared = '"fastapi", "furlong-core",'
    assert declared in text
    pyproject.write_text(text.replace(declared, '"fastapi", "furlong-core", "furlong-ledger", "colorama",'))
    result = run_check("--root", str(repo_copy), str(repo_copy / "services" / "dashboard"))
    assert result.returncode == 1
    problems = result.stdout.splitlines()
    assert "services/dashboard: declares furlong-ledger but imports nothing from it" in problems
    assert "services/dashboard: depends on colorama, which requirements.txt does not pin" in problems
    assert any("DEP002 'colorama'" in p for p in problems), problems


def test_furlong_imports_finds_every_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        textwrap.dedent(
            """\
            import importlib
            from typing import TYPE_CHECKING

            import furlong.core.errors
            from furlong import rpc
            from furlong.v1 import common_pb2

            from . import sibling

            if TYPE_CHECKING:
                from furlong.trainer.api import TrainStepRequest


            def later():
                from furlong.ledger import group_ledger

                return importlib.import_module("furlong.transfer.wire"), importlib.import_module(name)
            """
        )
    )
    assert sorted(furlong_imports(source)) == [
        ("core", 4),
        ("ledger", 15),
        ("rpc", 5),
        ("trainer", 11),
        ("transfer", 17),
        ("v1", 6),
    ]


def test_requirement_names_and_extras():
    assert requirement_name("PyYAML==6.0.4") == "pyyaml"
    assert requirement_name("nvidia_ml_py>=13; platform_system == 'Linux'") == "nvidia-ml-py"
    assert requirement_name("furlong-dashboard[nvidia]") == "furlong-dashboard"
    assert requirement_extras("furlong-dashboard[nvidia, amd]") == {"nvidia", "amd"}
    assert requirement_extras("megatron-core==0.16.0") == set()
