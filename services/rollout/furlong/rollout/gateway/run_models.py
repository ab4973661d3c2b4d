"""The rollout service's configured runs as the gateway's models: model `<run id>` is a serving
in-process engine of that run (its current policy version), with the run's tokenizer. Calls through
the gateway are sampled outside the run's steps and never enter its sample stream; what they drew
is in the gateway's session log.
"""

from __future__ import annotations

from furlong.core.errors import NotFoundError
from furlong.rollout.core.served_models import EngineModel, ServedModel
from furlong.rollout.core.service import RolloutService


class RunModels:
    """A `ModelCatalog` over a `RolloutService`'s runs. Thread-safe."""

    def __init__(self, service: RolloutService) -> None:
        self._service = service

    def names(self) -> list[str]:
        return self._service.run_ids()

    def get(self, name: str) -> ServedModel:
        if name not in self._service.run_ids():
            served = ", ".join(map(repr, self._service.run_ids())) or "none yet"
            raise NotFoundError(f"the model {name!r} does not exist; the models are the runs: {served}")
        engine, tokenizer = self._service.served_engine(name)
        return EngineModel(name, engine, tokenizer)
