"""Who may import whom around the weight-transfer library: furlong.transfer never imports the broker
service, the trainer and rollout reach the broker only through furlong.transfer, and the broker's
core stays pure (no gRPC, NIXL, Redis, sockets or processes of its own)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRANSFER = ROOT / "libs" / "transfer" / "furlong" / "transfer"
BROKER_CORE = ROOT / "services" / "weight-broker" / "furlong" / "weight_broker" / "core"

pytestmark = pytest.mark.unit


def imported_modules(code: str) -> list[str]:
    """Every module in sys.modules after running `code` in a fresh interpreter."""
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def direct_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_transfer_library_does_not_import_the_broker_service():
    modules = sorted(f"furlong.transfer.{p.stem}" for p in TRANSFER.glob("*.py") if p.stem != "__init__")
    loaded = imported_modules("\n".join(f"import {m}" for m in modules))
    assert set(modules) <= set(loaded)
    assert [m for m in loaded if m.startswith("furlong.weight_broker")] == []
    for path in TRANSFER.glob("*.py"):
        assert not any(name.startswith("furlong.weight_broker") for name in direct_imports(path)), path


def test_the_broker_core_stays_pure():
    loaded = imported_modules("import furlong.weight_broker.core")
    banned = ("grpc", "nixl", "redis", "furlong.rpc", "furlong.v1", "furlong.transfer")
    assert [m for m in loaded if any(m == b or m.startswith(b + ".") for b in banned)] == []
    for path in [*BROKER_CORE.glob("*.py"), ROOT / "libs/core/furlong/core/weight_versions.py"]:
        direct = {name.split(".")[0] for name in direct_imports(path)}
        assert not direct & {"socket", "subprocess", "grpc", "nixl", "redis"}, path


@pytest.mark.parametrize("service", ["trainer", "rollout"])
def test_trainer_and_rollout_depend_on_the_library_not_on_the_broker(service):
    project = tomllib.loads((ROOT / "services" / service / "pyproject.toml").read_text())["project"]
    assert "furlong-transfer" in project["dependencies"]
    assert "furlong-weight-broker" not in project["dependencies"]
    package = ROOT / "services" / service / "furlong" / service
    for path in package.rglob("*.py"):
        imports = direct_imports(path)
        assert not any(name.startswith("furlong.weight_broker") for name in imports), path
