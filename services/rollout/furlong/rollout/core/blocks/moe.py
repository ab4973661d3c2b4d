"""Routed mixture-of-experts MLPs: a router picks `experts_per_token` of `num_experts` gated SiLU
experts per token and weights their outputs; shared experts (DeepSeek-V3, GLM-4.7-Flash) see
every token.

Routers:
- `SoftmaxRouter` (Qwen3-MoE): softmax over the router logits in float32, top-k, optionally
  renormalised over the k (`norm_topk_prob`), cast to the activations' dtype;
- `GroupedSigmoidRouter` (DeepSeek-V3, GLM-4.7-Flash, "noaux_tc"): sigmoid scores in float32; the
  choice adds the per-expert correction bias and is limited to the `topk_group` best of `n_group`
  expert groups (a group scores the sum of its best two); the weights are the chosen experts'
  plain scores, optionally renormalised (+1e-20), times `routed_scaling_factor`.

Experts are the checkpoint's stacked tensors (gate_up_proj (E, 2I, H), down_proj (E, H, I)). A
step's (token, expert) pairs are sorted by expert and each expert multiplies its consecutive rows
(one grouped matmul where torch has it, see `_compat.grouped_linear`); outputs are weighted and
summed back per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import linear, silu

from furlong.rollout.core._compat import grouped_linear
from furlong.rollout.core.blocks.dense_mlp import GatedMlp


@dataclass(frozen=True)
class SoftmaxRouter:
    weight: torch.Tensor  # (E, H)
    top_k: int
    normalise: bool

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts


@dataclass(frozen=True)
class GroupedSigmoidRouter:
    weight: torch.Tensor  # (E, H)
    correction_bias: torch.Tensor  # (E,)
    top_k: int
    num_groups: int
    top_groups: int
    normalise: bool
    scaling: float

    def __post_init__(self) -> None:
        num_experts = self.weight.shape[0]
        if self.num_groups < 1 or num_experts % self.num_groups:
            raise ValueError(f"n_group {self.num_groups} does not divide n_routed_experts {num_experts}")
        if not 1 <= self.top_groups <= self.num_groups:
            raise ValueError(f"topk_group {self.top_groups} outside [1, n_group {self.num_groups}]")
        if self.top_groups < self.num_groups and num_experts // self.num_groups < 2:
            raise ValueError("group-limited routing needs at least 2 experts per group")
        if self.top_k > num_experts * self.top_groups // self.num_groups:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} exceeds the experts of {self.top_groups} groups"
            )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(linear(x.float(), self.weight.float()))
        choice = scores + self.correction_bias.float()
        if self.top_groups < self.num_groups:  # all groups kept: nothing to mask
            grouped = choice.view(x.shape[0], self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best = torch.topk(group_scores, self.top_groups, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if self.normalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


@dataclass(frozen=True)
class RoutedExperts:
    gate_up: torch.Tensor  # (E, 2I, H)
    down: torch.Tensor  # (E, H, I)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // top_k
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0])
        gate, up = grouped_linear(x[token], self.gate_up, counts).chunk(2, dim=-1)
        out = grouped_linear(silu(gate) * up, self.down, counts)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token, out)


@dataclass(frozen=True)
class MoeMlp:
    router: SoftmaxRouter | GroupedSigmoidRouter
    experts: RoutedExperts
    shared: GatedMlp | None = None

    @staticmethod
    def experts_of(moe: Any, where: str) -> RoutedExperts:
        gate_up = getattr(moe.experts, "gate_up_proj", None)
        down = getattr(moe.experts, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            raise ValueError(f"{where}.experts has no stacked gate_up_proj / down_proj tensors")
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[2] != down.shape[1]:
            raise ValueError(
                f"{where}.experts: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                f"{tuple(down.shape)} are not (E, 2I, H) and (E, H, I)"
            )
        return RoutedExperts(gate_up, down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.router(x)
        out = self.experts(x, weights, experts)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


def softmax_routed(moe: Any, config: Any, where: str) -> MoeMlp:
    """A Qwen3-MoE sparse block (router `gate.weight`, stacked experts, no shared experts)."""
    return MoeMlp(
        router=SoftmaxRouter(
            weight=_tensor(moe.gate, "weight", f"{where}.gate"),
            top_k=int(config.num_experts_per_tok),
            normalise=bool(config.norm_topk_prob),
        ),
        experts=MoeMlp.experts_of(moe, where),
    )


def sigmoid_routed(moe: Any, config: Any, where: str) -> MoeMlp:
    """A DeepSeek-V3 / GLM-4.7-Flash MoE block (grouped sigmoid router with correction bias,
    stacked experts, shared experts)."""
    return MoeMlp(
        router=GroupedSigmoidRouter(
            weight=_tensor(moe.gate, "weight", f"{where}.gate"),
            correction_bias=_tensor(moe.gate, "e_score_correction_bias", f"{where}.gate"),
            top_k=int(config.num_experts_per_tok),
            num_groups=int(config.n_group),
            top_groups=int(config.topk_group),
            normalise=bool(config.norm_topk_prob),
            scaling=float(config.routed_scaling_factor),
        ),
        experts=MoeMlp.experts_of(moe, where),
        shared=GatedMlp.of(moe.shared_experts, f"{where}.shared_experts"),
    )


def _tensor(module: Any, name: str, where: str) -> torch.Tensor:
    value = getattr(module, name, None)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} has no tensor {name!r}")
    return value
