"""A configured run as rollout's requests need it, and the deterministic ids and sampling seeds of
its samples: sample `i` of a prompt's group is `<prompt id>/<i>`; share (in-process) or chunk
(engine pool) i of a request samples with a seed derived from (run seed, request seed, i, refill
round, turn), and share k of n of a request has a request seed of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from furlong.core.settings import RolloutSettings
from furlong.core.tasks import Task
from furlong.rollout.core.agent_sessions import RunAgent
from furlong.rollout.core.data_source import DataSource
from furlong.rollout.core.engine_set import EngineSet
from furlong.rollout.core.episodes import EpisodeRunner
from furlong.rollout.core.group_scoring import Scorer
from furlong.rollout.core.sampling import MAX_SEED
from furlong.rollout.core.types import RunRecords


def engine_seed(run_seed: int, request_seed: int, share: int, round_: int = 0, turn: int = 0) -> int:
    """The sampling seed of share `share` of a request in refill round `round_`, episode turn
    `turn` (63 bits)."""
    entropy = (
        [run_seed, request_seed, share] + ([round_] if round_ or turn else []) + ([turn] if turn else [])
    )
    words = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return ((int(words[0]) << 32) | int(words[1])) & MAX_SEED


def share_seed(request_seed: int, share: int, num_shares: int) -> int:
    """The request seed of share `share` of `num_shares` of a request seeded `request_seed`."""
    words = np.random.SeedSequence([request_seed, num_shares, share]).generate_state(2, dtype=np.uint32)
    return ((int(words[0]) << 32) | int(words[1])) & MAX_SEED


def sample_id(prompt_id: str, index: int) -> str:
    """The deterministic id of sample `index` of a prompt's group (also its ledger field)."""
    return f"{prompt_id}/{index}"


@dataclass
class ActiveRun:
    """A configured run as its requests need it."""

    run_id: str
    seed: int
    rollout: RolloutSettings
    task: Task | None
    reward_name: str
    score: Scorer  # (response_text, prompt) -> reward; raises on failure
    tokenizer: Any
    engines: EngineSet
    records: RunRecords
    data: DataSource | None = None
    reward_timeout_s: float | None = None  # one response's reward; None: the service's
    reward_resamples: int = 0  # rounds a group whose reward failed is drawn again; 0: left out
    environment: EpisodeRunner | None = None  # multi-turn episodes; None: one generation per sample
    agent: RunAgent | None = None  # every sample a session of the run's agent (core.agent_sessions)
    ended: bool = field(default=False)
