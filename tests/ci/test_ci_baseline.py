"""Only the named dependencies may move when overrides are installed."""

from __future__ import annotations

import pytest

from tools.ci.baseline import BaselineDrift, check, drift, normalize, parse_freeze

pytestmark = pytest.mark.unit

SHA = "0123456789abcdef0123456789abcdef01234567"
BEFORE = """\
megatron-core==0.16.1
sglang==0.5.23
torch==2.14.1
transformers==5.19.0
-e git+https://github.com/furlong-ai/furlong@1111111111111111111111111111111111111111#egg=furlong_core&subdirectory=libs/core
"""
SGLANG_GIT = f"sglang @ git+https://github.com/sgl-project/sglang.git@{SHA}#subdirectory=python"


def test_parse_freeze_normalizes_names():
    entries = parse_freeze(BEFORE + "# comment\n\nMegatron_Core.Extra==1\n")
    assert entries["sglang"] == "sglang==0.5.23"
    assert entries["megatron-core-extra"] == "Megatron_Core.Extra==1"
    assert "furlong-core" in entries
    assert normalize("Megatron_Core") == "megatron-core"


@pytest.mark.parametrize(
    ("after", "overrides", "problems"),
    [
        (BEFORE, [], []),
        (BEFORE.replace("sglang==0.5.23", SGLANG_GIT), ["sglang"], []),
        (
            BEFORE.replace("sglang==0.5.23", SGLANG_GIT).replace(
                "megatron-core==0.16.1", "megatron-core @ file:///tmp/mlm"
            ),
            ["sglang", "megatron-core"],
            [],
        ),
        (
            BEFORE.replace("sglang==0.5.23", SGLANG_GIT),
            [],
            [f"changed: sglang==0.5.23 -> {SGLANG_GIT}"],
        ),
        (
            BEFORE.replace("sglang==0.5.23", SGLANG_GIT).replace("torch==2.14.1", "torch==2.15.0"),
            ["sglang"],
            ["changed: torch==2.14.1 -> torch==2.15.0"],
        ),
        (BEFORE + "flashinfer==0.3\n", [], ["added: flashinfer==0.3"]),
        (BEFORE.replace("transformers==5.19.0\n", ""), [], ["removed: transformers==5.19.0"]),
        (
            BEFORE,
            ["sglang"],
            ["override sglang is unchanged (sglang==0.5.23); it was not installed"],
        ),
        (
            BEFORE.replace("sglang==0.5.23\n", ""),
            ["sglang"],
            ["override sglang is not installed after the override step"],
        ),
    ],
)
def test_drift_table(after, overrides, problems):
    assert drift(BEFORE, after, overrides) == problems


def test_check_raises_with_every_problem():
    after = BEFORE.replace("torch==2.14.1", "torch==2.15.0") + "flashinfer==0.3\n"
    with pytest.raises(BaselineDrift) as info:
        check(BEFORE, after, [])
    assert "torch==2.15.0" in str(info.value) and "flashinfer==0.3" in str(info.value)


def test_unreadable_or_duplicate_lines_fail():
    with pytest.raises(ValueError):
        parse_freeze("==1.0\n")
    with pytest.raises(ValueError):
        parse_freeze("torch==1\ntorch==2\n")
