"""The controller's pure logic: run states and transitions, the run record, per-step records.
No Redis, gRPC, HTTP or processes."""

from furlong.controller.core.run_state import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    Run,
    RunState,
    check_transition,
)
from furlong.controller.core.step_record import StepRecord, sampling_seed

__all__ = [
    "ACTIVE_STATES",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "Run",
    "RunState",
    "StepRecord",
    "check_transition",
    "sampling_seed",
]
