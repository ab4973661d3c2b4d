"""Which steps' samples the controller may have generated while the trainer trains a step: the
asynchronous loop's schedule, as a pure decision.

In the synchronous loop (`max_staleness` 0) step s is generated after step s-1's policy is committed
and trained right after. With `max_staleness` K > 0, while the trainer trains step s (with version
v, the version committed after step s-1), rollout may already generate steps s+1 .. s+K, each with
at least version v: the trainer trains step m with version v + (m - s) <= v + K (one version per
step), so no trained sample is more than K versions old. Generation never runs further ahead, and
it runs in step order, so the run's sample stream holds the steps in order.

Knows nothing about the services or threads.
"""

from __future__ import annotations


def steps_to_generate(step: int, next_unrequested: int, last_step: int, max_staleness: int) -> range:
    """The steps whose generation may be requested when the loop starts training `step` (with the
    version committed after step - 1), given that steps before `next_unrequested` are requested
    already: every step up to step + max_staleness (and at most `last_step`) not requested yet."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if not 1 <= step <= last_step:
        raise ValueError(f"step must be in [1, {last_step}], got {step}")
    if next_unrequested < 1:
        raise ValueError(f"next_unrequested must be >= 1, got {next_unrequested}")
    return range(next_unrequested, min(step + max_staleness, last_step) + 1)
