"""How engines draw tokens, as a run spec (`sampling`), a Generate request and the engines see it:
temperature, top-k, top-p, min-p, length and stop strings. Declared once here; the proto form is
`furlong.v1.SamplingParams`, which also carries a request's sampling seed (a run derives it from the
run's seed and the step, so a run spec does not take one). Free of torch so that clients stay light.
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.settings.fields import check_fields, setting

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_NEW_TOKENS = 131072
MAX_TOP_K = 1 << 20


@dataclass(frozen=True)
class SamplingSettings:
    # 0 is greedy decoding: the most probable token, always (a support of size 1, log-prob 0).
    # Generation and evaluation take it; training runs refuse it (a point mass has no gradient).
    temperature: float = setting(
        1.0, ge=0.0, le=100.0, doc="1.0 samples from the model's distribution; 0 = greedy (argmax)"
    )
    top_k: int = setting(0, ge=0, le=MAX_TOP_K, doc="0 = off")
    top_p: float = setting(1.0, gt=0.0, le=1.0, doc="1.0 = off")
    min_p: float = setting(
        0.0, ge=0.0, lt=1.0, doc="0 = off; keep tokens with p >= min_p x p_max (after top-k and top-p)"
    )
    max_new_tokens: int = setting(8, ge=1, le=MAX_NEW_TOKENS)
    # A response ends at the token completing one of these strings (finish reason "stop"); the
    # returned text ends before it, the token ids keep every drawn token. Duplicates are dropped.
    stop: tuple[str, ...] = setting(
        (), max_items=MAX_STOP_STRINGS, min_chars=1, max_chars=MAX_STOP_CHARS, doc="stop strings"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        object.__setattr__(self, "stop", tuple(dict.fromkeys(self.stop)))

    @property
    def greedy(self) -> bool:
        """Temperature 0: every token is the argmax of the logits."""
        return self.temperature == 0.0

    def filters_vocab(self, vocab_size: int) -> bool:
        """True when greedy decoding, top-k, top-p or min-p can remove tokens from a vocabulary of
        this size."""
        return self.greedy or (0 < self.top_k < vocab_size) or self.top_p < 1.0 or self.min_p > 0.0
