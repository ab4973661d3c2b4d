"""`python -m tools.ci` as the workflows call it: environment in, $GITHUB_OUTPUT out."""

from __future__ import annotations

from pathlib import Path

import pytest
from ci_fakes import FakeGitHub, pull

from tools.ci import cli

pytestmark = pytest.mark.unit

REPO = "furlong-ai/furlong"
SHA = "0123456789abcdef0123456789abcdef01234567"
MEGATRON_SHA = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def api(monkeypatch) -> FakeGitHub:
    fake = FakeGitHub()
    monkeypatch.setattr(cli, "_api", lambda env: fake)
    return fake


def run_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    output = tmp_path / "github_output"
    output.touch()
    return {
        "GITHUB_OUTPUT": str(output),
        "GITHUB_SERVER_URL": "https://github.com",
        "GITHUB_REPOSITORY": REPO,
        "GITHUB_RUN_ID": "555",
        "GITHUB_RUN_ATTEMPT": "1",
        "GITHUB_ACTOR": "github-actions[bot]",
        "GITHUB_TOKEN": "t",
        "PR_NUMBER": "42",
        "HEAD_SHA": SHA,
        "TEST_PATH": "tests/core/test_weights.py",
        "REQUESTED_BY": "alice",
        **extra,
    }


def read_outputs(env: dict[str, str]) -> dict[str, str]:
    lines = Path(env["GITHUB_OUTPUT"]).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines)


def finalize_env(env: dict[str, str], outputs: dict[str, str], test_result: str) -> dict[str, str]:
    return {
        **env,
        "RUN_URL": f"https://github.com/{REPO}/actions/runs/555",
        "COMMENT_ID": outputs["comment_id"],
        "STARTED_AT": outputs["started_at"],
        "RESULT_ANNOUNCE": "success",
        "RESULT_RESOLVE": "success",
        "RESULT_TEST": test_result,
    }


def test_announce_then_finalize_twice_edits_one_comment(api, tmp_path):
    env = run_env(tmp_path)
    assert cli.main(["announce"], env) == 0
    outputs = read_outputs(env)
    assert outputs["comment_id"] == "9001" and outputs["started_at"].isdigit()
    assert cli.main(["finalize"], finalize_env(env, outputs, "failure")) == 1  # red unless passed
    assert cli.main(["finalize"], finalize_env(env, outputs, "success")) == 0
    (comment,) = api.comments_on(REPO, 42)
    assert "**`/rerun-test`: passed**" in comment["body"]
    assert [c[0] for c in api.writes()] == ["create_comment", "update_comment", "update_comment"]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("COMMENT_ID", ""),
        ("COMMENT_ID", "0"),
        ("COMMENT_ID", "01"),
        ("COMMENT_ID", "true"),
        ("COMMENT_ID", "9001.0"),
        ("COMMENT_ID", " 9001"),
        ("COMMENT_ID", "-9001"),
        ("COMMENT_ID", "9001\n"),
        ("STARTED_AT", ""),
        ("GITHUB_RUN_ID", "abc"),
        ("PR_NUMBER", "#42"),
        ("RESULT_TEST", ""),
        ("RESULT_TEST", "neutral"),
        ("RUN_URL", "https://github.com/other/repo/actions/runs/555"),
    ],
)
def test_finalize_rejects_bad_environment_before_any_call(api, tmp_path, capsys, name, value):
    env = run_env(tmp_path)
    assert cli.main(["announce"], env) == 0
    api.calls.clear()
    bad = {**finalize_env(env, read_outputs(env), "success"), name: value}
    assert cli.main(["finalize"], bad) == 1
    assert api.calls == []
    assert "::error::" in capsys.readouterr().out


def test_finalize_without_announce_output_fails_closed(api, tmp_path):
    env = finalize_env(run_env(tmp_path), {"comment_id": "", "started_at": ""}, "skipped")
    assert cli.main(["finalize"], env) == 1
    assert api.calls == []


def test_resolve_writes_string_outputs_and_names_who(api, tmp_path, caplog):
    api.pulls[(REPO, 42)] = pull(REPO, 42, SHA, body="ci-megatron-pr: " + MEGATRON_SHA, author="bob")
    api.commits.add(("NVIDIA/Megatron-LM", MEGATRON_SHA))
    summary = tmp_path / "summary.md"
    env = run_env(tmp_path, GITHUB_STEP_SUMMARY=str(summary))
    caplog.set_level("INFO")
    assert cli.main(["resolve"], env) == 0
    assert read_outputs(env) == {
        "override_sglang": "false",
        "sglang_sha": "",
        "override_megatron": "true",
        "megatron_sha": MEGATRON_SHA,
    }
    assert "named by @bob in the pull request body" in summary.read_text()
    assert "sglang: image baseline (not named)" in caplog.text


def test_resolve_input_beats_body_and_fails_on_bad_ref(api, tmp_path):
    api.pulls[(REPO, 42)] = pull(REPO, 42, SHA, body="ci-sglang-pr: #10", author="bob")
    api.pulls[("sgl-project/sglang", 11)] = pull("sgl-project/sglang", 11, MEGATRON_SHA)
    env = run_env(tmp_path, INPUT_SGLANG_REF="#11")
    assert cli.main(["resolve"], env) == 0
    assert read_outputs(env)["sglang_sha"] == MEGATRON_SHA
    assert ("pull_request", "sgl-project/sglang", 10) not in api.calls
    api.calls.clear()
    bad = {**env, "INPUT_SGLANG_REF": "#1x"}
    assert cli.main(["resolve"], bad) == 1
    assert [c[0] for c in api.calls] == ["pull_request"]  # read the body, pinned nothing


@pytest.mark.parametrize(
    ("env", "ok"),
    [
        ({"OVERRIDE_SGLANG": "false", "OVERRIDE_MEGATRON": "false"}, True),
        ({"OVERRIDE_SGLANG": "true", "SGLANG_SHA": SHA, "OVERRIDE_MEGATRON": "false"}, True),
        ({"OVERRIDE_SGLANG": "true", "SGLANG_SHA": "", "OVERRIDE_MEGATRON": "false"}, False),
        ({"OVERRIDE_SGLANG": "false", "SGLANG_SHA": SHA, "OVERRIDE_MEGATRON": "false"}, False),
        ({"OVERRIDE_SGLANG": "True", "OVERRIDE_MEGATRON": "false"}, False),
        ({"OVERRIDE_SGLANG": "1", "OVERRIDE_MEGATRON": "false"}, False),
        ({"OVERRIDE_MEGATRON": "false"}, False),
        ({"OVERRIDE_SGLANG": "false", "OVERRIDE_MEGATRON": "true", "MEGATRON_SHA": "main"}, False),
    ],
)
def test_check_suite_inputs(tmp_path, env, ok):
    assert cli.main(["check-suite-inputs", "--root", str(tmp_path)], env) == (0 if ok else 1)


def test_check_baseline_command(tmp_path):
    before, after = tmp_path / "before.txt", tmp_path / "after.txt"
    before.write_text("sglang==0.5.23\ntorch==2.14.1\n")
    after.write_text("sglang @ git+https://github.com/sgl-project/sglang.git@" + SHA + "\ntorch==2.14.1\n")
    assert cli.main(["check-baseline", str(before), str(after), "--override", "sglang"], {}) == 0
    assert cli.main(["check-baseline", str(before), str(after)], {}) == 1
