"""The `models check`, `convert` and `prepare` subcommands through an argparse parser."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from mxfp4_checkpoints import FIXTURES, e8m0_tensor, fp4_tensor, random_mxfp4, write_checkpoint

from furlong.controller.cli_models import add_commands


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="furlong")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def v4_release(tmp_path, spread=14):
    rng = np.random.default_rng(2)
    packed, scales = random_mxfp4(rng, (256, 256), max_spread=spread)
    scales[..., 1, 1] = 120 - spread
    return write_checkpoint(
        tmp_path / "v4-0731",
        {
            "model-00001-of-00001.safetensors": {
                "model.layers.0.ffn.experts.0.w1.weight": fp4_tensor(packed),
                "model.layers.0.ffn.experts.0.w1.scale": e8m0_tensor(scales),
                "model.embed.weight": torch.randn(8, 4).bfloat16(),
            }
        },
    )


@pytest.mark.integration
def test_models_check_prints_what_it_found(tmp_path, capsys):
    src = v4_release(tmp_path)
    assert run(["models", "check", str(src)]) == 0
    out = capsys.readouterr().out
    assert "spec: deepseek-v4-flash-0731" in out and "rope: yarn, theta 10000, factor=16" in out
    assert "mxfp4: 1 tensors" in out and "F4 1" in out and out.rstrip().endswith("ok")
    glm = tmp_path / "glm"
    glm.mkdir()
    shutil.copy(FIXTURES / "glm-4.7-flash.json", glm / "config.json")
    assert run(["models", "check", str(glm), "--config-only"]) == 0
    assert "rope: default, theta 1e+06" in capsys.readouterr().out
    assert run(["models", "check", str(glm)]) == 1
    config = json.loads((glm / "config.json").read_text())
    config["rope_scaling"] = {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    (glm / "config.json").write_text(json.dumps(config))
    assert run(["models", "check", str(glm), "--config-only"]) == 1
    # the family contract refuses it first (GLM-4.7-Flash's family uses plain RoPE only)
    err = capsys.readouterr().err
    assert "yarn" in err and "family glm4_moe_lite takes ['default']" in err


@pytest.mark.integration
def test_convert_verify_and_prepare(tmp_path, capsys):
    src = v4_release(tmp_path)
    assert run(["convert", "mxfp4-to-fp8", str(src), str(tmp_path / "out")]) == 0
    assert "1 tensors to FP8, 0 to bf16, 1 copied" in capsys.readouterr().out
    assert run(["convert", "verify", str(src), str(tmp_path / "out")]) == 0
    assert "identical: 1 MXFP4 tensors (65536 values" in capsys.readouterr().out
    assert run(["models", "check", str(tmp_path / "out")]) == 0
    assert "spec: deepseek-v4-flash " in capsys.readouterr().out
    assert run(["prepare", str(src)]) == 0
    assert "converted MXFP4 release to FP8 at" in capsys.readouterr().out
    assert (tmp_path / "v4-0731-fp8" / "model-00001-of-00001.safetensors").is_file()
    assert run(["prepare", str(tmp_path / "out")]) == 0
    assert "is ready as it is (spec deepseek-v4-flash)" in capsys.readouterr().out
    assert run(["convert", "mxfp4-to-fp8", str(tmp_path / "out"), str(tmp_path / "o2")]) == 1
    assert "no FP4 tensors" in capsys.readouterr().err


@pytest.mark.integration
def test_lossy_release_fails_closed_unless_bf16(tmp_path, capsys):
    src = v4_release(tmp_path, spread=18)
    assert run(["convert", "mxfp4-to-fp8", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "model.layers.0.ffn.experts.0.w1.weight" in err and "tile (0, 0)" in err
    assert run(["convert", "mxfp4-to-fp8", str(src), str(tmp_path / "out"), "--on-lossy", "bf16"]) == 0
    assert "bf16 (lossy in FP8" in capsys.readouterr().out
    assert run(["convert", "verify", str(src), str(tmp_path / "out")]) == 0
    with pytest.raises(SystemExit):
        run(["convert", "mxfp4-to-fp8", str(src), str(tmp_path / "x"), "--on-lossy", "fp16"])


@pytest.mark.integration
def test_models_check_passes_on_the_example_checkpoint_by_its_family_contract(capsys):
    example = Path(__file__).resolve().parents[2] / "examples" / "addition" / "checkpoint"
    assert run(["models", "check", str(example)]) == 0
    out = capsys.readouterr().out
    assert "family: llama (no registered release; checked against the family contract)" in out
    assert "rope: default, theta 10000" in out and out.rstrip().endswith("ok")
