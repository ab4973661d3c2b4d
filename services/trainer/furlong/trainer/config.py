"""Configuration of the trainer service process, parsed once at the edge (`__main__`)."""

from __future__ import annotations

from dataclasses import dataclass

from furlong.core.devices import parse_device
from furlong.rpc.tls import TlsFiles
from furlong.service_main.ports import check_port


@dataclass(frozen=True)
class TrainerServiceConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    metrics_port: int = 0  # Prometheus /metrics; 0 = any free port
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_address: str = "127.0.0.1:50051"
    consumer_name: str = "trainer-0"  # stable across restarts so pending samples are replayed
    num_threads: int = 2
    checkpoint_dir: str = ""  # "" = no training checkpoints; else one directory per run under it
    policy_dir: str = ""  # "" = exports only to named directories; else DIR/<run_id>/{final,checkpoints}
    auth_token_file: str = ""  # "" = gRPC unauthenticated; else the shared service token's file
    tls: TlsFiles = TlsFiles()  # no files = plaintext gRPC; else mutual TLS (furlong.rpc.tls)
    # Before a run's first version: sync its weights once into garbage-filled copies through the
    # broker, as a private run of its own, and compare bit-exactly (furlong.transfer.equality); a
    # mismatch fails it.
    check_weight_update_equal: bool = False
    device: str = "cpu"  # where runs' models train: "cpu", "cuda" or "cuda:N"
    # Where each run's weight staging bucket lives: "cpu" (host memory, every lane) or "cuda" /
    # "cuda:N" (GPU memory, offered over the nixl and cuda_ipc lanes only; furlong.transfer.bucket).
    weight_bucket_device: str = "cpu"
    # Memory of the training forward (LearnerConfig): tokens per chunk of the chunked LM head, and
    # 0 for padded micro-batches (the default, run_learner.DEFAULT_MICRO_BATCH_TOKENS) or the token
    # budget of packed, token-balanced ones.
    lm_head_chunk_tokens: int = 1024
    micro_batch_tokens: int = 0

    def __post_init__(self) -> None:
        try:
            parse_device(self.device)
        except ValueError as exc:
            raise ValueError(f"--device {self.device!r}: {exc}") from None
        try:
            parse_device(self.weight_bucket_device)
        except ValueError as exc:
            raise ValueError(f"--weight-bucket-device {self.weight_bucket_device!r}: {exc}") from None
        check_port("port", self.port)
        check_port("metrics_port", self.metrics_port)
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must be a redis:// URL, got {self.redis_url!r}")
        if ":" not in self.broker_address:
            raise ValueError(f"broker_address must be HOST:PORT, got {self.broker_address!r}")
        if not self.consumer_name:
            raise ValueError("consumer_name must not be empty")
        if self.lm_head_chunk_tokens < 1:
            raise ValueError(f"lm_head_chunk_tokens must be >= 1, got {self.lm_head_chunk_tokens}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens must be >= 0, got {self.micro_batch_tokens}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
