"""A policy is a Hugging Face model directory: `config.json`, the weights (`model.safetensors`, or
shards listed by `model.safetensors.index.json`), the tokenizer's own files (see
`furlong.core.tokenizer`) and `generation_config.json` (one EOS id or several).

`load_policy(dir, dtype)` is the one function trainer and rollout call: it checks every file before
reading a weight, builds transformers' own class for the family (`MODEL_TYPES`) without initialising
its parameters, and streams every stored tensor straight into its parameter (`read_into`), shard by
shard, so a load holds the model's bytes once plus at most one tensor being cast. Loading is strict:
a tensor that is missing, unexpected (beyond the family's own `_keys_to_ignore_on_load_unexpected`),
of the wrong shape or not floating point is an error naming it and its file; a missing or bad file
is an error naming the file. It never touches the network and never runs code from the directory.

`save_policy(model, tokenizer, dir)` writes such a directory from a model in memory (the example and
the tests); `export_policy(state, source_dir, out_dir)` writes a trained state dict as a copy of the
run's model directory with new weights (config with the stored dtype, generation config and tokenizer
files copied as they are), atomically, in the layout `transformers.from_pretrained`, SGLang and vLLM
load (per-expert tensors, `checkpoint_layout`). Knows nothing about training, serving or transports.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from furlong.core._compat import empty_model
from furlong.core.checkpoint_layout import StoredPiece, stored_pieces
from furlong.core.formats.checkpoint_dir import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointDir,
    WrittenShards,
    read_json_object,
    write_shards,
)
from furlong.core.models.family import FAMILY_CONTRACTS
from furlong.core.safetensors_io import DTYPES
from furlong.core.settings.checkpoint import DEFAULT_EXPORT_SHARD_BYTES
from furlong.core.tokenizer import TOKENIZER_SIDE_FILES, Tokenizer, load_tokenizer

if TYPE_CHECKING:
    import transformers

log = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = SINGLE_FILE
# The families with a contract (furlong.core.models.family): transformers' class for each is built.
MODEL_TYPES = tuple(FAMILY_CONTRACTS)
DEFAULT_MAX_SHARD_BYTES = DEFAULT_EXPORT_SHARD_BYTES
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class GenerationSettings:
    """What a policy directory's generation_config.json declares that Furlong uses."""

    eos_ids: tuple[int, ...]
    pad_id: int | None
    bos_id: int | None


def _ids(path: Path, field: str, value: object, required: bool) -> tuple[int, ...]:
    if value is None and not required:
        return ()
    items: list[object] = list(value) if isinstance(value, list) else [value]
    ids = [i for i in items if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
    if not items or len(ids) != len(items):
        raise ValueError(f"{path}: {field} must be a token id or a non-empty list of ids, got {value!r}")
    return tuple(ids)


def read_generation_config(model_dir: Path | str) -> GenerationSettings:
    """The EOS ids (one or several), pad and bos id of `generation_config.json`; ValueError naming
    the file when it is missing, malformed or declares no EOS id."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    data = read_json_object(path)
    eos = _ids(path, "eos_token_id", data.get("eos_token_id"), required=True)
    pad = _ids(path, "pad_token_id", data.get("pad_token_id"), required=False)
    bos = _ids(path, "bos_token_id", data.get("bos_token_id"), required=False)
    return GenerationSettings(eos_ids=eos, pad_id=pad[0] if pad else None, bos_id=bos[0] if bos else None)


def read_model_config(model_dir: Path | str) -> transformers.PretrainedConfig:
    """The directory's config.json as transformers' config class of its family; ValueError naming
    the file for a missing or malformed config, an unsupported family or a quantized checkpoint."""
    from transformers import AutoConfig

    path = Path(model_dir) / CONFIG_FILE
    data = read_json_object(path)
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not a supported family; "
            f"supported: {', '.join(MODEL_TYPES)}"
        )
    if data.get("quantization_config"):
        raise ValueError(
            f"{path}: quantized checkpoints ({data['quantization_config'].get('quant_method', '?')}) are "
            "not loaded for training or the built-in engine; give a bf16/fp32 checkpoint"
        )
    try:
        config: transformers.PretrainedConfig = AutoConfig.from_pretrained(
            str(path.parent), local_files_only=True, trust_remote_code=False
        )
        return config
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; name the file
        raise ValueError(f"{path} is not a valid {model_type} config: {type(exc).__name__}: {exc}") from None


def unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with aliases removed (see `unique_tensors`)."""
    return unique_tensors(model.state_dict())


def unique_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the tensors that share storage with an earlier entry (a tied output
    embedding is left out: checkpoints store it once, under the input embedding's name)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def _check_dir(model_dir: Path) -> None:
    try:
        exists = model_dir.is_dir()
    except OSError as exc:  # e.g. a name too long: the caller's path is bad, not the machine
        raise ValueError(f"model directory {str(model_dir)[:200]!r}: {exc.strerror}") from None
    if not exists:
        raise ValueError(f"model directory {model_dir} does not exist")


def _where(files: CheckpointDir, name: str) -> str:
    return f"{name} ({files.shard_of(name)})"


def _plan(
    pieces: list[StoredPiece], files: CheckpointDir, ignored: list[re.Pattern[str]]
) -> list[StoredPiece]:
    """The pieces to read; ValueError naming every missing, unexpected, misshapen or non-float
    stored tensor and its file."""
    stored = set(files.weight_map)
    wanted = {p.stored for p in pieces}
    missing = sorted(wanted - stored)
    extra = sorted(stored - wanted)
    unexpected = [n for n in extra if not any(p.search(n) for p in ignored)]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:20]}{' ...' if len(missing) > 20 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {[_where(files, n) for n in unexpected[:20]]}")
    for piece in pieces:
        if piece.stored not in stored:
            continue
        entry = files.entry(piece.stored)
        if entry.shape != piece.shape:
            problems.append(
                f"{_where(files, piece.stored)}: stored shape {list(entry.shape)}, model {list(piece.shape)}"
            )
        elif entry.dtype not in _FLOAT_DTYPES:
            problems.append(f"{_where(files, piece.stored)}: dtype {entry.dtype} is not a float format")
    if problems:
        raise ValueError(f"weights of {files.path} do not fit the model: {'; '.join(problems)}")
    if extra:
        log.info("%s: %d stored tensors the family ignores (e.g. %s)", files.path, len(extra), extra[0])
    return pieces


def _fill(model: torch.nn.Module, files: CheckpointDir, pieces: list[StoredPiece]) -> None:
    """Stream every piece into the model's tensors, shard by shard in file order."""
    targets = unique_state(model)
    order = {shard: i for i, shard in enumerate(files.shards)}
    pieces = sorted(pieces, key=lambda p: (order[files.shard_of(p.stored)], files.entry(p.stored).begin))
    with torch.no_grad():
        for piece in pieces:
            dest = piece.view(targets[piece.target].data)
            stored_dtype = DTYPES[files.entry(piece.stored).dtype][1]
            if stored_dtype == dest.dtype and dest.is_contiguous():
                files.read_into(piece.stored, dest)
            else:  # a cast: one stored tensor in memory at a time
                dest.copy_(files.read(piece.stored))


def load_policy(
    model_dir: Path | str, dtype: torch.dtype = torch.float32
) -> tuple[transformers.PreTrainedModel, Tokenizer]:
    """The directory's model (transformers' class for its family, `dtype`, eval mode, on the CPU)
    and its tokenizer; see the module docstring for what is checked."""
    model_dir = Path(model_dir)
    _check_dir(model_dir)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    config = read_model_config(model_dir)
    generation = read_generation_config(model_dir)
    pad = generation.pad_id
    if pad is None and isinstance(getattr(config, "pad_token_id", None), int):
        pad = config.pad_token_id
    tokenizer = load_tokenizer(model_dir, generation.eos_ids, fallback_pad_id=pad)
    vocab_size = int(config.vocab_size)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"model directory {model_dir}: the tokenizer knows {tokenizer.vocab_size} ids, more than "
            f"config.json's vocab_size {vocab_size}"
        )
    files = CheckpointDir.open(model_dir)
    model = empty_model(config, dtype)
    shapes = {name: tuple(t.shape) for name, t in unique_state(model).items()}
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    pieces = _plan(stored_pieces(shapes), files, ignored)
    _fill(model, files, pieces)
    module: torch.nn.Module = model  # nn.Module's signature of eval (transformers leaves it untyped)
    module.eval()
    log.info(
        "loaded %s policy from %s: %d stored tensors in %d file(s), %d parameters, %s",
        config.model_type,
        model_dir,
        len(pieces),
        len(files.shards),
        sum(t.numel() for t in unique_state(model).values()),
        dtype,
    )
    return model, tokenizer


def tied_keys(config: Mapping[str, Any]) -> dict[str, str]:
    """{tied name: the name it is stored under} of a model with this config.json: the family's
    `_tied_weights_keys` when the config ties the word embeddings, else nothing."""
    if not config.get("tie_word_embeddings"):
        return {}
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(
        transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")), ""), None
    )
    keys = getattr(cls, "_tied_weights_keys", None)
    return dict(keys) if isinstance(keys, dict) else {}


def _untied(state: Mapping[str, torch.Tensor], tied: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """`state` without its tied copies (each must equal the tensor it is tied to)."""
    out = dict(state)
    for copy, source in tied.items():
        if copy in out and source in out:
            if not torch.equal(out[copy], out[source]):
                raise ValueError(f"{copy} is tied to {source} but the state gives them different values")
            del out[copy]
    return out


def _stored_tensors(state: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    unique = {name: t.detach().to("cpu") for name, t in unique_tensors(state).items()}
    for name, tensor in unique.items():
        if not tensor.is_floating_point():
            raise ValueError(f"tensor {name} is {tensor.dtype}, not floating point")
    pieces = stored_pieces({name: tuple(t.shape) for name, t in unique.items()})
    return [(p.stored, p.view(unique[p.target]).contiguous()) for p in pieces]


def _stored_dtype(state: Mapping[str, torch.Tensor]) -> str:
    """The config's `dtype`: the one most elements are stored in (a family may keep a few small
    tensors in float32, e.g. DeepSeek-V3's router bias)."""
    counts: dict[str, int] = {}
    for tensor in state.values():
        name = str(tensor.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + tensor.numel()
    if not counts:
        raise ValueError("a policy without tensors")
    return max(counts, key=lambda name: counts[name])


def _write_weights(state: Mapping[str, torch.Tensor], model_dir: Path, max_shard_bytes: int) -> WrittenShards:
    return write_shards(_stored_tensors(state), model_dir, max_shard_bytes, metadata={"format": "pt"})


def _generation_dict(tokenizer: Tokenizer) -> dict[str, Any]:
    eos = list(tokenizer.eos_ids)
    out: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": tokenizer.pad_id}
    if tokenizer.bos_id is not None:
        out["bos_token_id"] = tokenizer.bos_id
    return out


def save_policy(
    model: transformers.PreTrainedModel,
    tokenizer: Tokenizer,
    model_dir: Path | str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> WrittenShards:
    """Write a policy directory (created if needed) from a model in memory: config.json (every
    field, the architecture and the stored dtype), generation_config.json (the tokenizer's EOS,
    pad and bos ids), the tokenizer's files and the weights."""
    model_dir = Path(model_dir)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in MODEL_TYPES:
        raise ValueError(
            f"save_policy needs a model of a supported family ({', '.join(MODEL_TYPES)}), got "
            f"{getattr(config, 'model_type', None)!r}"
        )
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer knows {tokenizer.vocab_size} ids, more than the model's "
            f"vocab_size {config.vocab_size}"
        )
    model_dir.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    written = _write_weights(state, model_dir, max_shard_bytes)
    config_dict = config.to_dict()  # every field, defaults included: nothing is left implicit
    config_dict["architectures"] = [type(model).__name__]
    config_dict["dtype"] = _stored_dtype(state)
    _write_json(model_dir / CONFIG_FILE, config_dict)
    _write_json(model_dir / GENERATION_CONFIG_FILE, _generation_dict(tokenizer))
    tokenizer.save(model_dir)
    log.info(
        "saved policy to %s: %d tensors in %d file(s)", model_dir, written.num_tensors, len(written.shards)
    )
    return written


@dataclass(frozen=True)
class ExportedPolicy:
    """A policy directory `export_policy` wrote."""

    path: Path
    shards: tuple[str, ...]
    num_tensors: int
    num_bytes: int


def export_policy(
    state: Mapping[str, torch.Tensor],
    source_dir: Path | str,
    out_dir: Path | str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ExportedPolicy:
    """Write `state` (a state dict of the model loaded from `source_dir`) as the policy directory
    `out_dir`: the source's config.json with `dtype` the stored one, its generation_config.json and
    tokenizer files as they are, and the weights. Written into a scratch directory next to
    `out_dir` and moved into place, replacing an earlier one: a reader never sees half of it."""
    source, target = Path(source_dir), Path(out_dir)
    _check_dir(source)
    config = read_json_object(source / CONFIG_FILE)
    read_generation_config(source)  # the copy must be loadable: refuse a source without one
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    try:
        written = _write_weights(_untied(state, tied_keys(config)), scratch, max_shard_bytes)
        config["dtype"] = _stored_dtype(state)
        if "torch_dtype" in config:
            config["torch_dtype"] = config["dtype"]
        _write_json(scratch / CONFIG_FILE, config)
        for name in (GENERATION_CONFIG_FILE, *TOKENIZER_SIDE_FILES):
            if (source / name).is_file():
                shutil.copyfile(source / name, scratch / name)
        _replace_dir(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    log.info(
        "exported policy to %s: %d tensors in %d file(s)", target, written.num_tensors, len(written.shards)
    )
    return ExportedPolicy(target, written.shards, written.num_tensors, written.total_bytes)


def _replace_dir(scratch: Path, target: Path) -> None:
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    if target.exists():
        target.rename(old)
    scratch.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "GENERATION_CONFIG_FILE",
    "INDEX_FILE",
    "MODEL_TYPES",
    "WEIGHTS_FILE",
    "ExportedPolicy",
    "GenerationSettings",
    "export_policy",
    "load_policy",
    "read_generation_config",
    "read_model_config",
    "save_policy",
    "tied_keys",
    "unique_state",
    "unique_tensors",
]
