"""Context parallelism of the megatron backend: every sequence of a micro-batch is split over the
ranks of a context-parallel group, each running the whole model on its share of the positions.

The split is the load-balanced one (`logprobs.context_parallel_rows`): the (right-padded) sequence
is cut into 2 x C chunks and rank r holds chunks r and 2C - 1 - r, so every rank has as much causal
attention work. Per-token layers need nothing more; attention (`GatheredKeysAttention`, in place of
megatron-core's local core attention, which refuses context parallelism) all-gathers the keys and
values of every rank and masks by global position, so each query sees exactly the keys a
one-rank model shows it. RoPE takes each position's own angle (`ContextParallel.rope`, in place of
the rotary module's forward: megatron-core's own slicing allocates on CUDA). The last layer's
logits are this rank's positions; `ContextParallel.scores` scores the response tokens among them
(`log_probs_with_support` with the tokens' `support_rows`) and assembles every token's scores on
every rank (an all-reduce of disjoint parts), so each rank computes the same loss. Gradients: the
key/value gather's backward sums every rank's gradient of the gathered tensors and keeps its own
rows; each rank's parameter gradients then hold its positions' share, summed over the group by
`MegatronCausalLM.finish_gradients`.

This is all-gather context parallelism (each rank holds every position's keys and values for a
layer at a time), not ring attention: it splits the activations, the logits and the attention
scores of a sequence, not its keys and values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from furlong.trainer.logprobs import LogProbs, SupportViolation, context_parallel_rows


@dataclass
class ContextParallel:
    """One model's context-parallel state: rank `rank` of `world` over `group`, and the layout of
    the micro-batch now going through it (`split`)."""

    group: dist.ProcessGroup
    rank: int
    world: int
    padded_width: int = 0
    mine: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    every: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def split(self, input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
        """This rank's columns of `input_ids` ([batch, width]) padded on the right to a multiple of
        2 x world; records the layout for the attention, RoPE and scores of this micro-batch."""
        width = input_ids.shape[1]
        padded = -(-width // (2 * self.world)) * 2 * self.world
        if padded > width:
            fill = input_ids.new_full((input_ids.shape[0], padded - width), pad_id)
            input_ids = torch.cat([input_ids, fill], dim=1)
        self.padded_width = padded
        rows = [torch.from_numpy(context_parallel_rows(padded, r, self.world)) for r in range(self.world)]
        self.mine = rows[self.rank].to(input_ids.device)
        self.every = torch.cat(rows).to(input_ids.device)  # the gathered keys' positions, in rank order
        return input_ids.index_select(1, self.mine)

    def rope(self, rotary: torch.nn.Module) -> Any:
        """A forward for megatron's rotary module: the angles of this rank's positions."""

        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            emb: torch.Tensor = rotary.get_emb(self.padded_width, 0)  # type: ignore[operator]  # megatron's RotaryEmbedding, untyped  # [positions, 1, 1, dim]
            return emb.index_select(0, self.mine.to(emb.device))

        return forward

    def scores(self, logits: torch.Tensor, positions: torch.Tensor, width: int, score: Any) -> LogProbs:
        """Every response token's scores on every rank. `logits`: [batch, own positions, vocab];
        `positions`: each token's row in the whole micro-batch's flattened logits (batch x `width`);
        `score(own_positions, index)` scores the tokens `index` (of `positions`) whose rows in
        `logits` are `own_positions`. A `SupportViolation` on any rank is raised on every rank."""
        n = positions.numel()
        local_of = torch.full((self.padded_width,), -1, dtype=torch.int64, device=positions.device)
        local_of[self.mine] = torch.arange(self.mine.numel(), device=positions.device)
        row, column = positions // width, positions % width
        local = local_of[column]
        index = torch.nonzero(local >= 0).reshape(-1)
        own_positions = row[index] * self.mine.numel() + local[index]
        failure = torch.zeros(4, dtype=torch.int64)
        out: LogProbs | None = None
        try:
            out = score(own_positions, index)
        except SupportViolation as exc:
            failure = torch.tensor([1, int(index[exc.row]), exc.support_row, exc.token_id], dtype=torch.int64)
        dist.all_reduce(failure, op=dist.ReduceOp.MAX, group=self.group)
        if failure[0] > 0:
            raise SupportViolation(int(failure[1]), int(failure[2]), int(failure[3]))
        assert out is not None
        if index.numel() == 0:
            # no response token among this rank's positions: the loss must still reach its layers,
            # whose backward joins the other ranks' key/value gathers (a zero gradient)
            out = LogProbs(out.logprobs + 0.0 * logits.sum(), out.entropy)
        logprobs: torch.Tensor = _Assemble.apply(out.logprobs, index, n, self.group)  # type: ignore[no-untyped-call]  # torch leaves Function.apply unannotated
        entropy: torch.Tensor = _Assemble.apply(out.entropy, index, n, self.group)  # type: ignore[no-untyped-call]  # torch leaves Function.apply unannotated
        return LogProbs(logprobs, entropy)


class _Assemble(torch.autograd.Function):
    """Forward: the (n,) vector whose entries `index` are this rank's `values`, the others the other
    ranks' (disjoint parts, summed over the group). Backward: this rank's entries of the gradient
    (every rank holds the same loss, so the same gradient)."""

    @staticmethod
    def forward(
        ctx: Any, values: torch.Tensor, index: torch.Tensor, n: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        whole = values.new_zeros(n)
        whole[index] = values.detach()
        dist.all_reduce(whole, group=group)
        ctx.save_for_backward(index)
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (index,) = ctx.saved_tensors
        return grad[index], None, None, None


class _GatherSequence(torch.autograd.Function):
    """Forward: every rank's [positions, ...] tensor concatenated in rank order. Backward: the sum
    of every rank's gradient of it, this rank's rows."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, world: int, rank: int
    ) -> torch.Tensor:
        pieces = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.size = group, rank, local.shape[0]
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed[ctx.rank * ctx.size : (ctx.rank + 1) * ctx.size], None, None, None


class GatheredKeysAttention(torch.nn.Module):
    """Core attention of a context-parallel rank: its queries against every rank's keys and values,
    causal by global position. Built by megatron-core's SelfAttention in place of its local
    DotProductAttention (the same arguments; `context` bound beforehand) and computing what it
    computes: scores scaled by 1/sqrt(kv_channels), key/value groups repeated for their heads."""

    def __init__(
        self,
        config: Any,
        *args: Any,
        context: ContextParallel,
        softmax_scale: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.context = context

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        cp = self.context
        key = _GatherSequence.apply(key, cp.group, cp.world, cp.rank)  # type: ignore[no-untyped-call]  # torch leaves Function.apply unannotated
        value = _GatherSequence.apply(value, cp.group, cp.world, cp.rank)  # type: ignore[no-untyped-call]  # torch leaves Function.apply unannotated
        if self.heads // self.groups > 1:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [batch, heads, positions, dim]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        allowed = cp.every.unsqueeze(0) <= cp.mine.unsqueeze(1)  # [own positions, every position]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [batch, heads, own positions, dim]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
