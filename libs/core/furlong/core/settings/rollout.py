"""How a run's rollout is shaped: engines, dynamic sampling, over-sampling and asynchronous mode, as
the REST run spec (`rollout`) declares them and the rollout service applies them. `engine` picks the
engine type (`builtin`: Furlong's own engine; `sglang`: SGLang HTTP servers the rollout service
launches, or the running servers listed in `engine_urls`, which it attaches to instead of
launching). Rollout alone decides, from these, how many prompts to draw, which groups to redraw and
which to cut; the controller paces generation by `max_staleness`. The proto form is
`furlong.v1.RolloutConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from furlong.core.settings.fields import SettingError, check_fields, setting

MAX_ENGINES = 64
MAX_REFILL_ROUNDS = 16
MAX_OVER_SAMPLING = 4.0
MAX_STALENESS = 64
MAX_URL_CHARS = 2048

ENGINE_BUILTIN = "builtin"  # Furlong's own engine (in the rollout service or one process each)
ENGINE_SGLANG = "sglang"  # SGLang HTTP servers (`furlong.rollout.sglang`)
ENGINE_KINDS = (ENGINE_BUILTIN, ENGINE_SGLANG)


@dataclass(frozen=True)
class RolloutSettings:
    """`max_refill_rounds` > 0 turns on dynamic sampling: a group whose rewards are all equal is
    drawn again, up to that many rounds, then dropped. `over_sampling` > 1 draws
    ceil(groups needed x over_sampling) prompts and keeps the first groups to complete; the rest are
    cut and recorded as such, never trained. `max_staleness` K > 0 is asynchronous mode: the samples
    of step s are generated while the trainer still trains earlier steps, with a policy at most K
    versions older than the one that trains on them; 0 is the synchronous loop."""

    num_engines: int = setting(1, ge=1, le=MAX_ENGINES, doc="engines serving the run")
    max_refill_rounds: int = setting(
        0, ge=0, le=MAX_REFILL_ROUNDS, doc="dynamic sampling: redraws of an equal-reward group; 0 = off"
    )
    over_sampling: float = setting(
        1.0, ge=1.0, le=MAX_OVER_SAMPLING, doc="prompts drawn per group needed; 1 = off"
    )
    max_staleness: int = setting(
        0,
        ge=0,
        le=MAX_STALENESS,
        doc="asynchronous mode: versions a trained sample may lag the trained policy; 0 = synchronous",
    )
    engine: str = setting(
        ENGINE_BUILTIN, choices=ENGINE_KINDS, doc="engine type: builtin (Furlong's engine) or sglang"
    )
    engine_urls: tuple[str, ...] = setting(
        (),
        max_items=MAX_ENGINES,
        min_chars=1,
        max_chars=MAX_URL_CHARS,
        doc="sglang only: base URLs (http://host:port) of running servers to attach to instead of "
        "launching; as many as num_engines",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.engine_urls:
            return
        if self.engine != ENGINE_SGLANG:
            raise SettingError(
                "engine_urls",
                f"attaching to running servers needs engine {ENGINE_SGLANG!r}, got engine {self.engine!r}",
            )
        for i, url in enumerate(self.engine_urls):
            _check_url(i, url)
        if len(set(self.engine_urls)) != len(self.engine_urls):
            raise SettingError("engine_urls", f"URLs repeat: {list(self.engine_urls)}")
        if len(self.engine_urls) != self.num_engines:
            raise SettingError(
                "num_engines",
                f"{self.num_engines} engine(s) but {len(self.engine_urls)} engine_urls: "
                f"set num_engines to {len(self.engine_urls)}",
            )

    def prompts_to_draw(self, groups_needed: int) -> int:
        """Prompts to draw for `groups_needed` groups."""
        return max(groups_needed, math.ceil(groups_needed * self.over_sampling - 1e-9))


def _check_url(index: int, url: str) -> None:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise SettingError("engine_urls", f"entry {index} must be an http(s)://HOST:PORT URL, got {url!r}")
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise SettingError(
            "engine_urls", f"entry {index} must be a server's base URL (no path or query), got {url!r}"
        )
