"""A checkpoint directory as Hugging Face lays it out: `config.json`, and either one
`model.safetensors` or shards listed by `model.safetensors.index.json` (`weight_map`: tensor name ->
shard file name, `metadata.total_size`).

`CheckpointDir.open` validates the whole layout before anything is read: the index is well formed,
shard names are plain file names inside the directory, every shard header is valid (see
`furlong.core.safetensors_io`), and the index and the shard headers agree tensor for tensor. Reading
then goes tensor by tensor. Knows nothing about model families or quantisation formats.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from furlong.core.safetensors_io import (
    Header,
    SafetensorsFormatError,
    SafetensorsReader,
    TensorEntry,
    write_file,
)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; ValueError naming the file otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_config(model_dir: Path | str) -> dict[str, Any]:
    return read_json_object(Path(model_dir) / CONFIG_FILE)


def _check_shard_name(index_path: Path, name: Any) -> str:
    if (
        not isinstance(name, str)
        or not name.endswith(".safetensors")
        or "/" in name
        or "\\" in name
        or name.startswith(".")
        or "\0" in name
    ):
        raise SafetensorsFormatError(
            f"index {index_path}: shard name {name!r} is not a plain .safetensors file name"
        )
    return name


def _read_index(index_path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    try:
        doc = read_json_object(index_path)
    except ValueError as exc:
        raise SafetensorsFormatError(str(exc)) from None
    weight_map = doc.get("weight_map")
    metadata = doc.get("metadata", {})
    if not isinstance(weight_map, dict) or not weight_map:
        raise SafetensorsFormatError(f"index {index_path}: weight_map must be a non-empty object")
    if not isinstance(metadata, dict):
        raise SafetensorsFormatError(f"index {index_path}: metadata must be an object")
    for name, shard in weight_map.items():
        if not name:
            raise SafetensorsFormatError(f"index {index_path}: empty tensor name")
        _check_shard_name(index_path, shard)
    return dict(weight_map), dict(metadata)


@dataclass
class CheckpointDir:
    """A validated checkpoint directory. `shards` are file names in first-use order."""

    path: Path
    shards: tuple[str, ...]
    weight_map: dict[str, str]
    indexed: bool
    index_metadata: dict[str, Any] = field(default_factory=dict)
    _readers: dict[str, SafetensorsReader] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: Path | str) -> CheckpointDir:
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"checkpoint directory {path} does not exist")
        index_path = path / INDEX_FILE
        if index_path.is_file():
            weight_map, metadata = _read_index(index_path)
            indexed = True
        elif (path / SINGLE_FILE).is_file():
            weight_map, metadata, indexed = {}, {}, False
        else:
            raise ValueError(f"checkpoint directory {path} has neither {INDEX_FILE} nor {SINGLE_FILE}")
        shards = tuple(dict.fromkeys(weight_map.values())) if indexed else (SINGLE_FILE,)
        readers: dict[str, SafetensorsReader] = {}
        for shard in shards:
            if not (path / shard).is_file():
                raise ValueError(f"checkpoint {path}: shard {shard} listed in {INDEX_FILE} does not exist")
            readers[shard] = SafetensorsReader(path / shard)
        if indexed:
            for shard, reader in readers.items():
                for name in reader.header.entries:
                    listed = weight_map.get(name)
                    if listed != shard:
                        raise SafetensorsFormatError(
                            f"checkpoint {path}: tensor {name!r} is stored in {shard} but the "
                            f"index maps it to {listed!r}"
                        )
            for name, shard in weight_map.items():
                if name not in readers[shard].header.entries:
                    raise SafetensorsFormatError(
                        f"checkpoint {path}: index maps tensor {name!r} to {shard}, which does not hold it"
                    )
        else:
            weight_map = {name: SINGLE_FILE for name in readers[SINGLE_FILE].header.entries}
        return cls(path, shards, weight_map, indexed, metadata, readers)

    def header(self, shard: str) -> Header:
        return self._readers[shard].header

    def names_in(self, shard: str) -> list[str]:
        """Tensor names of one shard in data-offset order."""
        return list(self._readers[shard].header.entries)

    def entry(self, name: str) -> TensorEntry:
        return self._readers[self.shard_of(name)].entry(name)

    def shard_of(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in checkpoint {self.path}") from None

    def read_bytes(self, name: str) -> np.ndarray:
        return self._readers[self.shard_of(name)].read_bytes(name)

    def read(self, name: str) -> torch.Tensor:
        return self._readers[self.shard_of(name)].read(name)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        self._readers[self.shard_of(name)].read_into(name, out)

    def iter_bytes(self, name: str, chunk_bytes: int = 64 << 20) -> Iterator[np.ndarray]:
        return self._readers[self.shard_of(name)].iter_bytes(name, chunk_bytes)

    def shard_bytes(self, shard: str) -> int:
        return self._readers[shard].header.file_bytes

    def total_tensor_bytes(self) -> int:
        return sum(self.entry(name).nbytes for name in self.weight_map)


def write_index(
    model_dir: Path,
    weight_map: Mapping[str, str],
    total_size: int,
    extra_metadata: Mapping[str, Any] | None = None,
) -> None:
    """Write `model.safetensors.index.json` (tensor names sorted, as Hugging Face writes them)."""
    metadata = dict(extra_metadata or {})
    metadata["total_size"] = int(total_size)
    doc = {"metadata": metadata, "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
    (Path(model_dir) / INDEX_FILE).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def shard_name(index: int, count: int) -> str:
    """Hugging Face's name of shard `index` (1-based) of `count`."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


@dataclass(frozen=True)
class WrittenShards:
    """What `write_shards` wrote: the shard file names, the tensors and their data bytes."""

    shards: tuple[str, ...]
    num_tensors: int
    total_bytes: int


def write_shards(
    tensors: Sequence[tuple[str, torch.Tensor]],
    model_dir: Path,
    max_shard_bytes: int,
    metadata: Mapping[str, str] | None = None,
) -> WrittenShards:
    """Write (name, tensor) pairs in order into shards of at most `max_shard_bytes` data bytes (a
    larger tensor gets a shard of its own): `model.safetensors` when everything fits in one, else
    `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`. Each tensor is written
    from its own memory, chunk by chunk; nothing is stacked or copied whole."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    groups: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not groups or (size + nbytes > max_shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += nbytes
    if not groups:
        raise ValueError("write_shards: no tensors to write")
    model_dir = Path(model_dir)
    names = (
        [SINGLE_FILE] if len(groups) == 1 else [shard_name(i + 1, len(groups)) for i in range(len(groups))]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for shard, group in zip(names, groups):
        write_file(model_dir / shard, dict(group), metadata)
        for name, tensor in group:
            weight_map[name] = shard
            total += tensor.numel() * tensor.element_size()
    if len(groups) > 1:
        write_index(model_dir, weight_map, total)
    return WrittenShards(tuple(names), len(weight_map), total)
