"""Fake SGLang HTTP servers for CPU tests: the built-in engine's HTTP server
(`furlong.rollout.engine_server`, the subset of SGLang's HTTP contract the adapter uses, in SGLang's
field names) on a tiny checkpoint.

- `FakeSGLang`: in this process, recording every POST so tests can check what the adapter sent.
- `StrictSGLang` (and `FakeSGLang(strict=True)`): also refuses what the real server refuses that
  the built-in server allows: `return_sampling_mask` without a finite `top_k` is HTTP 400, as in
  SGLang (the scheduler's check restored by sgl-project/sglang#35205).
- `sglang_standin.py`: a `StrictSGLang` as its own process, started with SGLang's
  `launch_server` command line (what the engine pool launches)."""

from __future__ import annotations

from furlong.rollout.engine_server import EngineHttpServer

UNBOUNDED_MASK_ERROR = "return_sampling_mask requires a finite top_k"


class StrictSGLang(EngineHttpServer):
    def generate(self, body: dict) -> tuple[int, object]:
        top_k = body.get("sampling_params", {}).get("top_k", -1)
        if body.get("return_sampling_mask") and (not isinstance(top_k, int) or top_k <= 0):
            return 400, {"error": {"message": f"{UNBOUNDED_MASK_ERROR}, got top_k {top_k!r}"}}
        return super().generate(body)


class FakeSGLang(StrictSGLang):
    def __init__(self, model_dir: str, strict: bool = False) -> None:
        super().__init__(model_dir)
        self.strict = strict
        self.requests: list[tuple[str, dict]] = []
        self.flushes = 0
        self.start()

    def generate(self, body: dict) -> tuple[int, object]:
        return super().generate(body) if self.strict else EngineHttpServer.generate(self, body)

    def post(self, path: str, body: dict) -> tuple[int, object]:
        self.requests.append((path, body))
        self.flushes += path == "/flush_cache"
        return super().post(path, body)
