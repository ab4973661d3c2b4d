"""Probe a platform patch against a dependency's source tree: applies, already applied, or not.

After a `ci-megatron-pr:` override the runner clones that Megatron-LM commit and, before anything is
installed, asks git whether Furlong's platform patch (`tools/ci/patches/`) still fits:

- APPLIES: `git apply --check` succeeds and the reverse check fails -> apply it;
- ALREADY_APPLIED: the reverse check succeeds and the forward one fails -> upstream has it;
- INCOMPATIBLE: neither succeeds (or, ambiguously, both) -> stop with an error that says what to do.

Only `git apply` decides; this module never edits files by itself.
"""

from __future__ import annotations

import enum
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PATCHES_DIR = Path(__file__).resolve().parent / "patches"
MEGATRON_PATCH = PATCHES_DIR / "megatron-cpu-device.patch"
GIT_TIMEOUT_S = 60


class PatchState(enum.Enum):
    APPLIES = "applies"
    ALREADY_APPLIED = "already-applied"
    INCOMPATIBLE = "incompatible"


class PlatformPatchError(RuntimeError):
    """The platform patch fits the named dependency neither forwards nor backwards."""


@dataclass(frozen=True)
class ProbeResult:
    state: PatchState
    forward_error: str  # git's stderr of the forward check ('' when it passed)
    reverse_error: str  # git's stderr of the reverse check ('' when it passed)


def _git_apply(source_dir: Path, patch_file: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "apply", *flags, str(patch_file.resolve())],
        cwd=source_dir,
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT_S,
        check=False,
    )


def probe(source_dir: Path, patch_file: Path) -> ProbeResult:
    """Classify `patch_file` against the working tree at `source_dir` (a git checkout's root)."""
    if not source_dir.is_dir():
        raise FileNotFoundError(f"source tree {source_dir} does not exist")
    if not patch_file.is_file():
        raise FileNotFoundError(f"patch {patch_file} does not exist")
    forward = _git_apply(source_dir, patch_file, "--check")
    reverse = _git_apply(source_dir, patch_file, "--reverse", "--check")
    fwd_ok, rev_ok = forward.returncode == 0, reverse.returncode == 0
    if fwd_ok and not rev_ok:
        state = PatchState.APPLIES
    elif rev_ok and not fwd_ok:
        state = PatchState.ALREADY_APPLIED
    else:
        state = PatchState.INCOMPATIBLE
    return ProbeResult(
        state=state,
        forward_error="" if fwd_ok else forward.stderr.strip(),
        reverse_error="" if rev_ok else reverse.stderr.strip(),
    )


def ensure_applied(source_dir: Path, patch_file: Path, context: str) -> PatchState:
    """Leave `source_dir` with the patch applied; raise PlatformPatchError when it cannot be.

    `context` names the dependency ref and who asked for it, for the error message. Returns the
    state found before acting (APPLIES means this call applied it).
    """
    result = probe(source_dir, patch_file)
    log.info("platform patch %s on %s: %s", patch_file.name, context, result.state.value)
    if result.state is PatchState.INCOMPATIBLE:
        both = not result.forward_error and not result.reverse_error
        raise PlatformPatchError(
            f"platform patch {patch_file.name} is incompatible with {context}: "
            + (
                "it applies both forwards and backwards, so its context is ambiguous. "
                if both
                else f"forward check: {result.forward_error or 'ok'}; "
                f"reverse check: {result.reverse_error or 'ok'}. "
            )
            + "Nothing was installed. Fix: rebase the patch onto that ref (regenerate it with "
            "`git diff` in a checkout of the ref, see docs/ci.md 'Platform patch'), or name a "
            "ref the patch fits, or drop the override to test against the image baseline."
        )
    if result.state is PatchState.APPLIES:
        done = _git_apply(source_dir, patch_file)
        if done.returncode != 0:
            raise PlatformPatchError(
                f"git apply {patch_file.name} failed after a passing check: {done.stderr.strip()}"
            )
        after = probe(source_dir, patch_file)
        if after.state is not PatchState.ALREADY_APPLIED:
            raise PlatformPatchError(
                f"after applying {patch_file.name} the probe says {after.state.value}, "
                "expected already-applied"
            )
    return result.state
