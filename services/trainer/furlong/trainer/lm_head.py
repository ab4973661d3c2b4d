"""Log-probs over each token's sampling support and the entropy, taken straight from the final
hidden states and the LM head weight, a chunk of tokens at a time: the (tokens x vocabulary)
logits are never materialised, in the forward pass or the backward pass.

`head_log_probs_with_support(hidden, weight, ...)` equals `log_probs_with_support(hidden @
weight.T, ...)` (same support replay, temperature and entropy; see `logprobs`). Forward computes
each chunk's logits, keeps four numbers per token and drops the logits; backward recomputes each
chunk's logits and turns their gradient into the chunk's rows of grad_hidden and its share of
grad_weight. Working memory is O(chunk_tokens x vocabulary) plus the weight's gradient, whatever
the number of tokens, plus at most `keep_logits_bytes` (default 256 MiB) of chunk logits that
forward keeps for backward instead of recomputing them (a quarter of the head's matmuls saved
where a micro-batch's logits are that small: short responses, small vocabularies; 0 keeps none).
An output that the loss does not use (the entropy, mostly) costs backward nothing. A tied
embedding needs nothing special: autograd adds the head's share of the weight's gradient to the
embedding's.

The matmul runs in `matmul_dtype` (the run's autocast dtype, or the inputs' own), the softmax
arithmetic in float32 (or wider), as the model's own head under autocast followed by
`log_probs_with_support` would. Knows nothing about models, samples or optimizers; the vocabulary
is not sharded here (tensor-parallel heads score their logits with `log_probs_with_support`).
"""

from __future__ import annotations

from typing import Any

import torch

from furlong.core.sampling_mask import RolloutSamplingMask
from furlong.trainer.logprobs import ChunkStats, LogProbs, ScoringPlan, chunk_grad, forward_chunks, make_plan

DEFAULT_CHUNK_TOKENS = 1024
DEFAULT_KEEP_LOGITS_BYTES = 256 * 2**20


def _scaled_logits(
    plan: ScoringPlan, hidden2d: torch.Tensor, weight: torch.Tensor, a: int, b: int
) -> torch.Tensor:
    """A private work-dtype tensor of the logits of scored rows [a, b) divided by T."""
    rows = plan.select_rows(hidden2d, a, b).to(weight.dtype)
    return plan.divide_by_temperature((rows @ weight.T).to(plan.dtype))


class _HeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden2d: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        plan: ScoringPlan,
        matmul_dtype: torch.dtype,
        keep_logits_bytes: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kept: list[torch.Tensor | None] = []
        room = [keep_logits_bytes]

        def scaled(a: int, b: int) -> torch.Tensor:
            x = _scaled_logits(plan, hidden2d, w, a, b)
            if len(kept) == a // plan.chunk_rows and x.numel() * x.element_size() <= room[0]:
                kept.append(x)  # _chunk_forward reads x without writing it
                room[0] -= x.numel() * x.element_size()
            return x

        with torch.autocast(device_type=hidden2d.device.type, enabled=False):
            w = weight.to(matmul_dtype)
            stats = forward_chunks(plan, targets, scaled)
        ctx.kept_logits = kept  # the first len(kept) chunks' x, each handed to one backward
        ctx.save_for_backward(hidden2d, weight, targets, *stats[1:])
        ctx.plan, ctx.matmul_dtype = plan, matmul_dtype
        ctx.set_materialize_grads(False)  # an unused output (the entropy, mostly) costs no pass
        return stats.logp, stats.entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        hidden2d, weight, targets, entropy, lse_full, lse_support = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        plan: ScoringPlan = ctx.plan
        kept: list[torch.Tensor | None] = ctx.kept_logits
        saved = ChunkStats(entropy, entropy, lse_full, lse_support)  # the log-probs are not needed
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden2d) if need_hidden else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = (
            torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if need_weight else None
        )
        with torch.autocast(device_type=hidden2d.device.type, enabled=False):
            w = weight.to(ctx.matmul_dtype)
            for i, (a, b) in enumerate(plan.chunks()):
                x = kept[i] if i < len(kept) else None
                if x is None:
                    x = _scaled_logits(plan, hidden2d, w, a, b)
                else:
                    kept[i] = None  # chunk_grad overwrites x: another backward recomputes it
                g = chunk_grad(plan, x, targets, saved, a, b, grad_logp, grad_entropy).to(w.dtype)
                del x
                if grad_hidden is not None:
                    plan.write_rows(grad_hidden, (g @ w).to(grad_hidden.dtype), a, b)
                if grad_weight is not None:
                    rows = plan.select_rows(hidden2d, a, b).to(w.dtype)
                    if g.dtype == accumulate:  # accumulated in place: no weight-sized temporary
                        grad_weight.addmm_(g.T, rows)
                    else:
                        grad_weight.add_((g.T @ rows).to(accumulate))
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None,
            None,
            None,
        )


def head_log_probs_with_support(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    support: RolloutSamplingMask | None = None,
    temperature: float = 1.0,
    *,
    positions: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    matmul_dtype: torch.dtype | None = None,
    keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES,
) -> LogProbs:
    """`log_probs_with_support(hidden @ weight.T, target_ids, support, temperature,
    positions=positions)` without the full logits. Differentiable w.r.t. `hidden` and `weight`.

    hidden: (..., H) final hidden states (after the final norm), flattened to rows; `positions`
    (N,) optionally picks the scored rows. weight: (V, H), the LM head's (no bias). chunk_tokens:
    scored rows per chunk. matmul_dtype: the dtype of the head's matmul (None: the promotion of
    hidden's and weight's dtypes). keep_logits_bytes: how many bytes of chunk logits forward may
    keep for backward (the first chunks that fit) instead of recomputing them.
    """
    if hidden.dim() < 2:
        raise ValueError(f"hidden states must have shape (..., hidden), got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"LM head weight must have shape (vocab, {hidden.shape[-1]}), got {tuple(weight.shape)}"
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
    if isinstance(keep_logits_bytes, bool) or not isinstance(keep_logits_bytes, int) or keep_logits_bytes < 0:
        raise ValueError(f"keep_logits_bytes must be an integer >= 0, got {keep_logits_bytes!r}")
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    mm = torch.promote_types(hidden.dtype, weight.dtype) if matmul_dtype is None else matmul_dtype
    dtype = torch.promote_types(mm, torch.float32)
    plan, targets = make_plan(
        hidden2d,
        target_ids,
        support,
        temperature,
        local_vocab=int(weight.shape[0]),
        dtype=dtype,
        positions=positions,
        chunk_rows=chunk_tokens,
    )
    if plan.n == 0:
        empty = hidden2d.new_zeros(0, dtype=dtype)
        return LogProbs(empty, empty.clone())
    logp, entropy = _HeadLogProbs.apply(hidden2d, weight, targets, plan, mm, keep_logits_bytes)  # type: ignore[no-untyped-call]  # torch leaves Function.apply unannotated
    return LogProbs(logp, entropy)
