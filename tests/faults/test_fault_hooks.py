"""The weight broker's fault-injection hook: parsing, and that it drops exactly one round."""

from __future__ import annotations

import pytest

from furlong.weight_broker.core import BrokerCore
from furlong.weight_broker.fault_hooks import (
    DROP_BUCKET_ENV,
    BucketDroppingCore,
    broker_core,
    parse_drop_bucket,
)

pytestmark = pytest.mark.unit


def test_parse_names_the_bad_value():
    assert parse_drop_bucket("2:0") == (2, 0)
    for bad in ("2", "a:b", "1:2:3", "-1:0"):
        with pytest.raises(ValueError, match=DROP_BUCKET_ENV):
            parse_drop_bucket(bad)


def test_the_hook_is_off_unless_its_variable_is_set():
    assert type(broker_core({})) is BrokerCore
    core = broker_core({DROP_BUCKET_ENV: "3:1"}, max_ack_attempts=2)
    assert isinstance(core, BucketDroppingCore)
    # a matching round is dropped once (no engine told, nothing staged); others reach the core
    assert core.stage_round("run", 3, 1) == []
    with pytest.raises(Exception, match="run"):  # the second time it reaches the real core
        core.stage_round("run", 3, 1)
