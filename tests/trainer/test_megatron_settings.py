"""`trainer.backend` and `trainer.megatron` in the run spec: validation naming the field and the
value, the trip to ConfigureRun and back, and the model configs the megatron backend refuses."""

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from furlong.controller.run_requests import trainer_config
from furlong.controller.run_spec import parse_run_spec
from furlong.core.settings import (
    AlgorithmSettings,
    MegatronSettings,
    PrecisionSettings,
    SettingError,
    TrainerSettings,
    from_mapping,
)
from furlong.trainer.convert import config_from_proto, config_to_proto
from furlong.trainer.megatron.spec import check_megatron_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"backend": "jax"}, "backend: must be one of ['torch', 'megatron'], got 'jax'"),
        (
            {"backend": "megatron", "megatron": {"pipeline_parallel": 2}},
            "megatron.tensor_parallel: tensor_parallel 1 x pipeline_parallel 2 x context_parallel 1 = 2 "
            "ranks, but parallel.world_size is 1",
        ),
        ({"backend": "megatron", "megatron": {"pipeline_parallel": 0}}, "megatron.pipeline_parallel: "),
        (
            {"backend": "megatron", "megatron": {"tensor_parallel": 2}},
            "megatron.tensor_parallel: tensor_parallel 2 x pipeline_parallel 1 x context_parallel 1 = 2 "
            "ranks, but parallel.world_size is 1",
        ),
        (
            {"backend": "megatron", "parallel": {"strategy": "fsdp2", "world_size": 2}},
            "parallel.strategy: backend megatron lays its ranks out itself",
        ),
        (
            {
                "backend": "megatron",
                "parallel": {"strategy": "ddp", "world_size": 3},
                "megatron": {"tensor_parallel": 2},
            },
            "parallel.world_size: 3 ranks cannot be replicas of tensor_parallel 2 x pipeline_parallel 1 x "
            "context_parallel 1",
        ),
        ({"megatron": {"tensor_parallel": 2}}, "megatron: set only with backend megatron"),
        ({"parallel": {"world_size": 2}}, "parallel.world_size: 2 ranks need a strategy"),
    ],
)
def test_bad_backend_settings_name_the_field_and_value(trainer, message):
    with pytest.raises(SettingError) as info:
        from_mapping(TrainerSettings, trainer)
    assert str(info.value).startswith(message), str(info.value)


def test_megatron_with_ddp_holds_replicas_of_its_layout_over_the_ranks():
    settings = from_mapping(
        TrainerSettings,
        {
            "backend": "megatron",
            "parallel": {"strategy": "ddp", "world_size": 8},
            "megatron": {"tensor_parallel": 2, "pipeline_parallel": 2},
        },
    )
    assert settings.data_parallel_size == 2
    assert (
        from_mapping(TrainerSettings, {"parallel": {"strategy": "ddp", "world_size": 4}}).data_parallel_size
        == 4
    )
    assert from_mapping(TrainerSettings, {}).data_parallel_size == 1


def test_megatron_over_two_ranks_is_tensor_parallel_with_strategy_none():
    settings = from_mapping(
        TrainerSettings,
        {"backend": "megatron", "parallel": {"world_size": 2}, "megatron": {"tensor_parallel": 2}},
    )
    assert settings.is_megatron and settings.megatron == MegatronSettings(tensor_parallel=2)
    assert settings.parallel.strategy == "none"


def test_the_run_spec_carries_the_backend_to_configure_run_and_back():
    body = {"name": "r", "model": "/m", "task": "addition", "steps": 2}
    spec = parse_run_spec(
        {
            **body,
            "trainer": {
                "backend": "megatron",
                "parallel": {"world_size": 2},
                "megatron": {"tensor_parallel": 2},
            },
        }
    )
    config = trainer_config("run-1", spec)
    sent = config_to_proto(config)
    megatron = sent.megatron
    assert (sent.backend, megatron.tensor_parallel, megatron.pipeline_parallel) == ("megatron", 2, 1)
    back = config_from_proto(sent)
    assert (back.backend, back.megatron) == ("megatron", spec.trainer.megatron)
    assert back.parallel == spec.trainer.parallel
    assert back.gathers_state
    # an older client sends neither field: the torch backend
    sent.ClearField("backend")
    sent.ClearField("megatron")
    sent.parallel.world_size = 1
    old = config_from_proto(sent)
    assert (old.backend, old.megatron) == ("torch", MegatronSettings())
    assert not old.gathers_state
    # checked together on the trainer's side too, named under `trainer`
    sent.backend = "megatron"
    sent.megatron.tensor_parallel, sent.megatron.pipeline_parallel = 2, 1
    with pytest.raises(SettingError, match=r"^trainer\.megatron\.tensor_parallel: tensor_parallel 2"):
        config_from_proto(sent)
    # two pipeline stages of two tensor-parallel ranks each over four ranks
    sent.megatron.tensor_parallel, sent.megatron.pipeline_parallel = 2, 2
    sent.parallel.world_size = 4
    staged = config_from_proto(sent)
    assert staged.megatron == MegatronSettings(tensor_parallel=2, pipeline_parallel=2)
    assert staged.gathers_state
    # context parallelism travels too; an older client leaves it 0, which is one rank
    sent.megatron.context_parallel, sent.megatron.pipeline_parallel = 2, 1
    assert config_from_proto(sent).megatron == MegatronSettings(tensor_parallel=2, context_parallel=2)
    sent.megatron.context_parallel, sent.parallel.world_size = 0, 2
    assert config_from_proto(sent).megatron == MegatronSettings(tensor_parallel=2)


def _tiny(cls, **overrides):
    fields = dict(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return cls(**{**fields, **overrides})


@pytest.mark.parametrize("cls", [LlamaConfig, Qwen2Config, Qwen3Config])
def test_llama_qwen2_and_qwen3_configs_are_built(cls):
    family = check_megatron_config(_tiny(cls), tensor_parallel=2)
    assert family.qkv_bias == (cls is Qwen2Config) and family.qk_norm == (cls is Qwen3Config)


def test_layers_the_pipeline_stages_cannot_share_equally_are_refused_by_name():
    check_megatron_config(_tiny(LlamaConfig, num_hidden_layers=4), pipeline_parallel=2)
    with pytest.raises(ValueError, match="trainer.megatron.pipeline_parallel 2") as info:
        check_megatron_config(_tiny(LlamaConfig, num_hidden_layers=3), pipeline_parallel=2)
    assert "num_hidden_layers=3, which 2 stages cannot split evenly" in str(info.value)


@pytest.mark.parametrize(
    ("config", "tensor_parallel", "message"),
    [
        (_tiny(MistralConfig), 1, "model_type 'mistral' is not one the megatron backend builds"),
        (
            _tiny(LlamaConfig, attention_bias=True),
            1,
            "model_type 'llama' has attention_bias=True (the megatron backend needs False)",
        ),
        (_tiny(LlamaConfig, hidden_act="gelu"), 1, "model_type 'llama' has hidden_act='gelu'"),
        (
            _tiny(Qwen2Config, use_sliding_window=True, sliding_window=8),
            1,
            "model_type 'qwen2' has use_sliding_window=True",
        ),
        (
            _tiny(LlamaConfig, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            1,
            "model_type 'llama' declares 'linear' RoPE",
        ),
        (
            _tiny(LlamaConfig, vocab_size=5, num_key_value_heads=4),
            4,
            "tensor_parallel 4: model_type 'llama' has vocab_size=5, too few",
        ),
        (_tiny(LlamaConfig, intermediate_size=47), 2, "has intermediate_size=47, which 2 ranks cannot split"),
        (
            _tiny(Qwen3Config, num_key_value_heads=1, num_attention_heads=4),
            2,
            "has num_key_value_heads=1",
        ),
    ],
)
def test_configs_megatron_cannot_express_are_refused_by_name(config, tensor_parallel, message):
    with pytest.raises(ValueError, match="trainer.(backend megatron|megatron.tensor_parallel)") as info:
        check_megatron_config(config, tensor_parallel)
    assert message in str(info.value), str(info.value)


def _megatron_run(**fields):
    from furlong.trainer.api import TrainerRunConfig

    fields = {"algorithm": AlgorithmSettings(), **fields}
    return TrainerRunConfig(
        run_id="r",
        model_dir="/m",
        sampling_temperature=1.0,
        seed=0,
        total_steps=1,
        backend="megatron",
        **fields,
    )


@pytest.mark.parametrize(
    ("fields", "device", "message"),
    [
        ({"algorithm": AlgorithmSettings(name="ppo")}, "cpu", "algorithm ppo needs a value model"),
        (
            {"precision": PrecisionSettings(gradient_checkpointing=True)},
            "cpu",
            "precision.gradient_checkpointing",
        ),
        (
            {"precision": PrecisionSettings(dtype="bfloat16")},
            "cpu",
            "precision.dtype bfloat16 on a CPU trainer",
        ),
    ],
)
def test_runs_the_megatron_backend_cannot_train_are_refused_by_setting(fields, device, message):
    from furlong.trainer.run_learner import check_megatron_run

    with pytest.raises(ValueError, match="trainer.backend megatron") as info:
        check_megatron_run(_megatron_run(**fields), _tiny(LlamaConfig), torch.device(device))
    assert message in str(info.value), str(info.value)


def test_a_bfloat16_megatron_run_is_taken_on_a_cuda_trainer():
    from furlong.trainer.run_learner import check_megatron_run

    check_megatron_run(
        _megatron_run(precision=PrecisionSettings(dtype="bfloat16")), _tiny(LlamaConfig), torch.device("cuda")
    )
