"""`python -m tools.ci COMMAND`: the edge between workflow steps and the logic of this package.

Workflow steps pass everything through environment variables (never by expanding `${{ }}` inside a
script), and this module is the only place that reads them. Numbers arrive as text and are parsed
strictly here (`^[1-9][0-9]*$`); the logic below then rejects anything that is not a real int.
Outputs go to `$GITHUB_OUTPUT`, notes to `$GITHUB_STEP_SUMMARY`. Any refusal exits 1 with an
`::error::` annotation.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from tools.ci import baseline, directives, gateway, patch_probe, status_comment, tree_paths
from tools.ci.command import CommandRejected
from tools.ci.github_api import DEFAULT_API_URL, GitHubApiError, GitHubRestApi
from tools.ci.outcome import JOBS, Outcome

log = logging.getLogger("tools.ci")

_DECIMAL = re.compile(r"[1-9][0-9]{0,18}")
_SHA = re.compile(r"[0-9a-f]{40}")
FAILURES = (
    ValueError,
    CommandRejected,
    GitHubApiError,
    status_comment.CommentWriteError,
    patch_probe.PlatformPatchError,
    baseline.BaselineDrift,
    FileNotFoundError,
)


def env_text(env: Mapping[str, str], name: str, *, allow_empty: bool = False) -> str:
    value = env.get(name)
    if value is None or (not value and not allow_empty):
        raise ValueError(f"environment variable {name} is missing or empty")
    return value


def env_int(env: Mapping[str, str], name: str) -> int:
    """A positive decimal integer from text; '01', '1.0', 'true', ' 1' are all rejected."""
    text = env_text(env, name)
    if not _DECIMAL.fullmatch(text):
        raise ValueError(f"{name} must be a positive decimal integer, got {text!r}")
    return int(text)


def env_bool(env: Mapping[str, str], name: str) -> bool:
    text = env_text(env, name)
    if text not in ("true", "false"):
        raise ValueError(f"{name} must be 'true' or 'false', got {text!r}")
    return text == "true"


def write_outputs(env: Mapping[str, str], values: Mapping[str, str]) -> None:
    for key, value in values.items():
        if "\n" in value or "\r" in value:
            raise ValueError(f"output {key} must be one line, got {value!r}")
    lines = "".join(f"{k}={v}\n" for k, v in values.items())
    target = env.get("GITHUB_OUTPUT")
    if target:
        with open(target, "a", encoding="utf-8") as fh:
            fh.write(lines)
    sys.stdout.write(lines)


def write_summary(env: Mapping[str, str], lines: list[str]) -> None:
    target = env.get("GITHUB_STEP_SUMMARY")
    if target:
        with open(target, "a", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")


def _api(env: Mapping[str, str]) -> GitHubRestApi:
    return GitHubRestApi(env_text(env, "GITHUB_TOKEN"), env.get("GITHUB_API_URL") or DEFAULT_API_URL)


def _run_context(env: Mapping[str, str]) -> status_comment.RunContext:
    return status_comment.RunContext(
        server_url=env_text(env, "GITHUB_SERVER_URL"),
        repository=env_text(env, "GITHUB_REPOSITORY"),
        run_id=env_int(env, "GITHUB_RUN_ID"),
        pr_number=env_int(env, "PR_NUMBER"),
        head_sha=env_text(env, "HEAD_SHA"),
        suite=env_text(env, "TEST_PATH"),
        requested_by=env_text(env, "REQUESTED_BY"),
    )


def cmd_gateway(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    event = gateway.CommentEvent(
        repository=env_text(env, "GITHUB_REPOSITORY"),
        pr_number=env_int(env, "PR_NUMBER"),
        author=env_text(env, "COMMENT_AUTHOR"),
        body=env_text(env, "COMMENT_BODY"),
        default_branch=env_text(env, "DEFAULT_BRANCH"),
    )
    repo_dir = Path(args.repo_dir)

    def check_path(head_sha: str, test_path: str) -> None:
        tree_paths.fetch_commit(repo_dir, head_sha)
        tree_paths.check_git_path(repo_dir, head_sha, test_path)

    api = _api(env)
    dispatch = gateway.handle(event, api, api, check_path)
    write_summary(env, [f"Dispatched `{dispatch.workflow_file}`: {dict(dispatch.inputs)}"])
    return 0


def cmd_announce(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    run = _run_context(env)
    started_at_s = int(time.time())
    comment_id = status_comment.announce(_api(env), run, env_int(env, "GITHUB_RUN_ATTEMPT"))
    write_outputs(env, {"comment_id": str(comment_id), "started_at": str(started_at_s)})
    return 0


def cmd_finalize(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    inputs = status_comment.FinalizerInputs(
        run=_run_context(env),
        run_url=env_text(env, "RUN_URL"),
        comment_id=env_int(env, "COMMENT_ID"),
        started_at_s=env_int(env, "STARTED_AT"),
        results={job: env_text(env, f"RESULT_{job.upper()}") for job in JOBS},
    )
    outcome = status_comment.finalize(_api(env), inputs, int(time.time()))
    write_summary(env, [f"`/rerun-test` {inputs.run.suite}: **{outcome.value}**"])
    # The run is green only when the comment says passed.
    return 0 if outcome is Outcome.PASSED else 1


def cmd_resolve(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    api = _api(env)
    if env.get("PR_NUMBER"):
        pr = api.pull_request(env_text(env, "GITHUB_REPOSITORY"), env_int(env, "PR_NUMBER"))
        body, author = pr.get("body"), (pr.get("user") or {}).get("login")
    else:
        body, author = env.get("PR_BODY"), env.get("PR_AUTHOR") or None
    inputs = {key: env.get(f"INPUT_{key.upper()}_REF", "") for key in directives.UPSTREAMS}
    chosen = directives.choose(body, inputs, author, env_text(env, "GITHUB_ACTOR"))
    pinned = directives.pin(chosen, api)
    lines = directives.describe(pinned)
    for line in lines:
        log.info("%s", line)
    write_summary(env, ["Dependency overrides:", *[f"- {line}" for line in lines]])
    write_outputs(env, directives.outputs(pinned))
    return 0


def cmd_check_suite_inputs(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    for key in directives.UPSTREAMS:
        override = env_bool(env, f"OVERRIDE_{key.upper()}")
        sha = env.get(f"{key.upper()}_SHA", "")
        if override and not _SHA.fullmatch(sha):
            raise ValueError(f"override_{key} is true but {key}_sha is {sha!r}, not a commit SHA")
        if not override and sha:
            raise ValueError(f"override_{key} is false but {key}_sha is set to {sha!r}")
    test_path = env.get("TEST_PATH", "")
    if test_path:
        tree_paths.check_checkout_path(Path(args.root), test_path)
    return 0


def cmd_check_test_path(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    tree_paths.check_checkout_path(Path(args.root), args.path)
    return 0


def cmd_platform_patch(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    state = patch_probe.ensure_applied(Path(args.source), Path(args.patch), args.context)
    write_outputs(env, {"patch_state": state.value})
    return 0


def cmd_check_baseline(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    baseline.check(Path(args.before).read_text(), Path(args.after).read_text(), args.override)
    return 0


def cmd_manifests(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from tools.ci import manifests  # not needed on GPU runners

    try:
        rendered = manifests.validate_tree(Path(args.root), Path(args.out), args.kube_version)
    except manifests.ManifestError as exc:
        raise ValueError(str(exc)) from None
    write_summary(env, [f"Validated {len(rendered)} rendered kustomization(s)"])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.ci")
    sub = parser.add_subparsers(dest="command", required=True)
    gw = sub.add_parser("gateway", help="check a /rerun-test comment and dispatch the run")
    gw.add_argument("--repo-dir", default=".")
    gw.set_defaults(func=cmd_gateway)
    sub.add_parser("announce", help="create the running status comment").set_defaults(func=cmd_announce)
    sub.add_parser("finalize", help="edit the status comment to its outcome").set_defaults(func=cmd_finalize)
    sub.add_parser("resolve", help="resolve dependency directives").set_defaults(func=cmd_resolve)
    si = sub.add_parser("check-suite-inputs", help="validate the GPU suite's inputs")
    si.add_argument("--root", default=".")
    si.set_defaults(func=cmd_check_suite_inputs)
    tp = sub.add_parser("check-test-path", help="check a test path in the working tree")
    tp.add_argument("path")
    tp.add_argument("--root", default=".")
    tp.set_defaults(func=cmd_check_test_path)
    pp = sub.add_parser("platform-patch", help="probe and apply the Megatron platform patch")
    pp.add_argument("--source", required=True)
    pp.add_argument("--patch", default=str(patch_probe.MEGATRON_PATCH))
    pp.add_argument("--context", required=True)
    pp.set_defaults(func=cmd_platform_patch)
    bl = sub.add_parser("check-baseline", help="compare pip freeze before/after overrides")
    bl.add_argument("before")
    bl.add_argument("after")
    bl.add_argument("--override", action="append", default=[])
    bl.set_defaults(func=cmd_check_baseline)
    mf = sub.add_parser("manifests", help="render and validate the Kubernetes manifests")
    mf.add_argument("--root", default="deploy/k8s")
    mf.add_argument("--out", required=True)
    mf.add_argument("--kube-version", default="1.32.0")
    mf.set_defaults(func=cmd_manifests)
    return parser


def command_names() -> set[str]:
    """The subcommands `python -m tools.ci` accepts."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, os.environ if env is None else env)
    except FAILURES as exc:
        message = str(exc).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
        sys.stdout.write(f"::error::{message}\n")
        return 1
