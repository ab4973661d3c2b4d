"""Forward passes of the learner's models over a `MicroBatch`: the policy's per-token log-probs
(over each token's sampling support) and entropy, the frozen reference's log-probs, and the value
model's per-token values. Every forward runs on the model's device, under
`torch.autocast(bfloat16)` when the run's precision says so (the weights stay float32); the
log-prob and entropy arithmetic after it is float32. Knows nothing about objectives or optimizers.
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import torch

from furlong.core.settings import AlgorithmSettings
from furlong.trainer.core.batch import MicroBatch
from furlong.trainer.core.value import ValueModel
from furlong.trainer.logprobs import SupportViolation, log_probs_with_support


class Scorer:
    def __init__(
        self,
        model: torch.nn.Module,
        temperature: float,
        objective: AlgorithmSettings,
        autocast_dtype: torch.dtype | None = None,
    ):
        """`autocast_dtype`: the dtype forwards compute in under torch.autocast (None: the
        weights' own)."""
        self.model = model
        self.policy_module = model  # what the policy's forward goes through (a DDP wrapper, say)
        self.temperature = temperature
        self.device = next(model.parameters()).device
        self.autocast_dtype = autocast_dtype
        forward_params = inspect.signature(model.forward).parameters
        self._can_trim_logits = "logits_to_keep" in forward_params
        self._pass_use_cache = "use_cache" in forward_params
        self.reference: torch.nn.Module | None = None
        if objective.uses_reference:
            self.reference = copy.deepcopy(model).eval()
            self.reference.requires_grad_(False)
        self.critic: ValueModel | None = (
            ValueModel(model).to(self.device).eval() if objective.name == "ppo" else None
        )

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def trainable_extra_parameters(self) -> list[torch.nn.Parameter]:
        return [] if self.critic is None else [p for p in self.critic.parameters() if p.requires_grad]

    def _logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        kwargs: dict[str, object] = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask}
        if self._pass_use_cache:
            kwargs["use_cache"] = False
        if self._can_trim_logits:
            kwargs["logits_to_keep"] = mb.width - mb.first  # prompt positions before `first` need no logits
        with self._autocast():
            logits: torch.Tensor = model(**kwargs).logits
        return logits

    def _logprobs(self, model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(model, mb)
        try:
            out = log_probs_with_support(
                logits, mb.targets, mb.support, self.temperature, positions=mb.positions(logits.shape[1])
            )
        except SupportViolation as exc:
            row = mb.rows[int(mb.seq[exc.row])]
            position = exc.row - int((mb.seq < mb.seq[exc.row]).sum())
            raise ValueError(
                f"sample {row.sample.sample_id}: token {exc.token_id} at response position "
                f"{position} is outside its sampling support"
            ) from None
        return out.logprobs.float(), out.entropy.float()

    def policy_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy), each (N,), differentiable w.r.t. the policy."""
        return self._logprobs(self.policy_module, mb)

    @torch.no_grad()
    def reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        if self.reference is None:
            raise ValueError("this objective has no reference model (kl_coef is 0)")
        return self._logprobs(self.reference, mb)[0]

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """(N,) value of the state before each response token (the position that predicts it)."""
        if self.critic is None:
            raise ValueError("this objective has no value model (algorithm is not ppo)")
        with self._autocast():
            values: torch.Tensor = self.critic(mb.input_ids, mb.attention_mask).float()
        return values.reshape(-1).index_select(0, mb.positions(values.shape[1]))
