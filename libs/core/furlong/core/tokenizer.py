"""A character-level tokenizer that needs no download: one token per character of a fixed alphabet.

Ids 0, 1 and 2 are the special tokens `<pad>`, `<bos>` and `<eos>`; the alphabet's characters follow
in the order given. It is stored next to a checkpoint as `tokenizer.json` in Furlong's own small
JSON format (`"type": "furlong-char"`). Knows nothing about models or tasks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_TYPE = "furlong-char"
FORMAT_VERSION = 1
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    """Maps each character of `chars` to one id; encodes without ever guessing an unknown character."""

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __init__(self, chars: str) -> None:
        if not isinstance(chars, str) or not chars:
            raise ValueError(f"tokenizer alphabet must be a non-empty string, got {chars!r}")
        seen: set[str] = set()
        for ch in chars:
            if ch in seen:
                raise ValueError(f"tokenizer alphabet {chars!r} repeats character {ch!r}")
            seen.add(ch)
        self.chars = chars
        self._id_of = {ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(chars)}
        self.vocab_size = len(SPECIAL_TOKENS) + len(chars)

    def __repr__(self) -> str:
        return f"CharTokenizer(chars={self.chars!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CharTokenizer):
            return NotImplemented
        return self.chars == other.chars

    def __hash__(self) -> int:
        return hash(self.chars)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(SPECIAL_TOKENS)))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, preceded by `<bos>` when `add_bos`; never appends `<eos>`."""
        ids = [self.bos_id] if add_bos else []
        for pos, ch in enumerate(text):
            tok = self._id_of.get(ch)
            if tok is None:
                raise ValueError(
                    f"character {ch!r} at position {pos} of {text!r} is not in the "
                    f"tokenizer alphabet {self.chars!r}"
                )
            ids.append(tok)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of `ids`; special tokens are dropped, or written as `<pad>`/`<bos>`/`<eos>`."""
        out: list[str] = []
        num_special = len(SPECIAL_TOKENS)
        for pos, raw in enumerate(ids):
            tok = int(raw)
            if not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"token id {tok} at position {pos} is outside the vocabulary [0, {self.vocab_size})"
                )
            if tok < num_special:
                if not skip_special:
                    out.append(SPECIAL_TOKENS[tok])
            else:
                out.append(self.chars[tok - num_special])
        return "".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": TOKENIZER_TYPE,
            "version": FORMAT_VERSION,
            "special_tokens": {name: i for i, name in enumerate(SPECIAL_TOKENS)},
            "chars": self.chars,
        }

    def save(self, directory: Path) -> None:
        """Write `directory/tokenizer.json` (the directory is created if needed)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / TOKENIZER_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: object, source: str = "tokenizer") -> CharTokenizer:
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if d.get("type") != TOKENIZER_TYPE:
            raise ValueError(f"{source}: type is {d.get('type')!r}, expected {TOKENIZER_TYPE!r}")
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{source}: format version {d.get('version')!r} is not supported (expected {FORMAT_VERSION})"
            )
        expected_special = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
        if d.get("special_tokens") != expected_special:
            raise ValueError(
                f"{source}: special_tokens {d.get('special_tokens')!r} differ from {expected_special!r}"
            )
        chars = d.get("chars")
        if not isinstance(chars, str):
            raise ValueError(f"{source}: chars must be a string, got {chars!r}")
        try:
            return cls(chars)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, directory: Path) -> CharTokenizer:
        """Read `directory/tokenizer.json`; a missing or malformed file is a ValueError naming it."""
        path = Path(directory) / TOKENIZER_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ValueError(f"tokenizer file {path} does not exist") from None
        except OSError as exc:
            raise ValueError(f"tokenizer file {path} cannot be read: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tokenizer file {path} is not valid JSON: {exc}") from None
        return cls.from_dict(data, source=str(path))
