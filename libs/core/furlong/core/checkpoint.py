"""The policy checkpoint format: a directory with `config.json` (a transformers LlamaConfig),
`model.safetensors` (every parameter, each stored once) and `tokenizer.json` (a CharTokenizer).

Loading is strict: a tensor that is missing, unexpected, or of the wrong shape is an error naming
it, and the config's vocabulary must match the tokenizer's. Tensors that alias one another inside a
model (tied embeddings) are written once, under the first name the model's state dict gives them.
Knows nothing about training, serving or transports.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from furlong.core.tokenizer import CharTokenizer

if TYPE_CHECKING:
    import transformers

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"


def unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with aliases removed: a tensor sharing storage with an earlier entry
    (e.g. a tied output embedding) is left out."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def _read_config(model_dir: Path) -> transformers.LlamaConfig:
    from transformers import LlamaConfig

    path = model_dir / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"checkpoint config {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"checkpoint config {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"checkpoint config {path} must hold a JSON object")
    if data.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"checkpoint config {path} has model_type {data.get('model_type')!r}, expected {MODEL_TYPE!r}"
        )
    try:
        return LlamaConfig.from_dict(data)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"checkpoint config {path} is not a valid LlamaConfig: {exc}") from None


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    path = model_dir / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint weights {path} do not exist")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"checkpoint weights {path} cannot be read: {exc}") from None


def _check_tensors(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], path: Path) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mismatched = [
        f"{name}: file {tuple(found[name].shape)} vs model {tuple(expected[name].shape)}"
        for name in expected
        if name in found and found[name].shape != expected[name].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches [{'; '.join(mismatched)}]")
    if problems:
        raise ValueError(f"checkpoint weights {path} do not fit the model: {', '.join(problems)}")
    not_float = sorted(name for name, t in found.items() if not t.is_floating_point())
    if not_float:
        raise ValueError(f"checkpoint weights {path}: tensors {not_float} are not floating point")


def load_policy(
    model_dir: Path | str, dtype: torch.dtype = torch.float32
) -> tuple[transformers.PreTrainedModel, CharTokenizer]:
    """Build LlamaForCausalLM from `config.json`, load `model.safetensors` strictly, cast to `dtype`
    and return it in eval() mode with its tokenizer."""
    from transformers import LlamaForCausalLM

    model_dir = Path(model_dir)
    try:
        exists = model_dir.is_dir()
    except OSError as exc:  # e.g. a name too long: the caller's path is bad, not the machine
        raise ValueError(f"checkpoint directory {str(model_dir)[:200]!r}: {exc.strerror}") from None
    if not exists:
        raise ValueError(f"checkpoint directory {model_dir} does not exist")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    tokenizer = CharTokenizer.load(model_dir)
    config = _read_config(model_dir)
    if config.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"checkpoint {model_dir}: config vocab_size {config.vocab_size} differs from "
            f"the tokenizer's vocab_size {tokenizer.vocab_size}"
        )
    found = _read_weights(model_dir)
    model = LlamaForCausalLM(config)
    expected = unique_state(model)
    _check_tensors(expected, found, model_dir / WEIGHTS_FILE)
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(found[name])
    # Through nn.Module's signatures: transformers wraps `to` with functools.wraps, which types it
    # as the unbound Module.to, and leaves `eval` unannotated. The methods called are the model's.
    module: torch.nn.Module = model
    module.to(dtype)
    module.eval()
    log.info(
        "loaded policy from %s: %d tensors, %d parameters, dtype %s",
        model_dir,
        len(expected),
        sum(t.numel() for t in expected.values()),
        dtype,
    )
    return model, tokenizer


def save_policy(model: transformers.PreTrainedModel, tokenizer: CharTokenizer, model_dir: Path) -> None:
    """Write the checkpoint directory (created if needed): config.json, model.safetensors,
    tokenizer.json. The model's config must say model_type "llama" and match the tokenizer."""
    model_dir = Path(model_dir)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) != MODEL_TYPE:
        raise ValueError(
            f"save_policy needs a model with a {MODEL_TYPE!r} config, got "
            f"{getattr(config, 'model_type', None)!r}"
        )
    if config.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"model vocab_size {config.vocab_size} differs from the tokenizer's "
            f"vocab_size {tokenizer.vocab_size}"
        )
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in unique_state(model).items()}
    save_file(tensors, str(model_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    config_dict = config.to_dict()  # every field, defaults included: nothing is left implicit
    config_dict["architectures"] = [ARCHITECTURE]
    config_dict["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (model_dir / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    tokenizer.save(model_dir)
    log.info("saved policy to %s: %d tensors", model_dir, len(tensors))
