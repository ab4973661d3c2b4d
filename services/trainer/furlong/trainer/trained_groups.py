"""The groups a trainer has trained but not yet made durable, and its side of the run's group ledger:
when to checkpoint and what a resumed run must re-record.

Groups a step trained on become durable when the training checkpoint holding that step is written.
Only then are they marked trained in the run ledger (one atomic script, refusing ids already
trained) and their stream entries acknowledged; until then they stay pending in the stream, so a
crash replays them into the restored checkpoint instead of losing them. The checkpoint's data
cursor lists the entries and ledger ids it made durable, so a checkpoint written just before a
crash (ledger not yet updated) is re-recorded on resume instead of being trained on again. It also
holds the step's summary (loss, samples, metrics: `result`), recorded in the ledger with the
checkpoint, so a controller that died before recording that step can record it after all.

The cadence (`every_steps`) is the run's checkpoint setting, sent with ConfigureRun; the last step of
a run is always checkpointed. Knows nothing about models or gRPC.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from furlong.ledger.group_ledger import GroupLedger, ledger_id
from furlong.trainer.sample_reader import SampleReader, StreamBatch

log = logging.getLogger(__name__)


@dataclass
class TrainedGroups:
    ledger: GroupLedger
    every_steps: int = 1
    entry_ids: list[bytes] = field(default_factory=list)  # trained, not yet durable
    ids: list[str] = field(default_factory=list)

    def add(self, batch: StreamBatch) -> None:
        self.entry_ids += batch.entry_ids
        self.ids += [ledger_id(g.step, g.prompt_id) for g in batch.groups]

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.every_steps == 0 or step >= total_steps

    def cursor(self, step: int, result: dict[str, Any] | None = None) -> dict[str, Any]:
        """The data cursor of a checkpoint after step: what it makes durable, and the step's summary."""
        cursor = {
            "step": step,
            "entry_ids": [e.decode() for e in self.entry_ids],
            "ledger_ids": list(self.ids),
        }
        if result is not None:
            cursor["result"] = result
        return cursor

    def commit(
        self,
        step: int,
        version: int,
        reader: SampleReader,
        durable: bool = True,
        result: dict[str, Any] | None = None,
    ) -> None:
        """The checkpoint of step is written (or, not `durable`, there are no checkpoints): mark its
        groups trained, then acknowledge them. Only a durable step is recorded as the checkpoint a
        recovery resumes from (with its summary `result`)."""
        if durable and result is not None:
            self.ledger.record_checkpoint_result(step, result)
        refused = self.ledger.commit_trained(self.ids, step if durable else -1, version)
        if refused:  # the reader refuses trained groups, so this would be a bug worth seeing
            log.error("run %s: step %d trained groups already trained: %s", self.ledger.run_id, step, refused)
        reader.ack(self.entry_ids)
        self.entry_ids, self.ids = [], []

    def reconcile(self, cursor: Any, step: int, version: int, reader: SampleReader) -> None:
        """On resume from a checkpoint: record what it made durable (idempotent)."""
        if isinstance(cursor, dict) and isinstance(cursor.get("result"), dict) and step >= 1:
            self.ledger.record_checkpoint_result(step, cursor["result"])
        if not isinstance(cursor, dict) or "ledger_ids" not in cursor:
            log.warning(
                "run %s: checkpoint of step %d has no ledger ids in its data cursor; recording the step only",
                self.ledger.run_id,
                step,
            )
            self.ledger.commit_trained([], step, version, reconcile=True)
            return
        self.ledger.commit_trained(list(cursor["ledger_ids"]), step, version, reconcile=True)
        reader.ack([e.encode() for e in cursor.get("entry_ids", [])])

    def next_version(self, checkpoint_version: int) -> int:
        """The version a (re)configured trainer starts from: its checkpoint's, or past every version
        ever published for the run, so that a version number never names two different weights."""
        published = self.ledger.max_version()
        return checkpoint_version if checkpoint_version > published else published + 1
