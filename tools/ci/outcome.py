"""The outcome of a `/rerun-test` run from the results of its jobs, fail-closed.

The dispatched workflow has exactly three jobs before its finalizer: `announce` (creates the status
comment), `resolve` (dependency directives) and `test` (the suite on a GPU runner). GitHub reports
each as `success`, `failure`, `cancelled` or `skipped`.

- passed: only `announce`, `resolve` and `test` all `success` — the one known-good combination.
- failed: any `failure`; any missing job, unknown job or unknown value; and every combination that
  the workflow's gates make impossible (for example `test` skipped although `resolve` succeeded).
- cancelled: at least one `cancelled`, no `failure`, everything else known.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

JOBS: tuple[str, ...] = ("announce", "resolve", "test")


class JobResult(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"


class Outcome(enum.Enum):
    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"
    CANCELLED = "cancelled"


KNOWN_RESULTS = frozenset(r.value for r in JobResult)


def decide_outcome(results: Mapping[str, object]) -> Outcome:
    """Map job results to the final outcome; total over any input, never raises."""
    if not isinstance(results, Mapping) or set(results) != set(JOBS):
        return Outcome.FAILED
    values = [results[job] for job in JOBS]
    if any(not isinstance(v, str) or v not in KNOWN_RESULTS for v in values):
        return Outcome.FAILED
    parsed = [JobResult(v) for v in values]
    if all(r is JobResult.SUCCESS for r in parsed):
        return Outcome.PASSED
    if any(r is JobResult.FAILURE for r in parsed):
        return Outcome.FAILED
    if any(r is JobResult.CANCELLED for r in parsed):
        return Outcome.CANCELLED
    # Only success and skipped remain, and not all success: a gate let a job be skipped without a
    # failure or cancellation upstream of it. That cannot be a pass.
    return Outcome.FAILED
