"""The trainer's Prometheus metrics live on the registry passed in: no module-global collectors,
two services with two registries never collide, and a training step shows up in its own only."""

from __future__ import annotations

import prometheus_client
import pytest
import redis
from prometheus_client import CollectorRegistry
from tiny_policy import addition_prompts, rollout_run, train, trainer_run
from tiny_policy import write_tiny_checkpoint as write_checkpoint

from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.service import RolloutService
from furlong.rollout.core.types import GenerateRequest
from furlong.rollout.receivers import broker_receiver_factory
from furlong.rollout.run_records import redis_records
from furlong.trainer import metrics as trainer_metrics
from furlong.trainer.metrics import STEPS_TOTAL, TrainerMetrics
from furlong.trainer.service import TrainerService
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore


def steps(registry: CollectorRegistry, run_id: str) -> float | None:
    return registry.get_sample_value(STEPS_TOTAL, {"run_id": run_id})


@pytest.mark.unit
def test_no_trainer_metric_is_registered_globally():
    assert not [n for n in prometheus_client.REGISTRY._names_to_collectors if n.startswith("furlong_trainer")]
    assert not [
        name
        for name, value in vars(trainer_metrics).items()
        if isinstance(value, prometheus_client.metrics.MetricWrapperBase)
    ]


@pytest.mark.unit
def test_metrics_register_on_the_registry_given():
    registry = CollectorRegistry()
    metrics = TrainerMetrics(registry)
    metrics.published(0.25)
    assert registry.get_sample_value("furlong_trainer_publish_seconds_count") == 1
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        TrainerMetrics(registry)  # really on that registry: a second set collides there
    other = CollectorRegistry()
    TrainerMetrics(other)  # ... and nowhere else
    assert other.get_sample_value("furlong_trainer_publish_seconds_count") == 0


@pytest.mark.integration
@pytest.mark.slow
def test_two_trainer_services_with_two_registries_do_not_collide(tmp_path, redis_url):
    model_dir = write_checkpoint(tmp_path / "ckpt")
    broker = InProcessBrokerClient(BrokerCore())
    client = redis.Redis.from_url(redis_url)
    first_registry, second_registry = CollectorRegistry(), CollectorRegistry()
    first = TrainerService(client, broker, "trainer-0", metrics=TrainerMetrics(first_registry))
    second = TrainerService(client, broker, "trainer-1", metrics=TrainerMetrics(second_registry))
    rollout = RolloutService(redis_records(client), broker_receiver_factory(broker))
    try:
        assert first.metrics.registry is first_registry and second.metrics.registry is second_registry
        rollout.configure_run(rollout_run("run-m", model_dir))
        first.configure_run(trainer_run("run-m", model_dir, 1, learning_rate=1e-2))
        rollout.generate(
            GenerateRequest(
                run_id="run-m",
                step=1,
                samples_per_prompt=4,
                sampling=SamplingConfig(max_new_tokens=4),
                timeout_s=30,
                prompts=addition_prompts(1, 2),
            )
        )
        result = first.train_step(train("run-m", 1, 2))
        assert steps(first_registry, "run-m") == 1
        assert steps(second_registry, "run-m") is None
        labels = {"run_id": "run-m"}
        assert first_registry.get_sample_value("furlong_trainer_samples_consumed_total", labels) == 8
        assert first_registry.get_sample_value("furlong_trainer_loss", labels) == pytest.approx(result.loss)
        assert first_registry.get_sample_value("furlong_trainer_sample_staleness_versions_count") == 8
        assert second_registry.get_sample_value("furlong_trainer_sample_staleness_versions_count") == 0
    finally:
        first.close()
        second.close()
        rollout.close()
        broker.close()
        client.close()
