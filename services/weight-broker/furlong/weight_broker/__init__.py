"""Furlong weight broker: carries every policy version from the trainer to the rollout engines.

The trainer stages a version round by round in one fixed-size bucket (furlong.transfer's
`WeightPublisher`), the broker (`core.BrokerCore`, served by `server.py`) tells every engine of the
run which round to pull, each engine pulls it over the best lane that reaches the bucket (NIXL, shared
memory or a gRPC stream, furlong.transfer.lanes), verifies it and acknowledges it (`WeightReceiver`),
and the broker commits the version once every live engine applied it, fencing engines that fail or
stall. `client.py` is the in-process twin of furlong.transfer's gRPC BrokerClient; `WeightRelay`
holds the latest version on the broker side (relay mode); `equality.py` runs furlong.transfer's
equality check from the command line over a private broker. See docs/weight-broker.md.
"""
