"""Publishing a sharded policy round by round (`core.round_gather`): over two fsdp2 gloo ranks the
engine receives exactly the bytes a publish of the whole gathered state gives it, while rank 0 holds
at most about one staging round of gathered tensors (measured against the whole gather, with a
model of a dozen rounds); a publish that stops early still leaves the ranks in step. Without ranks:
the order is enforced, a source shared by names of two rounds is gathered once and kept only
while the next round needs it, and the bytes alive are counted per storage."""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny_policy import learner_config
from transformers import LlamaConfig, LlamaForCausalLM

from furlong.core.weights import WeightLayout
from furlong.rpc.ports import free_port
from furlong.trainer.core.learner import Learner
from furlong.trainer.core.round_gather import RoundGather, held_bytes
from furlong.transfer.config import TransferConfig
from furlong.transfer.publisher import WeightPublisher
from furlong.transfer.receiver import WeightReceiver
from furlong.weight_broker.client import InProcessBrokerClient
from furlong.weight_broker.core import BrokerCore

BUCKET_BYTES = 16 << 10  # the model below is ~180 KiB: a dozen rounds or so
RUN = "run-gather"


def _model() -> LlamaForCausalLM:
    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


class _Engine:
    def __init__(self) -> None:
        self.applied: dict[int, dict[str, torch.Tensor]] = {}

    def apply(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.applied[version] = {name: t.clone() for name, t in tensors.items()}


def _bytes(state: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    return {
        name: t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for name, t in state.items()
    }


def _leader(learner: Learner, results: dict) -> None:
    full = learner.state_dict()  # the whole gather (a collective both ranks join)
    results["meta_layout_matches"] = WeightLayout.from_state_dict(learner.state_meta()) == (
        WeightLayout.from_state_dict(full)
    )
    core = BrokerCore(max_ack_attempts=3)
    broker = InProcessBrokerClient(core)
    engine = _Engine()
    receiver = WeightReceiver(broker, RUN, "e1", engine.apply, agent_name="engine-gather")
    receiver.start()
    config = TransferConfig(bucket_size_bytes=BUCKET_BYTES)
    publisher = WeightPublisher(
        broker, RUN, WeightLayout.from_state_dict(full), "trainer-gather", config=config
    )
    try:
        whole = publisher.publish(1, full)
        broker.wait_committed(RUN, 1, 30.0)
        order = publisher.publish_order
        dist.broadcast_object_list([order], src=0)  # what GatherCommand carries to the other ranks
        with learner.gathered_rounds(order) as rounds:
            lazy = publisher.publish(2, rounds)
        broker.wait_committed(RUN, 2, 30.0)
        results["num_rounds"] = (whole.num_rounds, lazy.num_rounds)
        results["full"] = _bytes(full)
        results["v1"], results["v2"] = _bytes(engine.applied[1]), _bytes(engine.applied[2])
        results["full_gather_bytes"] = held_bytes(full.values())
        results["round_gather_peak_bytes"] = rounds.peak_bytes
        results["largest_round_bytes"] = max(
            sum(publisher.layout.slot(n).size_bytes for n in names) for names in order
        )
        results["num_gathers"], results["num_tensors"] = rounds.num_gathers, len(full)
        del full
        # A publish that stops after one round: leaving the block gathers the rest, in order.
        early = learner.gathered_rounds(order)
        with pytest.raises(RuntimeError, match="read out of order"), early:
            with early.round(order[0]):
                pass
            with early.round(order[2]):  # skips round 1
                pass
        results["early_done"] = early.done
    finally:
        publisher.close()
        receiver.close()
        broker.close()


def _worker(rank: int, world: int, port: int, results: dict) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        group = dist.group.WORLD
        learner = Learner(_model(), learner_config(), data_parallel_group=group, data_parallel="fsdp2")
        assert learner.sharded
        out: dict = {}
        if rank == 0:
            _leader(learner, out)
        else:
            learner.state_dict()
            received: list = [None]
            dist.broadcast_object_list(received, src=0)
            learner.gathered_rounds(received[0]).drain()  # the publish
            learner.gathered_rounds(received[0]).drain()  # the publish that stopped early
        # Still in step: the same whole state on both ranks after it all.
        after = learner.state_dict()
        out["after"] = _bytes(after) if rank == 0 else None
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def published():
    results = mp.Manager().dict()
    # spawn, not fork: forking after this process ran torch's thread pool can hang the children.
    mp.start_processes(_worker, args=(2, free_port(), results), nprocs=2, join=True, start_method="spawn")
    return dict(results[0])


@pytest.mark.integration
def test_two_fsdp2_ranks_publish_round_by_round_the_bytes_of_the_whole_gather(published):
    assert published["meta_layout_matches"]
    whole_rounds, lazy_rounds = published["num_rounds"]
    assert whole_rounds == lazy_rounds >= 8
    assert published["v2"] == published["v1"] == published["full"]
    assert published["after"] == published["full"]


@pytest.mark.integration
def test_rank_0_holds_about_one_round_of_gathered_tensors_not_the_model(published):
    full, peak = published["full_gather_bytes"], published["round_gather_peak_bytes"]
    rounds = published["num_rounds"][0]
    print(f"{rounds} rounds: full gather {full} bytes, round by round at most {peak} ({peak / full:.3f})")
    assert peak <= published["largest_round_bytes"]
    assert peak * 4 < full
    # every tensor gathered twice: once to hash its round, once to stage it
    assert published["num_gathers"] == 2 * published["num_tensors"]


@pytest.mark.integration
def test_a_publish_that_stops_early_gathers_the_rest_so_the_ranks_stay_in_step(published):
    assert published["early_done"]
    assert published["after"] == published["full"]


# -- without ranks --------------------------------------------------------------------------------


class _Fused:
    """Names a.0, a.1 come from source "a" (a fused tensor), the others from themselves."""

    def __init__(self) -> None:
        self.gathered: list[str] = []
        self.whole = {"a": torch.arange(8.0), "b": torch.ones(4), "c": torch.zeros(2)}

    def source_of(self, name: str) -> str:
        return name.split(".")[0]

    def gather(self, source: str) -> torch.Tensor:
        self.gathered.append(source)
        return self.whole[source].clone()

    def derive(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        if name.startswith("a."):
            return whole.chunk(2)[int(name[-1])]
        return whole


@pytest.mark.unit
def test_a_source_shared_by_two_rounds_is_gathered_once_and_kept_only_while_needed():
    gatherer = _Fused()
    order = (("b", "a.0"), ("a.1",), ("c",), ("b", "a.0"), ("a.1", "c"))
    source = RoundGather(gatherer, order)
    seen = []
    for names in order:
        with source.round(names) as tensors:
            seen.append({n: tensors[n].tolist() for n in names})
        kept = tensors
    assert kept == {}  # the mapping handed out holds nothing after its round
    assert seen[0] == {"b": [1.0] * 4, "a.0": [0.0, 1.0, 2.0, 3.0]}
    assert seen[1] == {"a.1": [4.0, 5.0, 6.0, 7.0]}
    # "a" kept from round 0 into round 1, dropped before round 2, gathered again in round 3
    assert gatherer.gathered == ["b", "a", "c", "b", "a", "c"]
    assert source.num_gathers == 6 and source.done
    assert source.peak_bytes == (4 + 8) * 4  # b and a (the halves are views of a)


@pytest.mark.unit
def test_rounds_out_of_order_are_refused_and_close_gathers_what_is_left():
    gatherer = _Fused()
    order = (("b",), ("a.0", "a.1"), ("c",))
    source = RoundGather(gatherer, order)
    with pytest.raises(RuntimeError, match=r"round 0 of the publish order is \['b'\]"):
        with source.round(("c",)):
            pass
    with source:
        with source.round(("b",)):
            pass
    assert gatherer.gathered == ["b", "a", "c"] and source.done
    with pytest.raises(RuntimeError, match="publish order is None"):
        with source.round(("b",)):
            pass


@pytest.mark.unit
def test_held_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    assert held_bytes([a, a[:5], a.view(2, 5)]) == 40
    assert held_bytes([a, torch.zeros(3, dtype=torch.float16)]) == 46
    assert held_bytes([]) == 0
