"""How a run's responses are scored, as the REST run spec (`reward`) declares it and the rollout
service applies it: a weighted sum of built-in rewards, one section per kind, each used when its
`weight` is > 0. The proto form is `furlong.v1.RewardConfig`; the rewards themselves are
`furlong.rollout.rewards` and `furlong.rollout.reward_kinds`.

    exact_match  1 iff the stripped response equals the reference answer
    math         the response's final answer (\\boxed{}, "#### N", else its last number) is
                 equivalent to the reference (math-verify)
    regex        `pattern` found in / fully matching the response, or its first group equal to
                 the answer
    format       a named format check of the response (integer, single_line, boxed, gsm8k,
                 think_answer)
    code         the response's Python passes the row's tests (the reference answer) in a sandbox
    python       a user callable `module:function`, sync or async
    http         a remote reward or judge: JSON in, JSON out

A reward that raises, times out (`timeout_s`) or returns something not a finite number is an
infrastructure failure, never a 0: its group is left out of the step (`on_failure: exclude`) or
drawn again, up to `max_resamples` times (`resample`). With no weight > 0 the run's task scores
(a run on `data` needs one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from furlong.core.settings.fields import SettingError, check_fields, setting

MAX_WEIGHT = 1000.0
MAX_REWARD_TIMEOUT_S = 3600.0
FORMAT_CHECKS = ("integer", "single_line", "boxed", "gsm8k", "think_answer")
REGEX_MODES = ("search", "fullmatch", "answer")
ON_FAILURE = ("exclude", "resample")
SANDBOXES = ("auto", "bwrap", "rlimits")
MAX_RESAMPLES = 8


def _weight() -> float:
    return setting(  # type: ignore[no-any-return]
        0.0, ge=0.0, le=MAX_WEIGHT, doc="weight in the run's reward; 0 = not used"
    )


@dataclass(frozen=True)
class ExactMatchReward:
    weight: float = _weight()

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class MathReward:
    weight: float = _weight()

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class RegexReward:
    weight: float = _weight()
    pattern: str = setting("", max_chars=4096, doc="a Python regular expression")
    mode: str = setting(
        "search",
        choices=REGEX_MODES,
        doc="search: found anywhere; fullmatch: the stripped response; answer: group 1 equals the answer",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.weight > 0 and not self.pattern:
            raise SettingError("pattern", "a regex reward with a weight needs a pattern")
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise SettingError("pattern", f"{self.pattern!r} is not a regular expression: {exc}") from None


@dataclass(frozen=True)
class FormatReward:
    weight: float = _weight()
    check: str = setting("single_line", choices=FORMAT_CHECKS, doc="the format the response must have")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class CodeReward:
    """The sandbox: `bwrap` (bubblewrap: no network, read-only system, a private writable
    directory), `rlimits` (a child process with CPU/memory limits, a private directory, network
    refused by an unshared network namespace where permitted, else by blocked sockets), `auto`:
    bwrap where it runs, else rlimits (logged)."""

    weight: float = _weight()
    timeout_s: float = setting(10.0, gt=0.0, le=600.0, doc="wall time of one test run")
    cpu_s: int = setting(10, ge=1, le=600, doc="CPU seconds of one test run (RLIMIT_CPU)")
    memory_bytes: int = setting(
        512 << 20, ge=16 << 20, le=64 << 30, doc="address space of one test run (RLIMIT_AS)"
    )
    sandbox: str = setting("auto", choices=SANDBOXES, doc="how the tests are isolated")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class PythonReward:
    weight: float = _weight()
    function: str = setting(
        "", max_chars=256, doc="module:function, called as fn(response, answer[, metadata=...]); may be async"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.weight > 0 and ":" not in self.function:
            raise SettingError("function", f"must look like 'package.module:function', got {self.function!r}")


@dataclass(frozen=True)
class HttpReward:
    """POST {"response", "answer", "metadata", "prompt_id"} as JSON; the reply must be
    {"reward": <finite number>}."""

    weight: float = _weight()
    url: str = setting("", max_chars=2048, doc="http(s) URL of the reward service")
    timeout_s: float = setting(30.0, gt=0.0, le=MAX_REWARD_TIMEOUT_S, doc="per attempt")
    retries: int = setting(2, ge=0, le=10, doc="attempts after the first on a transport error or 5xx")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.weight > 0 and not self.url.startswith(("http://", "https://")):
            raise SettingError("url", f"must be an http:// or https:// URL, got {self.url!r}")


@dataclass(frozen=True)
class RewardSettings:
    exact_match: ExactMatchReward = setting(default_factory=ExactMatchReward)
    math: MathReward = setting(default_factory=MathReward)
    regex: RegexReward = setting(default_factory=RegexReward)
    format: FormatReward = setting(default_factory=FormatReward)
    code: CodeReward = setting(default_factory=CodeReward)
    python: PythonReward = setting(default_factory=PythonReward)
    http: HttpReward = setting(default_factory=HttpReward)
    timeout_s: float = setting(
        60.0, gt=0.0, le=MAX_REWARD_TIMEOUT_S, doc="deadline of one response's reward (all terms)"
    )
    on_failure: str = setting(
        "exclude",
        choices=ON_FAILURE,
        doc="a group whose reward failed: exclude it from the step, or resample it",
    )
    max_resamples: int = setting(1, ge=0, le=MAX_RESAMPLES, doc="on_failure resample: rounds at most")

    def __post_init__(self) -> None:
        check_fields(self)

    def terms(self) -> list[tuple[str, float]]:
        """(kind, weight) of every term with a weight > 0, in declaration order."""
        out = []
        for f in fields(self):
            section = getattr(self, f.name)
            weight = getattr(section, "weight", 0.0)
            if weight > 0:
                out.append((f.name, float(weight)))
        return out

    @property
    def enabled(self) -> bool:
        return bool(self.terms())
