"""The built-in engine as its own process, behind the subset of SGLang's HTTP API that the SGLang
adapter speaks (see `furlong.rollout.sglang`), so the engine pool drives built-in engines and SGLang
servers the same way:

    python -m furlong.rollout.engine_server --model-dir DIR --port P [--host 127.0.0.1]
        [--max-batch-size 64] [--num-threads 1] [--group-timeout-s 300]

Routes: GET /health, /health_generate; POST /generate, /pause_generation, /continue_generation,
/flush_cache, /update_weights_from_disk, /update_weight_version, and the routes of
`engine_weight_updates`: /update_weights_from_tensor, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group (gloo only; a weight update group
binds its sockets to --host, and waits at most --group-timeout-s for its peers). `/generate` waits
while generation is paused. A bad request is HTTP 400 with {"error": {"message"}}; a refused weight
load from disk or a failed rendezvous or transfer is {"success": false, "message"}. Served with the
standard library's threading HTTP server on the given host only.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from furlong.core.checkpoint import load_policy
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.rollout.core.engine import Engine
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.engine_weight_updates import EngineWeightUpdates

log = logging.getLogger("furlong.rollout.engine_server")


class EngineHttpServer:
    """Serves one built-in engine loaded from `model_dir` on host:port (0 picks a free port)."""

    def __init__(
        self,
        model_dir: str,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_size: int = 64,
        group_timeout_s: float = 300.0,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        if not group_timeout_s > 0:
            raise ValueError(f"group_timeout_s must be > 0, got {group_timeout_s!r}")
        model, self.tokenizer = load_policy(model_dir)
        self.engine = Engine(model, self.tokenizer, max_batch_size=max_batch_size, device=device, dtype=dtype)
        self.weight_version = "0"
        # engine policy version -> the label /update_weight_version gave it; each generated row
        # reports the label of the version that drew it, so a load racing a request cannot mislabel
        self._labels: dict[int, str] = {}
        self.weights = EngineWeightUpdates(self.engine, host, group_timeout_s, self._loaded)
        self._weight_routes = {
            "/update_weights_from_tensor": self.weights.from_tensor,
            "/init_weights_update_group": self.weights.init_group,
            "/update_weights_from_distributed": self.weights.from_distributed,
            "/destroy_weights_update_group": self.weights.destroy_group,
        }
        self.running = threading.Event()
        self.running.set()
        handler = type("Handler", (_Handler,), {"target": self})
        self.server = ThreadingHTTPServer((host, port), handler)
        self.url = f"http://{host}:{self.server.server_port}"
        self._thread: threading.Thread | None = None

    def start(self) -> EngineHttpServer:
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.running.set()
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(10)
        self.weights.close()

    def generate(self, body: dict[str, Any]) -> tuple[int, object]:
        params = body.get("sampling_params", {})
        try:
            config = SamplingConfig(
                temperature=float(params.get("temperature", 1.0)),
                top_k=max(0, int(params.get("top_k", -1))),
                top_p=float(params.get("top_p", 1.0)),
                min_p=float(params.get("min_p", 0.0)),
                max_new_tokens=int(params.get("max_new_tokens", 16)),
                seed=int(params.get("sampling_seed", 0)),
                stop=_stop_param(params.get("stop")),
            )
            prompts = body["input_ids"]
            single = bool(prompts) and isinstance(prompts[0], int)
            prompts = [prompts] if single else prompts
            self.running.wait()
            gens = self.engine.generate(prompts, config, ignore_eos=bool(params.get("ignore_eos")))
        except (ValueError, KeyError, TypeError) as exc:
            return 400, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
        out = []
        for p, g in zip(prompts, gens):
            if g.finish_reason == "eos":
                finish = {"type": "stop", "matched": self.tokenizer.eos_id}
            elif g.finish_reason == "stop":
                finish = {"type": "stop", "matched": g.stop_string}
            else:
                finish = {"type": "length", "length": len(g.token_ids)}
            meta: dict[str, Any] = {
                "prompt_tokens": len(p),
                "completion_tokens": len(g.token_ids),
                "finish_reason": finish,
                "weight_version": self._labels.get(g.policy_version, str(g.policy_version)),
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(g.logprobs, g.token_ids)],
            }
            meta.update(sampling_mask_fields(g.support, g.logprobs))
            out.append({"text": g.text, "output_ids": g.token_ids, "meta_info": meta})
        return 200, out[0] if single else out

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, object]:
        if path == "/generate":
            return self.generate(body)
        if path == "/pause_generation":
            self.running.clear()
            return 200, {"success": True}
        if path == "/continue_generation":
            self.running.set()
            return 200, {"success": True}
        if path == "/flush_cache":
            return 200, {"success": True}  # the slot cache holds nothing between requests
        if path == "/update_weights_from_disk":
            return self._load(body)
        if path == "/update_weight_version":
            if "new_version" not in body:
                return 400, {"error": {"message": "new_version is required"}}
            self.weight_version = str(body["new_version"])
            self._labels[self.engine.policy_version] = self.weight_version
            return 200, {"success": True, "new_version": self.weight_version}
        route = self._weight_routes.get(path)
        if route is not None:
            return route(body)
        return 404, {"error": {"message": f"no route {path}"}}

    def _loaded(self, version: int, label: str) -> None:
        self.weight_version = label
        self._labels[version] = label

    def _load(self, body: dict[str, Any]) -> tuple[int, object]:
        try:
            model, _ = load_policy(body["model_path"])
            version = int(body.get("weight_version", self.engine.policy_version + 1))
            self.engine.load_weights(version, model.state_dict())
        except (ValueError, KeyError, OSError) as exc:
            return 200, {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        self.weight_version = str(version)
        self._labels[version] = self.weight_version
        return 200, {"success": True, "message": f"serving version {version}"}

    def get(self, path: str) -> tuple[int, object]:
        if path == "/health":
            return 200, {}
        if path == "/health_generate":
            probe = self.tokenizer.encode("", add_bos=True) or [self.tokenizer.eos_id]
            self.engine.generate([probe], SamplingConfig(top_k=1, max_new_tokens=1))
            return 200, {}
        return 404, {"error": {"message": f"no route {path}"}}


def sampling_mask_fields(support: RolloutSamplingMask, logprobs: Sequence[float]) -> dict[str, Any]:
    """SGLang's `meta_info` sampling-mask fields for one response: the support of each token as a
    list of ids, each token's log-prob under its sampling distribution, the row count, and (a
    Furlong extension) the rows that are the whole vocabulary, sent as empty lists."""
    full = [i for i in range(support.num_rows) if support.row_is_implicit(i)]
    rows = [[] if support.row_is_implicit(i) else support.row(i).tolist() for i in range(support.num_rows)]
    fields: dict[str, Any] = {
        "output_token_sampling_mask": rows,
        "output_token_sampling_logprobs": list(logprobs),
        "output_token_sampling_mask_length": len(rows),
    }
    if full:
        fields["output_token_sampling_mask_full_rows"] = full
    return fields


def _stop_param(stop: object) -> Any:
    """SGLang's `stop`: absent, one string or a list of strings; anything else goes on as sent, for
    SamplingConfig to refuse naming `stop`."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop


class _Handler(BaseHTTPRequestHandler):
    target: EngineHttpServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply(*self.target.get(self.path))

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError as exc:
            return self._reply(400, {"error": {"message": f"body is not JSON: {exc}"}})
        if not isinstance(body, dict):
            return self._reply(400, {"error": {"message": "body must be a JSON object"}})
        self._reply(*self.target.post(self.path, body))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m furlong.rollout.engine_server")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--group-timeout-s", type=float, default=300.0)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--log-level", default="INFO", type=str.upper)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.num_threads)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, frame: stop.set())
    server = EngineHttpServer(
        args.model_dir,
        args.host,
        args.port,
        args.max_batch_size,
        args.group_timeout_s,
        device=args.device,
        dtype=args.dtype,
    ).start()
    log.info("engine serving %s on %s", args.model_dir, server.url)
    while not stop.wait(0.5):
        pass
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
