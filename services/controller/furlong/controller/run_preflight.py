"""What the `furlong` CLI checks of a run spec on this machine before it starts any process.

`parse_run_spec` checks the spec's own values (types, bounds, choices). A run also needs what the
spec points at: `preflight` checks that `model` is a checkpoint directory holding the files the
policy loader reads (`config.json`, the safetensors weights, `tokenizer.json`), that the tokenizer
loads and matches the config's vocabulary, and that it can encode the task's prompts and answers.
Each problem is a `SettingError` naming the field (`model`, `task`), so the CLI exits 2 before a
stack starts instead of the trainer failing after it did. It reads only small files: the weights
are checked to exist, not loaded (the trainer's strict load does that). Knows nothing about
processes, HTTP or the services.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from furlong.controller.run_spec import RunSpec
from furlong.core import tasks
from furlong.core.checkpoint import CONFIG_FILE, MODEL_TYPE, WEIGHTS_FILE
from furlong.core.formats.checkpoint_dir import INDEX_FILE
from furlong.core.settings import SettingError
from furlong.core.tokenizer import TOKENIZER_FILE, CharTokenizer

# Prompts of the first steps the tokenizer must encode: enough to meet every character a task
# draws from its alphabet, few enough to take no time.
_PROMPTS_CHECKED = 64


@dataclass(frozen=True)
class ModelSummary:
    path: Path
    vocab_size: int
    weights_file: str


def check_model(model: str) -> tuple[ModelSummary, CharTokenizer]:
    """The checkpoint directory's summary and tokenizer; SettingError("model", ...) otherwise."""
    path = Path(model)
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except OSError as exc:  # e.g. a name too long
        raise SettingError("model", f"{model[:200]!r}: {exc.strerror}") from None
    if not exists:
        raise SettingError("model", f"checkpoint directory {path} does not exist")
    if not is_dir:
        raise SettingError("model", f"{path} is not a directory (a checkpoint is a directory)")
    weights = next((name for name in (WEIGHTS_FILE, INDEX_FILE) if (path / name).is_file()), None)
    missing = [name for name in (CONFIG_FILE, TOKENIZER_FILE) if not (path / name).is_file()]
    if weights is None:
        missing.append(WEIGHTS_FILE)
    if missing:
        raise SettingError("model", f"checkpoint directory {path} has no {', '.join(missing)}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise SettingError("model", f"{path / CONFIG_FILE} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SettingError("model", f"{path / CONFIG_FILE} must hold a JSON object")
    if config.get("model_type") != MODEL_TYPE:
        raise SettingError(
            "model",
            f"{path / CONFIG_FILE} has model_type {config.get('model_type')!r}, expected {MODEL_TYPE!r}",
        )
    try:
        tokenizer = CharTokenizer.load(path)
    except ValueError as exc:
        raise SettingError("model", str(exc)) from None
    vocab = config.get("vocab_size")
    if vocab != tokenizer.vocab_size:
        raise SettingError(
            "model",
            f"{path / CONFIG_FILE} has vocab_size {vocab!r} but its tokenizer has "
            f"{tokenizer.vocab_size} tokens",
        )
    return ModelSummary(path=path, vocab_size=tokenizer.vocab_size, weights_file=weights), tokenizer


def check_task(spec: RunSpec, tokenizer: CharTokenizer) -> None:
    """The tokenizer encodes the task's prompts and answers; SettingError("task", ...) otherwise."""
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
