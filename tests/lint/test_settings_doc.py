"""The run-spec reference in docs/rest-api.md is the one `tools/settings_doc.py` generates from the
settings declarations, and the check notices a stale table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "settings_doc.py"


def test_the_run_spec_table_is_generated_from_the_declarations():
    out = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_table_names_every_field_with_its_bounds():
    sys.path.insert(0, str(TOOL.parent))
    try:
        import settings_doc
    finally:
        sys.path.remove(str(TOOL.parent))
    table = settings_doc.table()
    assert "| `algorithm.clip_eps` | number | `0.2` | (0, 1) |" in table
    assert "| `prompts_per_step` | integer | `16` | [1, 16384] |" in table
    assert "| `steps` | integer | required | [1, 10000000] |" in table
