"""A publisher reading a version round by round (`RoundTensors`): engines of the whole layout and of
a tensor-parallel shard layout get the same bytes as from the whole state dict, the source is read
in `publish_order` with only the round's tensors on hand, and a tensor that does not match the
layout is refused before anything is announced."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import pytest
import torch
from llama_state import assert_bytes_equal, llama

from furlong.core.weight_shards import expected_shards, llama_tensor_parallel
from furlong.core.weight_versions import WeightSourceInfo
from furlong.core.weights import Manifest, WeightLayout, plan_buckets
from furlong.transfer.config import TransferConfig
from furlong.transfer.publisher import WeightPublisher
from furlong.transfer.receiver import WeightReceiver
from furlong.transfer.round_tensors import publish_order
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

pytestmark = pytest.mark.integration

RUN = "run-rounds"
BUCKET = 1 << 10  # the one-layer llama state is ~5 KiB of bf16: several rounds


class RecordingBroker(InProcessBrokerClient):
    """The in-process broker client, keeping every manifest announced."""

    def __init__(self) -> None:
        super().__init__(BrokerCore())
        self.manifests: dict[int, Manifest] = {}

    def begin_version(self, run_id: str, manifest: Manifest, source: WeightSourceInfo) -> list[str]:
        self.manifests[manifest.version] = manifest
        return super().begin_version(run_id, manifest, source)


class OneRoundAtATime:
    """Hands out copies of one round's tensors only, and records the rounds it was asked for."""

    def __init__(self, state: Mapping[str, torch.Tensor], bad: str | None = None) -> None:
        self._state = state
        self._bad = bad
        self.asked: list[tuple[str, ...]] = []

    @contextlib.contextmanager
    def round(self, names: tuple[str, ...]) -> Iterator[Mapping[str, torch.Tensor]]:
        self.asked.append(names)
        tensors = {n: self._state[n].clone() for n in names}
        if self._bad in tensors:
            tensors[self._bad] = tensors[self._bad].float()
        yield tensors


def test_engines_get_the_bytes_of_the_whole_state_from_a_round_by_round_source():
    layout = WeightLayout.from_state_dict(llama(0))
    tp0 = llama_tensor_parallel(layout, 0, 2)
    params = {n: torch.zeros_like(t) for n, t in expected_shards(tp0, llama(0)).items()}
    whole: dict[int, dict[str, torch.Tensor]] = {}
    config = TransferConfig(bucket_size_bytes=BUCKET, lanes=("shm",))
    client = RecordingBroker()
    sharded = WeightReceiver(
        client, RUN, "engine-tp0", lambda v, t: None, config=config, shard_layout=tp0, params=params
    )
    plain = WeightReceiver(
        client,
        RUN,
        "engine-whole",
        lambda v, t: whole.__setitem__(v, {n: x.clone() for n, x in t.items()}),
        config=config,
    )
    publisher = WeightPublisher(client, RUN, layout, "trainer-rounds", config=config)
    try:
        sharded.start()
        plain.start()
        source = OneRoundAtATime(llama(1))
        result = publisher.publish(1, source)
        client.wait_committed(RUN, 1, 30.0)
        assert result.num_rounds >= 3
        plan = plan_buckets(layout, BUCKET)
        assert source.asked == list(publisher.publish_order) == list(publish_order(plan))
        assert len(source.asked) == 2 * result.num_rounds
        assert_bytes_equal(whole[1], llama(1))
        assert_bytes_equal(params, expected_shards(tp0, llama(1)))
        # the same version from the whole state dict: the same manifest checksum
        publisher.publish(2, llama(1))
        client.wait_committed(RUN, 2, 30.0)
        first, second = client.manifests[1], client.manifests[2]
        assert first.checksum == second.checksum
        assert first.destinations == second.destinations != ()
    finally:
        publisher.close()
        plain.close()
        sharded.close()
        client.close()


@pytest.mark.unit
def test_a_round_whose_tensor_does_not_match_the_layout_is_refused_before_it_is_announced():
    layout = WeightLayout.from_state_dict(llama(0))
    client = InProcessBrokerClient(BrokerCore())
    config = TransferConfig(bucket_size_bytes=BUCKET, lanes=("shm",))
    publisher = WeightPublisher(client, RUN, layout, "trainer-bad-round", config=config)
    try:
        bad = "model.layers.0.mlp.down_proj.weight"
        with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj.weight': dtype float32"):
            publisher.publish(1, OneRoundAtATime(llama(1), bad=bad))
        assert publisher.last_version is None
        publisher.publish(1, llama(1))  # nothing of the refused version was announced
        assert publisher.last_version == 1
    finally:
        publisher.close()
        client.close()
