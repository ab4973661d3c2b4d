"""A policy's tokenizer: transformers' `AutoTokenizer` over a model directory's own files, behind the
few operations trainer and rollout use (encode a prompt, decode a response, the EOS ids, the
vocabulary).

The tokenizer comes from the directory alone (`tokenizer.json` and/or `tokenizer_config.json`, plus
whatever vocabulary files they name; the chat template in `tokenizer_config.json` or
`chat_template.jinja`); loading never touches the network and never runs code from the directory.
The EOS ids are the model's generation config's (`generation_config.json`, one id or several), not
the tokenizer's guess.

`encode(text, add_bos=True)` is the tokenizer's own start-of-sequence special tokens (what
`encode(add_special_tokens=True)` puts before the text: `<bos>` for Llama, nothing for Qwen3)
followed by the text's ids; end-of-sequence tokens a tokenizer would append are never added, since a
prompt is continued. `decode` refuses ids outside the vocabulary instead of dropping them.

`char_tokenizer(alphabet)` builds a character-level tokenizer with the `tokenizers` library (one
token per character, `<pad>` 0, `<bos>` 1, `<eos>` 2): the addition example's and the tests'.
Knows nothing about models or tasks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Files a tokenizer may consist of: copied as they are when a policy directory is written from another.
TOKENIZER_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
)
CHAR_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Tokenizer:
    """A transformers tokenizer with the model's EOS ids. `vocab_size` is the number of ids the
    tokenizer knows (`len(tokenizer)`, added tokens included), which may be less than the model's
    embedding rows. Thread-safe for encode and decode (transformers' fast tokenizers are)."""

    def __init__(
        self, hf: PreTrainedTokenizerBase, eos_ids: Sequence[int], pad_id: int | None = None
    ) -> None:
        self.hf = hf
        self.vocab_size = len(hf)
        eos = tuple(eos_ids)
        if not eos or not all(_is_id(i) and 0 <= i < self.vocab_size for i in eos):
            raise ValueError(
                f"eos ids must be a non-empty list of ids in [0, {self.vocab_size}), got {list(eos_ids)!r}"
            )
        self.eos_ids: tuple[int, ...] = eos
        self.eos_id: int = eos[0]  # the one a response is closed with when one id must be chosen
        bos = hf.bos_token_id
        self.bos_id: int | None = bos if _is_id(bos) else None
        if pad_id is None:
            pad_id = hf.pad_token_id if _is_id(hf.pad_token_id) else None
        if pad_id is None:
            pad_id = eos[0]
            log.info("tokenizer declares no pad token: padding with the first EOS id %d", pad_id)
        if not 0 <= pad_id < self.vocab_size:
            raise ValueError(f"pad id {pad_id} outside the vocabulary [0, {self.vocab_size})")
        self.pad_id: int = pad_id
        self._prefix = self._start_tokens()

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def _start_tokens(self) -> list[int]:
        """The special tokens the tokenizer puts before a text (its add_special_tokens prefix),
        found by encoding a probe text with and without them."""
        for probe in ("0", "a", " ", "x"):
            try:
                with_special = [int(i) for i in self.hf.encode(probe, add_special_tokens=True)]
                plain = [int(i) for i in self.hf.encode(probe, add_special_tokens=False)]
            except Exception:  # noqa: BLE001 - the probe is not in this vocabulary: try the next
                continue
            if not plain:
                continue
            for start in range(len(with_special) - len(plain) + 1):
                if with_special[start : start + len(plain)] == plain:
                    return with_special[:start]
        raise ValueError(f"cannot tell which special tokens {type(self.hf).__name__} puts before a text")

    def __repr__(self) -> str:
        return (
            f"Tokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_ids={list(self.eos_ids)}, pad_id={self.pad_id})"
        )

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, after the tokenizer's start-of-sequence tokens when `add_bos`."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        try:
            ids = list(self.hf.encode(text, add_special_tokens=False))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise ValueError(f"cannot tokenize {text[:80]!r}{self._culprit(text)}: {exc}") from None
        return (list(self._prefix) if add_bos else []) + [int(i) for i in ids]

    def _culprit(self, text: str) -> str:
        """Which character of `text` the vocabulary cannot encode (for the error message)."""
        for pos, ch in enumerate(text):
            try:
                self.hf.encode(ch, add_special_tokens=False)
            except Exception:  # noqa: BLE001 - tokenizers raises plain Exception
                return f" (character {ch!r} at position {pos})"
        return ""

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of `ids`; special tokens are dropped when `skip_special`."""
        checked = []
        for pos, raw in enumerate(ids):
            tok = int(raw)
            if not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"token id {tok} at position {pos} is outside the vocabulary [0, {self.vocab_size})"
                )
            checked.append(tok)
        return str(self.hf.decode(checked, skip_special_tokens=skip_special))

    def save(self, directory: Path) -> None:
        """Write the tokenizer's files (tokenizer.json, tokenizer_config.json, chat template)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(directory))


def load_tokenizer(model_dir: Path, eos_ids: Sequence[int], fallback_pad_id: int | None = None) -> Tokenizer:
    """The directory's tokenizer with `eos_ids` (from its generation config) and its own pad token
    (else `fallback_pad_id`, else the first EOS id); ValueError naming the files when there is none
    or it cannot be loaded."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    present = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not present:
        raise ValueError(
            f"model directory {model_dir} has no tokenizer: neither {' nor '.join(TOKENIZER_FILES)} exists"
        )
    try:
        hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; name the files
        raise ValueError(
            f"tokenizer of {model_dir} ({', '.join(present)}) cannot be loaded: {type(exc).__name__}: {exc}"
        ) from None
    own_pad = hf.pad_token_id
    return Tokenizer(hf, eos_ids, own_pad if _is_id(own_pad) else fallback_pad_id)


def char_tokenizer(alphabet: str, chat_template: str | None = None) -> Tokenizer:
    """A character-level tokenizer built with the `tokenizers` library: `<pad>` 0, `<bos>` 1,
    `<eos>` 2, then one id per character of `alphabet` in order; `<bos>` starts every encoding.
    A character outside the alphabet cannot be encoded (there is no unknown token)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"tokenizer alphabet must be a non-empty string, got {alphabet!r}")
    vocab: dict[str, int] = {name: i for i, name in enumerate(CHAR_SPECIAL_TOKENS)}
    for ch in alphabet:
        if ch in vocab:
            raise ValueError(f"tokenizer alphabet {alphabet!r} repeats character {ch!r}")
        vocab[ch] = len(vocab)
    raw = RawTokenizer(models.WordLevel(vocab, unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    pad, bos, eos = CHAR_SPECIAL_TOKENS
    hf: Any = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token=pad
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    return Tokenizer(hf, [vocab[eos]], vocab[pad])
