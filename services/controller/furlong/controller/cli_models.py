"""`furlong` subcommands for checkpoints: model-spec checks, MXFP4 -> FP8 conversion, prepare.

    furlong models check DIR [--spec NAME] [--config-only]
    furlong convert mxfp4-to-fp8 SRC DST [--on-lossy {error,bf16}] [--scale-suffix NAME]
    furlong convert verify SRC DST [--scale-suffix NAME]
    furlong prepare MODEL_DIR [--out DIR] [--on-lossy {error,bf16}] [--spec NAME]

`add_commands(subparsers)` registers them on the main parser; each handler takes the parsed
arguments and returns the exit code: 0 success, 1 the checkpoint failed a check or could not be
converted (the reason goes to stderr). The work is done in `furlong.core`; this module parses and
prints.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from furlong.core.errors import IntegrityError
from furlong.core.formats.checkpoint_dir import INDEX_FILE, SINGLE_FILE, CheckpointDir, read_config
from furlong.core.formats.fp4_tensors import find_fp4_tensors
from furlong.core.formats.mxfp4_convert import ON_LOSSY, ConvertOptions, convert_mxfp4_to_fp8
from furlong.core.formats.verify import verify_conversion
from furlong.core.fp8 import DEFAULT_SCALE_SUFFIX
from furlong.core.models import (
    FAMILY_CONTRACTS,
    CheckedConfig,
    ModelSpec,
    check_model_config,
    load_checked_spec,
    stored_expert_dtype,
)
from furlong.core.prepare import prepare_checkpoint


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def describe_spec(spec: ModelSpec) -> list[str]:
    rope = spec.rope
    params = ", ".join(f"{k}={v}" for k, v in rope.scaling_items().items())
    lines = [
        f"spec: {spec.name} (model_type {spec.model_type})",
        f"attention: {spec.attention.value}; rotary_dim {spec.rotary_dim}",
        f"rope: {rope.type.value}, theta {rope.theta:g}"
        + (f", {params}" if params else "")
        + (f", compress_theta {rope.compress_theta:g}" if rope.compress_theta else ""),
        f"norm: {spec.norm.value} eps {spec.norm_eps:g}; vocab {spec.vocab_size}; "
        f"max positions {spec.max_position_embeddings}",
    ]
    if spec.experts:
        e = spec.experts
        lines.append(
            f"experts: {e.num_experts} routed, top-{e.experts_per_token}, "
            f"{e.num_shared_experts} shared, width {e.moe_intermediate_size}, "
            f"stored {e.stored_dtype}"
        )
    return lines


def describe_family(checked: CheckedConfig, config: dict[str, Any]) -> list[str]:
    """What `models check` says of a checkpoint of no registered release (a fine-tune, a tiny test
    model): checked against its family's contract only."""
    rope = checked.rope
    return [
        f"family: {checked.family.model_type} (no registered release; checked against the family contract)",
        f"attention: {checked.attention.value}; rotary_dim {checked.rotary_dim}",
        f"rope: {rope.type.value}, theta {rope.theta:g}",
        f"vocab {config.get('vocab_size')}; max positions {config.get('max_position_embeddings')}",
    ]


def _models_check(args: argparse.Namespace) -> int:
    model_dir = Path(args.dir)
    try:
        config = read_config(model_dir)
        if args.spec or str(config.get("model_type")) not in FAMILY_CONTRACTS:
            described = describe_spec(load_checked_spec(config, args.spec))
        else:  # its family's contract, and its release's spec when it has a registered identity
            checked = check_model_config(config)
            described = describe_spec(checked.spec) if checked.spec else describe_family(checked, config)
        lines = [f"checkpoint {model_dir}"] + ["  " + line for line in described]
        has_weights = (model_dir / INDEX_FILE).is_file() or (model_dir / SINGLE_FILE).is_file()
        if args.config_only:
            lines.append("  weights: not checked (--config-only)")
        elif not has_weights:
            return _fail(
                f"{model_dir} holds no {INDEX_FILE} or {SINGLE_FILE} "
                f"(use --config-only to check the config alone)"
            )
        else:
            ckpt = CheckpointDir.open(model_dir)
            dtypes = Counter(ckpt.entry(name).dtype for name in ckpt.weight_map)
            fp4 = find_fp4_tensors(ckpt)
            if bool(fp4) != (stored_expert_dtype(config) == "mxfp4"):
                return _fail(
                    f"config says experts are stored as {stored_expert_dtype(config)} "
                    f"but {len(fp4)} tensors are MXFP4"
                )
            lines.append(
                f"  weights: {len(ckpt.shards)} shard(s), {len(ckpt.weight_map)} tensors, "
                f"{ckpt.total_tensor_bytes()} bytes; dtypes "
                + ", ".join(f"{k} {v}" for k, v in sorted(dtypes.items()))
            )
            if fp4:
                lines.append(
                    f"  mxfp4: {len(fp4)} tensors; run `furlong prepare {model_dir}` to convert them to FP8"
                )
    except (ValueError, KeyError) as exc:
        return _fail(str(exc))
    print("\n".join(lines + ["ok"]))
    return 0


def _convert(args: argparse.Namespace) -> int:
    try:
        options = ConvertOptions(on_lossy=args.on_lossy, scale_suffix=args.scale_suffix)
        report = convert_mxfp4_to_fp8(args.src, args.dst, options)
    except ValueError as exc:
        return _fail(str(exc))
    if report.already_done:
        print(f"{report.dst} already holds this conversion of {report.src}")
    else:
        print(
            f"converted {report.src} -> {report.dst}: {report.num_fp8} tensors to FP8, "
            f"{len(report.bf16_tensors)} to bf16, {report.num_copied} copied, "
            f"{report.output_bytes} bytes"
        )
        for name in report.bf16_tensors:
            print(f"  bf16 (lossy in FP8, {report.lossy_tiles.get(name, 0)} tiles): {name}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    try:
        report = verify_conversion(args.src, args.dst, args.scale_suffix)
    except (ValueError, IntegrityError) as exc:
        return _fail(str(exc))
    print(
        f"identical: {report.num_fp4_tensors} MXFP4 tensors ({report.num_values_compared} "
        f"values, {len(report.bf16_tensors)} in bf16) and {report.num_copies_compared} copied "
        f"tensors"
    )
    return 0


def _prepare(args: argparse.Namespace) -> int:
    try:
        prepared = prepare_checkpoint(
            args.model_dir, args.out, ConvertOptions(on_lossy=args.on_lossy), args.spec
        )
    except ValueError as exc:
        return _fail(str(exc))
    if prepared.converted:
        print(f"converted MXFP4 release to FP8 at {prepared.path} (spec {prepared.spec_name})")
    else:
        print(f"{prepared.path} is ready as it is (spec {prepared.spec_name})")
    return 0


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `models`, `convert` and `prepare` to the main parser's subparsers."""
    models = subparsers.add_parser("models", help="model specs and checkpoint checks")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    check = models_sub.add_parser("check", help="check a checkpoint directory against its spec")
    check.add_argument("dir")
    check.add_argument("--spec", help="spec name (default: identified from config.json)")
    check.add_argument("--config-only", action="store_true", help="check config.json only")
    check.set_defaults(func=_models_check)

    convert = subparsers.add_parser("convert", help="convert checkpoint formats")
    convert_sub = convert.add_subparsers(dest="convert_command", required=True)
    to_fp8 = convert_sub.add_parser("mxfp4-to-fp8", help="lossless MXFP4 -> blockwise FP8")
    to_fp8.add_argument("src")
    to_fp8.add_argument("dst")
    to_fp8.add_argument("--on-lossy", choices=ON_LOSSY, default="error")
    to_fp8.add_argument("--scale-suffix", default=DEFAULT_SCALE_SUFFIX)
    to_fp8.set_defaults(func=_convert)
    verify = convert_sub.add_parser("verify", help="compare a conversion value by value")
    verify.add_argument("src")
    verify.add_argument("dst")
    verify.add_argument("--scale-suffix", default=DEFAULT_SCALE_SUFFIX)
    verify.set_defaults(func=_verify)

    prepare = subparsers.add_parser("prepare", help="make a released checkpoint loadable")
    prepare.add_argument("model_dir")
    prepare.add_argument("--out", help="output directory (default: MODEL_DIR-fp8)")
    prepare.add_argument("--on-lossy", choices=ON_LOSSY, default="error")
    prepare.add_argument("--spec", help="spec name (default: identified from config.json)")
    prepare.set_defaults(func=_prepare)
