"""The committed generated code must equal a fresh generation from proto/ (run `make proto`)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_check(root: Path) -> subprocess.CompletedProcess:
    # grpc_tools runs in a subprocess: it must never be imported next to nixl.
    return subprocess.run(
        [sys.executable, str(root / "tools" / "proto_gen.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.unit
def test_generated_code_matches_protos():
    result = run_check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.unit
def test_drift_is_detected(tmp_path):
    copy = tmp_path / "repo"
    for part in ("proto", "libs/proto", "tools"):
        shutil.copytree(ROOT / part, copy / part)
    proto = copy / "proto" / "furlong" / "v1" / "common.proto"
    proto.write_text(proto.read_text() + "\nmessage DriftProbe { int32 x = 1; }\n")
    result = run_check(copy)
    assert result.returncode == 1
    assert "differs: common_pb2.py" in result.stdout
