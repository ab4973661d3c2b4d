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


def test_without_enable_fault_hooks_the_broker_installs_no_hook(caplog):
    from prometheus_client import CollectorRegistry

    from furlong.weight_broker.__main__ import broker_core as core_for
    from furlong.weight_broker.config import BrokerConfig
    from furlong.weight_broker.metrics import BrokerMetrics

    environ = {DROP_BUCKET_ENV: "3:1"}
    plain = core_for(BrokerConfig(), BrokerMetrics(CollectorRegistry()), environ)
    assert type(plain) is BrokerCore
    with pytest.raises(Exception, match="run"):  # round 1 of version 3 reaches the real core
        plain.stage_round("run", 3, 1)
    assert f"ignoring {DROP_BUCKET_ENV}" in caplog.text
    assert BrokerConfig.from_args(["--port", "0", "--metrics-port", "0"]).fault_hooks is False
    enabled = BrokerConfig.from_args(["--port", "0", "--metrics-port", "0", "--enable-fault-hooks"])
    hooked = core_for(enabled, BrokerMetrics(CollectorRegistry()), environ)
    assert isinstance(hooked, BucketDroppingCore) and hooked.stage_round("run", 3, 1) == []
