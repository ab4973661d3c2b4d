"""The RL loop in one process: rollout service -> Redis stream -> trainer service -> NIXL publish ->
engines switch versions, through the in-process broker twin. Real Redis, real NIXL."""

import pytest
import redis
import torch
from tiny_policy import write_tiny_checkpoint as write_checkpoint

from furlong.core.errors import ConflictError, NotFoundError
from furlong.core.tasks import AdditionTask, get_task
from furlong.core.tokenizer import CharTokenizer
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import Prompt
from furlong.rollout.receivers import broker_receiver_factory
from furlong.trainer.core.learner import LearnerConfig
from furlong.trainer.service import TrainerService
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def loop(tmp_path, redis_url):
    model_dir = write_checkpoint(tmp_path / "ckpt")
    broker = InProcessBrokerClient(BrokerCore())
    client = redis.Redis.from_url(redis_url)
    rollout = RolloutService(client, broker_receiver_factory(broker))
    trainer = TrainerService(client, broker, consumer_name="trainer-0")
    yield model_dir, broker, rollout, trainer
    trainer.close()
    rollout.close()
    broker.close()


def test_two_steps_publish_and_engines_switch(loop, redis_url):
    redis_client = redis.Redis.from_url(redis_url)
    model_dir, broker, rollout, trainer = loop
    info = rollout.configure_run("run-a", str(model_dir), "addition_exact_match", num_engines=2, seed=0)
    assert len(info.engine_ids) == 2
    config = LearnerConfig(learning_rate=1e-2, seed=0)
    version, num_params = trainer.configure_run("run-a", str(model_dir), config, total_steps=2)
    assert version == 0 and num_params > 0
    task = get_task("addition")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6, seed=1)
    for step in (1, 2):
        prompts = [Prompt(p.prompt_id, p.text, p.answer) for p in task.prompts(0, step, 4)]
        generated = rollout.generate(
            "run-a", step, prompts, 4, sampling, min_policy_version=step - 1, timeout_s=30
        )
        assert generated.num_groups == 4 and generated.policy_version == step - 1
        stats, new_version = trainer.train_step("run-a", step, num_groups=4, timeout_s=30)
        assert new_version == step
        assert stats.num_samples == 16 and stats.num_groups == 4
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
    rollout.configure_run("run-b", str(model_dir), "addition_exact_match", num_engines=1, seed=0)
    trainer.configure_run("run-b", str(model_dir), LearnerConfig(learning_rate=1e-2), total_steps=1)
    prompts = [Prompt(p.prompt_id, p.text, p.answer) for p in get_task("addition").prompts(0, 1, 2)]
    rollout.generate("run-b", 1, prompts, 4, SamplingConfig(max_new_tokens=4), 0, 30)
    _, version = trainer.train_step("run-b", 1, 2, 30)
    trainer.publish_weights("run-b", version)
    broker.wait_committed("run-b", version, 30)
    trained = trainer._run("run-b").learner.state_dict()
    engine_model = rollout._get("run-b").engines.engine("run-b-engine-0").model
    served = engine_model.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(served[name], tensor), name


def test_out_of_order_step_and_stale_version_are_conflicts(loop):
    model_dir, broker, rollout, trainer = loop
    trainer.configure_run("run-c", str(model_dir), LearnerConfig(learning_rate=1e-3), total_steps=3)
    with pytest.raises(ConflictError, match="step 2 requested, expected 1"):
        trainer.train_step("run-c", 2, 1, 1.0)
    with pytest.raises(ConflictError, match="version 0 is not newer"):
        trainer.publish_weights("run-c", 0)
    with pytest.raises(ConflictError, match="already configured"):
        trainer.configure_run("run-c", str(model_dir), LearnerConfig(learning_rate=1e-3), 3)
    with pytest.raises(NotFoundError, match="run-x"):
        trainer.train_step("run-x", 1, 1, 1.0)
    with pytest.raises(ValueError, match="model_dir"):
        trainer.configure_run("run-d", str(model_dir / "missing"), LearnerConfig(learning_rate=1e-3), 3)


def test_group_the_learner_cannot_train_on_is_rejected_not_blocking(loop, redis_url):
    from furlong.core.samples import STREAM_FIELD, Sample, SampleGroup, stream_key
    from furlong.core.sampling_mask import RolloutSamplingMask

    model_dir, broker, rollout, trainer = loop
    rollout.configure_run("run-e", str(model_dir), "addition_exact_match", num_engines=1, seed=0)
    trainer.configure_run("run-e", str(model_dir), LearnerConfig(learning_rate=1e-3), total_steps=1)
    vocab = CharTokenizer(AdditionTask.ALPHABET).vocab_size
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
    prompts = [Prompt(p.prompt_id, p.text, p.answer) for p in get_task("addition").prompts(0, 1, 2)]
    rollout.generate("run-e", 1, prompts, 4, SamplingConfig(max_new_tokens=4), 0, 30)
    stats, _ = trainer.train_step("run-e", 1, num_groups=2, timeout_s=30)
    assert stats.num_groups == 2 and stats.num_samples == 8
    rejected = client.xrange("furlong:run:run-e:rejected")
    assert len(rejected) == 1 and b"bad/0" in rejected[0][1][b"reason"]
    assert client.xpending(stream_key("run-e"), "trainers")["pending"] == 0


def test_checkpointed_run_resumes_after_a_trainer_restart(tmp_path, redis_url):
    model_dir = write_checkpoint(tmp_path / "ckpt")
    broker = InProcessBrokerClient(BrokerCore())
    client = redis.Redis.from_url(redis_url)
    rollout = RolloutService(client, broker_receiver_factory(broker))
    root = tmp_path / "train-ckpt"
    try:
        rollout.configure_run("run-r", str(model_dir), "addition_exact_match", num_engines=1, seed=0)
        prompts = [Prompt(p.prompt_id, p.text, p.answer) for p in get_task("addition").prompts(0, 1, 2)]
        rollout.generate("run-r", 1, prompts, 4, SamplingConfig(max_new_tokens=4), 0, 30)
        first = TrainerService(client, broker, consumer_name="trainer-0", checkpoint_root=root)
        first.configure_run("run-r", str(model_dir), LearnerConfig(learning_rate=1e-2), total_steps=3)
        _, version = first.train_step("run-r", 1, 2, 30)
        trained = {k: v.clone() for k, v in first._run("run-r").learner.state_dict().items()}
        first.close()
        assert (root / "run-r" / "manifest.json").is_file()
        second = TrainerService(client, broker, consumer_name="trainer-0", checkpoint_root=root)
        resumed_version, _ = second.configure_run(
            "run-r", str(model_dir), LearnerConfig(learning_rate=1e-2), 3
        )
        assert resumed_version == version == 1
        for name, tensor in second._run("run-r").learner.state_dict().items():
            assert torch.equal(tensor, trained[name]), name
        with pytest.raises(ConflictError, match="step 1 requested, expected 2"):
            second.train_step("run-r", 1, 2, 1.0)
        second.close()
    finally:
        rollout.close()
        broker.close()
