"""Bad samples are rejected with an error naming the sample; nothing is trained on them and no
other group is dropped (real Redis, the trainer's stream reader and learner validation)."""

import json

import pytest
import redis
from test_learner import GOOD_A, PROMPT_A, make_sample, tiny_model
from tiny_policy import learner_config

from furlong.core.samples import STREAM_FIELD, SampleGroup, stream_key
from furlong.trainer.core.learner import Learner
from furlong.trainer.sample_reader import SampleReader, rejected_key

pytestmark = pytest.mark.integration


def _good(model, prompt_id):
    return SampleGroup("run", 1, prompt_id, [make_sample(model, f"{prompt_id}/0", PROMPT_A, GOOD_A, 1.0)])


def _mutated(model, prompt_id, change):
    d = json.loads(_good(model, prompt_id).encode())
    change(d["samples"][0])
    return json.dumps(d).encode()


def _outside_support(s):
    s["sampling_support"] = {"token_ids": [3, 3, 3], "offsets": [0, 1, 2, 3], "vocab_size": 15}


def _misaligned_offsets(s):
    s["sampling_support"]["offsets"][-1] += 2


def _outside_vocab(s):
    s["prompt_token_ids"][1] = 99


def _wrong_lengths(s):
    s["response_logprobs"] = s["response_logprobs"][:-1]


@pytest.mark.parametrize(
    "change, problem",
    [
        (_outside_support, "outside its sampling support"),
        (_misaligned_offsets, "offsets must end at len(token_ids)"),
        (_outside_vocab, "token id 99 outside the model vocabulary"),
        (_wrong_lengths, "2 log-probs for 3 response tokens"),
    ],
)
def test_bad_sample_is_rejected_by_name_and_nothing_else_dropped(redis_url, change, problem):
    model = tiny_model()
    learner = Learner(model, learner_config(learning_rate=1e-3))
    client = redis.Redis.from_url(redis_url)
    reader = SampleReader(client, "run", "trainer-0", validate=learner.check_group)
    key = stream_key("run")
    client.xadd(key, {STREAM_FIELD: _good(model, "p0").encode()})
    client.xadd(key, {STREAM_FIELD: _mutated(model, "bad", change)})
    client.xadd(key, {STREAM_FIELD: _good(model, "p1").encode()})
    batch = reader.read(2, timeout_s=5)
    assert [g.prompt_id for g in batch.groups] == ["p0", "p1"] and batch.num_rejected == 1
    (entry,) = client.xrange(rejected_key("run"))
    reason = entry[1][b"reason"].decode()
    assert "sample 'bad/0'" in reason or "sample bad/0" in reason, reason
    assert problem in reason, reason
    assert client.xpending(key, "trainers")["pending"] == 2  # the good groups await their step
    reader.ack(batch.entry_ids)
    assert client.xpending(key, "trainers")["pending"] == 0
