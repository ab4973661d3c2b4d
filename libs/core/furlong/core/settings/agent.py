"""A run's agent harness, as the REST run spec (`agent`) declares it and the rollout service applies
it. The proto form is `furlong.v1.AgentConfig`; the harness is `furlong.rollout.agents`.

`function` is `package.module:function`, a user's callable taking a dataset row (a dict: `prompt`
or `messages`, `tools`, `answer`, `metadata`) and an `openai.AsyncOpenAI` client bound to a fresh
session of the rollout service's OpenAI-compatible gateway, and returning the sample's reward (a
number; sync or async). Every call the agent makes through that client is recorded token-exact and
the session becomes one training trajectory; "" means the run has no agent. One agent run (all its
calls) must end within `timeout_s` and make at most `max_calls` calls; an agent that raises,
overruns or returns something not a finite number is an infrastructure failure that leaves its
group out of the step. At most `concurrency` agents of a step run at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from furlong.core.settings.fields import SettingError, check_fields, setting

MAX_AGENT_CALLS = 1024
MAX_AGENT_TIMEOUT_S = 3600.0
MAX_AGENT_CONCURRENCY = 1024
_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class AgentSettings:
    function: str = setting(
        "", max_chars=256, doc="package.module:function taking (row, AsyncOpenAI client), returning a reward"
    )
    max_calls: int = setting(32, ge=1, le=MAX_AGENT_CALLS, doc="gateway calls one agent run makes at most")
    timeout_s: float = setting(
        300.0, gt=0.0, le=MAX_AGENT_TIMEOUT_S, doc="deadline of one agent run, all its calls included"
    )
    concurrency: int = setting(
        64, ge=1, le=MAX_AGENT_CONCURRENCY, doc="agent runs of one step that run at once"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.function and not _FUNCTION_PATH.match(self.function):
            raise SettingError("function", f"must look like 'package.module:function', got {self.function!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.function)
