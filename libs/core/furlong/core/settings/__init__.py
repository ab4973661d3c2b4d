"""Run settings that two or more services must agree on, each declared once as a frozen dataclass and
validated once on construction (a `SettingError` naming the dotted field). The REST run spec is
built from them, the proto conversion of each is `furlong.rpc.settings`, and the trainer's and
rollout's internal configs are built from them. See `fields` for how a setting is declared.
"""

from furlong.core.settings.agent import AgentSettings
from furlong.core.settings.algorithm import AlgorithmSettings
from furlong.core.settings.checkpoint import CheckpointSettings
from furlong.core.settings.data import DataSettings
from furlong.core.settings.environment import EnvironmentSettings
from furlong.core.settings.evaluation import EvalSettings
from furlong.core.settings.fields import SettingError, from_mapping, json_schema, to_mapping
from furlong.core.settings.precision import PrecisionSettings
from furlong.core.settings.reward import RewardSettings
from furlong.core.settings.rollout import RolloutSettings
from furlong.core.settings.sampling import SamplingSettings
from furlong.core.settings.trainer import MegatronSettings, ParallelSettings, TrainerSettings

__all__ = [
    "AgentSettings",
    "AlgorithmSettings",
    "CheckpointSettings",
    "PrecisionSettings",
    "DataSettings",
    "EnvironmentSettings",
    "MegatronSettings",
    "ParallelSettings",
    "EvalSettings",
    "RewardSettings",
    "RolloutSettings",
    "SamplingSettings",
    "SettingError",
    "TrainerSettings",
    "from_mapping",
    "json_schema",
    "to_mapping",
]
