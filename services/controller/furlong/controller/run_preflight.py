"""What the `furlong` CLI checks of a run spec on this machine before it starts any process.

`parse_run_spec` checks the spec's own values (types, bounds, choices). A run also needs what the
spec points at: `preflight` checks that `model` is a Hugging Face model directory the policy loader
reads (`config.json` of a supported family, `generation_config.json` with its EOS ids, the tokenizer's
files, the safetensors weights or their index, every shard's header), that the tokenizer fits the
config's vocabulary, and that it can encode the task's prompts and answers. Each problem is a
`SettingError` naming the field (`model`, `task`), so the CLI exits 2 before a stack starts instead of
the trainer failing after it did. It reads only small files: the weights' headers are read, their
tensors are not (the trainer's strict load does that). Knows nothing about processes, HTTP or the
services.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from furlong.controller.run_spec import RunSpec
from furlong.core import tasks
from furlong.core.checkpoint import read_generation_config, read_model_config
from furlong.core.formats.checkpoint_dir import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, CheckpointDir
from furlong.core.settings import SettingError
from furlong.core.tokenizer import TOKENIZER_FILES, Tokenizer, load_tokenizer

# Prompts of the first steps the tokenizer must encode: enough to meet every character a task
# draws from its alphabet, few enough to take no time.
_PROMPTS_CHECKED = 64


@dataclass(frozen=True)
class ModelSummary:
    path: Path
    model_type: str
    vocab_size: int
    num_shards: int


def check_model(model: str) -> tuple[ModelSummary, Tokenizer]:
    """The model directory's summary and tokenizer; SettingError("model", ...) otherwise."""
    path = Path(model)
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except OSError as exc:  # e.g. a name too long
        raise SettingError("model", f"{model[:200]!r}: {exc.strerror}") from None
    if not exists:
        raise SettingError("model", f"model directory {path} does not exist")
    if not is_dir:
        raise SettingError("model", f"{path} is not a directory (a model is a Hugging Face directory)")
    missing = [] if (path / CONFIG_FILE).is_file() else [CONFIG_FILE]
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    if not any((path / name).is_file() for name in (SINGLE_FILE, INDEX_FILE)):
        missing.append(f"{SINGLE_FILE} or {INDEX_FILE}")
    if missing:
        raise SettingError("model", f"model directory {path} has no {', '.join(missing)}")
    try:
        config = read_model_config(path)
        generation = read_generation_config(path)
        pad = generation.pad_id
        if pad is None and isinstance(getattr(config, "pad_token_id", None), int):
            pad = config.pad_token_id
        tokenizer = load_tokenizer(path, generation.eos_ids, fallback_pad_id=pad)
        files = CheckpointDir.open(path)
    except ValueError as exc:
        raise SettingError("model", str(exc)) from None
    vocab = int(config.vocab_size)
    if tokenizer.vocab_size > vocab:
        raise SettingError(
            "model",
            f"model directory {path}: the tokenizer knows {tokenizer.vocab_size} ids, more than "
            f"{CONFIG_FILE}'s vocab_size {vocab}",
        )
    summary = ModelSummary(
        path=path, model_type=str(config.model_type), vocab_size=vocab, num_shards=len(files.shards)
    )
    return summary, tokenizer


def check_task(spec: RunSpec, tokenizer: Tokenizer) -> None:
    """The tokenizer encodes the task's prompts and answers; SettingError("task", ...) otherwise.
    A run on a dataset (no task) has its rows checked by `run_data.check_run_data`."""
    if not spec.task:
        return
    task = tasks.get_task(spec.task)
    for step in (1, 2):
        for prompt in task.prompts(spec.seed, step, min(spec.prompts_per_step, _PROMPTS_CHECKED)):
            for text in (prompt.text, prompt.answer):
                try:
                    tokenizer.encode(text)
                except ValueError as exc:
                    raise SettingError(
                        "task", f"{spec.task!r} does not fit the model's tokenizer: {exc}"
                    ) from None


def preflight(spec: RunSpec) -> ModelSummary:
    """Check what the spec points at on this machine (see the module docstring)."""
    summary, tokenizer = check_model(spec.model)
    check_task(spec, tokenizer)
    return summary
