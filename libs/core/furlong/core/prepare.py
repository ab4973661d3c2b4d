"""The prepare stage: turn a released checkpoint into a layout the rest of the pipeline loads.

`prepare_checkpoint(model_dir)` checks the checkpoint's config against its registered model spec,
then looks at the tensors: an MXFP4 release (routed experts as FP4 + e8m0 scales, such as
DeepSeek-V4-Flash-0731) is converted losslessly to blockwise FP8 in a sibling directory
(`<name>-fp8` unless told otherwise) and the converted config is checked against the spec of the
FP8 layout; any other checkpoint is used as it is. A config that says `expert_dtype: fp4` while no
tensor is FP4 (or the reverse) is an error, not a guess.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from furlong.core.formats.checkpoint_dir import CheckpointDir, read_config
from furlong.core.formats.fp4_tensors import find_fp4_tensors
from furlong.core.formats.mxfp4_convert import ConversionReport, ConvertOptions, convert_mxfp4_to_fp8
from furlong.core.models.contract import ContractError, load_checked_spec, stored_expert_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedCheckpoint:
    """Where the pipeline should load from, which spec it matches, and the conversion (if any)."""

    path: Path
    spec_name: str
    converted: bool
    conversion: ConversionReport | None = None


def default_output_dir(model_dir: Path) -> Path:
    return model_dir.parent / f"{model_dir.name}-fp8"


def is_mxfp4_release(model_dir: Path | str) -> bool:
    """True when the checkpoint holds MXFP4 tensors; ContractError when the config disagrees."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    has_fp4 = bool(find_fp4_tensors(CheckpointDir.open(model_dir)))
    says_fp4 = stored_expert_dtype(config) == "mxfp4"
    if has_fp4 != says_fp4:
        raise ContractError(
            f"checkpoint {model_dir}: config {'declares' if says_fp4 else 'does not declare'} "
            f"expert_dtype fp4 but {'some' if has_fp4 else 'no'} tensors are MXFP4"
        )
    return has_fp4


def prepare_checkpoint(
    model_dir: Path | str,
    out_dir: Path | str | None = None,
    options: ConvertOptions = ConvertOptions(),
    spec_name: str | None = None,
) -> PreparedCheckpoint:
    model_dir = Path(model_dir)
    spec = load_checked_spec(read_config(model_dir), spec_name)
    if not is_mxfp4_release(model_dir):
        log.info("%s (%s) is already in a supported layout", model_dir, spec.name)
        return PreparedCheckpoint(model_dir, spec.name, False)
    target = Path(out_dir) if out_dir is not None else default_output_dir(model_dir)
    report = convert_mxfp4_to_fp8(model_dir, target, options)
    converted_spec = load_checked_spec(read_config(target))
    log.info("prepared %s (%s) as %s (%s)", model_dir, spec.name, target, converted_spec.name)
    return PreparedCheckpoint(target, converted_spec.name, True, report)
