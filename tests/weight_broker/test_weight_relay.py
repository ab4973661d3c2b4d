"""Relay mode in one process: the trainer publishes to <run>~upstream, the relay takes each version
as an engine and serves it on <run> from its own bucket, so the trainer is free once the relay has
it and an engine that joins later catches up from the relay alone."""

from __future__ import annotations

import pytest
import torch
from llama_state import assert_bytes_equal, llama
from polling import wait_until

from furlong.core.weight_shards import expected_shards, llama_tensor_parallel
from furlong.core.weights import WeightLayout, plan_buckets
from furlong.transfer.config import TransferConfig
from furlong.transfer.publisher import WeightPublisher
from furlong.transfer.receiver import WeightReceiver
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore
from furlong.weight_broker.relay import WeightRelay, upstream_run_id

pytestmark = pytest.mark.integration

RUN = "run-relay"


def policy(seed: int, small: bool = False) -> dict[str, torch.Tensor]:
    """small: tensors of at most half the 1024-byte bucket, so a double-buffered plan splits it."""
    gen = torch.Generator().manual_seed(seed)
    if small:
        return {f"t{i}": torch.randn(16 + 2 * i, 4, generator=gen) for i in range(6)}
    return {
        "a": torch.randn(64, 8, generator=gen),
        "b": torch.randn(48, 8, generator=gen).half(),
        "c": torch.randn(100, generator=gen).to(torch.bfloat16),
    }


class Engine:
    def __init__(self) -> None:
        self.applied: dict[int, dict[str, torch.Tensor]] = {}

    def apply(self, version, tensors) -> None:
        self.applied[version] = {k: v.clone() for k, v in tensors.items()}


@pytest.mark.parametrize("double_buffer", [False, True])
def test_the_relay_frees_the_trainer_and_serves_late_engines(double_buffer):
    client = InProcessBrokerClient(BrokerCore())
    relay = WeightRelay(client, RUN, "relay-test")
    relay.start()
    early = Engine()
    first = WeightReceiver(client, RUN, "early", early.apply)
    first.start()
    layout = WeightLayout.from_state_dict(policy(0, double_buffer))
    assert plan_buckets(layout, 1024, double_buffer).double_buffered == double_buffer
    trainer = WeightPublisher(
        client,
        upstream_run_id(RUN),
        layout,
        "trainer-relayed",
        config=TransferConfig(bucket_size_bytes=1024, double_buffer=double_buffer),
    )
    late_receiver = None
    try:
        for version in (1, 2):
            trainer.publish(version, policy(version, double_buffer))
            assert client.wait_committed(upstream_run_id(RUN), version, 20.0).engine_ids == ("relay",)
            assert client.wait_committed(RUN, version, 20.0).committed_version == version
            for name, tensor in policy(version, double_buffer).items():
                assert torch.equal(early.applied[version][name], tensor), (version, name)
        trainer.close()  # the trainer is gone; the relay still serves version 2
        late = Engine()
        late_receiver = WeightReceiver(client, RUN, "late", late.apply)
        late_receiver.start()
        wait_until(lambda: 2 in late.applied)
        for name, tensor in policy(2, double_buffer).items():
            assert torch.equal(late.applied[2][name], tensor), name
        assert relay.served_version == 2
    finally:
        if late_receiver is not None:
            late_receiver.close()
        first.close()
        trainer.close()
        relay.close()
        client.close()


def test_engines_with_their_own_shard_layout_take_relayed_versions():
    """The trainer hashes digests for the layouts of the relayed run's engines (the broker lists
    them as destinations of the upstream run); the relay passes them on with the manifest, and
    each engine pulls exactly its pieces out of the relay's bucket, straight into its parameters,
    also after the trainer is gone."""
    client = InProcessBrokerClient(BrokerCore())
    relay = WeightRelay(client, RUN, "relay-shards")
    layout = WeightLayout.from_state_dict(llama(0))
    tp1 = llama_tensor_parallel(layout, 1, 2, fuse=True)
    engines, opened = {}, []

    def engine(engine_id: str) -> dict[str, torch.Tensor]:
        params = {n: torch.zeros_like(t) for n, t in expected_shards(tp1, llama(0)).items()}
        receiver = WeightReceiver(client, RUN, engine_id, lambda v, t: None, shard_layout=tp1, params=params)
        opened.append(receiver)
        receiver.start()
        return params

    trainer = WeightPublisher(
        client, upstream_run_id(RUN), layout, "trainer-shards", config=TransferConfig(bucket_size_bytes=2048)
    )
    try:
        relay.start()
        engines["tp1"] = engine("engine-tp1")
        assert [x.layout_id for x in client.destinations(upstream_run_id(RUN))] == [tp1.layout_id]
        for version in (1, 2):
            trainer.publish(version, llama(version))
            status = client.wait_committed(RUN, version, 20.0)
            assert status.committed_version == version and status.engine_ids == ("engine-tp1",)
            assert_bytes_equal(engines["tp1"], expected_shards(tp1, llama(version)))
        trainer.close()  # a late engine of the same layout catches up from the relay alone
        late = engine("engine-tp1-late")
        wait_until(
            lambda: torch.equal(
                late["model.norm.weight"], expected_shards(tp1, llama(2))["model.norm.weight"]
            )
        )
        assert_bytes_equal(late, expected_shards(tp1, llama(2)))
    finally:
        for receiver in opened:
            receiver.close()
        trainer.close()
        relay.close()
        client.close()


@pytest.mark.unit
def test_upstream_run_ids():
    assert upstream_run_id("r1") == "r1~upstream"
    with pytest.raises(ValueError, match="cannot be relayed"):
        upstream_run_id("r1~upstream")
