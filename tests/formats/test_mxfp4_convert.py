"""MXFP4 -> FP8 conversion of checkpoint directories on disk, verified value by value."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from mxfp4_checkpoints import e8m0_tensor, fp4_tensor, random_mxfp4, write_checkpoint
from safetensors.torch import load_file

from furlong.core import mxfp4
from furlong.core.errors import IntegrityError
from furlong.core.formats.checkpoint_dir import CheckpointDir
from furlong.core.formats.mxfp4_convert import (
    MARKER_FILE,
    ConvertOptions,
    LossyConversionError,
    convert_mxfp4_to_fp8,
)
from furlong.core.formats.verify import verify_conversion
from furlong.core.safetensors_io import write_file

EXPERT = "model.layers.{}.mlp.experts.{}.{}.weight"


def spread_checkpoint(tmp_path, spreads, code=5):
    """One 128x128 tensor per spread: a block of `code` at tile max - spread, in shard 1; the
    scales live in shard 2."""
    weights, scales = {}, {}
    for s in spreads:
        codes = np.zeros((128, 128), np.uint8)
        codes[0, :32] = code
        packed = mxfp4.pack_codes(codes)
        sc = np.full((128, 4), 140, np.uint8)
        sc[0, 0] = 140 - s
        weights[f"w{s}.weight"] = fp4_tensor(packed)
        scales[f"w{s}.scale"] = e8m0_tensor(sc)
    return write_checkpoint(
        tmp_path / "src",
        {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales},
    )


@pytest.mark.integration
def test_random_round_trip_across_shards_with_a_big_tensor(tmp_path):
    rng = np.random.default_rng(11)
    big_packed, big_scales = random_mxfp4(rng, (2048, 4096), top=130)
    small = {
        name: random_mxfp4(rng, shape)
        for name, shape in (
            (EXPERT.format(0, 0, "up_proj"), (256, 384)),
            (EXPERT.format(0, 1, "down_proj"), (200, 96)),
            ("model.layers.1.mlp.experts.stacked.weight", (4, 128, 256)),
        )
    }
    shard1 = {
        EXPERT.format(1, 0, "gate_proj"): fp4_tensor(big_packed),
        "model.embed_tokens.weight": torch.randn(64, 32).to(torch.bfloat16),
    }
    shard2 = {name: fp4_tensor(p) for name, (p, _) in small.items()}
    shard2["model.layers.0.self_attn.o_proj.weight"] = torch.randn(32, 32).to(torch.float8_e4m3fn)
    shard3 = {EXPERT.format(1, 0, "gate_proj")[:-6] + "scale": e8m0_tensor(big_scales)}
    shard3.update({name[:-6] + "scale": e8m0_tensor(s) for name, (_, s) in small.items()})
    shard3["model.norm.weight"] = torch.ones(32)
    src = write_checkpoint(
        tmp_path / "src",
        {
            "model-00001-of-00003.safetensors": shard1,
            "model-00002-of-00003.safetensors": shard2,
            "model-00003-of-00003.safetensors": shard3,
        },
    )
    report = convert_mxfp4_to_fp8(src, tmp_path / "dst")
    assert (report.num_fp8, report.num_copied, report.bf16_tensors) == (4, 3, ())
    check = verify_conversion(src, tmp_path / "dst")
    assert check.num_values_compared == 2048 * 4096 + 256 * 384 + 200 * 96 + 4 * 128 * 256
    dst = CheckpointDir.open(tmp_path / "dst")
    big = EXPERT.format(1, 0, "gate_proj")
    assert dst.shard_of(big) == "model-00001-of-00003.safetensors"
    assert dst.shard_of(big[:-6] + "weight_scale_inv") == "model-00001-of-00003.safetensors"
    assert not any(name.endswith(".scale") for name in dst.weight_map)
    loaded = load_file(tmp_path / "dst" / "model-00002-of-00003.safetensors")
    stacked = loaded["model.layers.1.mlp.experts.stacked.weight_scale_inv"]
    assert stacked.dtype == torch.float32 and stacked.shape == (4, 1, 2)
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == dst.total_tensor_bytes()
    assert set(index["weight_map"]) == set(dst.weight_map)


@pytest.mark.integration
def test_config_tokenizer_and_other_tensors(tmp_path):
    src = spread_checkpoint(tmp_path, [0, 3])
    convert_mxfp4_to_fp8(src, tmp_path / "dst")
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    original = json.loads((src / "config.json").read_text())
    assert "expert_dtype" in original and "expert_dtype" not in config
    original.pop("expert_dtype")
    assert config == original
    assert (tmp_path / "dst" / "tokenizer.json").read_text() == '{"v": 1}'
    assert (tmp_path / "dst" / "generation_config.json").is_file()
    # the shard that only held scales is gone from the output
    assert sorted(p.name for p in (tmp_path / "dst").glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors"
    ]


@pytest.mark.integration
def test_every_lossy_spread_is_refused_naming_tensor_and_tile(tmp_path):
    for spread in range(15, 21):
        src = spread_checkpoint(tmp_path / str(spread), [2, spread])
        with pytest.raises(LossyConversionError) as info:
            convert_mxfp4_to_fp8(src, tmp_path / str(spread) / "dst")
        assert f"w{spread}.weight" in str(info.value) and "tile (0, 0)" in str(info.value)
        assert f"{spread} octaves" in str(info.value)
        assert not (tmp_path / str(spread) / "dst").exists()
        assert not list((tmp_path / str(spread)).glob(".dst.partial-*"))


@pytest.mark.integration
def test_on_lossy_bf16_writes_exact_bf16(tmp_path):
    src = spread_checkpoint(tmp_path, list(range(21)))
    report = convert_mxfp4_to_fp8(src, tmp_path / "dst", ConvertOptions(on_lossy="bf16"))
    assert sorted(report.bf16_tensors) == sorted(f"w{s}.weight" for s in range(15, 21))
    assert report.num_fp8 == 15
    check = verify_conversion(src, tmp_path / "dst")
    assert sorted(check.bf16_tensors) == sorted(report.bf16_tensors)
    loaded = load_file(tmp_path / "dst" / "model-00001-of-00002.safetensors")
    assert loaded["w20.weight"].dtype == torch.bfloat16 and "w20.weight_scale_inv" not in loaded
    assert loaded["w3.weight"].dtype == torch.float8_e4m3fn
    quant = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert sorted(quant["modules_to_not_convert"]) == sorted(f"w{s}" for s in range(15, 21))


@pytest.mark.integration
def test_zero_blocks_far_below_are_fine(tmp_path):
    src = spread_checkpoint(tmp_path, [20], code=8)  # -0 only, 20 octaves below
    report = convert_mxfp4_to_fp8(src, tmp_path / "dst")
    assert report.num_fp8 == 1
    verify_conversion(src, tmp_path / "dst")


@pytest.mark.integration
def test_sign_of_zero_is_kept(tmp_path):
    """Policy: -0 codes become e4m3 -0 (0x80) and dequantise to -0.0."""
    src = spread_checkpoint(tmp_path, [0], code=8)
    convert_mxfp4_to_fp8(src, tmp_path / "dst")
    fp8 = load_file(tmp_path / "dst" / "model-00001-of-00002.safetensors")["w0.weight"]
    raw = fp8.view(torch.uint8)
    assert (raw[0, :32] == 0x80).all() and (raw[1:] == 0).all()
    assert torch.signbit(fp8.to(torch.float32)[0, :32]).all()


@pytest.mark.integration
def test_idempotent_and_refusals(tmp_path):
    src = spread_checkpoint(tmp_path, [1])
    first = convert_mxfp4_to_fp8(src, tmp_path / "dst")
    marker = (tmp_path / "dst" / MARKER_FILE).read_text()
    again = convert_mxfp4_to_fp8(src, tmp_path / "dst")
    assert again.already_done and not first.already_done
    assert (again.num_fp8, again.output_bytes) == (first.num_fp8, first.output_bytes)
    assert (tmp_path / "dst" / MARKER_FILE).read_text() == marker
    with pytest.raises(ValueError, match="no FP4 tensors"):
        convert_mxfp4_to_fp8(tmp_path / "dst", tmp_path / "dst2")
    with pytest.raises(ValueError, match="already exists"):
        convert_mxfp4_to_fp8(src, tmp_path / "dst", ConvertOptions(on_lossy="bf16"))
    with pytest.raises(ValueError, match="on_lossy"):
        ConvertOptions(on_lossy="fp16")


@pytest.mark.integration
def test_nan_scale_is_an_error_naming_the_tensor(tmp_path):
    packed = np.zeros((128, 64), np.uint8)
    scales = np.full((128, 4), 127, np.uint8)
    scales[5, 2] = 255
    src = write_checkpoint(
        tmp_path / "src",
        {"model.safetensors": {"e.weight": fp4_tensor(packed), "e.weight_scale": e8m0_tensor(scales)}},
        indexed=False,
    )
    with pytest.raises(ValueError, match=r"'e.weight'.*NaN"):
        convert_mxfp4_to_fp8(src, tmp_path / "dst")


@pytest.mark.integration
def test_single_file_source_and_custom_scale_suffix(tmp_path):
    rng = np.random.default_rng(5)
    packed, scales = random_mxfp4(rng, (128, 256))
    src = write_checkpoint(
        tmp_path / "src",
        {"model.safetensors": {"x.weight": fp4_tensor(packed), "x.scale": torch.from_numpy(scales)}},
        indexed=False,
    )
    convert_mxfp4_to_fp8(src, tmp_path / "dst", ConvertOptions(scale_suffix="scale"))
    loaded = load_file(tmp_path / "dst" / "model.safetensors")
    assert set(loaded) == {"x.weight", "x.scale"} and loaded["x.scale"].dtype == torch.float32
    assert not (tmp_path / "dst" / "model.safetensors.index.json").exists()
    verify_conversion(src, tmp_path / "dst", scale_suffix="scale")


@pytest.mark.integration
def test_verify_catches_a_changed_value(tmp_path):
    src = spread_checkpoint(tmp_path, [4])
    convert_mxfp4_to_fp8(src, tmp_path / "dst")
    path = tmp_path / "dst" / "model-00001-of-00002.safetensors"
    tensors = {k: v.clone() for k, v in load_file(path).items()}  # load_file maps the file
    raw = tensors["w4.weight"].view(torch.uint8).clone()
    raw[0, 1] ^= 0x01
    tensors["w4.weight"] = raw.view(torch.float8_e4m3fn)
    write_file(path, tensors)
    with pytest.raises(IntegrityError, match=r"w4.weight.*element \(0, 1\)"):
        verify_conversion(src, tmp_path / "dst")
