"""The RL loop in one process: rollout service -> Redis stream -> trainer service -> NIXL publish ->
engines switch versions, through the in-process broker twin. Real Redis, real NIXL."""

import dataclasses
import json

import pytest
import redis
import torch
from tiny_policy import addition_prompts, rollout_run, train, trainer_run
from tiny_policy import write_tiny_checkpoint as write_checkpoint

from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.models import ContractError
from furlong.core.settings import PrecisionSettings
from furlong.core.tasks import AdditionTask
from furlong.core.tokenizer import char_tokenizer
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest
from furlong.rollout.receivers import broker_receiver_factory
from furlong.rollout.run_records import redis_records
from furlong.trainer.__main__ import parse_args
from furlong.trainer.service import TrainerService
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _generate(run_id: str, step: int, count: int) -> GenerateRequest:
    return GenerateRequest(
        run_id=run_id,
        step=step,
        samples_per_prompt=4,
        sampling=SamplingConfig(max_new_tokens=4),
        timeout_s=30,
        prompts=addition_prompts(step, count),
    )


@pytest.fixture
def loop(tmp_path, redis_url):
    model_dir = write_checkpoint(tmp_path / "ckpt")
    broker = InProcessBrokerClient(BrokerCore())
    client = redis.Redis.from_url(redis_url)
    rollout = RolloutService(redis_records(client), broker_receiver_factory(broker))
    trainer = TrainerService(client, broker, consumer_name="trainer-0")
    yield model_dir, broker, rollout, trainer
    trainer.close()
    rollout.close()
    broker.close()


def test_two_steps_publish_and_engines_switch(loop, redis_url):
    redis_client = redis.Redis.from_url(redis_url)
    model_dir, broker, rollout, trainer = loop
    info = rollout.configure_run(rollout_run("run-a", model_dir, num_engines=2))
    assert len(info.engine_ids) == 2
    run = trainer.configure_run(trainer_run("run-a", model_dir, 2, learning_rate=1e-2))
    assert run.policy_version == 0 and run.num_parameters > 0
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6, seed=1)
    for step in (1, 2):
        generated = rollout.generate(
            GenerateRequest(
                run_id="run-a",
                step=step,
                samples_per_prompt=4,
                sampling=sampling,
                min_policy_version=step - 1,
                timeout_s=30,
                prompts=addition_prompts(step, 4),
            )
        )
        assert generated.num_groups == 4 and generated.policy_version == step - 1
        result = trainer.train_step(train("run-a", step, 4))
        new_version = result.policy_version
        assert new_version == step
        assert result.num_samples == 16 and result.num_groups == 4
        published = trainer.publish_weights("run-a", new_version)
        assert published.num_bytes > 0
        status = broker.wait_committed("run-a", new_version, timeout_s=30)
        assert status.committed_version == new_version
    engines = rollout.status("run-a").engines
    assert [e.policy_version for e in engines] == [2, 2]
    # Every stream entry was acknowledged after its step.
    assert redis_client.xpending("furlong:run:run-a:samples", "trainers")["pending"] == 0


def test_engine_weights_equal_trainer_weights_after_publish(loop):
    model_dir, broker, rollout, trainer = loop
    rollout.configure_run(rollout_run("run-b", model_dir))
    trainer.configure_run(trainer_run("run-b", model_dir, 1, learning_rate=1e-2))
    rollout.generate(_generate("run-b", 1, 2))
    version = trainer.train_step(train("run-b", 1, 2)).policy_version
    trainer.publish_weights("run-b", version)
    broker.wait_committed("run-b", version, 30)
    trained = trainer._run("run-b").learner.state_dict()
    engine_model = rollout._get("run-b").engines.engine("run-b-engine-0").model
    served = engine_model.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(served[name], tensor), name


def test_a_bfloat16_run_trains_float32_weights_and_engines_serve_them_rounded(tmp_path, redis_url):
    """precision bfloat16 with activation checkpointing: the trainer keeps float32 weights (the
    weight-equality check passes on them), the engines serve exactly those rounded to bfloat16."""
    model_dir = write_checkpoint(tmp_path / "ckpt")
    broker = InProcessBrokerClient(BrokerCore())
    client = redis.Redis.from_url(redis_url)
    rollout = RolloutService(redis_records(client), broker_receiver_factory(broker))
    trainer = TrainerService(client, broker, consumer_name="trainer-0", check_weight_update_equal=True)
    precision = PrecisionSettings(dtype="bfloat16", gradient_checkpointing=True)
    try:
        rollout.configure_run(dataclasses.replace(rollout_run("run-h", model_dir), precision=precision))
        # the entropy bonus trains every sample, whatever the (untrained) policy's rewards
        run = trainer_run("run-h", model_dir, 1, learning_rate=1e-2, entropy_coef=0.01)
        config = dataclasses.replace(run, precision=precision)
        trainer.configure_run(config)
        rollout.generate(_generate("run-h", 1, 2))
        result = trainer.train_step(train("run-h", 1, 2))
        assert 0.0 < result.metrics["logprob_abs_diff"] < 0.5
        trainer.publish_weights("run-h", result.policy_version)
        broker.wait_committed("run-h", result.policy_version, 30)
        trained = trainer._run("run-h").learner.state_dict()
        served = rollout._get("run-h").engines.engine("run-h-engine-0").model.state_dict()
        for name, tensor in trained.items():
            assert tensor.dtype == torch.float32 and served[name].dtype == torch.bfloat16, name
            assert torch.equal(served[name], tensor.to(torch.bfloat16)), name
    finally:
        trainer.close()
        rollout.close()
        broker.close()
        client.close()


@pytest.mark.parametrize("device", ["gpu", "cuda:one", "CPU"])
def test_a_bad_device_flag_exits_2_naming_it(device, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--redis-url", "redis://127.0.0.1:1/0", "--broker", "127.0.0.1:2", "--device", device])
    assert exc.value.code == 2 and "--device" in capsys.readouterr().err


def test_memory_flags_reach_the_config_and_bad_ones_exit_2(capsys):
    base = ["--redis-url", "redis://127.0.0.1:1/0", "--broker", "127.0.0.1:2"]
    config = parse_args([*base, "--lm-head-chunk-tokens", "256", "--micro-batch-tokens", "4096"])
    assert (config.lm_head_chunk_tokens, config.micro_batch_tokens) == (256, 4096)
    assert (parse_args(base).lm_head_chunk_tokens, parse_args(base).micro_batch_tokens) == (1024, 0)
    with pytest.raises(SystemExit) as exc:
        parse_args([*base, "--micro-batch-tokens", "-1"])
    assert exc.value.code == 2 and "micro_batch_tokens must be >= 0, got -1" in capsys.readouterr().err


def test_the_weight_bucket_device_flag_reaches_the_config_and_a_bad_one_exits_2(capsys):
    base = ["--redis-url", "redis://127.0.0.1:1/0", "--broker", "127.0.0.1:2"]
    assert parse_args(base).weight_bucket_device == "cpu"
    assert parse_args([*base, "--weight-bucket-device", "cpu"]).weight_bucket_device == "cpu"
    for bad in ("gpu", "cuda:x"):
        with pytest.raises(SystemExit) as exc:
            parse_args([*base, "--weight-bucket-device", bad])
        assert exc.value.code == 2 and f"--weight-bucket-device {bad!r}" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            parse_args([*base, "--weight-bucket-device", "cuda"])
        assert exc.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--redis-url", "redis://127.0.0.1:1/0", "--broker", "127.0.0.1:2", "--device", "cuda:0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--device 'cuda:0'" in err and "CUDA is not available" in err


def test_out_of_order_step_and_stale_version_are_conflicts(loop):
    model_dir, broker, rollout, trainer = loop
    trainer.configure_run(trainer_run("run-c", model_dir, 3, learning_rate=1e-3))
    with pytest.raises(ConflictError, match="step 2 requested, expected 1"):
        trainer.train_step(train("run-c", 2, 1, 1.0))
    with pytest.raises(ConflictError, match="version 0 is not newer"):
        trainer.publish_weights("run-c", 0)
    with pytest.raises(ConflictError, match="already configured"):
        trainer.configure_run(trainer_run("run-c", model_dir, 3, learning_rate=1e-3))
    with pytest.raises(NotFoundError, match="run-x"):
        trainer.train_step(train("run-x", 1, 1, 1.0))
    with pytest.raises(ValueError, match="model_dir"):
        trainer.configure_run(trainer_run("run-d", model_dir / "missing", 3, learning_rate=1e-3))
    with pytest.raises(ValueError, match="total_steps"):
        trainer.configure_run(trainer_run("run-d", model_dir, 10**9, learning_rate=1e-3))
    with pytest.raises(ValueError, match="num_groups"):
        trainer.train_step(train("run-c", 1, 0, 1.0))


def test_a_checkpoint_contradicting_its_family_contract_is_not_trained(loop, tmp_path):
    """The trainer checks the loaded config against its family before building the learner: a
    llama config stating multi-latent attention fields, or a RoPE parameter no code implements."""
    model_dir, broker, rollout, trainer = loop
    config_path = model_dir / "config.json"
    original = json.loads(config_path.read_text())
    for change, field in [
        ({"kv_lora_rank": 16}, "kv_lora_rank"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
            "rope_parameters.rope_type 'linear' is not implemented",
        ),
    ]:
        config_path.write_text(json.dumps({**original, **change}))
        with pytest.raises(ContractError, match=field):
            trainer.configure_run(trainer_run("run-f", model_dir, 1, learning_rate=1e-3))


def test_group_the_learner_cannot_train_on_is_rejected_not_blocking(loop, redis_url):
    from furlong.core.samples import STREAM_FIELD, Sample, SampleGroup, stream_key
    from furlong.core.sampling_mask import RolloutSamplingMask

    model_dir, broker, rollout, trainer = loop
    rollout.configure_run(rollout_run("run-e", model_dir))
    trainer.configure_run(trainer_run("run-e", model_dir, 1, learning_rate=1e-3))
    vocab = char_tokenizer(AdditionTask.ALPHABET).vocab_size
    bad = Sample(
        sample_id="bad/0",
        prompt_token_ids=[1, vocab + 5],
        response_token_ids=[3],
        response_logprobs=[-0.1],
        sampling_support=RolloutSamplingMask.from_lists([[3]], 64),
        reward=1.0,
        policy_version=0,
        finish_reason="eos",
    )
    client = redis.Redis.from_url(redis_url)
    client.xadd(stream_key("run-e"), {STREAM_FIELD: SampleGroup("run-e", 1, "bad", [bad]).encode()})
    rollout.generate(_generate("run-e", 1, 2))
    result = trainer.train_step(train("run-e", 1, 2))
    assert result.num_groups == 2 and result.num_samples == 8
    rejected = client.xrange("furlong:run:run-e:rejected")
    assert len(rejected) == 1 and b"bad/0" in rejected[0][1][b"reason"]
    assert client.xpending(stream_key("run-e"), "trainers")["pending"] == 0


def test_checkpointed_run_resumes_after_a_trainer_restart(tmp_path, redis_url):
    model_dir = write_checkpoint(tmp_path / "ckpt")
    broker = InProcessBrokerClient(BrokerCore())
    client = redis.Redis.from_url(redis_url)
    rollout = RolloutService(redis_records(client), broker_receiver_factory(broker))
    root = tmp_path / "train-ckpt"
    try:
        rollout.configure_run(rollout_run("run-r", model_dir))
        rollout.generate(_generate("run-r", 1, 2))
        first = TrainerService(client, broker, consumer_name="trainer-0", checkpoint_root=root)
        first.configure_run(trainer_run("run-r", model_dir, 3, learning_rate=1e-2))
        version = first.train_step(train("run-r", 1, 2)).policy_version
        trained = {k: v.clone() for k, v in first._run("run-r").learner.state_dict().items()}
        first.close()
        assert (root / "run-r" / "step-1" / "manifest.json").is_file()
        second = TrainerService(client, broker, consumer_name="trainer-0", checkpoint_root=root)
        resumed_version = second.configure_run(
            trainer_run("run-r", model_dir, 3, learning_rate=1e-2)
        ).policy_version
        assert resumed_version == version == 1
        for name, tensor in second._run("run-r").learner.state_dict().items():
            assert torch.equal(tensor, trained[name]), name
        with pytest.raises(ConflictError, match="step 1 requested, expected 2"):
            second.train_step(train("run-r", 1, 2, 1.0))
        second.close()
    finally:
        rollout.close()
        broker.close()


def test_only_the_newest_checkpoints_are_kept_leftovers_go_at_start_and_delete_removes_them(
    tmp_path, redis_url
):
    model_dir = write_checkpoint(tmp_path / "ckpt")
    broker = InProcessBrokerClient(BrokerCore())
    client = redis.Redis.from_url(redis_url)
    rollout = RolloutService(redis_records(client), broker_receiver_factory(broker))
    root = tmp_path / "train-ckpt"
    try:
        rollout.configure_run(rollout_run("run-k", model_dir))
        first = TrainerService(client, broker, consumer_name="trainer-0", checkpoint_root=root)
        first.configure_run(trainer_run("run-k", model_dir, 3, keep_last=2, learning_rate=1e-2))
        for step in (1, 2, 3):
            rollout.generate(_generate("run-k", step, 2))
            first.train_step(train("run-k", step, 2))
        assert sorted(p.name for p in (root / "run-k").iterdir()) == ["step-2", "step-3"]
        with pytest.raises(ConflictError, match="configured on this trainer"):
            first.delete_checkpoints("run-k")
        first.close()
        (root / "run-k" / "step-4.tmp").mkdir()  # a trainer killed while writing step 4
        (root / "other.tmp").mkdir()
        second = TrainerService(client, broker, consumer_name="trainer-0", checkpoint_root=root)
        assert not (root / "run-k" / "step-4.tmp").exists() and not (root / "other.tmp").exists()
        resumed = second.configure_run(trainer_run("run-k", model_dir, 3, keep_last=2, learning_rate=1e-2))
        assert resumed.policy_version == 3
        second.end_run("run-k")
        assert second.delete_checkpoints("run-k") == 2
        assert not (root / "run-k").exists()
        assert second.delete_checkpoints("run-k") == 0
        second.close()
    finally:
        rollout.close()
        broker.close()
