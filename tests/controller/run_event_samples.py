"""Run events for tests: one sample per event type, the flat strings an earlier controller wrote
for an event, and a finished run in a RunStore that went through every event type."""

from __future__ import annotations

import redis

from furlong.controller.core.run_state import CheckpointRef, RunState
from furlong.controller.core.step_record import StepRecord
from furlong.controller.run_events import (
    CheckpointEvent,
    CreatedEvent,
    RecoveryEvent,
    RequestEvent,
    RunEvent,
    ServiceEvent,
    StateEvent,
    StepEvent,
)
from furlong.controller.run_spec import parse_run_spec
from furlong.controller.run_store import RunStore, events_key

_COMMON = {
    "reason": "",
    "current_step": 0,
    "policy_version": 0,
    "stop_requested": False,
    "pause_requested": False,
    "time": 1767000000.25,
}


def sample_events() -> list[RunEvent]:
    """One event of each type, with distinct, non-default values where a type allows."""
    return [
        CreatedEvent(**{**_COMMON, "state": RunState.PENDING}),
        StateEvent(**{**_COMMON, "state": RunState.FAILED, "reason": "trainer: lost", "current_step": 3}),
        StepEvent(**{**_COMMON, "state": RunState.RUNNING, "current_step": 4, "policy_version": 5}),
        CheckpointEvent(
            **{**_COMMON, "state": RunState.PAUSED, "current_step": 2, "pause_requested": True},
            checkpoint_step=2,
            checkpoint_path="/checkpoints/r-1",
        ),
        RequestEvent(**{**_COMMON, "state": RunState.RUNNING, "stop_requested": True, "time": 17.0}),
        RecoveryEvent(
            **{**_COMMON, "state": RunState.RUNNING, "reason": "resumed from step 1", "current_step": 1}
        ),
        ServiceEvent(
            **{**_COMMON, "state": RunState.RUNNING, "current_step": 6, "policy_version": 6},
            **SERVICE_FIELDS,
        ),
    ]


SERVICE_FIELDS = {
    "service": "trainer",
    "action": "restarting",
    "pid": 4242,
    "new_pid": 0,
    "exit_code": -1,
    "signal": "SIGKILL",
    "restart": 1,
    "log_tail": "INFO furlong.trainer: step 6 trained",
    "message": "trainer (pid 4242) killed by SIGKILL; restarting it in 0.5s (restart 1 of 5 within 600s)",
}


def legacy_fields(event: RunEvent) -> dict[str, str]:
    """The stream entry an earlier controller wrote for event: every value a flat string."""
    fields = {}
    for name, value in event.to_dict().items():
        if isinstance(value, bool):
            fields[name] = str(int(value))
        elif isinstance(value, float):
            fields[name] = repr(value)
        else:
            fields[name] = str(value)
    return fields


def step_record(step: int, version: int) -> StepRecord:
    return StepRecord(
        step=step,
        reward_mean=0.5,
        loss=0.25,
        policy_version=version,
        samples=8,
        step_seconds=1.0,
        generate_seconds=0.5,
        train_seconds=0.4,
        sync_seconds=0.1,
    )


EVERY_EVENT_TYPES = [
    "created",
    "state",
    "request",
    "request",
    "state",
    "step",
    "checkpoint",
    "step",
    "service",
    "recovery",
    "step",
    "request",
    "state",
    "state",
]


def run_through_every_event(store: RunStore, name: str) -> str:
    """Create a run and take it, through the store alone, through every event type to `cancelled`
    (the events of EVERY_EVENT_TYPES); returns its id."""
    run_id = store.create(
        parse_run_spec({"name": name, "model": "/m", "task": "addition", "steps": 3})
    ).run_id
    store.transition(run_id, RunState.STARTING)
    store.request_pause(run_id)
    store.request_resume(run_id)
    store.transition(run_id, RunState.RUNNING)
    store.record_step(run_id, step_record(1, 1))
    store.record_checkpoint(
        run_id, CheckpointRef(step=1, path=f"/checkpoints/{run_id}", policy_version=1, created_at=1.5)
    )
    store.record_step(run_id, step_record(2, 2))
    store.record_service_event(run_id, SERVICE_FIELDS)
    store.rewind(run_id, 1, 1, "resumed from step 1 after step 2 trainer.TrainStep: trainer went away")
    store.record_step(run_id, step_record(2, 2))
    store.request_stop(run_id)
    store.transition(run_id, RunState.STOPPING)
    store.transition(run_id, RunState.CANCELLED, "stopped by request")
    return run_id


def rewrite_as_legacy(client: redis.Redis, store: RunStore, run_id: str) -> list[str]:
    """Rewrite the run's events as an earlier controller wrote them, with one entry no event
    decodes from before the last; returns the ids of the decodable entries."""
    events = [event for _, event in store.events(run_id, count=1000).events]
    client.delete(events_key(run_id))
    ids = [client.xadd(events_key(run_id), legacy_fields(event)) for event in events[:-1]]
    client.xadd(events_key(run_id), {**legacy_fields(events[-2]), "type": "step", "current_step": "two"})
    ids.append(client.xadd(events_key(run_id), legacy_fields(events[-1])))
    return [i.decode() if isinstance(i, bytes) else i for i in ids]
