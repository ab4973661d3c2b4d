"""The three-way platform-patch probe, on temporary git repositories built from the patch itself."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tools.ci.patch_probe import (
    MEGATRON_PATCH,
    PatchState,
    PlatformPatchError,
    ensure_applied,
    probe,
)

pytestmark = pytest.mark.unit

_HUNK = re.compile(r"@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@")


def patch_images(patch_text: str) -> dict[str, tuple[str, str]]:
    """{path: (text before, text after)} holding just the lines the patch's hunks see."""
    images: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    in_hunk = False
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            images[current] = ([], [])
            in_hunk = False
        elif current and _HUNK.match(line):
            if in_hunk:  # keep hunks apart, as in the real file
                for side in images[current]:
                    side.append("# (lines between hunks)")
            in_hunk = True
        elif in_hunk and line[:1] in (" ", "-", "+"):
            before, after = images[current]
            if line[0] in (" ", "-"):
                before.append(line[1:])
            if line[0] in (" ", "+"):
                after.append(line[1:])
    return {p: ("\n".join(b) + "\n", "\n".join(a) + "\n") for p, (b, a) in images.items()}


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    return subprocess.run(
        ["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True
    ).stdout


def make_repo(root: Path, files: dict[str, str]) -> Path:
    root.mkdir()
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "upstream")
    return root


@pytest.fixture(scope="module")
def images() -> dict[str, tuple[str, str]]:
    found = patch_images(MEGATRON_PATCH.read_text())
    assert set(found) == {
        "megatron/core/models/common/embeddings/rotary_pos_embedding.py",
        "megatron/core/utils.py",
    }
    return found


def test_real_patch_applies_to_its_base(tmp_path, images):
    repo = make_repo(tmp_path / "mlm", {p: before for p, (before, _) in images.items()})
    assert probe(repo, MEGATRON_PATCH).state is PatchState.APPLIES
    assert ensure_applied(repo, MEGATRON_PATCH, "NVIDIA/Megatron-LM@base") is PatchState.APPLIES
    for path, (_, after) in images.items():
        assert (repo / path).read_text() == after
    assert "torch.cuda.is_available()" in git(repo, "diff")
    assert probe(repo, MEGATRON_PATCH).state is PatchState.ALREADY_APPLIED


def test_real_patch_already_applied_upstream(tmp_path, images):
    repo = make_repo(tmp_path / "mlm", {p: after for p, (_, after) in images.items()})
    result = probe(repo, MEGATRON_PATCH)
    assert result.state is PatchState.ALREADY_APPLIED
    assert result.reverse_error == "" and "patch does not apply" in result.forward_error
    assert ensure_applied(repo, MEGATRON_PATCH, "NVIDIA/Megatron-LM@new") is PatchState.ALREADY_APPLIED
    assert git(repo, "status", "--porcelain") == ""  # nothing touched


def test_real_patch_incompatible_fails_with_an_actionable_error(tmp_path, images):
    files = {p: before for p, (before, _) in images.items()}
    utils = "megatron/core/utils.py"
    files[utils] = files[utils].replace("device=torch.cuda.current_device(),", "device=self.device,")
    repo = make_repo(tmp_path / "mlm", files)
    result = probe(repo, MEGATRON_PATCH)
    assert result.state is PatchState.INCOMPATIBLE
    assert "megatron/core/utils.py" in result.forward_error
    with pytest.raises(PlatformPatchError) as info:
        ensure_applied(repo, MEGATRON_PATCH, "NVIDIA/Megatron-LM@abc (ci-megatron-pr #7 by @bob)")
    message = str(info.value)
    assert "megatron-cpu-device.patch is incompatible with NVIDIA/Megatron-LM@abc" in message
    assert "Nothing was installed" in message and "rebase the patch" in message
    assert git(repo, "status", "--porcelain") == ""  # nothing half-applied


def test_missing_file_is_incompatible(tmp_path, images):
    path, (before, _) = next(iter(images.items()))
    repo = make_repo(tmp_path / "mlm", {path: before})
    assert probe(repo, MEGATRON_PATCH).state is PatchState.INCOMPATIBLE


def test_synthetic_patch_three_states_and_ambiguity(tmp_path):
    base = "import os\n\n\ndef f():\n    return 1\n\n\ndef g():\n    return 2\n"
    patched = base.replace("return 1", "return 10")
    work = make_repo(tmp_path / "work", {"pkg/mod.py": base})
    (work / "pkg/mod.py").write_text(patched)
    patch = tmp_path / "fix.patch"
    patch.write_text(git(work, "diff"))

    states = {}
    for name, text in [
        ("base", base),
        ("patched", patched),
        ("drifted", base.replace("return 1", "return 5")),
        ("both", base + "\n\n" + patched),  # a forward and a reverse match at once
    ]:
        states[name] = probe(make_repo(tmp_path / name, {"pkg/mod.py": text}), patch).state
    assert states == {
        "base": PatchState.APPLIES,
        "patched": PatchState.ALREADY_APPLIED,
        "drifted": PatchState.INCOMPATIBLE,
        "both": PatchState.INCOMPATIBLE,
    }
    with pytest.raises(PlatformPatchError, match="ambiguous"):
        ensure_applied(tmp_path / "both", patch, "upstream@both")


def test_missing_inputs_raise(tmp_path):
    with pytest.raises(FileNotFoundError):
        probe(tmp_path / "absent", MEGATRON_PATCH)
    with pytest.raises(FileNotFoundError):
        probe(tmp_path, tmp_path / "absent.patch")
