"""The rollout service's configured runs as the gateway's models: model `<run id>` is the run's
in-process engines (their current policy version), with the run's tokenizer. A call in a session
goes to the engine that served the session before while it serves, any other call to the
least-loaded serving engine (`RolloutService.served_engine`). Calls through the gateway are sampled
outside the run's steps and never enter its sample stream; what they drew is in the gateway's
session log.
"""

from __future__ import annotations

from furlong.core.errors import NotFoundError
from furlong.rollout.core.served_models import ServedModel
from furlong.rollout.core.service import RolloutService


class RunModels:
    """A `ModelCatalog` over a `RolloutService`'s runs. Thread-safe."""

    def __init__(self, service: RolloutService) -> None:
        self._service = service

    def names(self) -> list[str]:
        return self._service.run_ids()

    def get(self, name: str, session_id: str | None = None) -> ServedModel:
        if name not in self._service.run_ids():
            served = ", ".join(map(repr, self._service.run_ids())) or "none yet"
            raise NotFoundError(f"the model {name!r} does not exist; the models are the runs: {served}")
        return self._service.served_engine(name, session_id)

    def close_session(self, session_id: str) -> None:
        self._service.close_session(session_id)
