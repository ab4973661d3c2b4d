"""The import contracts of `.importlinter` hold on the tree, and `lint-imports` fails when a module
breaks one: a `core/` module importing redis, a library importing a service, the controller
importing a service's internals. Each case runs lint-imports on a copy of the sources."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
DISTS = ["libs/core", "libs/service-main", "libs/proto", "libs/ledger", "libs/transfer"] + [
    f"services/{name}" for name in ("weight-broker", "trainer", "rollout", "dashboard", "controller")
]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _copy_sources(target: Path) -> list[Path]:
    roots = []
    for dist in DISTS:
        shutil.copytree(
            ROOT / dist / "furlong", target / dist / "furlong", ignore=shutil.ignore_patterns("__pycache__")
        )
        roots.append(target / dist)
    shutil.copy(ROOT / ".importlinter", target / ".importlinter")
    return roots


def _lint(tree: Path, roots: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(r) for r in roots)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def tree(tmp_path):
    roots = _copy_sources(tmp_path)
    return tmp_path, roots


def test_the_contracts_hold_on_the_tree(tree):
    where, roots = tree
    out = _lint(where, roots)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize(
    "path, source, contract, line",
    [
        (
            "services/rollout/furlong/rollout/core/planted.py",
            "import redis\n",
            "every service's core/ package imports no gRPC, Redis",
            "furlong.rollout.core.planted -> redis",
        ),
        (
            "libs/core/furlong/core/planted.py",
            "import subprocess\n",
            "furlong.core holds contracts and pure code",
            "furlong.core.planted -> subprocess",
        ),
        (
            "libs/transfer/furlong/transfer/planted.py",
            "from furlong.weight_broker import core\n",
            "the libraries import no service",
            "furlong.transfer.planted -> furlong.weight_broker",
        ),
        (
            "services/controller/furlong/controller/planted.py",
            "from furlong.trainer import service\n",
            "the controller uses the other services only through their api and client modules",
            "furlong.controller.planted -> furlong.trainer.service",
        ),
    ],
)
def test_a_module_breaking_a_contract_fails_lint_imports(tree, path, source, contract, line):
    where, roots = tree
    (where / path).write_text(source)
    out = _lint(where, roots)
    assert out.returncode != 0
    assert "Contracts: 7 kept, 1 broken." in out.stdout, out.stdout
    assert " ".join(out.stdout.split()).find(f"{contract}") >= 0, out.stdout  # names the contract
    assert line in out.stdout, out.stdout
