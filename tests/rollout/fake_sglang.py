"""A fake SGLang HTTP server for CPU tests: the built-in engine's HTTP server
(`furlong.rollout.engine_server`, the subset of SGLang's HTTP contract the adapter uses) on a tiny
checkpoint, recording every POST so tests can check what the adapter sent."""

from __future__ import annotations

from furlong.rollout.engine_server import EngineHttpServer


class FakeSGLang(EngineHttpServer):
    def __init__(self, model_dir: str) -> None:
        super().__init__(model_dir)
        self.requests: list[tuple[str, dict]] = []
        self.flushes = 0
        self.start()

    def post(self, path: str, body: dict) -> tuple[int, object]:
        self.requests.append((path, body))
        self.flushes += path == "/flush_cache"
        return super().post(path, body)
