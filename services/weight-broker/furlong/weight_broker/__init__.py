"""Furlong weight broker: carries every policy version from the trainer to the rollout engines.

The trainer stages a version in a NIXL-registered host buffer (`WeightPublisher`), the broker tells
every engine of the run where to read it, each engine pulls and verifies it (`WeightReceiver`), and
the broker commits the version once all of them acknowledged it.
"""
