"""The SGLang adapter: one SGLang HTTP server used as a rollout engine.

It speaks SGLang's HTTP API with token ids only (servers run with `--skip-tokenizer-init`):

- `POST /generate` with `input_ids` (a batch), `sampling_params` (temperature, top_k, top_p, min_p,
  max_new_tokens, sampling_seed, ignore_eos, and `stop` when the config has stop strings),
  `return_logprob: true` and
  `return_sampling_mask: true`; each result carries `output_ids` and, in `meta_info`,
  `output_token_logprobs` ([log-prob, token id, _] per token: its ids must be `output_ids`),
  `output_token_sampling_mask` (per token, the list of token ids the sampler could have drawn:
  its support), `output_token_sampling_logprobs` (per token, its log-prob renormalised over that
  support: the log-prob recorded), optionally `output_token_sampling_mask_full_rows` (a Furlong
  extension only its own engine server sends: the rows that are the whole vocabulary, sent as an
  empty list) and
  `finish_reason` ({"type": "length"} or {"type": "stop", "matched": id or string}; a matched
  string must be one of the request's stop strings, and the text is cut before it) and
  `weight_version` (the version that drew the row: it is the sample's policy version when it is a
  decimal number, else — SGLang says "default" before any update — the version of the adapter's
  last weight update).
- `GET /health`, `/health_generate`; `POST /pause_generation`, `/continue_generation`, `/flush_cache`;
  `POST /update_weights_from_disk` (`model_path`, `weight_version`) and `/update_weight_version`.
- `POST /update_weights_from_tensor` (`serialized_named_tensors`: one entry per TP rank, each the
  base64 text of `tensor_payload.payload_of`: shared memory / CUDA IPC handles, so the server must
  run on this host; `weight_version`, `flush_cache: true`).
- `POST /init_weights_update_group`, `/update_weights_from_distributed` (`names`, `dtypes`,
  `shapes`, `group_name`, `weight_version`, `flush_cache: true`) and
  `/destroy_weights_update_group`: the engine's side of a torch.distributed group whose rank 0
  broadcasts the tensors; `weight_update_group.WeightUpdateGroup` drives these calls and the
  broadcast for a set of engines.

Every weight update through the adapter — disk, tensor or distributed — is paused around the
load, refuses a version older than the served one before calling the server, and moves
`policy_version` only when the server answered `{"success": true}`; `{"success": false}` is a
ValueError carrying the server's message.

SGLang returns sampling supports only for a finite top_k (it answers HTTP 400 otherwise, a
ValueError here); Furlong's engine server also serves top_k 0. The field names are SGLang's
(`io_struct.GenerateReqInput`, `tokenizer_manager`); `tests/rollout/sglang_contract.py` names the
source version they were read from.

Every response is checked before it becomes a `Generation` (lengths agree, each token lies in its
support, a support lists no id twice, log-probs are finite and <= 0); anything else is an error
naming the request row, never a guess; response text is decoded here with the given tokenizer.
HTTP 400 becomes ValueError (a bad request; the server is fine); unreachable servers and other
failures become UnavailableError. Knows nothing about runs, rewards or Redis.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from furlong.core.errors import UnavailableError
from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.rollout.core.engine import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, Generation, TokenizerLike
from furlong.rollout.core.sampling import SamplingConfig
from furlong.rollout.core.stop_strings import cut_at_stop
from furlong.rollout.tensor_payload import payload_of

log = logging.getLogger(__name__)


class SGLangEngine:
    """Thread-safe: every call is one HTTP request. `policy_version` is the version of the last
    successful weight update through this adapter (the server's `weight_version` string is its
    decimal form). `tp_size` is the server's tensor-parallel size (its ranks in a weight update
    group, its entries in a tensor update)."""

    def __init__(
        self,
        base_url: str,
        tokenizer: TokenizerLike,
        vocab_size: int,
        timeout_s: float = 120.0,
        policy_version: int = 0,
        name: str = "sglang",
        tp_size: int = 1,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        eos_id = tokenizer.eos_id
        if vocab_size <= 0 or not 0 <= eos_id < vocab_size:
            raise ValueError(
                f"need vocab_size > 0 and the tokenizer's eos_id in [0, vocab_size), "
                f"got {vocab_size}, {eos_id}"
            )
        self.tokenizer = tokenizer
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
        self.tp_size = tp_size
        self.base_url = base_url.rstrip("/")
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.name = name
        self._timeout_s = timeout_s
        self._version_changed = threading.Condition()
        self._policy_version = policy_version

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def wait_for_version(self, min_version: int, timeout_s: float) -> bool:
        with self._version_changed:
            return self._version_changed.wait_for(lambda: self._policy_version >= min_version, timeout_s)

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self._timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if exc.code == 400:
                raise ValueError(f"{self.name} {path}: {detail}") from None
            raise UnavailableError(f"{self.name} {path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise UnavailableError(f"{self.name} {path}: cannot reach {self.base_url}: {exc}") from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")

    def alive(self, timeout_s: float = 5.0) -> bool:
        """True when the server answers `/health` within `timeout_s` (cheap: generates nothing)."""
        try:
            self._request("GET", "/health", timeout_s=timeout_s)
        except (UnavailableError, ValueError):
            return False
        return True

    def healthy(self) -> bool:
        """True when the server generates a token (`/health_generate`)."""
        try:
            self._request("GET", "/health_generate")
        except (UnavailableError, ValueError):
            return False
        return True

    def pause(self) -> None:
        self._request("POST", "/pause_generation", {})

    def resume(self) -> None:
        self._request("POST", "/continue_generation", {})

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache", {})

    def update_weights_from_disk(self, version: int, model_path: str) -> None:
        """Load `model_path` on the server as policy `version` (paused around the load, cache
        flushed); ValueError for an older version or a load the server refuses."""
        self._check_newer(version)
        self.pause()
        try:
            reply = self._request(
                "POST",
                "/update_weights_from_disk",
                {"model_path": model_path, "weight_version": str(version)},
            )
            self._check_success("/update_weights_from_disk", reply)
            self.flush_cache()
        finally:
            self.resume()
        self._set_version(version)

    def update_weights_from_tensor(
        self, version: int, named_tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]
    ) -> None:
        """Load `named_tensors` (all parameters or some; state-dict names) on the server as policy
        `version`, shared through memory rather than copied over HTTP (paused around the load)."""
        self._check_newer(version)
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if not items:
            raise ValueError(f"{self.name}: a weight update needs at least one tensor")
        payload = payload_of(items)  # alive until the server answered: it maps these tensors
        self._paused_update(
            "/update_weights_from_tensor",
            version,
            {
                "serialized_named_tensors": [payload.text] * self.tp_size,
                "flush_cache": True,
                "weight_version": str(version),
            },
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Have the server join a weight update group at ranks rank_offset.. (one per TP rank);
        returns once every rank of the group joined."""
        reply = self._request(
            "POST",
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )
        self._check_success("/init_weights_update_group", reply)

    def update_weights_from_distributed(
        self,
        version: int,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
    ) -> None:
        """The server's half of a distributed update: it receives the tensors that rank 0 of
        `group_name` broadcasts (in `names` order) and loads them as `version` (paused around it).
        Rank 0 must broadcast concurrently; see `WeightUpdateGroup.update`."""
        self._check_newer(version)
        self._paused_update(
            "/update_weights_from_distributed",
            version,
            {
                "names": list(names),
                "dtypes": list(dtypes),
                "shapes": [list(s) for s in shapes],
                "group_name": group_name,
                "flush_cache": True,
                "weight_version": str(version),
            },
        )

    def destroy_weights_update_group(self, group_name: str) -> None:
        reply = self._request("POST", "/destroy_weights_update_group", {"group_name": group_name})
        self._check_success("/destroy_weights_update_group", reply)

    def _paused_update(self, path: str, version: int, body: dict[str, Any]) -> None:
        self.pause()
        try:
            self._check_success(path, self._request("POST", path, body))
        finally:
            self.resume()
        self._set_version(version)

    def update_weight_version(self, version: int) -> None:
        """Label the weights the server already holds as `version`."""
        self._check_newer(version)
        reply = self._request("POST", "/update_weight_version", {"new_version": str(version)})
        self._check_success("/update_weight_version", reply)
        self._set_version(version)

    def _check_newer(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < self._policy_version:
            raise ValueError(
                f"{self.name}: policy version {version!r} is older than the served "
                f"version {self._policy_version}"
            )

    def _check_success(self, path: str, reply: Any) -> None:
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise ValueError(f"{self.name} {path} refused: {reply!r}")

    def _set_version(self, version: int) -> None:
        with self._version_changed:
            self._policy_version = version
            self._version_changed.notify_all()
        log.info("%s serves policy version %d", self.name, version)

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], config: SamplingConfig, ignore_eos: bool = False
    ) -> list[Generation]:
        """One response per prompt, drawn by the server; same contract as `Engine.generate`."""
        prompts = [list(p) for p in prompt_ids]
        if not prompts:
            return []
        version = self._policy_version
        sampling_params: dict[str, Any] = {
            "temperature": config.temperature,
            "top_k": config.top_k or -1,
            "top_p": config.top_p,
            "min_p": config.min_p,
            "max_new_tokens": config.max_new_tokens,
            "sampling_seed": config.seed,
            "ignore_eos": ignore_eos,
        }
        body = {
            "input_ids": prompts,
            "return_logprob": True,
            "return_sampling_mask": True,
            "sampling_params": sampling_params,
        }
        if config.stop:
            sampling_params["stop"] = list(config.stop)
        reply = self._request("POST", "/generate", body)
        if not isinstance(reply, list) or len(reply) != len(prompts):
            raise UnavailableError(
                f"{self.name} /generate returned {type(reply).__name__} "
                f"{'of length ' + str(len(reply)) if isinstance(reply, list) else ''}"
                f" for {len(prompts)} prompts"
            )
        return [self._generation(i, item, version, config.stop) for i, item in enumerate(reply)]

    def _generation(self, row: int, item: Any, version: int, stops: tuple[str, ...]) -> Generation:
        where = f"{self.name} /generate row {row}"
        try:
            ids = [int(t) for t in item["output_ids"]]
            meta = item["meta_info"]
            lp_ids = [int(entry[1]) for entry in meta["output_token_logprobs"]]
            logprobs = [float(lp) for lp in meta["output_token_sampling_logprobs"]]
            support = support_of(
                meta["output_token_sampling_mask"],
                meta.get("output_token_sampling_mask_full_rows", ()),
                self.vocab_size,
            )
            finish = meta["finish_reason"]
            label = meta.get("weight_version")
            if isinstance(label, str) and label.isdecimal():  # the version that drew this row
                version = int(label)
        except (KeyError, TypeError, IndexError) as exc:
            raise UnavailableError(f"{where}: response is missing {exc}") from None
        except ValueError as exc:
            raise UnavailableError(f"{where}: bad sampling mask or log-prob: {exc}") from None
        if not ids or lp_ids != ids or support.num_rows != len(ids) or len(logprobs) != len(ids):
            raise UnavailableError(
                f"{where}: {len(ids)} tokens, log-probs for {lp_ids[:8]}..., "
                f"{support.num_rows} support rows, {len(logprobs)} sampling log-probs do not agree"
            )
        for pos, (tok, lp) in enumerate(zip(ids, logprobs)):
            if not (math.isfinite(lp) and lp <= 0.0) or not support.contains(pos, tok):
                raise UnavailableError(
                    f"{where}: token {tok} at {pos} (log-prob {lp}) is not a finite draw from its support"
                )
        reason = self._finish(finish, ids, where, stops)
        text = self.tokenizer.decode(ids, skip_special=True)
        stop_string = finish.get("matched") if reason == FINISH_STOP else None
        if isinstance(stop_string, str):
            text = cut_at_stop(text, stops)
        else:
            stop_string = None
        return Generation(
            token_ids=ids,
            logprobs=logprobs,
            support=support,
            finish_reason=reason,
            text=text,
            policy_version=version,
            stop_string=stop_string,
        )

    def _finish(self, finish: Any, ids: list[int], where: str, stops: tuple[str, ...]) -> str:
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind == "length":
            return FINISH_LENGTH
        if kind == "stop":
            matched = finish.get("matched")
            if isinstance(matched, str) and matched not in stops:
                raise UnavailableError(
                    f"{where}: finish_reason matched {matched!r}, which is not "
                    f"one of the request's stop strings {list(stops)}"
                )
            return FINISH_EOS if matched == self.eos_id and ids[-1] == self.eos_id else FINISH_STOP
        raise UnavailableError(f"{where}: unknown finish_reason {finish!r}")


def support_of(rows: Any, full_rows: Any, vocab_size: int) -> RolloutSamplingMask:
    """The CSR support of SGLang's `output_token_sampling_mask` (a list of token-id lists, one per
    token); the rows in `full_rows` are the whole vocabulary and must be sent empty. ValueError for
    anything else (not lists, an empty or repeating row, an id outside the vocabulary)."""
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise ValueError("output_token_sampling_mask must be a list of token-id lists")
    if not isinstance(full_rows, (list, tuple)):
        raise ValueError(f"output_token_sampling_mask_full_rows must be a list, got {full_rows!r}")
    full = set(full_rows)
    offsets = [0]
    flat: list[int] = []
    for i, row in enumerate(rows):
        if len(set(row)) != len(row):
            raise ValueError(f"row {i} lists a token id twice")
        flat.extend(row)
        offsets.append(len(flat))
    return RolloutSamplingMask.from_dict(
        {"token_ids": flat, "offsets": offsets, "vocab_size": vocab_size, "full_rows": sorted(full)}
    )
