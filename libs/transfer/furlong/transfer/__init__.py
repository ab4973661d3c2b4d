"""Furlong weight transfer: the library the trainer, the rollout engines and the weight broker share
to move policy versions.

The trainer stages a version round by round in one fixed-size bucket (`publisher.WeightPublisher`
over `bucket.StagingBucket`, in host or CUDA memory), each engine pulls it over the best lane that
reaches the bucket (a CUDA IPC share, NIXL, shared memory or a gRPC stream: `lanes.py`,
`cuda_ipc.py`, `nixl_transport.py`, `shm.py`; `device_memory.py` says which memory a buffer is in)
into its destination (`destination.py`), verifies it and acknowledges it
(`receiver.WeightReceiver`); `pull_lock.py` turns the pulls of one host, `host_memory.py` allocates
the buffers. Both sides talk to the broker through `broker_client.BrokerClient` (`GrpcBrokerClient`
over `wire.py`'s proto conversions); `config.TransferConfig` says how; `equality.py` checks that a
sync rewrites every parameter. Knows nothing about the broker's rules (the broker service,
services/weight-broker), and does not import it. See docs/weight-broker.md.
"""
