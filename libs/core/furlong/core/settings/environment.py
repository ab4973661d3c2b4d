"""A run's multi-turn environment, as the REST run spec (`environment`) declares it and the rollout
service applies it. The proto form is `furlong.v1.EnvironmentConfig`; the protocol an environment
implements is `furlong.rollout.core.environment.Environment`, the built-ins live in
`furlong.rollout.environments`.

`name` is a built-in (`calculator`: a `calc` tool for arithmetic; `python`: a sandboxed Python
tool) or `package.module:Class`, a class of the user's constructed without arguments in the
rollout service's environment worker processes; "" means the run has no environment (single-turn
generation). An episode ends when the environment says it is done, after `max_turns` assistant
turns, or when the episode's generated tokens reach `max_episode_tokens`; one assistant turn
generates at most `max_tokens_per_turn` tokens. Every environment call (the first one including the
start of its worker process) must answer within `timeout_s`; a call that raises, overruns or whose
worker dies is an infrastructure failure that leaves the episode's group out of the step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from furlong.core.settings.fields import SettingError, check_fields, setting

BUILTIN_ENVIRONMENTS = ("calculator", "python")
MAX_TURNS = 64
MAX_EPISODE_TOKENS = 1 << 17
MAX_ENVIRONMENT_TIMEOUT_S = 3600.0
MAX_ENVIRONMENT_WORKERS = 64
_CLASS_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class EnvironmentSettings:
    name: str = setting(
        "",
        max_chars=256,
        doc="a built-in environment (calculator, python) or package.module:Class; empty = none",
    )
    max_turns: int = setting(4, ge=1, le=MAX_TURNS, doc="assistant turns per episode at most")
    max_tokens_per_turn: int = setting(
        256, ge=1, le=MAX_EPISODE_TOKENS, doc="tokens one assistant turn generates at most"
    )
    max_episode_tokens: int = setting(
        1024, ge=1, le=MAX_EPISODE_TOKENS, doc="tokens the policy generates per episode at most"
    )
    timeout_s: float = setting(
        30.0,
        gt=0.0,
        le=MAX_ENVIRONMENT_TIMEOUT_S,
        doc="deadline of one environment call (reset or step), the worker's start-up included",
    )
    num_workers: int = setting(
        2, ge=1, le=MAX_ENVIRONMENT_WORKERS, doc="worker processes the run's environments run in"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.name and self.name not in BUILTIN_ENVIRONMENTS and not _CLASS_PATH.match(self.name):
            raise SettingError(
                "name",
                f"must be one of {list(BUILTIN_ENVIRONMENTS)} or look like 'package.module:Class', "
                f"got {self.name!r}",
            )
        if self.max_tokens_per_turn > self.max_episode_tokens:
            raise SettingError(
                "max_tokens_per_turn",
                f"{self.max_tokens_per_turn} is more than max_episode_tokens {self.max_episode_tokens}",
            )

    @property
    def enabled(self) -> bool:
        return bool(self.name)
