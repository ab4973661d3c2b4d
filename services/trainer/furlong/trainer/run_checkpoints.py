"""Where a run's training checkpoints live under the trainer's `--checkpoint-dir`, and how many stay.

    <root>/<run_id>/step-<N>/     one training checkpoint (`train_checkpoint`) after step N

The newest `keep_last` (the run spec's `checkpoint.keep_last`) are kept: after a checkpoint is
written the older ones are removed, so `every_steps: 1` does not keep the full optimizer state of
every step. A run resumes from its newest complete checkpoint (one with a manifest; a directory the
trainer was killed while writing is never complete: it is written as `step-<N>.tmp` and renamed).
A run directory of the earlier layout (`<root>/<run_id>/manifest.json`, one checkpoint) is resumed
from as well. `clean_leftovers` removes the `.tmp` / `.old` directories a killed trainer left behind;
the trainer calls it when it starts. `remove_all` deletes a run's checkpoints (a run deleted
through the REST API). Knows nothing about models or the ledger.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from furlong.trainer.train_checkpoint import MANIFEST

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
_LEFTOVER_SUFFIXES = (".tmp", ".old")


@dataclass(frozen=True)
class RunCheckpoints:
    root: Path
    run_id: str
    keep_last: int = 2

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id or self.run_id in (".", ".."):
            raise ValueError(f"run_id {self.run_id!r} cannot name a checkpoint directory")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint keep_last must be >= 1, got {self.keep_last}")

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    def path_for(self, step: int) -> Path:
        return self.run_dir / f"step-{step}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        if not self.run_dir.is_dir():
            return []
        found = []
        for child in self.run_dir.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / MANIFEST).is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint to resume from (None: none)."""
        steps = self.steps()
        if steps:
            return self.path_for(steps[-1])
        if (self.run_dir / MANIFEST).is_file():  # the earlier one-checkpoint layout
            return self.run_dir
        return None

    def prune(self) -> list[Path]:
        """Remove all but the newest keep_last checkpoints; the directories removed."""
        removed = [self.path_for(step) for step in self.steps()[: -self.keep_last]]
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        if removed:
            log.info(
                "run %s: removed %d older checkpoint(s), keeping %d",
                self.run_id,
                len(removed),
                self.keep_last,
            )
        return removed

    def remove_all(self) -> int:
        """Delete every checkpoint of the run; how many complete ones there were."""
        count = len(self.steps()) + int((self.run_dir / MANIFEST).is_file())
        shutil.rmtree(self.run_dir, ignore_errors=True)
        for suffix in _LEFTOVER_SUFFIXES:
            shutil.rmtree(self.run_dir.with_name(self.run_id + suffix), ignore_errors=True)
        log.info("run %s: deleted its %d checkpoint(s) in %s", self.run_id, count, self.run_dir)
        return count


def clean_leftovers(root: Path) -> list[Path]:
    """Remove the half-written (`.tmp`) and replaced (`.old`) checkpoint directories under root, one
    and two levels down; the paths removed."""
    if not root.is_dir():
        return []
    candidates = [*root.iterdir(), *(c for d in root.iterdir() if d.is_dir() for c in d.iterdir())]
    removed = [p for p in candidates if p.is_dir() and p.name.endswith(_LEFTOVER_SUFFIXES)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, left behind by a trainer that stopped while writing a checkpoint", path)
    return removed
