"""The pure core of the rollout service: sampling, the torch engine, request checks and the
service orchestration. Nothing here speaks gRPC."""
