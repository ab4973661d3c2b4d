"""The pure core of the rollout service: sampling, the torch engine (continuous batching over a
slot KV cache), request checks, group filters, staleness pacing and the service orchestration.
Nothing here speaks gRPC or HTTP."""
